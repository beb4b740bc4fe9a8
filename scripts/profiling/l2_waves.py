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
from kda_kcp.plan import CHUNK  # noqa: E402
from profile_step import DOCS, run_step  # noqa: E402

KERNELS = ("grads_kernel", "rev_walk_kernel", "fwd_walk_kernel", "prep_kernel", "walk_kernel")


def kernel_times(docs, H, steps=3):
    """{kernel: (ms per step, launches per step)} over ``steps`` profiled forward + backward steps, and the chunk-heads
    of one step (profile_step.run_step: inputs drawn afresh; only kda_kcp's kernels are counted)."""
    for _ in range(3):
        run_step(docs, H)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_step(docs, H)
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
    return {key: (t, n // steps) for key, (t, n) in out.items()}, sum(-(-n // CHUNK) for n in docs) * H


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for docs, H in (([64] * sms, 1), ([64] * (2 * sms), 1), ([64] * (16 * sms), 1), ([64] * (16 * sms), 4),
                    (list(DOCS), 16)):
        times, items = kernel_times(docs, H)
        print(f"{len(docs)} documents of {docs[0]}+ tokens, H = {H}: {items} chunk-heads, {items / sms:.1f} waves")
        for key, (ms, n) in sorted(times.items()):
            per_item = ms * 1e3 * sms / items
            print(f"  {key:16s} {ms:8.3f} ms a step ({n} launches), {per_item:7.2f} us of an SM a chunk-head")


if __name__ == "__main__":
    main()
