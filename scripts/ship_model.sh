#!/usr/bin/env bash
# Ships a trained checkpoint as the default model and redoes everything that depends on it:
# the fixed test questions, the quality table of docs/POLICIES.md (docs/eval) and the ablation
# rows (docs/eval/ablation.csv). The prose numbers of README.md, docs/POLICIES.md and
# docs/TRAINING.md are written by hand from the printed tables afterwards.
#
#   scripts/ship_model.sh build/shapes-llava        (or: make ship-model MODEL=build/shapes-llava)
#
# ~3 minutes on 2 cores; do not run it beside a training run.
set -euo pipefail
model=${1:?usage: scripts/ship_model.sh CHECKPOINT_DIR}
build=${BUILD:-build}
dest=models/shapes-llava
for f in config.json model.safetensors preprocessor_config.json tokenizer.model; do
  [[ -f "$model/$f" ]] || { echo "ship_model: $model/$f is missing" >&2; exit 1; }
done
if [[ "$(realpath "$model")" != "$(realpath "$dest")" ]]; then
  cp "$model"/{config.json,model.safetensors,preprocessor_config.json,tokenizer.model} "$dest"/
fi

echo "== test questions (tests/data/default_model)"
"$build"/llava-make-data --split heldout --seed 1001 --images 60 --out "$build"/shapes-heldout
python3 scripts/pick_default_questions.py --model "$dest" --heldout "$build"/shapes-heldout \
  --generate "$build"/llava-generate

echo "== quality table (docs/eval)"
make --no-print-directory eval-default BUILD="$build"

echo "== ablation (docs/eval/ablation.csv)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The product Elastic with one part changed at a time, then the paper's and its old ablations.
"$build"/llava-eval --model "$dest" --dataset "$build"/shapes-heldout/eval.jsonl \
  --budgets 0.8,0.5,0.3,0.2,0.1 --max-tokens 96 --out "$tmp"/a --policies \
  "$(tr -d ' \n' < scripts/ablation_policies.txt)"
cp "$tmp"/a/results.csv docs/eval/ablation.csv
column -s, -t docs/eval/ablation.csv
echo "== shipped $model as $dest; now update the numbers in README.md, docs/POLICIES.md, docs/TRAINING.md"
