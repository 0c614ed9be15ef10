#!/usr/bin/env python3
"""The engine's layering, checked over the sources (engine/CMakeLists.txt explains the order).

1. A file in engine/<folder>/ includes engine headers only from the folders below it (ALLOWED).
2. The sources of a torch-free target (marked llava_torch_free(...) in engine/CMakeLists.txt)
   reach no libtorch header, directly or through the engine headers they include.
3. server/ stays a thin layer over the engine's serving API: none of its files reaches a libtorch
   header (the model's header included, since it includes ATen).

Usage: layering_test.py SOURCE_DIR   (exit status 1 and one line per violation on failure)
"""
import os
import re
import sys

ALLOWED = {
    "io": {"io"},
    "eval": {"io", "eval"},
    "kv": {"io", "kv"},
    "kernels": {"io", "kernels"},
    "model": {"io", "kv", "kernels", "model"},
    "serving": {"io", "kv", "kernels", "model", "serving"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
TORCH = ("torch/", "ATen/", "c10/")


def includes(path):
    with open(path, encoding="utf-8") as f:
        return INCLUDE.findall(f.read())


def torch_free_sources(root):
    """The .cc files of every target that engine/CMakeLists.txt marks torch-free."""
    with open(os.path.join(root, "engine", "CMakeLists.txt"), encoding="utf-8") as f:
        text = re.sub(r"#[^\n]*", "", f.read())
    marked = set(re.findall(r"llava_torch_free\((\w+)\)", text))
    sources = {}
    for name, body in re.findall(r"add_library\((\w+)\s+STATIC([^)]*)\)", text):
        sources[name] = [os.path.join("engine", s) for s in body.split() if s.endswith(".cc")]
    missing = marked - sources.keys()
    if missing or not marked:
        sys.exit(f"layering_test: no sources found for torch-free targets {sorted(missing)}")
    return {s for name in marked for s in sources[name]}


def main():
    root = sys.argv[1]
    errors = []
    files = []
    for folder, _, names in os.walk(os.path.join(root, "engine")):
        files += [os.path.relpath(os.path.join(folder, n), root)
                  for n in names if n.endswith((".h", ".cc", ".cu"))]
    for rel in sorted(files):
        layer = rel.split(os.sep)[1]
        if layer not in ALLOWED:
            errors.append(f"{rel}: engine/{layer}/ is not a known layer (add it to ALLOWED)")
            continue
        for quote, inc in includes(os.path.join(root, rel)):
            if quote == '"' and inc.startswith("engine/"):
                target = inc.split("/")[1]
                if target not in ALLOWED[layer]:
                    errors.append(f"{rel}: includes {inc}, but engine/{layer}/ may include "
                                  f"only {sorted(ALLOWED[layer])}")

    # Every header reachable from a torch-free source must be torch-free too.
    def reaches_torch(rel, seen):
        if rel in seen:
            return None
        seen.add(rel)
        for quote, inc in includes(os.path.join(root, rel)):
            if inc.startswith(TORCH):
                return [rel, inc]
            if quote == '"' and inc.startswith(("engine/", "server/")):
                chain = reaches_torch(inc, seen)
                if chain:
                    return [rel] + chain
        return None

    for rel in sorted(torch_free_sources(root)):
        chain = reaches_torch(rel, set())
        if chain:
            errors.append(f"{rel}: a torch-free target's source reaches libtorch: "
                          + " -> ".join(chain))
    server = sorted(os.path.join("server", n) for n in os.listdir(os.path.join(root, "server"))
                    if n.endswith((".h", ".cc")))
    for rel in server:
        chain = reaches_torch(rel, set())
        if chain:
            errors.append(f"{rel}: server/ reaches libtorch: " + " -> ".join(chain))
    files += server
    for e in errors:
        print(e)
    print(f"layering_test: {len(files)} files, {len(errors)} violations")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
