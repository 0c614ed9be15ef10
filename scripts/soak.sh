#!/usr/bin/env bash
# Soak: llava-server with the default model under llava-load at saturation for SECONDS, the
# server's RSS and KV gauges sampled every 10 s; then the load stops and the gauges must fall
# back to 0. Prints the RSS after warm-up (the first sample past WARMUP seconds), at the end,
# the growth between them (issue target: < 1%) and the least-squares trend of the samples after
# warm-up, and writes every sample to OUT/soak.csv.
# Not part of make test (it takes SECONDS).
#
# usage: scripts/soak.sh [SECONDS=1800] [OUT=/tmp/llava-soak] [WARMUP=120]
set -euo pipefail
seconds=${1:-1800}
out=${2:-/tmp/llava-soak}
warmup=${3:-120}
cd "$(dirname "$0")/.."
build=${BUILD:-build}
mkdir -p "$out"
"$build/llava-server" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --http-listen off \
  --threads 1 > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2> /dev/null || true; kill $load 2> /dev/null || true' EXIT
port="" metrics=""
for _ in $(seq 600); do
  port=$(grep -oE "serving on port [0-9]+" "$out/server.log" | grep -oE "[0-9]+$" || true)
  metrics=$(grep -oE "metrics on port [0-9]+" "$out/server.log" | grep -oE "[0-9]+$" || true)
  [ -n "$port" ] && [ -n "$metrics" ] && break
  sleep 0.2
done
[ -n "$port" ] || { echo "server did not start"; cat "$out/server.log"; exit 1; }
gauge() {  # metric name -> value
  curl -s "http://127.0.0.1:$metrics/metrics" | awk -v m="$1" '$1 == m { print $2 }'
}
rss() { awk '/^VmRSS:/ { print $2 * 1024 }' "/proc/$server/status"; }

# Requests at saturation: 8 streams over the README's image, mixed lengths, until the time is up.
end=$(($(date +%s) + seconds))
(
  while [ "$(date +%s)" -lt "$end" ]; do
    "$build/llava-load" --server "127.0.0.1:$port" --concurrency 8 --requests 64 \
      --image models/examples/scene2.png --max-tokens 96 --min-tokens 8 --ignore-eos \
      > /dev/null 2>&1 || echo "llava-load failed at $(date +%s)" >> "$out/errors.txt"
  done
) &
load=$!
start=$(date +%s)
echo "t_s,rss_bytes,running,waiting,kv_used_bytes" > "$out/soak.csv"
while kill -0 $load 2> /dev/null; do
  echo "$(($(date +%s) - start)),$(rss),$(gauge llava_num_requests_running),$(gauge llava_num_requests_waiting),$(gauge llava_kv_cache_used_bytes)" >> "$out/soak.csv"
  sleep 10
done
sleep 2
after="$(rss),$(gauge llava_num_requests_running),$(gauge llava_num_requests_waiting),$(gauge llava_kv_cache_used_bytes)"
echo "idle,$after" >> "$out/soak.csv"
served=$(curl -s "http://127.0.0.1:$metrics/metrics" |
  awk '$1 ~ /^llava_request_status_total\{api="grpc",code="OK"\}/ { print $2 }')
awk -F, -v w="$warmup" -v served="$served" '
  NR > 1 && $1 != "idle" {
    if (base == "" && $1 >= w) base = $2
    last = $2; if ($2 > peak) peak = $2
    if ($1 >= w) { n++; sx += $1; sy += $2; sxy += $1 * $2; sxx += $1 * $1 }
  }
  $1 == "idle" { idle = $0 }
  END {
    printf "requests served: %s\n", served
    printf "rss after warm-up: %.1f MB, at the end: %.1f MB, peak: %.1f MB, growth: %+.2f%%\n",
           base / 1e6, last / 1e6, peak / 1e6, (last - base) * 100 / base
    # Least-squares slope after warm-up: steady growth shows here, allocator swings do not.
    if (n > 2 && n * sxx != sx * sx) {
      slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
      printf "rss trend after warm-up: %+.2f MB/hour (%+.2f%% of the warm-up RSS per hour)\n",
             slope * 3600 / 1e6, slope * 3600 * 100 / base
    }
    split(idle, f, ","); printf "idle: running %s, waiting %s, kv_used_bytes %s\n", f[3], f[4], f[5]
  }' "$out/soak.csv"
[ ! -s "$out/errors.txt" ] || { echo "load errors:"; cat "$out/errors.txt"; exit 1; }
