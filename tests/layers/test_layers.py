"""The layers of the code, enforced: every `#include "…"` of trainer/ and kernels/ must point to a
layer the table below allows (its own layer is always allowed). The table is mirrored in
docs/architecture.md, and this test also fails when the two disagree, so neither can drift.

A layer is a folder (trainer/model, kernels/cpu, ...); kernels/backend.h and its siblings are the
layer `kernels`; trainer/main.cpp is `trainer/main`. Lowest first. Every file of these trees must
belong to a layer of the table, and every include must name a file that exists.

Usage: test_layers.py --root SOURCE_DIR
"""
import argparse
import os
import re
import sys

# layer: the layers it may include, besides itself.
BASE = ["kernels/common"]
ALLOWED = {
    "kernels/common": [],
    "kernels": BASE,
    "kernels/cpu": BASE + ["kernels"],
    "kernels/cuda": BASE + ["kernels"],
    "trainer/core": BASE,
    "trainer/config": BASE + ["trainer/core"],
    "trainer/comm": BASE + ["kernels", "trainer/core"],
    "trainer/params": BASE + ["trainer/core", "trainer/config"],
    "trainer/data": BASE + ["trainer/core", "trainer/config"],
    "trainer/checkpoint": BASE + ["kernels", "trainer/core", "trainer/config", "trainer/comm", "trainer/params"],
    "trainer/optim": BASE + ["kernels", "trainer/core", "trainer/config", "trainer/comm", "trainer/params",
                             "trainer/checkpoint"],
    "trainer/parallel": BASE + ["kernels", "trainer/core", "trainer/config", "trainer/comm", "trainer/params",
                                "trainer/optim"],
    "trainer/model": BASE + ["kernels", "trainer/core", "trainer/config", "trainer/comm", "trainer/params",
                             "trainer/parallel"],
    "trainer/train": BASE + ["kernels", "kernels/cpu", "kernels/cuda", "trainer/core", "trainer/config",
                             "trainer/comm", "trainer/params", "trainer/data", "trainer/checkpoint", "trainer/optim",
                             "trainer/parallel", "trainer/model"],
    "trainer/plan": BASE + ["kernels", "kernels/cpu", "trainer/core", "trainer/config", "trainer/comm",
                            "trainer/params", "trainer/parallel", "trainer/model", "trainer/train"],
    "trainer/cli": BASE + ["kernels", "kernels/cpu", "kernels/cuda", "trainer/core", "trainer/config", "trainer/comm",
                           "trainer/params", "trainer/data", "trainer/checkpoint", "trainer/optim", "trainer/parallel",
                           "trainer/model", "trainer/train", "trainer/plan"],
    "trainer/main": BASE + ["kernels", "trainer/core", "trainer/config", "trainer/comm", "trainer/params",
                            "trainer/data", "trainer/checkpoint", "trainer/optim", "trainer/parallel", "trainer/model",
                            "trainer/train", "trainer/plan", "trainer/cli"],
}
SOURCE = re.compile(r"\.(h|hpp|cpp|cc|cu|cuh)$")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_of(path):
    parts = path.split("/")
    if parts[0] == "trainer" and len(parts) == 2:
        return "trainer/main"
    if parts[0] == "kernels" and len(parts) == 2:
        return "kernels"
    # trainer/comm/no_mpi/mpi.h belongs to trainer/comm
    return "/".join(parts[:2])


def doc_table(root):
    """{layer: set of allowed layers} from docs/architecture.md's table: rows `| layer | a, b, c |`
    whose first cell is a layer of the table (backquotes allowed), "—" or "nothing" for none."""
    path = os.path.join(root, "docs", "architecture.md")
    if not os.path.exists(path):
        return None, f"{path} does not exist"
    rows = {}
    for line in open(path, encoding="utf-8"):
        cells = [c.strip().strip("`").strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] not in ALLOWED:
            continue
        allowed = set()
        for item in re.split(r"[,;]\s*", cells[1]):
            item = item.strip().strip("`").strip()
            if item and item not in ("—", "-", "nothing", "(nothing)"):
                allowed.add(item)
        rows[cells[0]] = allowed
    return rows, path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    root = ap.parse_args().root
    errors = []
    files = 0
    edges = 0
    for top in ("kernels", "trainer"):
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(names):
                if not SOURCE.search(name):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
                src = layer_of(rel)
                if src not in ALLOWED:
                    errors.append(f"{rel}: folder {src} is not a layer of tests/layers/test_layers.py's table "
                                  "(add it there and to docs/architecture.md, with what it may include)")
                    continue
                files += 1
                text = open(os.path.join(root, rel), encoding="utf-8", errors="replace").read()
                for m in INCLUDE.finditer(text):
                    inc = m.group(1)
                    line = text.count("\n", 0, m.start()) + 1
                    if not inc.startswith(("trainer/", "kernels/", "tests/")):
                        # a file next to this one (no project path): must exist there
                        if not os.path.exists(os.path.join(dirpath, inc)):
                            errors.append(f"{rel}:{line}: includes \"{inc}\", which is neither a project path nor "
                                          "a file beside it")
                        continue
                    edges += 1
                    if not os.path.exists(os.path.join(root, inc)):
                        errors.append(f"{rel}:{line}: includes \"{inc}\", which does not exist")
                        continue
                    dst = layer_of(inc)
                    if dst == src:
                        continue
                    if dst not in ALLOWED.get(src, []):
                        errors.append(f"{rel}:{line}: layer {src} includes {inc} of layer {dst}, which the layers "
                                      f"table does not allow ({src} may include: "
                                      f"{', '.join(ALLOWED[src]) or 'nothing'})")
    rows, where = doc_table(root)
    if rows is None:
        errors.append(where)
    else:
        for layer, allowed in ALLOWED.items():
            if layer not in rows:
                errors.append(f"{where}: the layers table has no row for {layer}")
            elif rows[layer] != set(allowed):
                errors.append(f"{where}: the row of {layer} allows {sorted(rows[layer])}, this test "
                              f"{sorted(allowed)}")
    for e in errors:
        print("FAIL:", e)
    print(f"{files} files, {edges} project includes checked against {len(ALLOWED)} layers: "
          f"{len(errors)} problem(s)")
    return 1 if errors or files == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
