#!/usr/bin/env python3
"""Reference outputs from Hugging Face transformers for tests/hf_parity_test.cc.

Runs where `transformers` is installed (not on CI): builds a tiny random
LlavaForConditionalGeneration, saves it with save_pretrained (llava-hf layout),
and records in fp32 on CPU:
  - logits of every position for a prompt with one image (reference.safetensors),
  - the greedy continuation from model.generate (reference.json),
  - CLIPImageProcessor outputs for a committed test image at two sizes.
Usage: python3 make_reference.py OUT_DIR
"""
import json
import os
import sys

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
import transformers
from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration)

out = sys.argv[1]
model_dir = os.path.join(out, "model")
os.makedirs(model_dir, exist_ok=True)
torch.manual_seed(1234)

V = 320
IMAGE_TOKEN = V - 1
text_kwargs = dict(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                   pad_token_id=0)
try:
    text = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                       **text_kwargs)
except TypeError:
    text = LlamaConfig(rope_theta=50000.0, **text_kwargs)
vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, image_size=30, patch_size=6, projection_dim=32,
                          hidden_act="quick_gelu", layer_norm_eps=1e-5)
config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                     projector_hidden_act="gelu", vision_feature_select_strategy="default",
                     vision_feature_layer=-2)
model = LlavaForConditionalGeneration(config).eval().float()
# Larger weights than the 0.02 init so that every block visibly changes the logits.
with torch.no_grad():
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, 0.15)
        elif "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        else:
            p.normal_(0.0, 0.05)
model.save_pretrained(model_dir, safe_serialization=True)

n_img = (30 // 6) ** 2
ids = [1, 17, 33, 250, 8] + [IMAGE_TOKEN] * n_img + [90, 91, 5, 200, 13, 44, 7]
input_ids = torch.tensor([ids])
pixel_values = torch.randn(1, 3, 30, 30)
model.set_attn_implementation("eager") if hasattr(model, "set_attn_implementation") else None
with torch.no_grad():
    logits = model(input_ids=input_ids, pixel_values=pixel_values).logits[0].float()
    gen = model.generate(input_ids=input_ids, pixel_values=pixel_values, max_new_tokens=12,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
generated = gen[0, len(ids):].tolist()

# Image preprocessing: a deterministic non-square test image (gradients, noise, edges).
rng = np.random.default_rng(7)
h, w = 83, 131
yy, xx = np.mgrid[0:h, 0:w]
img = np.stack([(xx * 255 // w), (yy * 255 // h), ((xx + yy) * 3) % 256], -1).astype(np.int32)
img[20:50, 30:70] = [250, 20, 40]
img += rng.integers(-20, 21, size=img.shape)
img = np.clip(img, 0, 255).astype(np.uint8)
Image.fromarray(img, "RGB").save(os.path.join(out, "image.png"))
pil = Image.open(os.path.join(out, "image.png"))
tensors = {"logits": logits.contiguous(), "pixel_values": pixel_values[0].contiguous()}
for size in (30, 96):
    proc = CLIPImageProcessor(size={"shortest_edge": size},
                              crop_size={"height": size, "width": size})
    pv = proc(images=pil, return_tensors="pt")["pixel_values"][0].float()
    tensors[f"image_{size}"] = pv.contiguous()
    if size == 30:
        proc.save_pretrained(model_dir)
save_file(tensors, os.path.join(out, "reference.safetensors"))
with open(os.path.join(out, "reference.json"), "w") as f:
    json.dump({"transformers": transformers.__version__, "torch": torch.__version__,
               "input_ids": ids, "image_offset": 5, "greedy_continuation": generated}, f,
              indent=1)
print(open(os.path.join(model_dir, "config.json")).read())
print(json.dumps({"generated": generated, "logits_std": float(logits.std()),
                  "argmax": logits.argmax(-1).tolist()}))
for k, v in sorted(os.popen(f"ls -la {model_dir} {out}").read().splitlines()[:0]):
    pass
os.system(f"ls -la {model_dir} {out}")
