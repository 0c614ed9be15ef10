#!/usr/bin/env bash
# Issue 26's GPU run in one call, on the device machine (an NVIDIA GPU, a PyTorch with CUDA,
# nvcc, CMake and ninja; no Debian packages, no network). It unpacks the three packages
# scripts/gpu-deps.sh put in .gpu-deps/ (carried), builds GoogleTest with libtorch's ABI flag,
# configures a model-only CUDA build (LLAVA_MODEL_ONLY: engine io/kv/kernels/model, llava-bench,
# device_tests) against PyTorch's own libtorch, runs the device tests and the benchmarks, and
# writes at most six files to OUT: run.log (environment and one line per step), build.log,
# tests.log, tests.xml, bench.log, summary.txt (the benchmarks' key=value lines).
#
#   scripts/gpu-run.sh OUT [quick|full|smoke]
#
#   quick  device tests (twice: decode attention through ATen, then the CUDA kernel); decode at
#          batch 1/8/16/32 on 4 LLaVA-7B-shaped layers, each way; the paper's experiment
#          (1024-token prompts, 512-token answers, batch 16, Full vs Elastic 0.2, and Elastic at
#          the batch that fits Full's KV bytes) on 4 layers with the kernel (~2.5 min with build)
#   full   quick, then the same decode and paper runs on all 32 layers (13.5 GB of bf16)
#
# The first run (2026-12-04, H200, before the kernel): build 78 s from a bare machine, the
# whole `full` run 452 s, paper-32 alone 294 s (docs/BENCHMARKS.md, "On a GPU").
#   smoke  tiny shapes: for trying the script itself
#
# LLAVA_GPU_DEVICE=cpu runs it on a CPU machine against the system libtorch (no CUDA), which is
# how the script is tested where there is no GPU (`LLAVA_GPU_DEVICE=cpu scripts/gpu-run.sh
# /tmp/gpu-out smoke`). Each step has a time limit, so what finished comes back even when a
# later step hangs. The call, from a session with a device (docs/BENCHMARKS.md, "On a GPU"):
#   run(command="LLAVA_GPU_DEADLINE=500 bash scripts/gpu-run.sh $OUT full", carry=[".gpu-deps"],
#       timeout_s=530)
set -uo pipefail
out=${1:?usage: scripts/gpu-run.sh OUT [quick|full|smoke]}
mode=${2:-quick}
root=$(cd "$(dirname "$0")/.." && pwd)
device=${LLAVA_GPU_DEVICE:-cuda}
work=${LLAVA_GPU_WORK:-/tmp/llava-gpu}
jobs=$(nproc)
mkdir -p "$out" "$work"
t_start=$(date +%s)

log() { echo "[$(date +%T) +$(($(date +%s) - t_start))s] $*" | tee -a "$out/run.log"; }
# step NAME LIMIT_S LOGFILE CMD...: runs CMD with a time limit, appends its output to LOGFILE,
# logs the exit status and the last lines.
# LLAVA_GPU_DEADLINE=S (seconds from the start) caps every step, so that the run ends, its files
# written, before the device call's own limit.
step() {
  local name=$1 limit=$2 file=$3
  shift 3
  if [ "${LLAVA_GPU_DEADLINE:-0}" -gt 0 ]; then
    local left=$((LLAVA_GPU_DEADLINE - ($(date +%s) - t_start)))
    if [ $left -lt 15 ]; then
      log "$name: skipped (deadline)"
      return 124
    fi
    [ $left -lt "$limit" ] && limit=$left
  fi
  log "$name: $*"
  echo "=== $name: $*" >> "$out/$file"
  timeout "$limit" "$@" >> "$out/$file" 2>&1
  local rc=$?
  log "$name: exit $rc"
  tail -n 4 "$out/$file" | sed 's/^/    /' | tee -a "$out/run.log"
  return $rc
}

