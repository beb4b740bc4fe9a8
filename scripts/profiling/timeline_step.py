#!/usr/bin/env python
"""Where a step's wall time goes: every GPU kernel and copy of one timed forward or backward on the benchmark
batch (W = 1), from torch.profiler's trace, with its stream, start and length, and the idle time between them.

The benchmark times `bwd` as the backward of an untimed forward (CUDA events around `torch.autograd.grad`);
ncu gives kernel durations one at a time. Neither says how much of the wall is kernels, how much is the
walks' two streams overlapping, and how much is the GPU waiting for the host. This does:

    python scripts/profiling/timeline_step.py --heads 16 --op bwd --trace $OUT/trace.json
    python scripts/profiling/timeline_step.py --heads 16 --op fwd --activations   # the benchmark's --activations call

Prints one line per kernel (start offset and duration in us, stream, name) and a summary: the span from the
first kernel's start to the last one's end, the time some kernel is running (the union over streams), and the
idle gaps longer than --gap us.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.utils.checkpoint

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # profile_step
sys.path.insert(0, str(ROOT / "benchmarks"))
import kda_kcp  # noqa: E402
from bench_kda_kcp import ACTIVATION_OPTIONS, draw_inputs  # noqa: E402  (the --activations row's call and inputs)
from profile_step import DOCS, offsets, step_inputs  # noqa: E402


def short(name: str) -> str:
    for key in ("prep_kernel", "fwd_walk_kernel", "rev_walk_kernel", "walk_kernel", "grads_kernel", "act_fwd_kernel",
                "act_bwd_kernel", "merge", "fold"):
        if key in name:
            tmpl = name[name.find(key):]
            return tmpl.split("(")[0][:48]
    return name[:48]


def kernels_of(ev):
    out = []
    for e in ev:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        out.append((float(e["ts"]), float(e["dur"]), e.get("tid"), e["cat"], e["name"]))
    return sorted(out)


def host_events(trace, first_kernel: float, min_us: float) -> None:
    """The host's ops and CUDA runtime / driver calls from the start event's record on, against the first
    kernel's start on the GPU (the profiler puts both on one clock)."""
    ev = [e for e in trace if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")]
    rec = [float(e["ts"]) for e in ev if e["name"] in ("cudaEventRecord", "cudaEventRecordWithFlags")]
    if not rec:
        print("no cudaEventRecord in the trace")
        return
    h0 = min(rec)
    print(f"\nhost, from the start event's record (us; the first kernel starts on the GPU at {first_kernel - h0:.1f}):")
    for e in sorted(ev, key=lambda e: float(e["ts"])):
        if float(e["dur"]) >= min_us and float(e["ts"]) >= h0:
            print(f"{float(e['ts']) - h0:10.1f} {float(e['dur']):9.1f}  {e['cat']:14s} {e['name'][:70]}")


def run_before(spec: str, dev, workspace: bool) -> None:
    """One untimed step of op at H (``spec`` = "H:OP"), its tensors freed after: what the benchmark's earlier cells
    leave behind (allocator state, streams)."""
    H, op = spec.split(":")
    cu, *inputs = step_inputs(DOCS, int(H), dev)
    x = tuple(t.requires_grad_() for t in inputs)
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=dev))
    ws = kda_kcp.WorkspaceKcp(ctx, int(H), device=dev) if workspace else None

    def fn(*a):
        return kda_kcp.chunk_kda_kcp(*a, ctx, deterministic=True, workspace=ws)

    do = torch.randn(x[0].shape, device=dev, dtype=torch.bfloat16)
    for _ in range(2):
        if op == "fwd":
            fn(*x)
        elif op == "bwd":
            torch.autograd.grad(fn(*x), x, do)
        else:
            torch.autograd.grad(torch.utils.checkpoint.checkpoint(fn, *x, use_reentrant=False), x, do)
    torch.cuda.synchronize()
    print(f"before: H = {H} {op}")


