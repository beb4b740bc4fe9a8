#!/usr/bin/env python
"""How much of a timed call is the GPU waiting for the host: the benchmark's timing against the GPU's own time.

The benchmark synchronizes before each iteration, records its start event, then calls the op: until the host
has launched the op's first kernel, the GPU idles inside the timed window. Here each op (fwd, bwd, ckpt on the
benchmark batch, with a workspace) is timed two ways per iteration, alternating:

    as the benchmark:  flush, synchronize, start event, op, end event
    GPU-bound:         flush, synchronize, torch.cuda._sleep (a kernel that spins ~--sleep-us), start event, op,
                       end event: the host enqueues the op while the GPU spins, so the window holds GPU time only

The difference of the medians is the host latency the benchmark's number carries.

    python scripts/host_gap.py --heads 4 16 --ops fwd bwd ckpt
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kda_kcp  # noqa: E402
from bench_kda_kcp import Bench  # noqa: E402  (the benchmark's own fwd / bwd / ckpt ops)
from profile_step import DOCS, step_inputs  # noqa: E402


def spin_cycles(us: float) -> int:
    """Clock cycles of torch.cuda._sleep that last ~``us`` microseconds (measured once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # warm
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return int(1_000_000 * us / (1000 * start.elapsed_time(end)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, nargs="+", default=[4, 16])
    p.add_argument("--ops", nargs="+", choices=("fwd", "bwd", "ckpt"), default=["fwd", "bwd", "ckpt"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sleep-us", type=float, default=2000.0, help="the spin before the GPU-bound window")
    args = p.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    cycles = spin_cycles(args.sleep_us)
    print("| H | op | as the benchmark ms | GPU-bound ms | host latency ms |")
    print("|---|---|---|---|---|")
    for H in args.heads:
        cu, *inputs = step_inputs(list(DOCS), H, dev)
        x = tuple(t.requires_grad_() for t in inputs)
        ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=dev))
        ws = kda_kcp.WorkspaceKcp(ctx, H, device=dev)

        def fn(q, k, v, g, beta):
            return kda_kcp.chunk_kda_kcp(q, k, v, g, beta, ctx, workspace=ws)

        do = torch.randn(x[0].shape, dtype=torch.bfloat16, device=dev)
        for op in args.ops:
            prepare, timed = Bench.op_fns(op, fn, x, do)
            times = {False: [], True: []}
            for i in range(2 * args.iters + 2):
                spin = bool(i % 2)
                state = prepare()
                flush.zero_()
                torch.cuda.synchronize()
                if spin:
                    torch.cuda._sleep(cycles)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = timed(state)
                end.record()
                end.synchronize()
                if i >= 2:  # the first pair warms up
                    times[spin].append(start.elapsed_time(end))
                del out, state
            a, b = statistics.median(times[False]), statistics.median(times[True])
            print(f"| {H} | {op} | {a:.3f} | {b:.3f} | {a - b:.3f} |", flush=True)


if __name__ == "__main__":
    main()
