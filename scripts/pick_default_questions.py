#!/usr/bin/env python3
"""Picks tests/data/default_model/questions.jsonl for a newly shipped default model.

For each question kind, the first held-out item (data generator, held-out split, not the model's
output) that the model answers correctly with greedy decoding: exactly for short answers, for
descriptions the first one with a word-level ROUGE-L F1 of at least 0.9 (the test asks 0.8).
The answers in the file are the generator's; the model only chooses which items are asked.

  build/llava-make-data --split heldout --seed 1001 --images 60 --out build/shapes-heldout
  scripts/pick_default_questions.py --model models/shapes-llava --heldout build/shapes-heldout
"""
import argparse, json, os, shutil, subprocess

KINDS = ["describe", "position", "count", "colour", "exists", "where", "larger", "shape"]


def rouge_l(a, b):
    x, y = a.split(), b.split()
    if not x or not y:
        return 0.0
    prev = [0] * (len(y) + 1)
    for t in x:
        cur = [0]
        for j, u in enumerate(y):
            cur.append(prev[j] + 1 if t == u else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(x), lcs / len(y)
    return 2 * p * r / (p + r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/shapes-llava")
    ap.add_argument("--heldout", default="build/shapes-heldout")
    ap.add_argument("--out", default="tests/data/default_model")
    ap.add_argument("--generate", default="build/llava-generate")
    ap.add_argument("--keep", default="00003.png", help="image another test uses")
    a = ap.parse_args()
    items = [json.loads(l) for l in open(os.path.join(a.heldout, "eval.jsonl")) if l.strip()]
    picked = {}
    for it in items:
        kind = it.get("kind")
        if kind not in KINDS or kind in picked or "conversation" in it:
            continue
        out = subprocess.run([a.generate, "--model", a.model, "--policy", "full", "--threads", "1",
                              "--max-tokens", "96", "--image", os.path.join(a.heldout, it["image"]),
                              "--prompt", it["prompt"]], capture_output=True, text=True, check=True)
        text = out.stdout.strip()
        ok = rouge_l(text, it["answer"]) >= 0.9 if kind == "describe" else text == it["answer"]
        print(f"{kind:9s} {'ok ' if ok else 'no '} {it['image']} {it['prompt']!r} -> {text!r}")
        if ok:
            picked[kind] = it
        if len(picked) == len(KINDS):
            break
    missing = [k for k in KINDS if k not in picked]
    if missing:
        raise SystemExit(f"no correct answer found for: {', '.join(missing)}")
    for f in os.listdir(a.out):
        if f.endswith(".png") and f != a.keep:
            os.remove(os.path.join(a.out, f))
    with open(os.path.join(a.out, "questions.jsonl"), "w") as f:
        for kind in KINDS:
            it = picked[kind]
            name = os.path.basename(it["image"])
            shutil.copy(os.path.join(a.heldout, it["image"]), os.path.join(a.out, name))
            f.write(json.dumps({"image": name, "prompt": it["prompt"], "answer": it["answer"],
                                "kind": kind}) + "\n")


if __name__ == "__main__":
    main()
