#!/usr/bin/env bash
# Installs everything the build, the tests and `make serve` need on a fresh Debian 12.
# Idempotent: packages already present are skipped by apt-get; safe to run repeatedly.
# usage: install-deps.sh [--tests | --build-only]
#   --build-only: only what building the service needs (the Docker image's build stage)
#   LLAVA_DEPS_TORCH=none: without Debian's libtorch (Dockerfile.cuda brings PyTorch's CUDA one)
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config git ca-certificates curl
  # engine
  libtorch-dev libopenblas-dev        # OpenBLAS replaces reference BLAS for libtorch's fp32 GEMM
  libopencv-core-dev libopencv-imgproc-dev libopencv-imgcodecs-dev
  libspdlog-dev libfmt-dev nlohmann-json3-dev libcli11-dev
  libtcmalloc-minimal4                # llava-train's allocator (docs/TRAINING.md)
  # API / server / metrics
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  prometheus-cpp-dev
  libboost1.81-dev                    # Boost.Beast (header-only): the HTTP API and /metrics
  libssl-dev                          # their TLS, and the certificate callback (server/tls.cc)
  libcpp-httplib-dev                  # llava-load's HTTP client
)
# Tests, benchmarks, the trainer and the developer tools.
DEV_PACKAGES=(
  libgtest-dev libgmock-dev libbenchmark-dev
  sentencepiece                       # spm_train / spm_encode, run as separate processes only
  clang-format
  gnuplot-nox                         # llava-eval's plots
  prometheus                          # promtool: checks the /metrics exposition and deploy/ in tests
  python3-yaml                        # tests/deploy_test.py reads the Kubernetes manifests
  nodejs                              # tests/deploy_schema: Kubernetes API schema validation
  qemu-user                           # the kernels on an emulated AVX2-only CPU (-cpu Haswell)
  openssl                             # tests/server_e2e_test.cc makes its TLS certificates
  clang libclang-rt-14-dev            # make fuzz: libFuzzer and the sanitizers' runtimes
)
# Debian's npm, unless a nodejs that bundles its own (NodeSource's) is installed already.
command -v npm > /dev/null 2>&1 || DEV_PACKAGES+=(npm)
# kubectl (`kubectl kustomize`: the tests check the rendered overlays): Debian's, unless one is
# installed already (e.g. the Google Cloud SDK's).
command -v kubectl > /dev/null 2>&1 || DEV_PACKAGES+=(kubernetes-client)
[ "${1:-}" = "--build-only" ] || PACKAGES+=("${DEV_PACKAGES[@]}")
if [ "${LLAVA_DEPS_TORCH:-debian}" = none ]; then
  for i in "${!PACKAGES[@]}"; do [ "${PACKAGES[$i]}" = libtorch-dev ] && unset "PACKAGES[$i]"; done
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
else
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# With --tests (make test): also the npm packages of tests/deploy_schema and
# tests/openai_client (versions pinned by their package-lock.json), from the npm registry, once.
# The service itself needs none.
[ "${1:-}" = "--tests" ] || exit 0
tests_dir="$(cd "$(dirname "$0")/.." && pwd)/tests"
for pkg in deploy_schema/node_modules/kubernetes-models openai_client/node_modules/openai; do
  dir="$tests_dir/${pkg%%/node_modules/*}"
  [ -d "$tests_dir/$pkg" ] && continue
  echo "install-deps: npm ci in tests/${dir##*/}"
  for attempt in 1 2 3; do
    npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error && break
    [ "$attempt" -eq 3 ] && exit 1
    sleep 5
  done
done
