#!/usr/bin/env python3
"""Verify build.json against csrc/: schema, every listed file exists, every csrc source belongs to a
program, every binding has its kernel file, archs are declared. Exit 1 on any mismatch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIRED_ARCHS = ("sm_90a", "sm_100a", "sm_103a", "sm_107a")


def main() -> int:
    errs: list[str] = []
    try:
        man = json.loads((ROOT / "build.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"build.json unreadable: {exc}")
        return 1
    archs = man.get("archs")
    if not isinstance(archs, dict):
        errs.append("'archs' must be an object")
        archs = {}
    for a in REQUIRED_ARCHS:
        if a not in archs:
            errs.append(f"arch {a} is not declared")
    for a, spec in archs.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("buildable"), bool):
            errs.append(f"arch {a}: needs a boolean 'buildable'")
        elif not spec["buildable"] and not spec.get("why"):
            errs.append(f"arch {a}: unbuildable archs must say 'why'")
    progs = man.get("programs")
    if not isinstance(progs, list) or not progs:
        errs.append("'programs' must be a non-empty list")
        progs = []
    names = set()
    listed: set[str] = set()
    for p in progs:
        name = p.get("name")
        if not name or name in names:
            errs.append(f"program name missing or duplicated: {name!r}")
        names.add(name)
        if p.get("package") not in ("det", "nondet", "common"):
            errs.append(f"{name}: package must be det, nondet or common")
        srcs = p.get("sources")
        if not isinstance(srcs, list) or not srcs:
            errs.append(f"{name}: 'sources' must be a non-empty list")
            srcs = []
        if not isinstance(p.get("flags", []), list):
            errs.append(f"{name}: 'flags' must be a list")
        for f in srcs + list(p.get("headers", [])):
            if not (ROOT / f).is_file():
                errs.append(f"{name}: {f} does not exist")
            listed.add(f)
        if not any(s.endswith("_binding.cu") for s in srcs):
            errs.append(f"{name}: no *_binding.cu among its sources")
        for s in srcs:
            if s.endswith("_binding.cu"):
                kernel = s[: -len("_binding.cu")] + ".cu"
                if kernel not in srcs:
                    errs.append(f"{name}: {s} has no kernel file {kernel} in the same program")
    for f in sorted((ROOT / "csrc").rglob("*")):
        if f.suffix in (".cu", ".cuh", ".h", ".cc", ".cpp") and f.is_file():
            rel = f.relative_to(ROOT).as_posix()
            if rel not in listed:
                errs.append(f"{rel} is in csrc/ but in no program of build.json")
    for e in errs:
        print(f"build.json: {e}")
    if not errs:
        print(f"build.json OK: {len(progs)} program(s), archs {sorted(archs)}")
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main())
