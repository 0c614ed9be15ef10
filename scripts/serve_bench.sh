#!/usr/bin/env bash
# Starts llava-server with the given flags, runs llava-load against it while sampling the
# running-requests gauge, prints the load summary and the largest running batch seen.
# MODEL (default: the shipped default model; /tmp/bench-model is what
# `build/llava-make-tiny --preset bench` writes). Load flags may quote: "--prompt 'Two words'".
# SERVER picks the server binary (default build/llava-server), e.g. an older build for an A/B.
# PERF=1 also records the server with `perf record -g` into /tmp/sb-NAME.perf.data.
# usage: serve_bench.sh NAME "server flags" "load flags"
set -u
name=$1; sflags=$2; lflags=$3
cd "$(dirname "$0")/.."
"${SERVER:-./build/llava-server}" --model "${MODEL:-models/shapes-llava}" --listen 127.0.0.1:50090 --metrics-listen 127.0.0.1:9290 --http-listen off $sflags > /tmp/sb-$name.log 2>&1 &
spid=$!
for i in $(seq 1 100); do grep -q "serving on port" /tmp/sb-$name.log && break; sleep 0.2; done
( maxr=0; while kill -0 $spid 2>/dev/null; do r=$(curl -s 127.0.0.1:9290/metrics | awk '/^llava_num_requests_running /{print $2}'); r=${r%.*}; [ -n "$r" ] && [ "$r" -gt "$maxr" ] && maxr=$r && echo $maxr > /tmp/sb-$name.maxrun; sleep 0.2; done ) &
if [ -n "${PERF:-}" ]; then
  perf record -F 999 -g -o /tmp/sb-$name.perf.data -p $spid > /dev/null 2>&1 &
  perfpid=$!
fi
eval "./build/llava-load --server 127.0.0.1:50090 $lflags" 2>&1 | tail -1 | sed "s/^/$name /"
if [ -n "${PERF:-}" ]; then kill -INT $perfpid; wait $perfpid 2>/dev/null; fi
echo "$name max_running=$(cat /tmp/sb-$name.maxrun 2>/dev/null)"
kill -TERM $spid; wait $spid 2>/dev/null
