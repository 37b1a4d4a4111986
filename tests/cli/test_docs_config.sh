#!/usr/bin/env bash
# docs/config.md against the binary: every leaf key of the config `tetra train --print-config` resolves
# (a dotted path such as model.moe.top_k) must have a row in docs/config.md whose default cell
# holds the printed value and whose type cell agrees with it; every key the page documents must
# exist. The config printed sets nothing but data.synthetic (the least a valid config needs), so
# the printed values are the defaults; data.synthetic itself is checked for its row only.
#
# Usage: test_docs_config.sh <tetra binary> [<source dir> [<scratch dir>]]
#   the source dir defaults to the checkout this script lies in, the scratch dir to a temporary one.
here="$(dirname "${BASH_SOURCE[0]}")"
set -- "$1" "${2:-$here/../..}" "${3:-$(mktemp -d)}"
source "$here/lib.sh"

doc="$src/docs/config.md"
case=doc_exists
[[ -f "$doc" ]] || { fail "no $doc"; finish "docs/config.md checks"; }

case=print_config
echo '{"data": {"synthetic": true}}' >"$scratch/minimal.json"
"$tetra" train --config "$scratch/minimal.json" --print-config >"$scratch/resolved.json" 2>"$scratch/err" ||
  fail "--print-config exited non-zero: $(cat "$scratch/err")"

case=keys_and_defaults
$py - "$scratch/resolved.json" "$doc" <<'PY' || fail "docs/config.md disagrees with --print-config (above)"
import json, re, sys

resolved = json.load(open(sys.argv[1]))
set_by_test = {"data.synthetic"}  # the one key the minimal config sets

def leaves(node, prefix=""):
    for key, value in node.items():
        path = prefix + key
        if isinstance(value, dict):
            yield from leaves(value, path + ".")
        else:
            yield path, value

printed = dict(leaves(resolved))

# Rows of the page's tables whose first cell is one backticked dotted key: | `a.b` | type | default | meaning |
def cells(line):
    parts = re.split(r"(?<!\\)\|", line.strip())
    return [p.strip() for p in parts[1:-1]]

documented = {}
for n, line in enumerate(open(sys.argv[2], encoding="utf-8"), 1):
    if not line.lstrip().startswith("|"):
        continue
    row = cells(line)
    if len(row) < 4:
        continue
    m = re.fullmatch(r"`([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)`", row[0])
    if not m:
        continue
    if m.group(1) in documented:
        print(f"docs/config.md:{n}: {m.group(1)}: listed twice")
        documented["__duplicate__"] = None
    documented[m.group(1)] = (n, row[1], row[2])

def kind(value):
    if value is None: return "null"
    if isinstance(value, bool): return "bool"
    if isinstance(value, int): return "int"
    if isinstance(value, float): return "float"
    if isinstance(value, str): return "string"
    if isinstance(value, list): return "list"
    return "object"

def same(doc_value, value):
    if kind(doc_value) in ("int", "float") and kind(value) in ("int", "float"):
        return doc_value == value
    return kind(doc_value) == kind(value) and doc_value == value

# The type column: what the printed value may be for each documented type.
allowed = {"int": {"int"}, "float": {"int", "float"}, "bool": {"bool"}, "enum": {"string"},
           "string": {"string"}, "list": {"list"}, "list of int": {"list"},
           "float or null": {"int", "float", "null"}, "bool or null": {"bool", "null"},
           "int or null": {"int", "null"}}

bad = 0
for key, value in sorted(printed.items()):
    if key not in documented:
        print(f"{key}: printed by --print-config (value {json.dumps(value)}) but not listed in docs/config.md")
        bad += 1
        continue
    n, type_cell, default_cell = documented[key]
    if type_cell not in allowed:
        print(f"docs/config.md:{n}: {key}: unknown type {type_cell!r} (one of {', '.join(allowed)})")
        bad += 1
    elif kind(value) not in allowed[type_cell]:
        print(f"docs/config.md:{n}: {key}: documented as {type_cell}, but --print-config gives {json.dumps(value)}")
        bad += 1
    if key in set_by_test:
        continue
    tokens = re.findall(r"`([^`]*)`", default_cell)
    values = []
    for t in tokens:
        try:
            values.append(json.loads(t))
        except ValueError:
            pass
    if not any(same(v, value) for v in values):
        print(f"docs/config.md:{n}: {key}: default {default_cell!r}, but --print-config gives {json.dumps(value)}")
        bad += 1

for key, (n, _, _) in sorted(documented.items()):
    if key != "__duplicate__" and key not in printed:
        print(f"docs/config.md:{n}: {key}: documented, but --print-config has no such key")
        bad += 1
if "__duplicate__" in documented:
    bad += 1

print(f"{len(printed)} keys printed, {len(documented)} documented, {bad} problem(s)")
sys.exit(1 if bad else 0)
PY

finish "docs/config.md checks"
