#!/usr/bin/env python
"""Where the host's time goes inside one timed call, stage by stage: kda_kcp's stages and every call into a kernel
program, timed on the host on whichever thread runs them (the backward runs on autograd's device thread, which
cProfile on the main thread does not see), from just before the start event's record.

torch.profiler shows the torch ops and runtime calls but not the Python between them. This lists the stages with
their start offsets and lengths, nested by time, and marks the first kernel-program call (the first launch):

    python scripts/profiling/host_trace.py --heads 4 --op bwd          # on the GPU machine
    python scripts/profiling/host_trace.py --heads 4 --op fwd --stub   # anywhere: CPU tensors, kernel programs stubbed

Each op runs --warm untimed times first; the trace is of the last of --iters traced runs, and the first line gives
the medians (and the spread) over all of them: one run's numbers scatter by tens of microseconds. --bare times the
same runs without the per-stage timers (their own cost is a few microseconds per stage); the first launch is then
still timed.

With --stub the call's own checks run as on the GPU (CPU tensors of the CUDA backend's dtypes pass them), but the
stream work of the CUDA path does not: off CUDA the backward's launches run in order on the host, so its stream
switches, events and waits show only on the GPU.
"""

import argparse
import functools
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # profile_step
sys.path.insert(0, str(ROOT / "benchmarks"))
import kda_kcp  # noqa: E402
import kda_kcp.function as function  # noqa: E402
from kda_kcp.cuda import CudaBackend  # noqa: E402
from kda_kcp.cuda import backward as cuda_bwd  # noqa: E402
from kda_kcp.cuda import forward as cuda_fwd  # noqa: E402
from bench_kda_kcp import Bench  # noqa: E402  (the benchmark's own fwd / bwd / ckpt ops)
from profile_step import DOCS, step_inputs  # noqa: E402

EVENTS: list = []  # (t0, t1, thread name, name)


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            EVENTS.append((t0, time.perf_counter(), threading.current_thread().name, name))

    return wrapper


class TimedProgram:
    """A loaded kernel program whose entry points are timed (named "launch <entry>")."""

    def __init__(self, mod):
        self._mod = mod

    def __getattr__(self, name):
        return timed(f"launch {name}", getattr(self._mod, name))


class NoKernels:
    """--stub: a kernel program whose entry points do nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


STAGES = ((function, ("_prepare", "_split_workspace", "_workspace_layout", "backward_kcp", "check_inputs",
                       "check_grad_output", "select_backend")),
          (cuda_bwd, ("chunk_tables", "seg_tables", "walk_groups", "pipelined_walks_and_grads")),
          (cuda_fwd, ("call_tables", "forward_tables")))
METHODS = ((function.ForwardCall, ("__init__", "finish")),
           (cuda_bwd.PreparedBackward, ("__init__", "grads", "summaries")),
           (cuda_fwd.PreparedForward, ("__init__", "output", "summaries")))


def instrument(stub: bool, bare: bool) -> None:
    """Timers on the stages (none with ``bare``) and on every kernel-program call; with ``stub`` the programs
    do nothing and the CUDA backend is chosen for CPU tensors."""
    for owner, names in () if bare else STAGES:
        for name in names:
            setattr(owner, name, timed(f"{owner.__name__.split('.')[-1]}.{name}", getattr(owner, name)))
    for cls, names in () if bare else METHODS:
        for name in names:
            setattr(cls, name, timed(f"{cls.__name__}.{name}", getattr(cls, name)))
    for cls in () if bare else (function.KdaKcpInputs, function.KdaKcpOutput):
        for name in ("forward", "backward"):
            setattr(cls, name, staticmethod(timed(f"{cls.__name__}.{name}", getattr(cls, name))))
    for mod in (cuda_fwd, cuda_bwd):
        load = mod.load
        mod.load = (lambda device=None: TimedProgram(NoKernels())) if stub else \
            (lambda device=None, _load=load: TimedProgram(_load(device)))
    if stub:
        backend = CudaBackend(True)
        backend.load = lambda device: None

        def select(device, det):
            return backend

        function.select_backend = select if bare else timed("function.select_backend", select)
        cuda_fwd.check_tensors = cuda_bwd.check_tensors = lambda *a: None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--op", choices=("fwd", "bwd", "ckpt"), default="bwd")
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--min-us", type=float, default=2.0, help="list stages of at least this length")
    p.add_argument("--stub", action="store_true", help="CPU tensors, kernel programs stubbed (the host path only)")
    p.add_argument("--bare", action="store_true", help="time the launches only (no per-stage timers)")
    args = p.parse_args()
    dev = torch.device("cpu" if args.stub else "cuda")
    instrument(args.stub, args.bare)
    cu, *inputs = step_inputs(list(DOCS), args.heads, dev)
    x = tuple(t.requires_grad_() for t in inputs)
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=dev))
    ws = kda_kcp.WorkspaceKcp(ctx, args.heads, device=dev) if not args.stub else \
        kda_kcp.WorkspaceKcp.from_buffer(torch.empty(function._workspace_layout(
            ctx, args.heads, function.select_backend(dev, True), dev, 128, 128, torch.float32, None)[0],
            dtype=torch.uint8))
    do = torch.randn(x[0].shape, dtype=torch.bfloat16, device=dev)

    def fn(q, k, v, g, beta):
        return kda_kcp.chunk_kda_kcp(q, k, v, g, beta, ctx, workspace=ws)

    def sync():
        if not args.stub:
            torch.cuda.synchronize()

    prepare, timed = Bench.op_fns(args.op, fn, x, do)
    calls, firsts = [], []
    for i in range(args.warm + args.iters):
        state = prepare()
        sync()
        EVENTS.clear()
        t0 = time.perf_counter()
        if not args.stub:
            torch.cuda.Event(enable_timing=True).record()
        out = timed(state)
        t_end = time.perf_counter()
        sync()
        del out, state
        launches = [e for e in EVENTS if e[3].startswith("launch ")]
        first = min(e[0] for e in launches) if launches else None
        if i >= args.warm:
            calls.append(1e6 * (t_end - t0))
            if first is not None:
                firsts.append(1e6 * (first - t0))

    def spread(xs):
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else xs * 3
        return f"{statistics.median(xs):.0f} us (quartiles {q[0]:.0f}-{q[2]:.0f})"

    print(f"{args.op} H={args.heads}{' (stubbed kernels, CPU)' if args.stub else ''}, median of {len(calls)}: "
          f"host call {spread(calls)}" + (f", first launch {spread(firsts)}" if firsts else ""))
    print(f"the last run: host call {1e6 * (t_end - t0):.0f} us"
          + (f", first launch ({min(launches)[3][7:]}) at {1e6 * (first - t0):.0f} us" if launches else ""))
    stack = []
    for t_a, t_b, thread, name in sorted(EVENTS, key=lambda e: (e[0], -e[1])):
        while stack and t_a >= stack[-1]:
            stack.pop()
        if 1e6 * (t_b - t_a) >= args.min_us or name.startswith("launch "):
            print(f"{1e6 * (t_a - t0):9.1f} {1e6 * (t_b - t_a):9.1f}  {thread[:12]:12s} {'  ' * len(stack)}{name}")
        stack.append(t_b)


if __name__ == "__main__":
    main()
