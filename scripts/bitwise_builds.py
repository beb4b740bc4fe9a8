#!/usr/bin/env python
"""o and every gradient of one det CUDA step on the benchmark batch, saved or compared bitwise: the check that a
kernel change which should not touch the arithmetic does not (an A/B between builds, scripts/ab_builds.sh).

    python scripts/bitwise_builds.py save /tmp/ref.pt --heads 16     # with build A's .so files in place
    python scripts/bitwise_builds.py cmp /tmp/ref.pt --heads 16      # with build B's: one line per tensor
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step import DOCS, run_step  # noqa: E402

NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def step(H, docs):
    torch.manual_seed(0)
    return dict(zip(NAMES, run_step(docs, H)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("save", "cmp"))
    p.add_argument("path")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--docs", nargs="+", type=int, default=list(DOCS))
    args = p.parse_args()
    res = step(args.heads, args.docs)
    if args.mode == "save":
        torch.save({n: t.cpu() for n, t in res.items()}, args.path)
        print(f"saved {', '.join(NAMES)} to {args.path}")
        return 0
    ref = torch.load(args.path)
    differ = 0
    for n, t in res.items():
        r = ref[n].to(t.device)
        same = torch.equal(t, r)
        differ += not same
        rel = ((t.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
        print(f"{n}: {'bitwise equal' if same else 'DIFFERS'} (rel {rel:.2e})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