def activations_call(x, cu_t, ws):
    """The benchmark's --activations call (det) on raw inputs x = (q, k, v, g, beta, A_log, dt_bias): o [T, H, V]."""
    q, k, v, g, beta, A_log, dt_bias = x
    cu_cpu = cu_t.cpu()  # once here, not a copy (and a synchronize) inside the traced call

    def fwd():
        return kda_kcp.chunk_kda(q[None], k[None], v[None], g[None], beta[None], A_log=A_log, dt_bias=dt_bias,
                                 cu_seqlens=cu_t, cu_seqlens_cpu=cu_cpu, deterministic=True, workspace=ws,
                                 **ACTIVATION_OPTIONS)[0][0]

    return fwd


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--op", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--warm", type=int, default=2, help="untimed steps first")
    p.add_argument("--gap", type=float, default=5.0, help="report idle gaps longer than this (us)")
    p.add_argument("--trace", type=Path, default=Path("/tmp/kda_trace.json"))
    p.add_argument("--workspace", action="store_true", help="pass a WorkspaceKcp, as the benchmark does")
    p.add_argument("--gates", choices=("bench", "strong"), default="bench",
                   help="the gate law, as the benchmark's --gates (the per-kernel sums show what a law costs where)")
    p.add_argument("--before", nargs="*", default=[], metavar="H:OP",
                   help="run these ops (fwd, bwd, ckpt) at these head counts first, untimed, in this process (the "
                        "benchmark's cell order: e.g. --before 4:fwd 4:bwd 4:ckpt before the H = 16 forward)")
    p.add_argument("--host", type=float, default=None, metavar="US",
                   help="also list the host's ops and CUDA runtime calls of at least US microseconds, from the "
                        "start event's record (where the GPU waits for the host)")
    p.add_argument("--cuda-only", action="store_true",
                   help="trace the GPU's activity only (no host ops: tracing them slows the host's launches several "
                        "fold, which delays every kernel of a schedule of many launches)")
    p.add_argument("--activations", action="store_true",
                   help="kda_kcp.chunk_kda with the gate, the q / k norm and the beta sigmoid inside, on raw inputs with "
                        "the distributions of the benchmark's --activations row")
    p.add_argument("--empty-cache", action="store_true",
                   help="hand the caching allocator's free blocks back to the driver after the --before ops (does "
                        "the measured step depend on where its tensors land?)")
    args = p.parse_args()
    dev = torch.device("cuda")
    from kda_kcp.backend import select_backend

    # a timeline of the torch backend's kernels is no answer: say which one ran (KDA_KCP_BACKEND=cuda makes it fail)
    print(f"kda_kcp backend: {select_backend(dev, True).name}")
    for spec in args.before:
        run_before(spec, dev, args.workspace)
    if args.empty_cache:
        torch.cuda.empty_cache()
    cu, *inputs = step_inputs(DOCS, args.heads, dev, args.gates) if not args.activations else (offsets(DOCS),)
    cu_t = torch.tensor(cu, device=dev)
    ctx = kda_kcp.build_context_kcp(cu_t)
    ws = kda_kcp.WorkspaceKcp(ctx, args.heads, device=dev) if args.workspace else None
    if args.activations:
        q, k, v, g, beta, do, A_log, dt_bias = draw_inputs(cu[-1], args.heads, 128, dev, 0, activations=True)
        x = tuple(t.requires_grad_() for t in (q, k, v, g, beta, A_log, dt_bias))
        fwd = activations_call(x, cu_t, ws)
    else:
        x = tuple(t.requires_grad_() for t in inputs)
        do = torch.randn(x[0].shape, device=dev, dtype=torch.bfloat16)

        def fwd():
            return kda_kcp.chunk_kda_kcp(*x, ctx, deterministic=True, workspace=ws)

    for _ in range(args.warm):
        torch.autograd.grad(fwd(), x, do)
    torch.cuda.synchronize()
    o = fwd() if args.op == "bwd" else None
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    acts = [torch.profiler.ProfilerActivity.CUDA]
    if not args.cuda_only:
        acts.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=acts) as prof:
        start.record()
        if args.op == "bwd":
            torch.autograd.grad(o, x, do)  # as the benchmark's bwd op: no .grad accumulation
        else:
            o = fwd()
        end.record()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(args.trace))
    trace = json.loads(args.trace.read_text())["traceEvents"]
    ks = kernels_of(trace)
    if not ks:
        print("no kernels in the trace")
        return
    t0 = ks[0][0]
    streams = {}
    for ts, dur, tid, cat, name in ks:
        s = streams.setdefault(tid, len(streams))
        print(f"{ts - t0:10.1f} {dur:9.1f}  s{s}  {cat[4:] if cat != 'kernel' else '':7s} {short(name)}")
    busy, cur_s, cur_e = 0.0, None, None
    gaps = []
    for ts, dur, *_ in ks:
        if cur_e is None or ts > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                if ts - cur_e > args.gap:
                    gaps.append((cur_e - t0, ts - cur_e))
            cur_s, cur_e = ts, ts + dur
        else:
            cur_e = max(cur_e, ts + dur)
    busy += cur_e - cur_s
    span = cur_e - t0
    print(f"\n{args.op} H={args.heads}: events {start.elapsed_time(end) * 1e3:.0f} us, kernel span {span:.0f} us, "
          f"some kernel running {busy:.0f} us, idle {span - busy:.0f} us in {len(gaps)} gaps > {args.gap} us")
    for at, length in gaps:
        print(f"  gap at {at:10.1f} us: {length:8.1f} us")
    if args.host is not None:
        host_events(trace, t0, args.host)
    by = {}
    for ts, dur, tid, cat, name in ks:
        by[short(name)] = by.get(short(name), 0.0) + dur
    print("time per kernel name (us, summed over streams):")
    for name, t in sorted(by.items(), key=lambda x: -x[1]):
        print(f"  {t:9.1f}  {name}")


if __name__ == "__main__":
    main()
