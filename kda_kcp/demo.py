"""``python -m kda_kcp.demo``: one KDA training step on a small packed batch, checked against the FP64 oracle.

It runs a forward + backward step and a ``torch.utils.checkpoint`` step at W = 1, then the same split over W = 2
ranks (two spawned processes: NCCL when two GPUs are present, else gloo on the CPU). Each row prints the output's
and every gradient's relative RMS error against the FP64 oracle and PASS when every one is within the library's
accuracy bounds (``TOLERANCE``; docs/design.md §10), else FAIL; the checkpointed steps must equal the plain ones
bit for bit. The exit status is 1 when any row failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

import kda_kcp
from kda_kcp.backend import select_backend
from kda_kcp.reference import naive_kda

DOCS = (300, 37, 1, 0, 211, 129)
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")
# relative RMS against the FP64 oracle; BF16 rounding of o, dq, dk, dv, dbeta alone is ~1.7e-3
TOLERANCE = {"o": 4e-3, "dq": 6e-3, "dk": 6e-3, "dv": 6e-3, "dg": 1e-2, "dbeta": 1e-2}
LAYOUT_CKPT = "zigzag"  # the W > 1 layout whose checkpointed step is checked too


def make_batch(docs, heads, dim, device, seed=0):
    """A packed batch as a model would hand it over: q, k L2-normalised, gates and beta activated."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(docs)
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q = torch.nn.functional.normalize(rand(T, heads, dim), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(rand(T, heads, dim), dim=-1).bfloat16()
    v = rand(T, heads, dim).bfloat16()
    g = torch.nn.functional.logsigmoid(rand(T, heads, dim) + 2.0).clamp(min=-5.0)
    beta = torch.sigmoid(rand(T, heads)).bfloat16()
    do = rand(T, heads, dim).bfloat16()
    to = lambda x: x.to(device).contiguous()  # noqa: E731
    return cu, [to(x) for x in (q, k, v, g, beta)], to(do)


def oracle(cu, inputs, do):
    """FP64 output and gradients of <o, do>."""
    leaves = [x.detach().double().cpu().requires_grad_() for x in inputs]
    o = naive_kda(*leaves, cu)
    o.backward(do.double().cpu())
    return [o.detach()] + [x.grad for x in leaves]


def rel_rms(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def train_step(inputs, do, ctx, use_checkpoint):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]

    def layer(*xs):
        return kda_kcp.chunk_kda_kcp(*xs, ctx)

    o = checkpoint(layer, *leaves, use_reentrant=False) if use_checkpoint else layer(*leaves)
    o.backward(do)
    return [o.detach()] + [x.grad for x in leaves]


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def backend_line(device) -> str:
    """Which backend runs tensors on ``device``, and why."""
    return select_backend(device, True).describe(device)


def row_labels(world: int) -> list[str]:
    labels = ["W=1 step", "W=1 checkpoint step", "W=1 checkpoint = plain step"]
    if world > 1:
        for layout in kda_kcp.LAYOUTS:
            labels.append(f"W={world} {layout}")
            if layout == LAYOUT_CKPT:
                labels += [f"W={world} {layout} checkpoint", f"W={world} {layout} checkpoint = plain"]
    return labels


class Report:
    """The table of checks: one row per step (its time, each tensor's error, PASS or FAIL), its first column as
    wide as the longest label."""

    ERR = 9  # width of an error column ("1.7e-03" and two spaces)

    def __init__(self, width: int):
        self.width = width
        self.checks = self.failed = 0

    def header(self) -> None:
        names = "".join(f"{n:<{self.ERR}}" for n in NAMES)
        print(f"{'check':<{self.width}}  {'ms':>8}  {names}result", flush=True)

    def _result(self, label: str, seconds, body: str, failures: list[str]) -> bool:
        self.checks += 1
        ms = f"{seconds * 1e3:8.1f}" if seconds is not None else f"{'':>8}"
        verdict = "PASS" if not failures else "FAIL (" + ", ".join(failures) + ")"
        self.failed += bool(failures)
        print(f"{label:<{self.width}}  {ms}  {body}{verdict}", flush=True)
        return not failures

    def errors(self, label: str, results, ref, seconds) -> bool:
        """One step's errors against the oracle, each against its bound."""
        errs = {n: rel_rms(x, r) for n, x, r in zip(NAMES, results, ref)}
        body = "".join(f"{errs[n]:<{self.ERR}.1e}" for n in NAMES)
        failures = [f"{n} > {TOLERANCE[n]:.0e}" for n in NAMES if not errs[n] <= TOLERANCE[n]]  # NaN fails too
        return self._result(label, seconds, body, failures)

    def equal(self, label: str, a, b) -> bool:
        """Two steps' outputs and gradients bit for bit."""
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        body = f"{'bitwise equal' if same else 'not bitwise equal':<{self.ERR * len(NAMES)}}"
        return self._result(label, None, body, [] if same else ["differ"])


def _worker(rank, world, init_file, docs, heads, dim, use_cuda, ref_file, width, result_file):
    backend = "nccl" if use_cuda else "gloo"
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        cu, inputs, do = make_batch(docs, heads, dim, device)
        ref = torch.load(ref_file)
        report = Report(width)
        for layout in kda_kcp.LAYOUTS:
            ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=device), dist.group.WORLD, layout)
            local = [ctx.shard(x) for x in inputs]
            steps = {}
            for use_ckpt in (False, True) if layout == LAYOUT_CKPT else (False,):
                train_step(local, ctx.shard(do), ctx, use_ckpt)  # warm-up: first-use costs stay out of the time
                dist.barrier()
                res, sec = timed(lambda: train_step(local, ctx.shard(do), ctx, use_ckpt), device)
                # the slowest rank's time counts; gather every shard into the global tensors on all ranks
                t = torch.tensor([sec], dtype=torch.float64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                full = []
                for x in res:
                    g = ctx.unshard(x.float())
                    dist.all_reduce(g)
                    full.append(g)
                steps[use_ckpt] = full
                if rank == 0:
                    report.errors(f"W={world} {layout}{' checkpoint' if use_ckpt else ''}", full, ref, float(t))
            if rank == 0 and True in steps:
                report.equal(f"W={world} {layout} checkpoint = plain", steps[True], steps[False])
        if rank == 0:
            with open(result_file, "w") as f:
                f.write(f"{report.checks} {report.failed}")
        dist.barrier()  # every rank done with the group before any tears it down (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()
    # Done: leave without the interpreter's teardown, where gloo's threads can abort an exit after a clean
    # destroy_process_group (torch 2.13 on CPU: "terminate called without an active exception"). Not reached when
    # the rank raised, so mp.spawn still reports a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None) -> int:
    """Runs the demo; returns the exit status (0: every check passed)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, nargs="+", default=list(DOCS), help="document lengths (tokens)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--world", type=int, default=2, help="ranks of the KCP part (0 or 1 skips it)")
    args = p.parse_args(argv)

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    cu, inputs, do = make_batch(args.docs, args.heads, args.dim, device)
    print(f"kda_kcp demo: {len(args.docs)} documents {args.docs} (T = {cu[-1]}), H = {args.heads}, D = {args.dim}, "
          f"torch {torch.__version__}", flush=True)
    print(f"backend: {backend_line(device)}", flush=True)
    print("tolerance (relative RMS against the FP64 oracle): " + ", ".join(f"{n} {t:.0e}" for n, t in TOLERANCE.items()),
          flush=True)
    t0 = time.perf_counter()
    ref = oracle(cu, inputs, do)
    print(f"FP64 oracle (token by token): {1e3 * (time.perf_counter() - t0):.0f} ms", flush=True)

    W = args.world
    report = Report(max(len(s) for s in row_labels(W) + ["check"]))
    print(flush=True)
    report.header()
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=device))
    for use_ckpt in (False, True):
        train_step(inputs, do, ctx, use_ckpt)  # warm-up: kernel loading, caches, checkpoint's first use
    plain, sec = timed(lambda: train_step(inputs, do, ctx, False), device)
    report.errors("W=1 step", plain, ref, sec)
    ckpt, sec = timed(lambda: train_step(inputs, do, ctx, True), device)
    report.errors("W=1 checkpoint step", ckpt, ref, sec)
    report.equal("W=1 checkpoint = plain step", ckpt, plain)

    checks, failed = report.checks, report.failed
    if W > 1:
        gpus = torch.cuda.device_count() if use_cuda else 0
        on_gpus = gpus >= W
        if on_gpus:
            print(f"W={W}: {W} spawned processes over NCCL, one GPU each", flush=True)
        else:
            why = "no CUDA device" if not use_cuda else f"{W} GPUs needed, {gpus} found"
            print(f"W={W}: {W} spawned processes over gloo on the CPU (torch backend: {why})", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            ref_file, result_file = os.path.join(tmp, "ref.pt"), os.path.join(tmp, "result")
            torch.save(ref, ref_file)
            mp.spawn(_worker, args=(W, os.path.join(tmp, "init"), args.docs, args.heads, args.dim, on_gpus, ref_file,
                                    report.width, result_file), nprocs=W, join=True)
            with open(result_file) as f:
                c, fl = (int(x) for x in f.read().split())
        checks, failed = checks + c, failed + fl
    print(flush=True)
    if failed:
        print(f"FAIL: {failed} of {checks} checks failed", flush=True)
        return 1
    print(f"PASS: all {checks} checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
