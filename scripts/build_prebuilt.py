#!/usr/bin/env python3
"""Build every program of build.json for the given archs into kda_kcp/prebuilt/<arch>/ (or --out DIR).

Needs nvcc (and ninja) but no GPU:  python scripts/build_prebuilt.py --arch sm_90a sm_100a sm_103a
An experiment's compile-time variant for an A/B (scripts/ab_builds.sh, gpu_session.sh PREBUILT=...):
  ... --out DIR --define NAME=VALUE
Each program carries its build identity (kda_kcp/jit.py): kda_kcp uses a prebuilt one only while it is of the
checkout's sources and flags (and package version), so rebuild after changing them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kda_kcp import jit  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", nargs="+", required=True, help="e.g. sm_90a sm_100a sm_103a")
    ap.add_argument("--out", default=None, help="output root (default: kda_kcp/prebuilt)")
    ap.add_argument("--program", nargs="*", default=None, help="only these programs")
    ap.add_argument("--define", nargs="*", default=(), metavar="NAME=VALUE",
                    help="extra macros: an experiment's compile-time variant for an A/B (scripts/ab_builds.sh)")
    args = ap.parse_args()
    out_root = Path(args.out) if args.out else Path(jit.__file__).resolve().parent / "prebuilt"
    progs = [p["name"] for p in jit.manifest()["programs"]]
    if args.program:
        progs = [p for p in progs if p in args.program]
    failed = 0
    for arch in args.arch:
        for name in progs:
            t0 = time.time()
            try:
                path = jit.build_program(name, arch, out_root / arch, args.define)
            except jit.KernelBuildError as exc:
                print(f"{arch} {name}: FAILED: {exc}", file=sys.stderr)
                failed += 1
                continue
            print(f"{arch} {name}: {path} ({time.time() - t0:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
