#!/usr/bin/env python3
"""Forward stage timing, W = 1, on the benchmark batch (BENCHMARKS.md): the CUDA forward (kda_kcp.cuda.forward) at
each walk width and segment length asked for, and FLA 0.6.0 chunk_kda (safe_gate=True).

Protocol: inputs without autograd; each timed iteration an L2 flush (512 MB
write) and CUDA events around the call; one untimed call per arm, then `groups` groups visiting the arms
in a palindromic order with `iters` timed iterations per visit; cell = median over groups of the group
medians. Also the forward stages alone (prep, summary walk + fold, output walk) and each arm's error vs the
FP64 oracle on a slice (first `slice` tokens of every document).

`--model` prints the forward's cost model predictions and needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DOCS = [42024, 57573, 73122, 88673]

# ---- the forward cost model (docs/kernels.md §2) ----
BW = 3.5e12  # B/s reached by streaming kernels (KINDS.md copy: ~4.3 TB/s)
PREP_BYTES = 1026 + 1096  # per token-head: reads q, k, g, beta; writes the record
WALK_DRAM_BYTES = 1096 + 256 + 256  # reads the record once (its V tiles hit L2), v; writes o
PREP_CYCLES = 10_000  # per (chunk, head) CTA, per SM, with 2 CTAs resident
STEP_US = 3.0  # one output-walk step (64 columns x 1 chunk) at 2 CTAs/SM: 8 warps x ~80 KB ldmatrix
CLOCK = 1.83e9


def simulate(heads, L, sms=132, warps=4):
    """Greedy list schedule (longest first, as the tables order the CTAs) of summary pass, fold, output
    pass, in output steps: a sharper estimate than the closed form the segment choice uses."""
    import heapq

    from kda_kcp.cuda import tuning
    from kda_kcp.cuda.common import even_split

    chunks = [math.ceil(n / 64) for n in DOCS]
    slots = tuning.CTAS_PER_SM * sms
    tiles = 128 // (16 * warps)

    def run(jobs):
        if not jobs:
            return 0.0
        free = [0.0] * min(slots, len(jobs))
        for j in sorted(jobs, reverse=True):
            t = heapq.heappop(free)
            heapq.heappush(free, t + j)
        return max(free)

    out, summ, steps = [], [], 0
    for c in chunks:
        parts = even_split(c, max(1, math.ceil(c / L)))
        out += [p + tuning.CTA_START for p in parts] * heads * tiles
        summ += [(p + tuning.CTA_START) * tuning.SUMMARY_STEP for p in parts[:-1]] * heads * 2 * tiles
        steps = max(steps, len(parts) - 1)
    return run(summ) + tuning.MERGE_STEP * steps + run(out)


def model(heads, sms=132, warps=4):
    from kda_kcp.cuda.tuning import fwd_segment_chunks

    chunks = [math.ceil(n / 64) for n in DOCS]
    L = fwd_segment_chunks(chunks, heads, sms, warps)
    steps = simulate(heads, L, sms, warps)
    th = sum(DOCS) * heads
    prep_mem = th * PREP_BYTES / BW * 1e3
    prep_cmp = sum(chunks) * heads / sms * PREP_CYCLES / CLOCK * 1e3
    walk_mem = th * WALK_DRAM_BYTES / BW * 1e3
    walk_cmp = steps * STEP_US * 1e-3
    prep = max(prep_mem, prep_cmp)
    walk = max(walk_mem, walk_cmp)
    return dict(H=heads, L=L, steps=steps, prep_ms=prep, walk_ms=walk, total_ms=prep + walk,
                bytes_per_token_head=PREP_BYTES + WALK_DRAM_BYTES)


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


def time_visit(fn, iters, buf):
    out = []
    for _ in range(iters):
        buf.zero_()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


class WarpsEnv:
    """KDA_KCP_TUNING="fwd_warps=w" (and fwd_seg_chunks=seg when seg > 0) inside the block (kda_kcp.cuda.tuning)."""

    def __init__(self, w, seg=0):
        knobs = ([f"fwd_warps={w}"] if w is not None else []) + ([f"fwd_seg_chunks={seg}"] if seg else [])
        self.val = ",".join(knobs)

    def __enter__(self):
        self.old = os.environ.get("KDA_KCP_TUNING")
        os.environ["KDA_KCP_TUNING"] = self.val

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("KDA_KCP_TUNING", None)
        else:
            os.environ["KDA_KCP_TUNING"] = self.old


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--segs", type=int, nargs="+", default=[0],
                    help="segment lengths in chunks to time (0: the cost model's choice)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--slice", type=int, default=1024)
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", action="store_true", help="print the cost model's predictions (no GPU)")
    args = ap.parse_args()

    if args.model:
        print("| H | segment (chunks) | walk steps | prep ms | walk ms | v4 ms | FLA ms | FLA / v4 |")
        print("|---|---|---|---|---|---|---|---|")
        fla = {4: 5.1, 16: 13.8, 64: 50.0}
        for H in args.heads:
            m = model(H)
            f = fla.get(H)
            print(f"| {H} | {m['L']} | {m['steps']:.0f} | {m['prep_ms']:.2f} | {m['walk_ms']:.2f} | "
                  f"{m['total_ms']:.2f} | {f or '-'} | {f / m['total_ms'] if f else 0:.1f}x |")
        return

    from kda_kcp import status
    from kda_kcp.cuda import forward
    from kda_kcp.plan import LocalPlan, build_plan
    from kda_kcp.reference import naive_kda

    fla_chunk = None
    if not args.no_fla:
        try:
            from fla.ops.kda import chunk_kda as fla_chunk  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            print(f"FLA unavailable: {exc}")
    T = sum(DOCS)
    cu = cu_of(DOCS)
    plan = LocalPlan(T, build_plan(cu, [[(0, T)]]).rank_runs[0])
    buf = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    scale = 128**-0.5
    rows = []
    for H in args.heads:
        q, k, v, g, beta = make_inputs(DOCS, H, seed=H)
        arms = []
        for w in args.warps:
            for seg in args.segs:
                def f4(w=w, seg=seg):
                    with WarpsEnv(w, seg):
                        return forward.fwd_output(q, k, v, g, beta, scale, plan)
                arms.append([f"v4_w{w}" + (f"_L{seg}" if seg else ""), f4, w])
        if fla_chunk is not None:
            cu_t = torch.tensor(cu, dtype=torch.long, device="cuda")
            cu_c = torch.tensor(cu, dtype=torch.long)

            def fla_fn():
                return fla_chunk(q[None], k[None], v[None], g[None], beta[None], scale=scale, safe_gate=True,
                                 cu_seqlens=cu_t, cu_seqlens_cpu=cu_c)[0]

            arms.append(["fla", fla_fn, None])
        res = {a[0]: dict(times=[], peak=None, status="ok", err=None) for a in arms}
        for name, fn, _ in arms:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.time()
            try:
                fn()
                torch.cuda.synchronize()
                res[name]["peak"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            except torch.OutOfMemoryError as exc:
                res[name]["status"] = "OOM"
                print(f"H={H} {name}: out of memory ({str(exc).splitlines()[0]})")
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001
                res[name]["status"] = f"error: {str(exc).splitlines()[0][:120]}"
                print(f"H={H} {name}: {exc}")
            print(f"H={H} {name}: first call {time.time() - t0:.1f} s", flush=True)
        live = [a for a in arms if res[a[0]]["status"] == "ok"]
        order = live + live[::-1]
        for _ in range(args.groups):
            for name, fn, _ in order:
                res[name]["times"].append(time_visit(fn, args.iters, buf))
        # v4 stages alone (first warps value): prep; summaries + fold; output walk
        stages = {}
        if live and any(a[2] is not None for a in live):
            w = args.warps[0]
            with WarpsEnv(w):
                tabs = forward.forward_tables(plan, H, q.device)
                mod = forward.load(q.device)
                ws = torch.empty(tabs.num_chunks * H * forward.RECORD_BYTES, dtype=torch.uint8, device="cuda")
                none = torch.empty(0, device="cuda")
                m = torch.empty(max(tabs.num_summary, 1), H, 128, 128, device="cuda")
                e = torch.empty_like(m)
                sin = torch.empty(max(tabs.num_sin, 1), H, 128, 128, device="cuda")
                o = torch.empty_like(q)

                def prep():
                    mod.fwd_prep(q, k, g, beta, tabs.chunks, ws, scale, status.word(q.device))

                def summ():
                    if tabs.num_summary:
                        mod.fwd_walk_summary(v, ws, tabs.chunks, tabs.summary, m[:tabs.num_summary],
                                                e[:tabs.num_summary], w)
                        mod.merge_fold(m[:tabs.num_summary], e[:tabs.num_summary], tabs.chains, none,
                                       sin[:tabs.num_sin])

                def walk():
                    mod.fwd_walk_output(v, ws, tabs.chunks, tabs.out, none,
                                           sin[:tabs.num_sin] if tabs.num_sin else none, o, w)

                for nm, fn in (("prep", prep), ("summaries+fold", summ), ("output walk", walk)):
                    fn()
                    stages[nm] = statistics.median([time_visit(fn, args.iters, buf) for _ in range(args.groups)])
                stages["segment_chunks"] = tabs.seg_chunks
                stages["segments"] = int(tabs.out.shape[0])
                del ws, m, e, sin, o
        # error vs FP64 on a slice
        idx = torch.cat([torch.arange(s, s + args.slice) for s in cu[:-1]]).cuda()
        sl_cu = cu_of([args.slice] * len(DOCS))
        sq, sk, sv, sg, sb = (x[idx].contiguous() for x in (q, k, v, g, beta))
        ref = naive_kda(sq, sk, sv, sg, sb, sl_cu, scale=scale)
        sl_plan = LocalPlan(sl_cu[-1], build_plan(sl_cu, [[(0, sl_cu[-1])]]).rank_runs[0])
        for name, _, w in live:
            if name == "fla":
                o = fla_chunk(sq[None], sk[None], sv[None], sg[None], sb[None], scale=scale, safe_gate=True,
                              cu_seqlens=torch.tensor(sl_cu, device="cuda"), cu_seqlens_cpu=torch.tensor(sl_cu))[0][0]
            else:
                with WarpsEnv(w):
                    o = forward.fwd_output(sq, sk, sv, sg, sb, scale, sl_plan)
            res[name]["err"] = ((o.double() - ref).norm() / ref.norm()).item()
        for name, _, _ in arms:
            r = res[name]
            med = None
            if r["times"]:
                per_group = [statistics.median(r["times"][i * 2:(i + 1) * 2]) for i in range(args.groups)]
                med = statistics.median(per_group)
            rows.append(dict(H=H, arm=name, ms=med, status=r["status"], peak_gib=r["peak"], err=r["err"],
                             visits=r["times"]))
            print(f"ROW H={H} arm={name} ms={med} peak_gib={r['peak']} err={r['err']} status={r['status']}",
                  flush=True)
        if stages:
            rows.append(dict(H=H, arm="v4_stages", **stages))
            print(f"STAGES H={H} {stages}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
        del q, k, v, g, beta
        torch.cuda.empty_cache()

    print("\n| H | arm | fwd ms | peak GiB | rel err vs FP64 (slice) | status | model ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["arm"] == "v4_stages":
            continue
        ms = f"{r['ms']:.3f}" if r["ms"] is not None else "-"
        pk = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        er = f"{r['err']:.2e}" if r["err"] is not None else "-"
        md = f"{model(r['H'])['total_ms']:.2f}" if r["arm"].startswith("v4") else ""
        print(f"| {r['H']} | {r['arm']} | {ms} | {pk} | {er} | {r['status']} | {md} |")
    for r in rows:
        if r["arm"] == "v4_stages":
            print(f"v4 stages H={r['H']}: prep {r['prep']:.3f} ms, summaries+fold {r['summaries+fold']:.3f} ms, "
                  f"output walk {r['output walk']:.3f} ms (segments of {r['segment_chunks']} chunks, "
                  f"{r['segments']} segments)")
    for H in args.heads:
        f = [r for r in rows if r["H"] == H and r["arm"] == "fla" and r.get("ms")]
        for r in rows:
            if r["H"] == H and r["arm"] not in ("fla", "v4_stages") and r.get("ms") and f:
                print(f"H={H}: FLA / {r['arm']} = {f[0]['ms'] / r['ms']:.2f}x")


if __name__ == "__main__":
    main()
