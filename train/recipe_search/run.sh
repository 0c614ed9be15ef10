#!/bin/bash
# Recipe search for the default model on one GPU (docs/TRAINING.md, "Learning rate: found on a
# GPU"): eight variants of train/recipe_search/explore.py in parallel, one results line per
# evaluation appended to $RESULTS. Needs python3 with torch (CUDA), transformers, opencv,
# sentencepiece, and the data below in the folder this script is in (the device tool carries
# an ignored folder, e.g. .gpu/, holding explore.py, run.sh and the data):
#   build/llava-make-data --split train --seed 0 --images 200000 --conversations --no-images \
#     --out DIR/train
#   build/llava-make-data --split heldout --seed 1001 --images 400 --conversations --no-images \
#     --out DIR/heldout
#   cp models/shapes-llava/tokenizer.model DIR/
#   gzip DIR/train/conversations.jsonl
# SET=1: the first sweep (recipe changes, 390 s each); SET=2: learning rates (150 s each);
# SET=3 (not run yet): at the new learning rate, more question training (description
# probability 0.3, 0.15), how far a long schedule gets, a 2-layer decoder, batch 32, and
# perception controls (image size, patch size).
cd "$(dirname "$0")"
SET=${SET:-1}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 RESULTS=${RESULTS:-${OUT:-/tmp}/results.log}
if [ "$SET" = 1 ]; then
  v() { python3 explore.py "$@" limit_s=390 > /tmp/log_$1.txt 2>&1; }
  v base &
  v long steps=20000 &
  v desc02 desc_prob=0.2 &
  v vis3 vis_mult=3 &
  v curr curriculum=1500 &
  v lr08 lr=8e-4 &
  v t2 t_layers=2 &
  v b64 batch=64 lr=2e-3 steps=10000 &
elif [ "$SET" = 3 ]; then
  v() { python3 explore.py "$@" lr=3e-4 limit_s=390 > /tmp/log_$1.txt 2>&1; }
  v lr3 &
  v lr3long steps=30000 &
  v img128 img=128 &
  v patch6 patch=6 &
  v desc015 desc_prob=0.15 &
  v t2 t_layers=2 &
  v b32 batch=32 steps=2500 &
  v desc03 desc_prob=0.3 &
else
  v() { python3 explore.py "$@" steps=2200 eval_every=1100 limit_s=150 > /tmp/log_$1.txt 2>&1; }
  v lr2 lr=2e-4 &
  v lr3 lr=3e-4 &
  v lr4 lr=4e-4 &
  v lr6 lr=6e-4 &
  v lr8 lr=8e-4 &
  v lr8s1 lr=8e-4 seed=1 &
  v lr8w5 lr=8e-4 warmup=500 &
  v lr4d3 lr=4e-4 desc_prob=0.3 &
fi
wait
sort -s -k1,1 "$RESULTS"
