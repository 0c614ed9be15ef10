#!/usr/bin/env bash
# Physical memory of the KV cache under load: starts llava-server (no warm-up, so nothing has
# touched the pool), samples its resident memory (/proc/PID/status: VmRSS, and RssAnon, the
# anonymous part: the weights are a file mapping whose pages come in as the first requests
# read them) and the KV gauges every 0.3 s while llava-load runs, and prints one line per run:
#   idle_rss_mb  the loaded server before any KV byte is touched
#   peak_above_idle_mb  peak RSS - idle RSS
#   weights_paged_in_mb  file-backed RSS at the end - at idle (weight pages first read)
#   anon_peak_above_idle_mb  peak anonymous RSS - idle: KV pool pages + workspace
#   kv_used_max_mb  the most pool pages in use at once (= the pool pages ever touched)
#   workspace_mb  anon_peak_above_idle - kv_used_max: activations, prompt transients, freed heap
#   kv_full_max_mb  what Full would have held at that moment; running_max; preemptions (the
#   counter's last value)
#   act_peak_live_mb  the most bytes of CPU tensors live at once (llava_activation_peak_bytes)
#   act_mapped_max_mb  the most the activation allocator had mapped (llava_activation_bytes)
#   then llava-load's summary (tokens/s, TTFT, ...)
# usage: kv_memory_bench.sh NAME "server flags" "load flags"
# e.g. MODEL=/tmp/bench-model scripts/kv_memory_bench.sh full \
#   "--default-policy full --max-batch 32 --kv-cache-bytes 421003264" \
#   "--concurrency 32 --requests 32 --prompt 'Describe the image.' \
#    --image models/examples/scene2.png --max-tokens 256 --ignore-eos"
set -u
name=$1; sflags=$2; lflags=$3
cd "$(dirname "$0")/.."
port=${PORT:-50091}; mport=$((port + 200))
log=/tmp/kvmem-$name.log
# (Server flags are split on spaces, unquoted: $! must be the server itself, not a subshell.)
# shellcheck disable=SC2086
"${SERVER:-./build/llava-server}" --model "${MODEL:-models/shapes-llava}" --listen 127.0.0.1:$port \
  --metrics-listen 127.0.0.1:$mport --http-listen off --warmup false $sflags > "$log" 2>&1 &
spid=$!
for _ in $(seq 1 300); do grep -q "serving on port" "$log" && break; sleep 0.2; done
sleep 1
rss() { awk '/^VmRSS/ {r=$2} /^RssAnon/ {a=$2} /^RssFile/ {f=$2} END {print r, a, f}' /proc/$spid/status 2>/dev/null; }
idle=$(rss)
last=$idle
samples=/tmp/kvmem-$name.samples
: > "$samples"
( while kill -0 $spid 2>/dev/null; do
    m=$(curl -s 127.0.0.1:$mport/metrics)
    echo "$(rss) $(echo "$m" | awk '/^llava_kv_cache_used_bytes /{u=$2} /^llava_kv_cache_full_equivalent_bytes /{f=$2} /^llava_num_requests_running /{r=$2} /^llava_preemptions_total /{p=$2} /^llava_activation_peak_bytes /{ap=$2} /^llava_activation_bytes /{am=$2} END{print u+0, f+0, r+0, p+0, ap+0, am+0}')" >> "$samples"
    sleep 0.3
  done ) &
sampler=$!
out=$(eval "./build/llava-load --server 127.0.0.1:$port $lflags" 2>&1 | tail -1)
sleep 0.5
last=$(rss)
kill $sampler 2>/dev/null
kill -TERM $spid; wait $spid 2>/dev/null
awk -v name="$name" -v idle="$idle" -v last="$last" -v load="$out" '
  BEGIN { split(idle, i, " "); split(last, l, " ") }
  { if ($1 > peak) peak = $1; if ($2 > anon) anon = $2
    if ($4 > used) used = $4; if ($5 > full) full = $5; if ($6 > run) run = $6
    if ($7 > pre) pre = $7; if ($8 > ap) ap = $8; if ($9 > am) am = $9 }
  END {
    printf "%s idle_rss_mb=%.0f peak_above_idle_mb=%.0f weights_paged_in_mb=%.0f anon_peak_above_idle_mb=%.0f kv_used_max_mb=%.0f workspace_mb=%.0f kv_full_max_mb=%.0f running_max=%d preemptions=%d act_peak_live_mb=%.0f act_mapped_max_mb=%.0f | %s\n",
      name, i[1] / 1024, (peak - i[1]) / 1024, (l[3] - i[3]) / 1024, (anon - i[2]) / 1024,
      used / 1048576, (anon - i[2]) / 1024 - used / 1048576, full / 1048576, run, pre, ap / 1048576, am / 1048576, load }' "$samples"
