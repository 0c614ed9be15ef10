#!/usr/bin/env bash
# Fetches, here (Debian 12, apt reachable), the three source packages the GPU machine's
# model-only build needs and that machine lacks: nlohmann-json and CLI11 (headers) and
# GoogleTest's sources (built there with libtorch's flags). They go to .gpu-deps/ (git-ignored,
# ~0.8 MB), which a device run carries: scripts/gpu-run.sh and docs/BENCHMARKS.md "On a GPU".
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$root/.gpu-deps"
cd "$root/.gpu-deps"
rm -f ./*.deb
apt-get download nlohmann-json3-dev libcli11-dev googletest 2>&1 | grep -v "^W: Download is performed unsandboxed"
ls -la "$root/.gpu-deps"
