# Recipe exploration for the default model on a GPU (not shipped: the model itself is trained
# by build/llava-train on the CPU). Same architecture as ours (transformers' LLaVA, verified
# equal to the engine by tests/hf_parity_test.cc), initialised and scheduled like
# train/train_main.cc; scenes from llava-make-data, rendered here.
#   python3 explore.py NAME key=value...   (keys: see arg() calls below)
# Prints one line per evaluation: held-out short-answer exact match (teacher-forced history,
# which equals greedy decoding for a correct prefix), per kind, description token accuracy.
import gzip, json, math, os, sys, time, traceback
import cv2, numpy as np, torch, sentencepiece as spm

NAME = sys.argv[1]
A = dict(a.split('=', 1) for a in sys.argv[2:])
def arg(k, d): return type(d)(A.get(k, d))
lr = arg('lr', 1.5e-3); steps = arg('steps', 5000); batch = arg('batch', 16); warmup = arg('warmup', 200)
limit_s = arg('limit_s', 400.0); desc_prob = arg('desc_prob', 0.5); vis_mult = arg('vis_mult', 1.0)
curriculum = arg('curriculum', 0); max_obj = arg('max_obj', 2); eval_every = arg('eval_every', 500)
t_layers = arg('t_layers', 4); t_hidden = arg('t_hidden', 256); t_ffn = arg('t_ffn', 688)
v_layers = arg('v_layers', 5); pos_rms = arg('pos_rms', 0.5); seed = arg('seed', 0)
v_hidden = arg('v_hidden', 192); v_heads = arg('v_heads', 6); S = arg('img', 96); PATCH = arg('patch', 8)
RESULTS = os.environ.get('RESULTS', '/tmp/results.log')
torch.manual_seed(seed); rng = np.random.default_rng(seed)
D = os.path.dirname(os.path.abspath(__file__))
sp = spm.SentencePieceProcessor(model_file=D + '/tokenizer.model')
IMG = sp.piece_to_id('<image>'); BOS, EOS = 1, 2
NIMG = (S // PATCH) ** 2  # image rows (class token dropped)

def split(items):
    desc, short = [], []
    for it in items:
        d = [t for t in it['turns'] if t[0].startswith('Describe')]
        s = [t for t in it['turns'] if not t[0].startswith('Describe')]
        if d: desc.append((it['scene'], d[:1]))
        if s: short.append((it['scene'], s))
    return desc, short
tr_desc, tr_short = split(json.loads(l) for l in gzip.open(D + '/train/conversations.jsonl.gz', 'rt'))
small = lambda L: [x for x in L if len(x[0]['objects']) <= max_obj]
cur_desc, cur_short = small(tr_desc), small(tr_short)
ho_desc, ho_short = split(json.loads(l) for l in open(D + '/heldout/conversations.jsonl'))

COL = [(220, 40, 40), (245, 145, 30), (235, 210, 30), (40, 160, 70), (40, 90, 220), (135, 65, 185), (240, 120, 185), (25, 25, 25)]
BG = [(250, 250, 250), (200, 200, 200), (238, 226, 196)]
RAD = [6, 10, 15]
MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32); STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)

def poly(shape, r, ang):
    a0 = math.radians(ang)
    def ring(n, start, radii):
        return [(radii[i % len(radii)] * math.cos(a0 + start + 2 * math.pi * i / n), radii[i % len(radii)] * math.sin(a0 + start + 2 * math.pi * i / n)) for i in range(n)]
    if shape == 1: return ring(4, math.pi / 4, [r * 1.1])
    if shape == 2: return ring(3, -math.pi / 2, [r * 1.15])
    if shape == 3: return [(0, -r * 1.15), (r * 0.75, 0), (0, r * 1.15), (-r * 0.75, 0)]
    return ring(10, -math.pi / 2, [r * 1.2, r * 0.5])

