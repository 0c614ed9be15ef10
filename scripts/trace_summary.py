#!/usr/bin/env python3
"""Self time per ATen op in a chrome trace written by `llava-train --trace FILE`.

Usage: scripts/trace_summary.py TRACE.json [--top N]

An op's self time is its duration less the time of the ops it called (nested intervals of the
same thread), so the rows add up to the traced time and a matmul's oneDNN call is not counted
twice under aten::linear, aten::matmul and aten::mm. Backward functions (e.g. MulBackward0) show
their own self time; the ops they call are their own rows.
"""
import argparse
import collections
import json


def load_events(path):
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def self_times(events):
    """{name: [self_us, calls]} from complete events, nesting resolved per thread."""
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    totals = collections.defaultdict(lambda: [0.0, 0])
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack = []  # [end, name, child_us]

        def close(item):
            end, name, child = item
            totals[name][0] -= child
            if stack:
                stack[-1][2] += durations[id(item)]

        durations = {}
        for e in evs:
            ts, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= ts:
                close(stack.pop())
            item = [ts + dur, e["name"], 0.0]
            durations[id(item)] = dur
            totals[e["name"]][0] += dur
            totals[e["name"]][1] += 1
            stack.append(item)
        while stack:
            close(stack.pop())
    return totals


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    totals = self_times(load_events(args.trace))
    whole = sum(t for t, _ in totals.values())
    print(f"{whole / 1e3:.1f} ms of op self time in {sum(c for _, c in totals.values())} ops")
    print(f"{'op':<44} {'self ms':>9} {'share':>6} {'calls':>7} {'us/call':>8}")
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    for name, (t, calls) in rows[: args.top]:
        print(f"{name[:44]:<44} {t / 1e3:9.1f} {100 * t / whole:5.1f}% {calls:7d} {t / calls:8.1f}")


if __name__ == "__main__":
    main()
