#!/usr/bin/env python
"""Loads or latency: the SM time per chunk-head of every kernel of one forward + backward, with the inputs
L2-resident (one wave of one-chunk documents at H = 1, which the prep and the walks leave in L2) against streaming
from DRAM (many waves), from torch.profiler's kernel durations:

    python3 scripts/profiling/l2_waves.py

SM time per chunk-head = a kernel's time in one step x the SM count / chunk-heads. A kernel whose one-wave time
matches its streaming time is bound by its own chain of work, not by its loads (docs/kernels.md, Where the time
goes). The last row is the benchmark batch at H = 16.
"""

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import kda_kcp  # noqa: E402
from profile_step import DOCS, step_inputs  # noqa: E402

KERNELS = ("grads_kernel", "rev_walk_kernel", "fwd_walk_kernel", "prep_kernel", "walk_kernel")


def kernel_times(docs, H, steps=3):
    """{kernel: (ms per step, launches per step)} over ``steps`` profiled forward + backward steps."""
    dev = torch.device("cuda")
    cu, *inputs = step_inputs(docs, H, dev)
    q, k, v, g, beta = (x.requires_grad_() for x in inputs)
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=dev))
    do = torch.randn(cu[-1], H, 128, device=dev).bfloat16()

    def step():
        o = kda_kcp.chunk_kda_kcp(q, k, v, g, beta, ctx, deterministic=True)
        torch.autograd.grad(o, (q, k, v, g, beta), do)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        key = next((name for name in KERNELS if name in e.name), None)
        if key is None:
            continue
        if key == "prep_kernel":
            key = "backward prep" if "bwd" in e.name else "forward prep"
        t, n = out.get(key, (0.0, 0))
        out[key] = (t + e.device_time / 1e3 / steps, n + 1)
    return {key: (t, n // steps) for key, (t, n) in out.items()}, (cu[-1] // 64) * H


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for docs, H in (([64] * sms, 1), ([64] * (2 * sms), 1), ([64] * (16 * sms), 1), ([64] * (16 * sms), 4),
                    (list(DOCS), 16)):
        times, items = kernel_times(docs, H)
        print(f"{len(docs)} documents of {docs[0]}+ tokens, H = {H}: {items} chunk-heads, {items / sms:.1f} waves")
        for key, (ms, n) in sorted(times.items()):
            print(f"  {key:16s} {ms:8.3f} ms a step ({n} launches), {ms * 1e3 * sms / items:7.2f} us of an SM a chunk-head")


if __name__ == "__main__":
    main()