case $mode in quick | full | smoke) ;; *) echo "mode: quick, full or smoke" >&2; exit 2 ;; esac
if ! ls "$root"/.gpu-deps/*.deb > /dev/null 2>&1; then
  echo "no .gpu-deps/*.deb: run scripts/gpu-deps.sh on the CPU machine and carry .gpu-deps" >&2
  exit 2
fi

# ---- the machine -----------------------------------------------------------------------------
{
  echo "mode=$mode device=$device cores=$jobs"
  uname -a
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
    --format=csv 2> /dev/null || echo "nvidia-smi: none"
  command -v nvcc > /dev/null && nvcc --version | tail -n 2
  g++ --version | head -n 1
  cmake --version | head -n 1
} >> "$out/run.log" 2>&1

if [ "$device" = cpu ]; then
  torch_prefix=""
  abi=1
  cuda=${LLAVA_GPU_CUDA:-OFF}  # ON: compile the CUDA kernels too (nvcc here, no GPU)
  cxx_std=${LLAVA_CXX_STANDARD:-17}
else
  torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  abi=$(python3 -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
  # ATen's headers need C++20 from PyTorch 2.12 on.
  cxx_std=$(python3 -c 'import torch; v = tuple(int(x) for x in torch.__version__.split(".")[:2]); print(20 if v >= (2, 12) else 17)')
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)' \
    >> "$out/run.log" 2>&1
  cuda=ON
fi
log "libtorch: ${torch_prefix:-system}; _GLIBCXX_USE_CXX11_ABI=$abi; C++$cxx_std"

# ---- dependencies: headers, and GoogleTest built with libtorch's ABI ----------------------------
sysroot=$work/sysroot
mkdir -p "$sysroot"
for deb in "$root"/.gpu-deps/*.deb; do
  if command -v dpkg-deb > /dev/null; then
    dpkg-deb -x "$deb" "$sysroot"
  else  # a .deb is an ar archive holding data.tar.*
    (cd "$work" && ar x "$deb" && tar -xf data.tar.* -C "$sysroot" && rm -f data.tar.* control.tar.* debian-binary)
  fi
done
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
if [ ! -f "$sysroot/usr/lib/cmake/GTest/GTestConfig.cmake" ] &&
  [ ! -f "$sysroot/usr/lib64/cmake/GTest/GTestConfig.cmake" ]; then
  step gtest 300 build.log cmake -S "$sysroot/usr/src/googletest" -B "$work/gtest-build" \
    "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF \
    -DCMAKE_INSTALL_PREFIX="$sysroot/usr" -DCMAKE_INSTALL_LIBDIR=lib \
    -DCMAKE_CXX_FLAGS="-D_GLIBCXX_USE_CXX11_ABI=$abi" || exit 1
  step gtest-install 300 build.log cmake --build "$work/gtest-build" --target install -j "$jobs" ||
    exit 1
fi

# ---- the model-only build ----------------------------------------------------------------------
# Two ways to libtorch: PyTorch's CMake package (given hints for the cuDNN and NVTX it looks for
# again, which pip installs in its own Python packages), and, if that refuses to configure, the
# headers and libraries named directly (LLAVA_TORCH_LIBS). LLAVA_GPU_TORCH=direct skips the first.
build=$work/build
cuda_args=()
if [ "$cuda" = ON ]; then
  nvcc_path=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  cuda_args=(-DCMAKE_CUDA_COMPILER="$nvcc_path" -DCMAKE_CUDA_ARCHITECTURES=90)
  export TORCH_CUDA_ARCH_LIST=9.0
  cuda_include=$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")/include
  [ -d "$cuda_include/nvtx3" ] && cuda_args+=(-DUSE_SYSTEM_NVTX=ON -Dnvtx3_dir="$cuda_include")
fi
package_args=()
if [ "$device" != cpu ]; then
  cudnn_lib=- cudnn_inc=-
  read -r cudnn_lib cudnn_inc < <(python3 - << 'PY'
import glob, os, torch
sp = os.path.dirname(os.path.dirname(torch.__file__))
libs = sorted(glob.glob(os.path.join(sp, "nvidia", "**", "libcudnn.so*"), recursive=True))
hdrs = sorted(glob.glob(os.path.join(sp, "nvidia", "**", "cudnn_version.h"), recursive=True))
print(libs[0] if libs else "-", os.path.dirname(hdrs[0]) if hdrs else "-")
PY
  )
  cudnn_lib=${cudnn_lib:--} cudnn_inc=${cudnn_inc:--}
  log "cuDNN for PyTorch's CMake package: lib=$cudnn_lib include=$cudnn_inc"
  if [ "$cudnn_lib" != - ] && [ "$cudnn_inc" != - ]; then
    package_args=(-DCAFFE2_USE_CUDNN=ON -DCUDNN_LIBRARY_PATH="$cudnn_lib"
      -DCUDNN_INCLUDE_PATH="$cudnn_inc")
  fi
fi
common_args=(-DCMAKE_BUILD_TYPE=Release -DLLAVA_MODEL_ONLY=ON -DLLAVA_WITH_CUDA="$cuda"
  -DCMAKE_CXX_STANDARD="$cxx_std" "${cuda_args[@]}")
configured=0
if [ "${LLAVA_GPU_TORCH:-package}" != direct ]; then
  if step configure 300 build.log cmake -S "$root" -B "$build" "${generator[@]}" "${common_args[@]}" \
    -DCMAKE_PREFIX_PATH="${torch_prefix:+$torch_prefix;}$sysroot/usr" "${package_args[@]}"; then
    configured=1
  else
    grep -A6 "CMake Error" "$out/build.log" | head -n 40 | sed 's/^/    /' >> "$out/run.log"
  fi
fi
if [ $configured = 0 ]; then
  if [ "$device" = cpu ]; then
    torch_include="/usr/include/torch/csrc/api/include"
    torch_libdir=$(dirname "$(readlink -f /usr/lib/x86_64-linux-gnu/libtorch.so)")
  else
    torch_dir=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
    torch_include="$torch_dir/include;$torch_dir/include/torch/csrc/api/include"
    torch_libdir=$torch_dir/lib
  fi
  torch_libs=""
  for name in torch torch_cpu c10 torch_cuda c10_cuda; do
    [ -e "$torch_libdir/lib$name.so" ] && torch_libs="${torch_libs:+$torch_libs;}$torch_libdir/lib$name.so"
  done
  rm -rf "$build"
  step configure-direct 300 build.log cmake -S "$root" -B "$build" "${generator[@]}" \
    "${common_args[@]}" -DCMAKE_PREFIX_PATH="$sysroot/usr" -DLLAVA_TORCH_INCLUDE="$torch_include" \
    -DLLAVA_TORCH_LIBS="$torch_libs" -DLLAVA_TORCH_CXX11_ABI="$abi" || {
    grep -A6 "CMake Error" "$out/build.log" | tail -n 40 | sed 's/^/    /' >> "$out/run.log"
    exit 1
  }
fi
step build 900 build.log cmake --build "$build" --target llava-bench device_tests -j "$jobs" || {
  grep -B2 -A6 -E "error|Error" "$out/build.log" | head -n 60 | sed 's/^/    /' >> "$out/run.log"
  exit 1
}

# ---- device tests --------------------------------------------------------------------------------
LLAVA_TEST_DEVICE=$device step tests 300 tests.log "$build/device_tests" \
  --gtest_output="xml:$out/tests.xml"
# Again with the model's decode rows on the batched CUDA decode-attention kernel, which the
# model uses on a GPU only when asked until a run of this script has passed with it.
LLAVA_CUDA_ATTENTION=kernel LLAVA_TEST_DEVICE=$device step tests-kernel 300 tests.log \
  "$build/device_tests"

# ---- benchmarks (each key=value line also goes to summary.txt) -----------------------------------
bench() {
  local name=$1 limit=$2 before
  shift 2
  before=0
  if [ -f "$out/bench.log" ]; then before=$(wc -l < "$out/bench.log"); fi
  if step "$name" "$limit" bench.log "$build/llava-bench" --device "$device" "$@"; then
    tail -n +"$((before + 1))" "$out/bench.log" | grep -E '^(layers|suite)=' | tail -n 1 |
      sed "s/^/$name /" >> "$out/summary.txt"
  else
    echo "$name failed (bench.log)" >> "$out/summary.txt"
  fi
}
kernel() { LLAVA_CUDA_ATTENTION=kernel bench "$@"; }
if [ "$mode" = smoke ]; then
  bench decoder-smoke 120 --layers 1 --prompt 32 --batches 1 2 --context 16 --steps 4 --reps 2
  kernel paper-smoke-kernel 120 --suite paper --layers 1 --prompt 64 --answer 8 --batches 2 \
    --equal-memory true --max-batch 6
else
  # ATen's attention (one sequence at a time) against the kernel, then the paper's experiment.
  bench decoder-4 240 --layers 4 --prompt 512 --batches 1 8 16 32 --context 64 --steps 32 --reps 5
  kernel decoder-4-kernel 240 --layers 4 --prompt 512 --batches 1 8 16 32 --context 64 \
    --steps 32 --reps 5
  kernel paper-4-kernel 300 --suite paper --layers 4 --prompt 1024 --answer 512 --batches 16 \
    --equal-memory true --max-batch 96
  if [ "$mode" = full ]; then
    kernel decoder-32-kernel 300 --layers 32 --prompt 512 --batches 1 8 16 32 --context 64 \
      --steps 16 --reps 3
    kernel paper-32-kernel 600 --suite paper --layers 32 --prompt 1024 --answer 512 \
      --batches 16 --equal-memory true --max-batch 96
  fi
fi
# The run's verdict: every step above logged its exit status; the tests' decide.
if grep -q 'tests: exit 0' "$out/run.log" && grep -q 'tests-kernel: exit 0' "$out/run.log"; then
  log "done"
else
  log "done: the device tests failed (tests.log)"
  exit 1
fi
