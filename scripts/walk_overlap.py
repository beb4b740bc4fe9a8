#!/usr/bin/env python
"""How much the backward's two walks gain from running at once (kda_kcp.cuda.backward._both_walks): the
forward walk (h, V_new) alone, the reverse walk (dh, dV_new) alone, then both on two streams, on the
benchmark batch (whole runs, the choice at H >= 16), CUDA events, median of --iters. Each timed call gets
fresh records (the forward walk writes V_new over U), made untimed.

    python scripts/walk_overlap.py --heads 16
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kda_kcp.cuda import backward as cb  # noqa: E402
from kda_kcp.plan import LocalPlan, build_plan  # noqa: E402
from profile_step import DOCS, step_inputs  # noqa: E402  (scripts/ is on sys.path when run as a script)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    dev, H = torch.device("cuda"), args.heads
    cu, q, k, v, g, beta = step_inputs(DOCS, H, dev)
    T = cu[-1]
    do = torch.randn(T, H, 128, device=dev).bfloat16()
    plan = LocalPlan(T, build_plan(cu, [[(0, T)]]).rank_runs[0])  # one rank, every run a whole document
    chunks, runs = cb._tables(plan, dev)
    nc = chunks.shape[0]
    h = torch.empty(cb.hi_state_shape(nc, H), dtype=torch.bfloat16, device=dev)
    dh = torch.empty(cb.scaled_state_shape(nc, H), dtype=torch.uint8, device=dev)
    e0 = torch.empty(0, device=dev)

    def run(which):
        pb = cb.PreparedBackward(q, k, v, g, beta, do, 128**-0.5, plan)
        mod, prep = pb.mod, pb.prep
        fwd = lambda: mod.bwd_fwd_walk(prep, chunks, runs, e0, e0, e0, h, 8)  # noqa: E731
        rev = lambda: mod.bwd_rev_walk(do, prep, chunks, runs, e0, e0, e0, dh, 8)  # noqa: E731
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if which == "fwd":
            fwd()
        elif which == "rev":
            rev()
        elif which == "serial":
            rev()
            fwd()
        else:
            cb._both_walks(rev, fwd, dev)
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b)

    for which in ("fwd", "rev", "serial", "both"):
        run(which)  # warm-up
        t = statistics.median(run(which) for _ in range(args.iters))
        print(f"walk_overlap H={H}: {which:6s} {t:.3f} ms")


if __name__ == "__main__":
    main()
