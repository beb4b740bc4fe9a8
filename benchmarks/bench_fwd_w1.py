#!/usr/bin/env python3
"""Minimal forward benchmark, W = 1 (until benchmarks/bench_kda_kcp.py exists): the CUDA backend's
fwd_output vs FLA 0.6.0 chunk_kda (safe_gate=True) on the DESIGN.md section 8 batch.

Protocol (a subset of section 8): inputs without autograd; each timed iteration: L2 flush (a 512 MB
write), CUDA events around the call; one untimed call per arm, then `groups` groups in the palindromic
order ours, fla, fla, ours with `iters` timed iterations per visit. Cell = median over groups of the
group medians. Peak memory per arm = max_memory_allocated during one call minus the inputs. Error of
each arm vs the FP64 oracle on a slice (the first `slice` tokens of every document).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kda_kcp.cuda import CudaBackend  # noqa: E402
from kda_kcp.plan import LocalPlan, build_plan  # noqa: E402
from kda_kcp.reference import naive_kda  # noqa: E402

DOCS = [42024, 57573, 73122, 88673]


def make_inputs(lens, H, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(T, H, 128, generator=gen), dim=-1).bfloat16().cuda()
    k = torch.nn.functional.normalize(torch.randn(T, H, 128, generator=gen), dim=-1).bfloat16().cuda()
    v = torch.randn(T, H, 128, generator=gen).bfloat16().cuda()
    g = (-5 * torch.rand(T, H, 128, generator=gen)).clamp(-5.0, -1e-6).float().cuda()
    beta = torch.rand(T, H, generator=gen).bfloat16().cuda()
    return q, k, v, g, beta


def cu_of(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


class Arm:
    def __init__(self, name, fn):
        self.name, self.fn, self.times, self.peak, self.err, self.status = name, fn, [], None, None, "ok"


def flush(buf):
    buf.zero_()


def time_visit(arm, iters, buf):
    out = []
    for _ in range(iters):
        flush(buf)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        arm.fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--slice", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    fla_chunk = None
    if not args.no_fla:
        try:
            from fla.ops.kda import chunk_kda as fla_chunk  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            print(f"FLA unavailable: {exc}")
    T = sum(DOCS)
    cu = cu_of(DOCS)
    plan = LocalPlan(T, build_plan(cu, [[(0, T)]]).rank_runs[0])
    be = CudaBackend()
    buf = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    rows = []
    for H in args.heads:
        q, k, v, g, beta = make_inputs(DOCS, H, seed=H)
        scale = 128**-0.5
        arms = [Arm("ours", lambda: be.fwd_output(q, k, v, g, beta, scale, plan))]
        if fla_chunk is not None:
            cu_t = torch.tensor(cu, dtype=torch.long, device="cuda")
            cu_c = torch.tensor(cu, dtype=torch.long)

            def fla_fn():
                return fla_chunk(q[None], k[None], v[None], g[None], beta[None], scale=scale, safe_gate=True,
                                 cu_seqlens=cu_t, cu_seqlens_cpu=cu_c)[0]

            arms.append(Arm("fla", fla_fn))
        for arm in arms:  # untimed call (compiles / autotunes), peak memory
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.time()
            try:
                arm.fn()
                torch.cuda.synchronize()
                arm.peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            except torch.OutOfMemoryError as exc:
                arm.status = "OOM"
                print(f"H={H} {arm.name}: out of memory ({str(exc).splitlines()[0]})")
                torch.cuda.empty_cache()
            print(f"H={H} {arm.name}: first call {time.time() - t0:.1f} s", flush=True)
        live = [a for a in arms if a.status == "ok"]
        order = live + live[::-1]
        for _ in range(args.groups):
            for arm in order:
                arm.times.append(time_visit(arm, args.iters, buf))
        # error vs FP64 on a slice: the first `slice` tokens of each document
        idx = torch.cat([torch.arange(s, s + args.slice) for s in cu[:-1]]).cuda()
        sl_cu = cu_of([args.slice] * len(DOCS))
        sq, sk, sv, sg, sb = (x[idx].contiguous() for x in (q, k, v, g, beta))
        ref = naive_kda(sq, sk, sv, sg, sb, sl_cu, scale=scale)
        sl_plan = LocalPlan(sl_cu[-1], build_plan(sl_cu, [[(0, sl_cu[-1])]]).rank_runs[0])
        for arm in live:
            if arm.name == "ours":
                o = be.fwd_output(sq, sk, sv, sg, sb, scale, sl_plan)
            else:
                o = fla_chunk(sq[None], sk[None], sv[None], sg[None], sb[None], scale=scale, safe_gate=True,
                              cu_seqlens=torch.tensor(sl_cu, device="cuda"),
                              cu_seqlens_cpu=torch.tensor(sl_cu))[0][0]
            arm.err = ((o.double() - ref).norm() / ref.norm()).item()
        for arm in arms:
            # visits per group: ours twice, fla twice -> group median of each group's visits
            med = None
            if arm.times:
                per_group = [statistics.median(arm.times[i * 2:(i + 1) * 2]) for i in range(args.groups)]
                med = statistics.median(per_group)
            rows.append(dict(H=H, arm=arm.name, ms=med, status=arm.status, peak_gib=arm.peak, err=arm.err,
                             visits=arm.times))
            print(f"ROW H={H} arm={arm.name} ms={med} peak_gib={arm.peak} err={arm.err} status={arm.status}",
                  flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
        del q, k, v, g, beta
        torch.cuda.empty_cache()
    print("\n| H | arm | fwd ms | peak GiB | rel err vs FP64 (slice) | status |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ms = f"{r['ms']:.3f}" if r["ms"] is not None else "-"
        pk = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        er = f"{r['err']:.2e}" if r["err"] is not None else "-"
        print(f"| {r['H']} | {r['arm']} | {ms} | {pk} | {er} | {r['status']} |")
    for H in args.heads:
        o = [r for r in rows if r["H"] == H and r["arm"] == "ours"]
        f = [r for r in rows if r["H"] == H and r["arm"] == "fla" and r["ms"]]
        if o and f and o[0]["ms"]:
            print(f"H={H}: FLA / ours = {f[0]['ms'] / o[0]['ms']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
