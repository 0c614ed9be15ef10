#!/usr/bin/env python3
"""Exact match per question template from llava-eval's --items JSON lines.

Usage: scripts/per_template.py ITEMS.jsonl [ITEMS2.jsonl ...]

Groups short answers by template (colour and shape words replaced by placeholders), and prints
the cases docs/TRAINING.md tracks: counts whose reference is 0, existence by reference yes/no,
and how often the model's most frequent answer to a template is given (a constant answer means
no lookup).
"""
import collections
import json
import re
import sys

COLOURS = "red orange yellow green blue purple pink black".split()
SHAPES = "circle square triangle diamond star".split()


def template(q, kind):
    if not q:
        return "(last turn of a conversation: %s)" % kind
    q = re.sub(r"\b(%s)\b" % "|".join(COLOURS), "<colour>", q)
    q = re.sub(r"\b(%s)s?\b" % "|".join(SHAPES), "<shape>", q)
    q = re.sub(r"\b(an?) <colour>", "a <colour>", q)
    if q.startswith("What is "):
        return "What is <position>?"
    if q.startswith("Which is larger"):
        return "Which is larger, ...?"
    return q


def main(paths):
    for path in paths:
        rows = [json.loads(line) for line in open(path)]
        rows = [r for r in rows if r["kind"] != "describe" and r["policy"] == "full"]
        groups = collections.defaultdict(list)
        for r in rows:
            groups[template(r["prompt"], r["kind"])].append(r)
        right = sum(r["score"] == 1.0 for r in rows)
        print(f"== {path}: short answers {right}/{len(rows)} = {right / max(1, len(rows)):.3f}")
        for t, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            ok = sum(r["score"] == 1.0 for r in rs)
            top, n = collections.Counter(r["answer"] for r in rs).most_common(1)[0]
            print(f"  {ok:4d}/{len(rs):<4d} {t:45s} most frequent answer {top!r} x{n}")
        zero = [r for r in rows if r["kind"].endswith("count") and r["reference"] == "0"]
        yes = [r for r in rows if r["kind"].endswith("exists") and r["reference"] == "yes"]
        no = [r for r in rows if r["kind"].endswith("exists") and r["reference"] == "no"]
        for name, rs in (("count, reference 0", zero), ("exists, reference yes", yes),
                         ("exists, reference no", no)):
            ok = sum(r["score"] == 1.0 for r in rs)
            print(f"  {name}: {ok}/{len(rs)}")


if __name__ == "__main__":
    main(sys.argv[1:])
