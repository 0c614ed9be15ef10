#!/usr/bin/env python3
"""Rewords the short questions of an eval set with wordings that no training run uses.

The trainer's --paraphrase rewordings (train/shapes_world.cc) are deliberately left out: this set
checks that the default model answers questions worded in ways it never saw. Every colour, shape
and place word is kept, so the reference answers stay right. Questions no rule matches, the
descriptions and the multi-turn items are left out.

Usage: scripts/reword_eval.py IN.jsonl OUT.jsonl [--limit N]
  OUT.jsonl then holds the first N reworded questions; image paths are made absolute so that
  OUT can live anywhere. Run `llava-eval --dataset OUT.jsonl --policies full --budgets 1.0` on it
  and on the same items unchanged (written next to it as OUT.orig.jsonl).
"""
import argparse
import json
import os
import re

# (pattern of the held-out template, rewording); the first match wins.
RULES = [
    (r"^How many objects are there\?$", "How many items are there?"),
    (r"^How many (.+) are there\?$", r"How many \1 do you count?"),
    (r"^What color is the (.+)\?$", r"Tell me the color of the \1."),
    (r"^Where is the (.+)\?$", r"Where can I find the \1?"),
    (r"^What is (at|on) the (.+)\?$", r"What is located \1 the \2?"),
    (r"^Which is larger, (.+)\?$", r"Which is the larger one, \1?"),
    (r"^What shape is the (.+)\?$", r"What kind of shape is the \1?"),
    (r"^Is there an? (.+)\?$", r"Is there any \1?"),
]


def reword(question):
    for pattern, replacement in RULES:
        if re.match(pattern, question):
            return re.sub(pattern, replacement, question)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inp")
    ap.add_argument("out")
    ap.add_argument("--limit", type=int, default=300)
    args = ap.parse_args()
    base = os.path.dirname(os.path.abspath(args.inp))
    kept, rules_used = [], set()
    with open(args.inp) as f:
        for line in f:
            item = json.loads(line)
            if "prompt" not in item or "short_answer" not in item:
                continue
            new = reword(item["prompt"])
            if new is None:
                continue
            rules_used.add(next(p for p, _ in RULES if re.match(p, item["prompt"])))
            item["image"] = os.path.join(base, item["image"])
            kept.append((item, new))
            if len(kept) == args.limit:
                break
    orig = os.path.splitext(args.out)[0] + ".orig.jsonl"
    with open(args.out, "w") as out, open(orig, "w") as same:
        for item, new in kept:
            same.write(json.dumps(item) + "\n")
            out.write(json.dumps(dict(item, prompt=new)) + "\n")
    print(f"{len(kept)} questions, {len(rules_used)} of {len(RULES)} rewordings used -> {args.out}")


if __name__ == "__main__":
    main()
