#!/usr/bin/env bash
# Runs every libFuzzer target of tests/fuzz (built by `make fuzz` into BUILD_DIR) for SECONDS
# each, or for RUNS executions each when RUNS is set, starting from the committed corpus. New
# inputs go to a scratch corpus (the committed one is not touched); a crash leaves its input in
# OUT/crash-* and fails the script. Prints each target's executions, coverage and corpus size.
#
# usage: scripts/fuzz.sh BUILD_DIR [SECONDS] [OUT]     (RUNS=1000000 scripts/fuzz.sh ...)
set -euo pipefail
build=$1
seconds=${2:-20}
out=${3:-$(mktemp -d /tmp/llava-fuzz.XXXXXX)}
cd "$(dirname "$0")/.."
mkdir -p "$out"
limit=(-max_total_time="$seconds")
if [ -n "${RUNS:-}" ]; then limit=(-runs="$RUNS"); fi
status=0
for corpus in tests/fuzz/corpus/*/; do
  name=$(basename "$corpus")
  scratch="$out/corpus-$name"
  mkdir -p "$scratch"
  log="$out/$name.log"
  echo "== fuzz_$name ($(date -u +%H:%M:%S))"
  if ! UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 "$build/fuzz_$name" "$scratch" "$corpus" \
      "${limit[@]}" -timeout=10 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
      -artifact_prefix="$out/$name-" > "$log" 2>&1; then
    echo "fuzz_$name FAILED; input and log in $out:"
    grep -E "ERROR|property failed|SUMMARY|Test unit written" "$log" | head -20
    status=1
  fi
  grep -E "^stat::(number_of_executed_units|peak_rss_mb|new_units_added)" "$log" | tr '\n' ' '
  grep -oE "cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9]+[a-zA-Z]*" "$log" | tail -1
done
exit $status