def render(sc):  # the scene at S x S pixels (the generator's 96-pixel layout scaled by S / 96)
    k = S / 96
    img = np.zeros((S, S, 3), np.int32); img[:] = BG[sc['background']]
    if sc['textured']:
        r = np.random.default_rng(sc['texture_seed'] % (2**32)); period = 6 + r.integers(6)
        yy, xx = np.mgrid[0:S, 0:S]; stripe = np.where(((xx + yy) // round(period * k)) % 2 == 0, -10, 0)
        img += (stripe + r.integers(-6, 7, size=(S, S)))[..., None]
    img = np.clip(img, 0, 255).astype(np.uint8)
    for sh, c, sz, cell, dx, dy, ang in sc['objects']:
        cx = (16 + 32 * (cell % 3) + dx) * k; cy = (16 + 32 * (cell // 3) + dy) * k; r = RAD[sz] * k
        if sh == 0:
            cv2.circle(img, (round(cx * 16), round(cy * 16)), round(r * 16), COL[c], -1, cv2.LINE_AA, 4)
        else:
            pts = np.array([[round((cx + x) * 16), round((cy + y) * 16)] for x, y in poly(sh, r, 0 if sh == 3 else ang)], np.int32)
            cv2.fillPoly(img, [pts], COL[c], cv2.LINE_AA, 4)
    x = (img.astype(np.float32) / 255 - MEAN) / STD
    return torch.from_numpy(x.transpose(2, 0, 1).copy())


def example(turns):
    ids = [BOS] + sp.encode('USER:') + [IMG] * NIMG; lab = [-100] * len(ids)
    for i, (q, a) in enumerate(turns):
        p = sp.encode(('\n' if i == 0 else 'USER: ') + q + ' ASSISTANT:'); ans = sp.encode(a) + [EOS]
        ids += p + ans; lab += [-100] * len(p) + ans
    return ids, lab

def collate(items):
    ex = [example(t) for _, t in items]; n = max(len(i) for i, _ in ex)
    ids = torch.zeros(len(ex), n, dtype=torch.long); lab = torch.full((len(ex), n), -100); att = torch.zeros(len(ex), n, dtype=torch.long)
    for b, (i, l) in enumerate(ex):
        ids[b, :len(i)] = torch.tensor(i); lab[b, :len(l)] = torch.tensor(l); att[b, :len(i)] = 1
    px = torch.stack([render(s) for s, _ in items])
    return ids.cuda(non_blocking=True), lab.cuda(non_blocking=True), att.cuda(non_blocking=True), px.cuda(non_blocking=True)

def sample_batch(step):
    Dl, Sl = (cur_desc, cur_short) if step < curriculum else (tr_desc, tr_short)
    out = []
    for _ in range(batch):
        if rng.random() < desc_prob: out.append(Dl[rng.integers(len(Dl))])
        else:
            s, t = Sl[rng.integers(len(Sl))]; out.append((s, [t[j] for j in rng.permutation(len(t))]))
    return out

def sincos(grid, d, rms):
    out = torch.zeros(grid * grid + 1, d); q = d // 4
    om = torch.pow(100.0, -torch.arange(q, dtype=torch.float64) / q)
    for r in range(grid):
        for c in range(grid):
            row = out[1 + r * grid + c]
            row[:q] = torch.sin(r * om); row[q:2 * q] = torch.cos(r * om)
            row[2 * q:3 * q] = torch.sin(c * om); row[3 * q:] = torch.cos(c * om)
    return out * (rms / math.sqrt(0.5))

KINDS = [('What color', 'colour'), ('What shape', 'shape'), ('How many', 'count'), ('Is there', 'exists'),
         ('What is', 'position'), ('Where is', 'where'), ('Which is larger', 'larger')]
def kind(q): return next((k for p, k in KINDS if q.startswith(p)), 'other')

def run_eval(items):
    model.eval(); res = []
    with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):
        for i in range(0, len(items), 64):
            chunk = items[i:i + 64]; ids, lab, att, px = collate(chunk)
            logits = model(input_ids=ids, attention_mask=att, pixel_values=px).logits
            pred = logits[:, :-1].argmax(-1).cpu(); tgt = lab[:, 1:].cpu()
            for b, (_, turns) in enumerate(chunk):
                pos = (tgt[b] != -100).nonzero().flatten().tolist(); k = 0
                for q, a in turns:
                    run = []
                    while k < len(pos):
                        run.append(pos[k]); k += 1
                        if tgt[b, run[-1]].item() == EOS: break
                    good = sum(int(pred[b, t] == tgt[b, t]) for t in run)
                    res.append((q, good == len(run), good, len(run)))
    model.train(); return res

def report(step, ema, t0):
    s = run_eval(ho_short); d = run_eval(ho_desc)
    em = sum(r[1] for r in s) / len(s)
    per = {}
    for q, ok, _, _ in s: per.setdefault(kind(q), []).append(ok)
    kinds = ' '.join(f'{k}={sum(v) / len(v):.2f}' for k, v in sorted(per.items()))
    dacc = sum(r[2] for r in d) / max(1, sum(r[3] for r in d)); dem = sum(r[1] for r in d) / max(1, len(d))
    line = (f'{NAME} step {step} convs {step * batch} loss {ema:.4f} shortEM {em:.3f} descTok {dacc:.3f} '
            f'descEM {dem:.2f} t {time.time() - t0:.0f}s | {kinds}')
    print(line, flush=True)
    with open(RESULTS, 'a') as f: f.write(line + '\n')

try:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    heads = t_hidden // 64
    vision = CLIPVisionConfig(hidden_size=v_hidden, intermediate_size=4 * v_hidden, num_hidden_layers=v_layers,
                              num_attention_heads=v_heads, image_size=S, patch_size=PATCH, hidden_act='quick_gelu', layer_norm_eps=1e-5)
    text = LlamaConfig(vocab_size=max(512, sp.get_piece_size()), hidden_size=t_hidden, intermediate_size=t_ffn,
                       num_hidden_layers=t_layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                       head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMG,
                                                      vision_feature_layer=-2, tie_word_embeddings=False)).cuda()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if 'embed_tokens' in n or 'patch_embedding' in n: p.normal_(0, 0.02)
            elif 'position_embedding' in n:
                if pos_rms > 0: p.copy_(sincos(S // PATCH, p.shape[1], pos_rms))
                else: p.normal_(0, 0.2)  # RandomLlavaWeights' positions
            elif 'class_embedding' in n: p.normal_(0, 0.5)
            elif p.dim() >= 2: p.normal_(0, 0.02)
            elif 'norm' in n and n.endswith('weight'): p.copy_(1 + 0.1 * torch.randn_like(p))
            else: p.normal_(0, 0.05)
    groups = {}
    for n, p in model.named_parameters():
        v = 'vision_tower' in n or 'multi_modal' in n; dec = p.dim() >= 2 and 'embed' not in n
        groups.setdefault((v, dec), []).append(p)
    opt = torch.optim.AdamW([{'params': ps, 'lr': lr, 'm': vis_mult if v else 1.0, 'weight_decay': 0.05 if dec else 0.0}
                             for (v, dec), ps in groups.items()], betas=(0.9, 0.98), fused=True)
    decay = [p for (v, dec), ps in groups.items() if dec for p in ps]
    nodecay = [p for (v, dec), ps in groups.items() if not dec for p in ps]
    print(NAME, A, 'params %.2fM' % (sum(p.numel() for p in model.parameters()) / 1e6), flush=True)
    t0 = time.time(); ema = None; step = 0
    for step in range(steps):
        warm = min(1.0, (step + 1) / warmup); prog = min(1.0, max(0.0, (step - warmup) / max(1, steps - warmup)))
        cur = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))
        for g in opt.param_groups: g['lr'] = cur * g['m']
        ids, lab, att, px = collate(sample_batch(step))
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=att, pixel_values=px, labels=lab).loss
        opt.zero_grad(set_to_none=True); loss.backward()
        torch.nn.utils.clip_grad_norm_(decay, 1.0); torch.nn.utils.clip_grad_norm_(nodecay, 1.0); opt.step()
        if step % 50 == 0 or step == steps - 1:
            l = loss.item(); ema = l if ema is None else 0.9 * ema + 0.1 * l
        if (step + 1) % eval_every == 0: report(step + 1, ema, t0)
        if time.time() - t0 > limit_s: break
    if (step + 1) % eval_every != 0: report(step + 1, ema, t0)
except Exception:
    traceback.print_exc()
    with open(RESULTS, 'a') as f: f.write(NAME + ' FAILED: ' + traceback.format_exc().splitlines()[-1] + '\n')
