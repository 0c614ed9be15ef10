#!/usr/bin/env bash
# llava-eval end to end on the tiny checkpoint: the table, CSV, JSON and plots are written, and
# every policy at budget 1 reproduces Full exactly (same PPL, ROUGE-L 1 against Full).
set -euo pipefail
eval_bin=$1 model=$2 dataset=$3 out=$4
rm -rf "$out"
"$eval_bin" --model "$model" --dataset "$dataset" --out "$out" --budgets 1.0,0.5,0.2 \
  --max-tokens 8 --dtype f32 --threads 2 --items "$out.items.jsonl" > "$out.stdout"
cat "$out.stdout"
csv="$out/results.csv"
test -s "$out/results.json"
rows=$(($(wc -l < "$csv") - 1))
[ "$rows" -eq 19 ] || { echo "expected 19 result rows (full + 6 policies x 3 budgets), got $rows"; exit 1; }
full_ppl=$(awk -F, '$1=="full"{print $4}' "$csv")
awk -F, -v ppl="$full_ppl" 'NR>1 && $2=="1.00" {
    if ($4 != ppl) { print "budget 1 PPL differs from Full: " $0; bad=1 }
    if ($5 != "1.0000") { print "budget 1 ROUGE-L is not 1: " $0; bad=1 } }
  NR>1 && $2!="1.00" && $8 >= 1.0 { print "compressed run kept all bytes: " $0; bad=1 }
  END { exit bad }' "$csv"
# --items: one line per sample and (policy, budget), and Full's answers score like the table.
items=$(wc -l < "$out.items.jsonl")
[ "$items" -eq $((rows * 3)) ] || { echo "expected $((rows * 3)) item lines, got $items"; exit 1; }
python3 - "$out.items.jsonl" "$full_ppl" <<'PY'
import json, math, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert {l["policy"] for l in lines} == {"full", "elastic", "elastic+paper", "h2o", "snapkv",
                                       "lookm", "streaming_llm"}, lines[0]
assert all(set(l) == {"sample", "policy", "budget", "kind", "prompt", "reference", "answer",
                      "score", "nll", "tokens"} for l in lines)
assert sorted({l["sample"] for l in lines}) == [0, 1, 2]
# The items' nll and tokens add up to the table's PPL.
full = [l for l in lines if l["policy"] == "full"]
ppl = math.exp(sum(l["nll"] for l in full) / sum(l["tokens"] for l in full))
assert abs(ppl - float(sys.argv[2])) <= 1e-3 * ppl, (ppl, sys.argv[2])
PY
if command -v gnuplot > /dev/null; then
  test -s "$out/ppl_vs_budget.png" && test -s "$out/rouge_vs_budget.png" && \
    test -s "$out/accuracy_vs_budget.png" && test -s "$out/rouge_ref_vs_budget.png"
fi
echo "eval tool test passed"
