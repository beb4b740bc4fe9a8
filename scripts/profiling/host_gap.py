#!/usr/bin/env python
"""How much of a benchmark cell is the host's: the det forward or backward on the benchmark batch (W = 1, with a
WorkspaceKcp, as the benchmark calls it), timed two ways in alternation, medians over --iters calls per visit:

- bench: the benchmark's protocol (flush, synchronize, CUDA events around the call): the host's work before the
  first kernel counts, since the GPU waits for it;
- gpu:   the same with a GPU sleep queued before the start event, long enough for the host to launch the whole
  call behind it: only the GPU's time counts.

bench - gpu is the host's share of the cell. With --checkout DIR kda_kcp (and its programs) come from DIR, so two
checkouts compare in separate processes, alternated by the caller (scripts/compare_checkouts.sh, stage gap):

    python3 scripts/profiling/host_gap.py --heads 4 16 --op fwd bwd
    python3 scripts/profiling/host_gap.py --heads 4 --op fwd --checkout /path/to/base --tag base

One line per (op, H, visit): "GAP tag op H=.. bench MS gpu MS host US".
"""

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, nargs="+", default=[4, 16])
    p.add_argument("--op", nargs="+", choices=("fwd", "bwd"), default=["fwd"])
    p.add_argument("--gates", choices=("bench", "strong"), default="bench", help="the benchmark's --gates")
    p.add_argument("--visits", type=int, default=2)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--sleep-cycles", type=int, default=3_000_000,
                   help="the GPU sleep before the start event in gpu mode (~1.5 ms at 2 GHz: longer than the host's "
                        "launches of one call)")
    p.add_argument("--checkout", default=None, metavar="DIR", help="import kda_kcp from DIR (default: this tree)")
    p.add_argument("--tag", default=None, help="the name printed on each line (default: the checkout's folder)")
    args = p.parse_args()
    sys.path.insert(0, str(Path(args.checkout).resolve() if args.checkout else ROOT))
    sys.path.insert(1, str(ROOT / "benchmarks"))
    import torch

    import kda_kcp
    from bench_kda_kcp import cu_of, draw_inputs

    tag = args.tag or Path(kda_kcp.__file__).resolve().parents[1].name
    dev = torch.device("cuda")
    cu = cu_of([42024, 57573, 73122, 88673])
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, dtype=torch.int64, device=dev), layout="contiguous")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    for H in args.heads:
        q, k, v, g, beta, do = draw_inputs(cu[-1], H, 128, dev, 0, gates=args.gates)
        x = [t.requires_grad_() for t in (q, k, v, g, beta)]
        ws = kda_kcp.WorkspaceKcp(ctx, H, device=dev, deterministic=True, head_dim=128)

        def fwd():
            return kda_kcp.chunk_kda_kcp(*x, ctx, scale=None, deterministic=True, workspace=ws)

        def visit(op, iters, gpu_only):
            ts = []
            for _ in range(iters):
                o = fwd() if op == "bwd" else None
                flush.zero_()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if gpu_only:
                    torch.cuda._sleep(args.sleep_cycles)
                start.record()
                r = fwd() if op == "fwd" else torch.autograd.grad(o, x, do)
                end.record()
                end.synchronize()
                ts.append(start.elapsed_time(end))
                del o, r
            return statistics.median(ts)

        for op in args.op:
            visit(op, 3, False), visit(op, 3, True)  # warm: programs loaded, workspace carves made
            for i in range(args.visits):
                order = (False, True) if i % 2 == 0 else (True, False)
                got = {mode: visit(op, args.iters, mode) for mode in order}
                bench, gpu = got[False], got[True]
                print(f"GAP {tag} {op} H={H} bench {bench:.4f} gpu {gpu:.4f} host {1e3 * (bench - gpu):.0f} us",
                      flush=True)
        del x, ws, q, k, v, g, beta, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
