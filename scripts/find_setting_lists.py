#!/usr/bin/env python3
"""List the literal tuples, lists, sets and dict keys in ``fedfeat/`` that name two or more run settings or partition
scheme names, outside the run specification (``fedfeat/spec/``) and the scheme registry (``fedfeat/partition/
registry.py``, ``kinds/``): the places where a hand-written list of settings could drift from the specification.

Usage: ``python scripts/find_setting_lists.py``. Each hit is printed with what it names; a reviewer decides whether
it is a key (which must be derived) or a record's schema, a display column list or data (which may stay). Exit
status 0 always: this is a reading aid, not a gate.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedfeat.partition.registry import SCHEMES  # noqa: E402
from fedfeat.spec import FIELDS  # noqa: E402

SKIP = ("fedfeat/spec/", "fedfeat/partition/registry.py", "fedfeat/partition/kinds/")


def main() -> int:
    keys, names = set(FIELDS) | {"params"}, set(SCHEMES)
    for p in sorted((ROOT / "fedfeat").rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith(SKIP):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                elts = node.elts
            elif isinstance(node, ast.Dict):
                elts = [k for k in node.keys if k is not None]
            else:
                continue
            strs = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            attrs = [e.attr for e in elts if isinstance(e, ast.Attribute) and e.attr in keys
                     and isinstance(e.value, ast.Name) and e.value.id.startswith("cfg")]  # fmt: skip
            ks, ns = [s for s in strs if s in keys] or attrs, [s for s in strs if s in names]
            if len(ks) >= 2 or len(ns) >= 2:
                print(f"{rel}:{node.lineno}: settings {ks} schemes {ns}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
