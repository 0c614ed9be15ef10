#!/usr/bin/env python3
"""Does the model read the colour word of a question? (docs/TRAINING.md)

  scripts/colour_probe.py make HELDOUT_DIR OUT.jsonl   # questions for llava-eval --dataset
  scripts/colour_probe.py score ITEMS.jsonl            # llava-eval --items output

`make` asks "How many <colour> objects are there?" for all 8 colours about every held-out image
that has a description (references from its text). `score` prints exact match, the zero counts,
and how many images get more than one distinct answer over the 8 colours: a model that ignores
the colour word answers all 8 the same.
"""
import collections
import json
import os
import re
import sys

COLOURS = "red orange yellow green blue purple pink black".split()


def make(heldout, out_path):
    with open(out_path, "w") as out:
        for line in open(os.path.join(heldout, "eval.jsonl")):
            j = json.loads(line)
            if j["kind"] != "describe":
                continue
            found = re.findall(r"a (?:small|medium|large) (\w+) \w+ (?:at|on|in) ", j["answer"])
            for c in COLOURS:
                out.write(json.dumps({"image": j["image"], "prompt": f"How many {c} objects are there?",
                                      "answer": str(found.count(c)), "kind": "colour-count"}) + "\n")


def score(items_path):
    rows = [json.loads(line) for line in open(items_path)]
    rows = [r for r in rows if r["kind"] == "colour-count"]
    by_image = collections.defaultdict(set)
    for r in rows:
        by_image[r["sample"] // len(COLOURS)].add(r["answer"])
    right = sum(r["score"] == 1.0 for r in rows)
    zero = [r for r in rows if r["reference"] == "0"]
    print(f"colour counts right {right}/{len(rows)}; reference 0 right "
          f"{sum(r['score'] == 1.0 for r in zero)}/{len(zero)}; images with more than one "
          f"distinct answer over the 8 colours {sum(len(s) > 1 for s in by_image.values())}/{len(by_image)}")


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3])
    else:
        score(sys.argv[2])
