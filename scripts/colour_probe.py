#!/usr/bin/env python3
"""Does the model read the colour word of a question? (docs/TRAINING.md)

  scripts/colour_probe.py make HELDOUT_DIR OUT.jsonl   # questions for llava-eval --dataset
  scripts/colour_probe.py score ITEMS.jsonl            # llava-eval --items output
  scripts/colour_probe.py grouped HELDOUT_DIR OUT.jsonl  # "List the objects by color." items

`grouped` writes the held-out references of the by-colour list (llava-train --grouped-prob,
DescribeByColour in train/shapes_world.cc), rebuilt from each description's text; `score` then
also prints how many of those answers match their reference exactly.

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
OBJECT = r"a (small|medium|large) (\w+) (\w+) ((?:at|on|in) the (?:top left|top right|bottom left|bottom right|top|bottom|left|right|center))"


def described_objects(heldout):
    """(image, [(size, colour, shape, where), ...] row-major) for every held-out description."""
    for line in open(os.path.join(heldout, "eval.jsonl")):
        j = json.loads(line)
        if j["kind"] == "describe":
            yield j["image"], re.findall(OBJECT, j["answer"])


def make(heldout, out_path):
    with open(out_path, "w") as out:
        for image, objects in described_objects(heldout):
            colours = [colour for _, colour, _, _ in objects]
            for c in COLOURS:
                out.write(json.dumps({"image": image, "prompt": f"How many {c} objects are there?",
                                      "answer": str(colours.count(c)), "kind": "colour-count"}) + "\n")


def grouped(heldout, out_path):
    with open(out_path, "w") as out:
        for image, objects in described_objects(heldout):
            groups = []
            for c in COLOURS:
                hits = [f"a {size} {shape} {where}" for size, colour, shape, where in objects if colour == c]
                if hits:
                    listed = hits[0] if len(hits) == 1 else ", ".join(hits[:-1]) + " and " + hits[-1]
                    groups.append(f"{c}: {listed}")
            out.write(json.dumps({"image": image, "prompt": "List the objects by color.",
                                  "answer": "; ".join(groups) + ".", "kind": "describe-by-colour"}) + "\n")


def score(items_path):
    rows = [json.loads(line) for line in open(items_path)]
    lists = [r for r in rows if r["kind"] == "describe-by-colour"]
    if lists:
        exact = sum(r["answer"].strip() == r["reference"].strip() for r in lists)
        print(f"by-colour lists: exact {exact}/{len(lists)}")
    rows = [r for r in rows if r["kind"] == "colour-count"]
    if not rows:
        return
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
    elif sys.argv[1] == "grouped":
        grouped(sys.argv[2], sys.argv[3])
    else:
        score(sys.argv[2])
