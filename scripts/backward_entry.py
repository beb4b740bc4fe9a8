#!/usr/bin/env python
"""When the backward's nodes start, on the benchmark batch with a workspace, as the benchmark's `bwd` op runs them
(torch.autograd.grad of an untimed forward): KdaKcpOutput.backward's entry and exit, KdaKcpInputs.backward's entry,
function.backward_kcp's span and grad()'s return, in us after the call, under ablations:

    as is | no autograd threads (torch.autograd.set_multithreading_enabled(False): the caller's thread runs the
    backward) | gc off | backward_kcp stubbed (the forward real, no backward kernels) | stubbed, no threads

    python scripts/backward_entry.py --heads 4        # on the GPU machine

scripts/autograd_entry.py runs Functions with no work in them for comparison; scripts/host_trace.py lists every
stage of one call.
"""

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_trace  # noqa: E402  (its stage timers)
import kda_kcp  # noqa: E402
import kda_kcp.function as function  # noqa: E402
from profile_step import DOCS, step_inputs  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--iters", type=int, default=12)
    args = p.parse_args()
    host_trace.instrument(False)
    dev = torch.device("cuda")
    cu, *inputs = step_inputs(list(DOCS), args.heads, dev)
    x = tuple(t.requires_grad_() for t in inputs)
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=dev))
    ws = kda_kcp.WorkspaceKcp(ctx, args.heads, device=dev)
    do = torch.randn(x[0].shape, dtype=torch.bfloat16, device=dev)

    def fn():
        return kda_kcp.chunk_kda_kcp(*x, ctx, workspace=ws)

    real = function.backward_kcp

    def stub(do, saved, ctx, workspace=None):
        return tuple(torch.empty_like(t) for t in (saved.q, saved.k, saved.v, saved.g, saved.beta))

    def run(name, threads=True, gc_off=False, stubbed=False):
        function.backward_kcp = host_trace.timed("function.backward_kcp", stub if stubbed else real)
        rows = []
        for i in range(args.iters + 3):
            o = fn()
            torch.cuda.synchronize()
            if gc_off:
                gc.disable()
            host_trace.EVENTS.clear()
            t0 = time.perf_counter()
            with torch.autograd.set_multithreading_enabled(threads):
                gr = torch.autograd.grad(o, x, do)
            t1 = time.perf_counter()
            gc.enable()
            torch.cuda.synchronize()
            ev = {e[3]: e for e in host_trace.EVENTS}
            out_b, in_b, bk = ev["KdaKcpOutput.backward"], ev["KdaKcpInputs.backward"], ev["function.backward_kcp"]
            if i >= 3:
                rows.append((out_b[0] - t0, out_b[1] - t0, in_b[0] - t0, bk[0] - t0, bk[1] - t0, t1 - t0))
            del o, gr
        m = [1e6 * statistics.median(c) for c in zip(*rows)]
        print(f"{name:24s} Output.backward {m[0]:6.0f}-{m[1]:6.0f}  Inputs.backward {m[2]:6.0f}  backward_kcp "
              f"{m[3]:6.0f}-{m[4]:6.0f}  grad() returns {m[5]:6.0f}", flush=True)
        function.backward_kcp = real

    print(f"H = {args.heads}: medians of {args.iters}, us after the call to torch.autograd.grad")
    run("as is")
    run("no autograd threads", threads=False)
    run("gc off", gc_off=True)
    run("backward_kcp stubbed", stubbed=True)
    run("stubbed, no threads", stubbed=True, threads=False)


if __name__ == "__main__":
    main()
