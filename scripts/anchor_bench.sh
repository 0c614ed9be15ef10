#!/usr/bin/env bash
# Our decoder against the speed anchor, llama.cpp (DESIGN.md section 6), in alternating runs on
# the same machine: `llava-bench` (4 random bf16 layers at LLaVA-7B shapes, 2 threads) and
# `llama-bench` on the GGUF of the same shapes (scripts/anchor_gguf.py), pp512 and tg128.
#
# usage: scripts/anchor_bench.sh LLAMA_BENCH GGUF [CPU_PATH] [RUNS] [WEIGHTS]
#   CPU_PATH: empty for this CPU's best path, or avx2 / avx512 / generic to force a lower one.
#   WEIGHTS: our --weights (bf16, int8, int4), against a GGUF of the matching format made by
#   llama.cpp's own llama-quantize (Q8_0 for int8, Q4_K_M or Q4_1 for int4).
#   Forcing avx2 on an AVX-512 machine stands in for an AVX2-only CPU: libtorch's own kernels
#   are limited the same way (ATen's dispatch, oneDNN, OpenBLAS), and LLAMA_BENCH should then
#   be a llama.cpp built with -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
#   -DGGML_AVX512=OFF.
set -euo pipefail
llama_bench=$1
gguf=$2
cpu_path=${3:-}
runs=${4:-3}
weights=${5:-bf16}
cd "$(dirname "$0")/.."

ours_env=()
if [ -n "$cpu_path" ]; then
  ours_env=(LLAVA_CPU_PATH="$cpu_path")
  case "$cpu_path" in
    avx2) ours_env+=(ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell) ;;
    avx512) ours_env+=(ONEDNN_MAX_CPU_ISA=AVX512_CORE) ;;
    generic) ours_env+=(ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41
                        OPENBLAS_CORETYPE=Nehalem) ;;
  esac
fi

for i in $(seq "$runs"); do
  echo "== run $i $(date -u +%H:%M:%S)"
  env "${ours_env[@]}" build/llava-bench --threads 2 --batches 1 8 --weights "$weights" | grep -E '^(cpu_path|layers)='
  "$llama_bench" -m "$gguf" -t 2 -p 512 -n 128 -r 3 -o csv 2>/dev/null |
    awk -F, '{ gsub(/"/, "") } NR == 1 { for (c = 1; c <= NF; ++c) col[$c] = c; next }
             { printf "llama.cpp n_prompt=%s n_gen=%s avg_ts=%s\n",
               $col["n_prompt"], $col["n_gen"], $col["avg_ts"] }'
done
