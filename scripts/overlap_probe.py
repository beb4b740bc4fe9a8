#!/usr/bin/env python
"""How much a forward could gain by running its prep and its output walk at the same time (NOTES.md, session 8).

The walk is a serial chain per (run, head, value tile) of latency-bound steps that leaves most of each SM idle;
the prep is parallel over (chunk, head). This probe times, on the benchmark batch, the prep alone, the walk
alone, both in sequence (what the forward does), and both at once on two streams (the walk re-reading records
that an earlier prep wrote, while the prep rewrites the same bytes): the last is the ceiling of a prep -> walk
overlap, and says whether the two kernels slow each other down more than the overlap saves.

    python scripts/overlap_probe.py --heads 16 64
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kda_kcp  # noqa: E402
from kda_kcp.cuda import forward  # noqa: E402
from profile_step import DOCS, step_inputs  # noqa: E402


def timed(fn, iters):
    """Median ms of fn() over iters runs, each after a device synchronize (fn times itself or not)."""
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        out.append(fn())
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, nargs="+", default=[16])
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    dev = torch.device("cuda")
    for H in args.heads:
        cu, q, k, v, g, beta = step_inputs(DOCS, H, dev)
        ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=dev))
        pf = forward.PreparedForward(q, k, v, g, beta, 128 ** -0.5, ctx.local)
        prep = lambda: pf.mod.fwd_prep(pf.q, pf.k, pf.g, pf.beta, pf.tabs.chunks, pf.ws, pf.scale, pf.word)  # noqa: E731
        main_s = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side_hi = torch.cuda.Stream(priority=-1)

        def one(fn):
            def run():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                return a.elapsed_time(b)
            return run

        def both(walk_stream, walk_first):
            def run():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(main_s)
                walk_stream.wait_event(a)
                if walk_first:
                    with torch.cuda.stream(walk_stream):
                        pf.output()
                    prep()
                else:
                    prep()
                    with torch.cuda.stream(walk_stream):
                        pf.output()
                main_s.wait_stream(walk_stream)
                b.record(main_s)
                b.synchronize()
                return a.elapsed_time(b)
            return run

        for fn in (prep, pf.output):  # warm up
            fn()
        rows = [
            ("prep alone", timed(one(prep), args.iters)),
            ("walk alone", timed(one(pf.output), args.iters)),
            ("prep then walk (one stream)", timed(one(lambda: (prep(), pf.output())), args.iters)),
            ("prep || walk (walk launched second)", timed(both(side, False), args.iters)),
            ("prep || walk (walk launched first)", timed(both(side, True), args.iters)),
            ("prep || walk (walk second, high priority)", timed(both(side_hi, False), args.iters)),
        ]
        print(f"## H = {H}, T = {cu[-1]}, {args.iters} runs each (median ms)")
        for name, ms in rows:
            print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()
