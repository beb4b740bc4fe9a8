#!/usr/bin/env python
"""kda_kcp against FLA 0.6.0 ``chunk_kda``: the benchmark protocol of BENCHMARKS.md.

Workload (--batch default): one packed batch of 4 documents (42024, 57573, 73122, 88673 tokens; T = 261392), H
heads of dim 128; --batch kimi-packed: 32 documents of 4096 tokens (T = 131072), --batch kimi-long: one document
of 32768 tokens (Kimi-Linear-like shapes, to run at --heads 32). Drawn on the device from a fixed seed:

    q, k   randn, L2-normalised over the head dim in FP32, then BF16
    v, do  randn, BF16
    g      --gates bench (default): logsigmoid(2 + 1.5 z), z ~ N(0, 1), clipped below at -5: FP32 in [-5, 0),
           mean about -0.26; --gates strong: uniform in (-5, 0], mean -2.5 (trained gates bounded at -5 by a
           sigmoid, as Kimi Linear's are); already activated: FLA gets the same tensor with
           use_gate_in_kernel=False, safe_gate=True
    beta   sigmoid(z) clipped to [2^-8, 1 - 2^-8], BF16 (strictly inside (0, 1))

Arms: ``det`` (deterministic=True), ``nd`` (deterministic=False), ``control`` (a second visit of nd),
``fla`` (FLA's chunk_kda on the same shard, varlen through cu_seqlens; at W > 1 that is the rank's shard
with its documents cut at the piece boundaries and no state exchange) and ``fla_cp`` (FLA's context
parallelism, cp_context=build_cp_context(...), W > 1 only).

Ops: ``fwd`` (forward with autograd recording), ``bwd`` (backward of an untimed forward; only the
backward is timed), ``ckpt`` (one torch.utils.checkpoint(use_reentrant=False) step: forward + backward).
Gradients are taken with torch.autograd.grad(o, (q, k, v, g, beta), do) (no accumulation into .grad).

Each iteration: L2 flush (write a --flush-mib buffer), device synchronize, barrier (W > 1), CUDA events
around the op (time.perf_counter on the CPU); every iteration's time is all-reduced with MAX over the
ranks (the slowest rank counts). Per cell: one untimed warm-up call per arm, then --groups groups in the
palindromic order det, nd, control, fla, fla_cp, fla_cp, fla, control, nd, det (unselected arms are
skipped), --iters timed iterations per visit. A group's median pools both visits of an arm; the cell is
the median over groups of the group medians. control/nd must lie in 0.98-1.02 and the drift of nd
between the first and the last group within 2 %; rows outside either are marked with a dagger.

Examples:
    python benchmarks/bench_kda_kcp.py --json bench_w1.json --plot bench_w1.png          # 1 GPU
    python benchmarks/bench_kda_kcp.py --world 2 --json bench_w2.json --plot bench_w2.png  # 2 GPUs
    python benchmarks/bench_kda_kcp.py --device cpu --docs 300 200 150 --heads 2 --quick   # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import importlib.util
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

try:
    import kda_kcp
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import kda_kcp
from kda_kcp.reference import naive_kda

DEFAULT_DOCS = (42024, 57573, 73122, 88673)
BATCHES = {"default": DEFAULT_DOCS, "kimi-packed": (4096,) * 32, "kimi-long": (32768,)}
GATE_LAWS = {
    "bench": "logsigmoid(2 + 1.5 z) clipped to [-5, 0)",
    "strong": "uniform in (-5, 0]",
}
LAYOUTS = tuple(kda_kcp.LAYOUTS)  # contiguous, zigzag, zigzag_per_document
ARMS = ("det", "nd", "control", "fla", "fla_cp")
OURS = ("det", "nd", "control")
FLA_ARMS = ("fla", "fla_cp")
NOT_RUN_AFTER_OOM = "not run: out of memory in this H's bwd cell"  # --fla-ckpt-after-bwd-oom skip
OPS = ("fwd", "bwd", "ckpt")
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")
# chunk_kda's options in the --activations row (every arm): the gate, the q / k norm and the beta sigmoid inside
ACTIVATION_OPTIONS = dict(scale=None, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
                          safe_gate=True, use_beta_sigmoid_in_kernel=True)
# docs/design.md §10: relative RMS tolerances against the FP64 oracle (BF16 I/O)
TOLERANCE = {"o": 4e-3, "dq": 6e-3, "dk": 6e-3, "dv": 6e-3, "dg": 1e-2, "dbeta": 1e-2}
CONTROL_BAND = (0.98, 1.02)
DRIFT_LIMIT = 0.02
BETA_MIN, BETA_MAX = 2.0 ** -8, 1.0 - 2.0 ** -8
DAGGER = "\u2020"


class Unsupported(Exception):
    """An arm that cannot run a row; the message is the reason printed in the table."""


# ----------------------------------------------------------------------------------------------------
# arguments


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="kda_kcp vs FLA 0.6.0 chunk_kda on the BENCHMARKS.md workload "
        "(4 packed documents, T = 261392, head dim 128).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--world", type=int, default=1, help="ranks (one process per rank, one GPU each; NCCL, gloo on CPU)")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                   help="KCP layouts (at W = 1 they are all one piece: only the first is run)")
    p.add_argument("--heads", nargs="+", type=int, default=[4, 16, 64], help="head counts H")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="fwd, bwd, ckpt")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="arms (fla_cp runs at W > 1 only)")
    p.add_argument("--iters", type=int, default=8, help="timed iterations per visit")
    p.add_argument("--groups", type=int, default=3, help="palindromic groups per cell")
    p.add_argument("--quick", action="store_true", help="groups=1, iters=3")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (rewritten after every cell; \"complete\" is false until the last)")
    p.add_argument("--plot", metavar="PATH", help="draw speedup vs FLA per row to a PNG (needs matplotlib)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--batch", choices=tuple(BATCHES), default="default", help="the packed batch's documents")
    p.add_argument("--docs", nargs="+", type=int, default=None, help="document lengths (overrides --batch)")
    p.add_argument("--gates", choices=tuple(GATE_LAWS), default="bench", help="the law g is drawn from")
    p.add_argument("--tokens-scale", type=float, default=1.0, help="scale every document length (min 1 token)")
    p.add_argument("--head-dim", type=int, default=128, help="K = V (the CUDA kernels support 128 only)")
    p.add_argument("--activations", action="store_true",
                   help="FLA's in-call activations: raw q, k, g, beta; every arm calls chunk_kda (ours kda_kcp.chunk_kda) "
                        "with use_qk_l2norm_in_kernel, use_gate_in_kernel (A_log, dt_bias, lower_bound=-5, safe_gate) and "
                        "use_beta_sigmoid_in_kernel; gradients include A_log and dt_bias (no accuracy slice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-oracle", action="store_true", help="skip the accuracy slice against the FP64 oracle")
    p.add_argument("--fla-ckpt-after-bwd-oom", choices=("run", "skip"), default="run",
                   help="skip: an FLA arm that ran out of memory in the bwd cell of the same layout and H is not run "
                        "in its ckpt cell (reported as not run); FLA's ckpt at H = 64 can spend minutes in Triton "
                        "autotuning before it fails")
    p.add_argument("--oracle-tokens", type=int, default=2048, help="tokens cut from the start of each of 2 documents")
    p.add_argument("--oracle-heads", type=int, default=None,
                   help="heads of the accuracy slice (default: the smallest of --heads, capped at 4)")
    p.add_argument("--flush-mib", type=int, default=None, help="flush buffer per iteration (default 256 on cuda, 32 on cpu)")
    p.add_argument("--no-workspace", action="store_true", help="do not pass a WorkspaceKcp to the kda_kcp arms")
    p.add_argument("--local-arena", choices=("replay", "lean"), default="replay",
                   help="the kda_kcp arms' workspace arena (lean: the backward in --lean-passes passes)")
    p.add_argument("--lean-passes", type=int, default=None, help="passes of the lean arena (1..8; default 2)")
    p.add_argument("--timeout-min", type=float, default=15.0, help="process-group timeout in minutes (W > 1)")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.iters = 1, 3
    if args.world < 1 or args.iters < 1 or args.groups < 1:
        p.error("--world, --iters and --groups must be >= 1")
    if any(h < 1 for h in args.heads):
        p.error("--heads must be positive")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda, but torch sees no CUDA device")
        if args.world > torch.cuda.device_count():
            p.error(f"--world {args.world} needs {args.world} GPUs; torch sees {torch.cuda.device_count()}")
    docs = list(args.docs) if args.docs else list(BATCHES[args.batch])
    if args.tokens_scale != 1.0:
        docs = [max(1, int(round(n * args.tokens_scale))) for n in docs]
    if not docs or any(n < 0 for n in docs) or sum(docs) < 1:
        p.error("--docs must hold non-negative lengths with a positive total")
    args.doc_lengths = docs
    if args.flush_mib is None:
        args.flush_mib = 256 if args.device == "cuda" else 32
    if args.activations:
        args.no_oracle = True  # the slice's oracle takes activated inputs; tests/gpu/test_fla_parity.py checks this call
    if args.oracle_heads is None:
        args.oracle_heads = min(min(args.heads), 4)
    args.layouts = list(dict.fromkeys(args.layouts))
    if args.world == 1:
        args.layouts = args.layouts[:1]  # W = 1: every layout is the same single piece
    args.arms = [a for a in ARMS if a in args.arms]
    args.dropped_arms = []
    if args.world == 1 and "fla_cp" in args.arms:
        args.arms.remove("fla_cp")
        args.dropped_arms.append("fla_cp (W = 1: nothing to parallelize)")
    args.ops = [o for o in OPS if o in args.ops]
    args.heads = list(dict.fromkeys(args.heads))
    args.command = " ".join([Path(sys.argv[0]).name if sys.argv else "bench_kda_kcp.py", *(sys.argv[1:] if argv is None else argv)])
    return args


# ----------------------------------------------------------------------------------------------------
# inputs


def cu_of(lengths) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def draw_inputs(T, H, D, device, seed, post=lambda x: x, gates="bench", activations=False):
    """(q, k, v, g, beta, do) of the global batch, each passed through ``post`` (the shard) as soon as drawn.

    The generator is seeded from (seed, H) so every rank draws the same global tensors. With ``activations`` the
    tensors are raw (q, k randn, g the raw gate, beta logits, all BF16) and (A_log [H], dt_bias [H * D], FP32)
    follow as two more values: exp(A_log) in [0.2, 0.6] and dt_bias ~ N(-2, 0.5), the gate's parameters.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + H)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    bf16 = torch.bfloat16
    if activations:
        q, k, v = (post(randn(T, H, D).to(bf16)) for _ in range(3))
        g = post(randn(T, H, D).to(bf16))
        beta = post(randn(T, H).to(bf16))
        do = post(randn(T, H, D).to(bf16))
        A_log = (0.2 + 0.4 * torch.rand(H, generator=gen, device=device)).log()
        dt_bias = randn(H * D).mul_(0.5).sub_(2.0)
        return q, k, v, g, beta, do, A_log, dt_bias
    q = post(F.normalize(randn(T, H, D), dim=-1).to(bf16))
    k = post(F.normalize(randn(T, H, D), dim=-1).to(bf16))
    v = post(randn(T, H, D).to(bf16))
    if gates == "strong":
        g = post(torch.rand(T, H, D, generator=gen, device=device, dtype=torch.float32).mul_(-5.0))
    else:
        g = post(F.logsigmoid(randn(T, H, D).mul_(1.5).add_(2.0)).clamp_(min=-5.0))
    beta = post(torch.sigmoid(randn(T, H)).clamp_(BETA_MIN, BETA_MAX).to(bf16))
    do = post(randn(T, H, D).to(bf16))
    return q, k, v, g, beta, do


def local_cu(ctx, cu) -> list[int]:
    """cu_seqlens of this rank's shard: document boundaries and piece boundaries, in local order."""
    out, base = [0], 0
    for s, e in ctx.pieces:
        for c in cu:
            if s < c < e:
                out.append(base + c - s)
        base += e - s
        out.append(base)
    return out


def rel_rms(x, ref) -> float:
    x, ref = x.detach().double(), ref.detach().double().to(x.device)
    den = ref.pow(2).sum().sqrt().item()
    num = (x - ref).pow(2).sum().sqrt().item()
    return num / den if den > 0 else num


def fmt_ms(x):
    return "-" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.2f}" if x < 100 else f"{x:.1f}")


def fmt_bytes(n):
    return "-" if n is None else f"{n / 2**30:.2f}"


def md_table(header, rows) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


# ----------------------------------------------------------------------------------------------------
# FLA


def load_fla(cuda: bool):
    """(chunk_kda, build_cp_context, version) or (None, None, reason the fla arms cannot run)."""
    try:
        fla = importlib.import_module("fla")
    except ImportError:
        return None, None, "fla not installed"
    try:
        from fla.ops.cp import build_cp_context
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # noqa: BLE001 - e.g. triton missing or incompatible
        return None, None, f"fla import failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if not cuda:
        return None, None, "FLA needs a CUDA GPU"
    return chunk_kda, build_cp_context, getattr(fla, "__version__", "unknown")


def fla_extras() -> dict:
    """Optional FLA backends that could replace its Triton path (found or not)."""
    return {name: importlib.util.find_spec(name) is not None for name in ("triton", "tilelang", "flash_kda")}


# ----------------------------------------------------------------------------------------------------
# one rank


class Layout:
    """Everything one layout needs, built once: our context, FLA's shard cu_seqlens and its CP context."""

    def __init__(self, bench, name):
        self.name = name
        b = bench
        self.ctx = kda_kcp.build_context_kcp(torch.tensor(b.cu, dtype=torch.int64, device=b.device), group=b.group, layout=name)
        self.whole = self.ctx.pieces == [(0, b.T)]
        lc = local_cu(self.ctx, b.cu)
        self.fla_cu_cpu = torch.tensor(lc, dtype=torch.int64)
        self.fla_cu = self.fla_cu_cpu.to(b.device)
        self.fla_cp = None
        self.fla_cp_reason = None
        if "fla_cp" in b.args.arms:
            self.fla_cp, self.fla_cp_reason = b.fla_cp_context(b.cu, name, self.ctx)

    def shard(self, x):
        return x if self.whole else self.ctx.shard(x)


class Bench:
    def __init__(self, args, rank, device, group):
        self.args = args
        self.rank = rank
        self.W = args.world
        self.device = device
        self.group = group
        self.cuda = device.type == "cuda"
        self.nccl = group is not None and dist.get_backend(group) == "nccl"
        self.cu = cu_of(args.doc_lengths)
        self.T = self.cu[-1]
        self.D = args.head_dim
        self.chunk_kda, self.build_cp_context, fla_info = load_fla(self.cuda)
        self.fla_version = fla_info if self.chunk_kda is not None else None
        self.fla_reason = None if self.chunk_kda is not None else fla_info
        self.bwd_oom = set()  # (layout, H, arm) that ran out of memory in a bwd cell
        self.flush_buf = torch.empty(args.flush_mib * 2**20, dtype=torch.uint8, device=device)
        self.t0 = time.perf_counter()

    # -- printing and collectives -------------------------------------------------------------------

    def log(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    def coll_device(self):
        return self.device if self.nccl else torch.device("cpu")

    def barrier(self):
        if self.W > 1:
            if self.nccl:
                dist.barrier(group=self.group, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.group)

    def reduce(self, values, op):
        if self.W == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.coll_device())
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def agree(self, ok: bool) -> bool:
        """True when every rank is ok."""
        return self.reduce([1.0 if ok else 0.0], dist.ReduceOp.MIN if self.W > 1 else None)[0] > 0.5

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def flush(self):
        self.flush_buf.zero_()

    def free(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    # -- FLA contexts -------------------------------------------------------------------------------

    def fla_cp_context(self, cu, layout, ctx):
        """(FLA CP context, None) or (None, reason) for this layout over our group."""
        if self.fla_reason:
            return None, self.fla_reason
        if layout not in ("contiguous", "zigzag"):
            return None, "FLA CP has no per-document zigzag"
        T, W = cu[-1], self.W
        parts = W if layout == "contiguous" else 2 * W
        if T % parts:
            return None, f"FLA CP needs T % {parts} == 0 (T = {T})"
        cu_cpu = torch.tensor(cu, dtype=torch.int64)
        try:
            cp = self.build_cp_context(cu_cpu.to(self.device), group=self.group, cu_seqlens_cpu=cu_cpu, layout=layout)
        except Exception as exc:  # noqa: BLE001
            return None, f"build_cp_context: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        # when T divides, FLA splits exactly as we do (equal parts): the token counts must agree
        n_local = int(cp.cu_seqlens_cpu[-1])
        if n_local != ctx.local_tokens:
            return None, f"FLA CP shard has {n_local} tokens, ours {ctx.local_tokens}"
        return cp, None

    # -- arms ---------------------------------------------------------------------------------------

    def static_reason(self, arm, lay: Layout):
        if arm in FLA_ARMS and self.fla_reason:
            return self.fla_reason
        if arm == "fla_cp":
            return lay.fla_cp_reason
        return None

    def arm_fn(self, arm, lay: Layout, H):
        """fn(q, k, v, g, beta) -> o [T, H, V] for one arm (workspace, if any, allocated here); with --activations
        fn(q, k, v, g, beta, A_log, dt_bias) calling chunk_kda with the activations inside."""
        if self.args.activations:
            return self.activations_fn(arm, lay, H)
        if arm in OURS:
            det = arm == "det"
            ws = None if self.args.no_workspace else kda_kcp.WorkspaceKcp(
                lay.ctx, H, device=self.device, deterministic=det, head_dim=self.D,
                local_arena=self.args.local_arena, lean_passes=self.args.lean_passes)
            ctx = lay.ctx

            def ours(q, k, v, g, beta):
                return kda_kcp.chunk_kda_kcp(q, k, v, g, beta, ctx, scale=None, deterministic=det, workspace=ws)

            return ours
        chunk_kda = self.chunk_kda
        if arm == "fla":
            cu, cu_cpu = lay.fla_cu, lay.fla_cu_cpu

            def fla(q, k, v, g, beta):
                o, _ = chunk_kda(
                    q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=None,
                    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                    use_gate_in_kernel=False, safe_gate=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                )
                return o[0]

            return fla
        cp = lay.fla_cp

        def fla_cp(q, k, v, g, beta):
            o, _ = chunk_kda(
                q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=None,
                initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                use_gate_in_kernel=False, safe_gate=True, cp_context=cp,
            )
            return o[0]

        return fla_cp

    def activations_fn(self, arm, lay: Layout, H):
        """The FLA-shaped call with the gate, the q / k norm and the beta sigmoid inside, for one arm."""
        if arm in OURS:
            det = arm == "det"
            ws = None if self.args.no_workspace else kda_kcp.WorkspaceKcp(
                lay.ctx, H, device=self.device, deterministic=det, head_dim=self.D,
                local_arena=self.args.local_arena, lean_passes=self.args.lean_passes)
            call, extra = kda_kcp.chunk_kda, dict(deterministic=det, workspace=ws)
            where = dict(cu_seqlens=lay.fla_cu, cu_seqlens_cpu=lay.fla_cu_cpu) if self.W == 1 else dict(cp_context=lay.ctx)
        else:
            call, extra = self.chunk_kda, {}
            where = dict(cu_seqlens=lay.fla_cu, cu_seqlens_cpu=lay.fla_cu_cpu) if arm == "fla" else dict(cp_context=lay.fla_cp)

        def fn(q, k, v, g, beta, A_log, dt_bias):
            o, _ = call(q[None], k[None], v[None], g[None], beta[None], A_log=A_log, dt_bias=dt_bias,
                        **ACTIVATION_OPTIONS, **where, **extra)
            return o[0]

        return fn

    @staticmethod
    def op_fns(op, fn, x, do):
        """(prepare, timed): prepare() is untimed and its result is handed to timed()."""
        if op == "fwd":
            return (lambda: None), (lambda _: fn(*x))
        if op == "bwd":
            return (lambda: fn(*x)), (lambda o: torch.autograd.grad(o, x, do))

        def step(_):
            o = checkpoint(fn, *x, use_reentrant=False)
            return torch.autograd.grad(o, x, do)

        return (lambda: None), step

    # -- timing -------------------------------------------------------------------------------------

    def time_iters(self, prepare, timed, iters):
        times = []
        for _ in range(iters):
            state = prepare()
            self.flush()
            self.sync()
            self.barrier()
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                out = timed(state)
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                out = timed(state)
                ms = (time.perf_counter() - t0) * 1e3
            del out, state
            times.append(ms)
        return times

    def visit(self, arm, op, lay, H, x, do, iters):
        """Run one arm: returns (times in ms, slowest rank per iteration; peak bytes; peak above baseline)."""
        if self.cuda:
            self.sync()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        fn = self.arm_fn(arm, lay, H)
        prepare, timed = self.op_fns(op, fn, x, do)
        times = self.time_iters(prepare, timed, iters)
        del fn, prepare, timed
        peak = extra = None
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            extra = peak - base
        times = self.reduce(times, dist.ReduceOp.MAX if self.W > 1 else None)
        if peak is not None:
            peak, extra = (int(v) for v in self.reduce([peak, extra], dist.ReduceOp.MAX if self.W > 1 else None))
        return times, peak, extra

    def guarded(self, what, fn):
        """(result, None) or (None, reason); every rank learns whether any rank failed."""
        result, reason = None, None
        try:
            result = fn()
        except Unsupported as exc:
            reason = str(exc)
        except torch.cuda.OutOfMemoryError:
            reason = "OOM"
        except Exception as exc:  # noqa: BLE001 - an arm's failure is reported in its cell, the run goes on
            msg = str(exc).strip().splitlines()
            reason = f"{type(exc).__name__}: {msg[0][:120] if msg else ''}"
            print(f"[rank {self.rank}] {what} failed:", file=sys.stderr)
            traceback.print_exc()
        if reason is not None:
            result = None
            self.free()
        if not self.agree(reason is None) and reason is None:
            reason, result = "failed on another rank", None
        return result, reason

    # -- a cell: one (layout, H, op) ----------------------------------------------------------------

    def run_cell(self, lay, H, op, x, do):
        args = self.args
        arms = list(args.arms)
        status = {a: self.static_reason(a, lay) for a in arms}
        if op == "ckpt" and args.fla_ckpt_after_bwd_oom == "skip":
            for a in arms:
                if a in FLA_ARMS and status[a] is None and (lay.name, H, a) in self.bwd_oom:
                    status[a] = NOT_RUN_AFTER_OOM
        pools = {a: [[] for _ in range(args.groups)] for a in arms}
        peaks = {a: [None, None] for a in arms}

        def note_peak(a, peak, extra):
            if peak is not None:
                peaks[a][0] = max(peaks[a][0] or 0, peak)
                peaks[a][1] = max(peaks[a][1] or 0, extra)

        for a in arms:  # one untimed warm-up call per arm (compiles, autotunes, fills caches)
            if status[a] is None:
                _, status[a] = self.guarded(f"{lay.name} H={H} {op} {a} warm-up",
                                            lambda: self.visit(a, op, lay, H, x, do, 1))
        order = [a for a in arms if status[a] is None]
        for gi in range(args.groups):
            for a in order + order[::-1]:
                if status[a] is not None:
                    continue
                res, status[a] = self.guarded(f"{lay.name} H={H} {op} {a} group {gi}",
                                              lambda: self.visit(a, op, lay, H, x, do, args.iters))
                if res is not None:
                    pools[a][gi].extend(res[0])
                    note_peak(a, res[1], res[2])
        row = {"layout": lay.name, "H": H, "op": op, "arms": {}}
        for a in arms:
            gm = [statistics.median(p) for p in pools[a] if p]
            ok = status[a] is None and len(gm) == args.groups
            row["arms"][a] = {
                "ms": statistics.median(gm) if ok else None,
                "status": "ok" if ok else (status[a] or "incomplete"),
                "group_medians_ms": gm,
                "times_ms": pools[a],
                "peak_bytes": peaks[a][0],
                "peak_above_inputs_bytes": peaks[a][1],
            }
        if op == "bwd":
            self.bwd_oom |= {(lay.name, H, a) for a in arms if status[a] == "OOM"}
        row["kda_kcp_bytes"] = self.byte_queries(lay, H)
        finish_row(row)
        return row

    def byte_queries(self, lay, H) -> dict:
        """What the library says a call of this rank needs (workspace, saved for the backward, exchanged)."""
        out = {}
        queries = (
            ("workspace", lambda c: kda_kcp.kda_workspace_bytes_kcp(c, H, head_dim=self.D, device=self.device)),
            ("workspace_lean2", lambda c: kda_kcp.kda_workspace_bytes_kcp(
                c, H, head_dim=self.D, device=self.device, local_arena="lean", lean_passes=2)),
            ("saved", lambda c: kda_kcp.kda_saved_bytes_kcp(c, H, head_dim=self.D)),
            ("comm", lambda c: kda_kcp.kda_comm_bytes_kcp(c, H, head_dim=self.D)),
        )
        for name, fn in queries:
            try:
                out[name] = int(fn(lay.ctx))
            except Exception as exc:  # noqa: BLE001 - informational only
                out[name] = f"{type(exc).__name__}: {exc}"
        return out

    # -- accuracy slice -----------------------------------------------------------------------------

    def accuracy(self, layouts):
        """Error of every arm against the FP64 oracle on the first tokens of (up to) two documents."""
        args = self.args
        Hs, D = args.oracle_heads, self.D
        lens = [n for n in args.doc_lengths if n > 0][:2]
        starts = [self.cu[i] for i, n in enumerate(args.doc_lengths) if n > 0][:2]
        unit = 2 * self.W if self.W > 1 else 1  # FLA CP needs the slice's T divisible by 2W
        cut = []
        for n in lens:
            m = min(n, args.oracle_tokens)
            cut.append(m - m % unit if m >= unit else m)
        gx = draw_inputs(self.T, Hs, D, self.device, args.seed, gates=args.gates)
        sl = [torch.cat([t[s:s + m] for s, m in zip(starts, cut)]).contiguous() for t in gx]
        del gx
        self.free()
        cu_s = cu_of(cut)
        Ts = cu_s[-1]
        self.log(f"accuracy slice: the first {' and '.join(map(str, cut))} tokens of documents of {' and '.join(map(str, lens))} "
                 f"tokens (T = {Ts}), H = {Hs}; FP64 oracle kda_kcp.reference.naive_kda")
        ref = None
        if self.rank == 0:
            t0 = time.perf_counter()
            leaves = [t.detach().double().requires_grad_(True) for t in sl[:5]]
            o_ref = naive_kda(*leaves, cu_s)
            ref = (o_ref.detach(), *torch.autograd.grad(o_ref, leaves, sl[5].double()))
            del o_ref, leaves
            self.log(f"  oracle: {time.perf_counter() - t0:.1f} s")
        results = []
        fla_done = False
        for name in layouts:
            cu_dev = torch.tensor(cu_s, dtype=torch.int64, device=self.device)
            ctx = kda_kcp.build_context_kcp(cu_dev, group=self.group, layout=name)
            for a in self.args.arms:
                if a == "control":
                    continue  # the same function as nd
                if a == "fla" and fla_done:
                    continue  # FLA without CP runs the whole slice on one GPU: layout-free
                lay_name = "(whole slice, 1 GPU)" if a == "fla" and self.W > 1 else name
                reason = self.fla_reason if a in FLA_ARMS else None
                cp = None
                if a == "fla_cp" and reason is None:
                    cp, reason = self.fla_cp_context(cu_s, name, ctx)
                errs = None
                if reason is None:
                    def run(a=a, cp=cp, ctx=ctx, sl=sl):
                        return self.slice_arm(a, ctx, cu_s, sl, cp)
                    outs, reason = self.guarded(f"accuracy {name} {a}", run)
                    if outs is not None and self.rank == 0:
                        errs = dict(zip(("o", *GRAD_NAMES), (rel_rms(y, r) for y, r in zip(outs, ref))))
                if a == "fla":
                    fla_done = True
                results.append({"layout": lay_name, "arm": a, "errors": errs, "status": "ok" if reason is None else reason})
        return {"tokens": cut, "doc_lengths": lens, "T": Ts, "H": Hs, "rows": results}

    def slice_arm(self, arm, ctx, cu_s, sl, cp):
        """o and the five gradients of one arm on the slice, gathered to global order on every rank."""
        q, k, v, g, beta, do = sl
        if arm == "fla":  # no CP: the whole slice, on this GPU
            cu = torch.tensor(cu_s, dtype=torch.int64)
            x = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]
            o, _ = self.chunk_kda(q=x[0][None], k=x[1][None], v=x[2][None], g=x[3][None], beta=x[4][None],
                                  scale=None, use_gate_in_kernel=False, safe_gate=True,
                                  cu_seqlens=cu.to(self.device), cu_seqlens_cpu=cu)
            o = o[0]
            grads = torch.autograd.grad(o, x, do)
            return [t.detach().float() for t in (o, *grads)]
        x = [ctx.shard(t).detach().requires_grad_(True) for t in (q, k, v, g, beta)]
        dol = ctx.shard(do)
        if arm == "fla_cp":
            o, _ = self.chunk_kda(q=x[0][None], k=x[1][None], v=x[2][None], g=x[3][None], beta=x[4][None],
                                  scale=None, use_gate_in_kernel=False, safe_gate=True, cp_context=cp)
            o = o[0]
        else:
            o = kda_kcp.chunk_kda_kcp(*x, ctx, scale=None, deterministic=arm == "det")
        grads = torch.autograd.grad(o, x, dol)
        outs = []
        for t in (o, *grads):
            y = ctx.unshard(t.detach().float())
            if self.W > 1:
                y = y.to(self.coll_device())
                dist.all_reduce(y, group=self.group)  # other ranks' rows are zeros: the sum is exact
            outs.append(y)
        return outs

    # -- the whole run ------------------------------------------------------------------------------

    def header(self):
        a = self.args
        from kda_kcp.backend import select_backend

        try:
            backend = select_backend(self.device, True).name
        except Exception as exc:  # noqa: BLE001
            backend = f"unavailable ({exc})"
        dev = torch.cuda.get_device_name(self.device) if self.cuda else f"CPU ({platform.processor() or platform.machine()})"
        meta = {
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": a.command,
            "device": dev,
            "world": self.W,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "kda_kcp": getattr(kda_kcp, "__version__", "?"),
            "kda_kcp_backend": backend,
            "KDA_KCP_BACKEND": os.environ.get("KDA_KCP_BACKEND", ""),
            "KDA_KCP_TUNING": os.environ.get("KDA_KCP_TUNING", ""),  # forced tuning choices (kda_kcp/cuda/tuning.py)
            "fla": self.fla_version or self.fla_reason,
            "fla_optional_modules": fla_extras(),
            "docs": a.doc_lengths,
            "T": self.T,
            "head_dim": self.D,
            "heads": a.heads,
            "layouts": a.layouts,
            "ops": a.ops,
            "arms": a.arms,
            "iters": a.iters,
            "groups": a.groups,
            "flush_mib": a.flush_mib,
            "workspace": not a.no_workspace,
            "local_arena": a.local_arena,
            "lean_passes": a.lean_passes,
            "seed": a.seed,
            "inputs": ("raw q, k, v, do, g, beta randn (BF16), exp(A_log) in [0.2, 0.6], dt_bias ~ N(-2, 0.5) (FP32); "
                       "chunk_kda with use_qk_l2norm_in_kernel, use_gate_in_kernel (lower_bound=-5, safe_gate), "
                       "use_beta_sigmoid_in_kernel" if a.activations else
                       f"q,k: L2-normalised randn (BF16); v, do: randn (BF16); g: {GATE_LAWS[a.gates]} (FP32); "
                       "beta: sigmoid(z) clipped to [2^-8, 1 - 2^-8] (BF16)"),
            "activations": a.activations,
            "gates": a.gates,
            "batch": a.batch if not a.docs else "docs",
            "timer": "CUDA events" if self.cuda else "time.perf_counter",
        }
        self.log(f"# kda_kcp benchmark, {meta['date_utc']}")
        self.log(f"command: {meta['command']}")
        self.log(f"device: {dev} x {self.W}; torch {torch.__version__} (CUDA {torch.version.cuda}); kda_kcp "
                 f"{meta['kda_kcp']} backend={backend}; fla: {meta['fla']}")
        if self.fla_version and self.fla_version != "0.6.0":
            self.log(f"warning: the baseline is FLA 0.6.0, this is fla {self.fla_version}")
        self.log(f"workload: docs {a.doc_lengths}, T = {self.T}, head dim {self.D}, H in {a.heads}; {meta['inputs']}")
        self.log(f"protocol: {a.groups} groups x 2 visits x {a.iters} iters per arm, flush {a.flush_mib} MiB, "
                 f"{meta['timer']}, slowest rank per iteration; arms {a.arms}; layouts {a.layouts}; ops {a.ops}")
        if a.dropped_arms:
            self.log(f"not run: {', '.join(a.dropped_arms)}")
        if self.W == 1:
            self.log("W = 1: every layout is one piece, so only one layout row is run")
        return meta

    def run(self):
        a = self.args
        meta = self.header()
        layouts = [Layout(self, name) for name in a.layouts]
        accuracy = None
        rows = []

        def save(complete):
            """The JSON so far (rank 0), rewritten after every cell, so that a run cut short by a time limit keeps
            the cells it finished ("complete": false until the last cell)."""
            meta["wall_s"] = round(time.perf_counter() - self.t0, 1)
            result = {"meta": meta, "complete": complete, "rows": rows, "accuracy": accuracy}
            if self.rank == 0 and a.json:
                path = Path(a.json)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(path.name + ".tmp")
                with open(tmp, "w") as f:
                    json.dump(result, f, indent=1)
                tmp.replace(path)
            return result

        if not a.no_oracle:
            accuracy = self.accuracy(a.layouts)
            save(False)
        n_cells, i = len(a.heads) * len(layouts) * len(a.ops), 0
        for H in a.heads:
            for lay in layouts:
                t_in = time.perf_counter()
                drawn = draw_inputs(self.T, H, self.D, self.device, a.seed, post=lay.shard, gates=a.gates,
                                    activations=a.activations)
                do = drawn[5]
                x = tuple(t.requires_grad_(True) for t in drawn[:5] + drawn[6:])
                del drawn
                self.free()
                for op in a.ops:
                    i += 1
                    t_cell = time.perf_counter()
                    row = self.run_cell(lay, H, op, x, do)
                    rows.append(row)
                    self.log(f"[{i}/{n_cells}] {progress_line(row)} ({time.perf_counter() - t_cell:.1f} s"
                             + (f", inputs {t_cell - t_in:.1f} s" if op == a.ops[0] else "") + ")")
                    save(False)
                del x, do
                self.free()
        result = save(True)
        if self.rank == 0:
            if a.json:
                print(f"wrote {a.json}", flush=True)
            if a.plot:
                plot(result, a.plot)
            report(result)  # the tables come last
        return result


# ----------------------------------------------------------------------------------------------------
# rows, tables and the plot


def baselines_of(row):
    return [b for b in FLA_ARMS if b in row["arms"]]


def finish_row(row):
    arms = row["arms"]
    ms = {a: v["ms"] for a, v in arms.items()}
    row["speedup"] = {}
    for b in baselines_of(row):
        for a in ("det", "nd"):
            if a in arms:
                ok = ms.get(a) and ms.get(b)
                row["speedup"][f"{a}/{b}"] = ms[b] / ms[a] if ok else None
    row["control_nd"] = ms["control"] / ms["nd"] if ms.get("control") and ms.get("nd") else None
    gm = arms["nd"]["group_medians_ms"] if "nd" in arms and arms["nd"]["ms"] else []
    row["drift_nd"] = gm[-1] / gm[0] - 1.0 if len(gm) >= 2 else None
    bad_control = row["control_nd"] is not None and not CONTROL_BAND[0] <= row["control_nd"] <= CONTROL_BAND[1]
    bad_drift = row["drift_nd"] is not None and abs(row["drift_nd"]) > DRIFT_LIMIT
    row["dagger"] = bool(bad_control or bad_drift)


def arm_cell(row, a):
    v = row["arms"].get(a)
    if v is None:
        return "-"
    if v["ms"] is not None:
        return fmt_ms(v["ms"])
    if v["status"] == NOT_RUN_AFTER_OOM:
        return v["status"]
    return f"{'error' if a in OURS else 'unsupported'} ({v['status']})"


def progress_line(row):
    parts = [f"{a} {arm_cell(row, a)}" + (" ms" if row["arms"][a]["ms"] is not None else "") for a in row["arms"]]
    extra = []
    if row["control_nd"] is not None:
        extra.append(f"control/nd {row['control_nd']:.3f}")
    if row["drift_nd"] is not None:
        extra.append(f"drift {100 * row['drift_nd']:+.1f}%")
    for key, s in row["speedup"].items():
        if s is not None:
            extra.append(f"{key} {s:.2f}x")
    return f"{row['layout']} H={row['H']} {row['op']}{' ' + DAGGER if row['dagger'] else ''}: " + ", ".join(parts) + (
        " | " + ", ".join(extra) if extra else "")


def main_table(result) -> str:
    rows = result["rows"]
    arms = result["meta"]["arms"]
    ms_arms = [a for a in ("det", "nd", "fla", "fla_cp") if a in arms]
    keys = []
    for r in rows:
        for k in r["speedup"]:
            if k not in keys:
                keys.append(k)
    header = ["layout", "H", "op", *(f"{a} ms" for a in ms_arms), *keys, "control/nd", "drift nd"]
    body = []
    for r in rows:
        cells = [r["layout"], r["H"], r["op"] + (f" {DAGGER}" if r["dagger"] else "")]
        cells += [arm_cell(r, a) for a in ms_arms]
        cells += ["-" if r["speedup"].get(k) is None else f"{r['speedup'][k]:.2f}x" for k in keys]
        cells.append("-" if r["control_nd"] is None else f"{r['control_nd']:.3f}")
        cells.append("-" if r["drift_nd"] is None else f"{100 * r['drift_nd']:+.1f}%")
        body.append(cells)
    return md_table(header, body)


def memory_table(result) -> str | None:
    rows = result["rows"]
    arms = result["meta"]["arms"]
    if not rows or all(v["peak_bytes"] is None for r in rows for v in r["arms"].values()):
        return None
    header = ["layout", "H", "op", *(f"{a} GiB" for a in arms)]
    body = []
    for r in rows:
        cells = [r["layout"], r["H"], r["op"]]
        for a in arms:
            v = r["arms"].get(a)
            if v is None or v["peak_bytes"] is None:
                cells.append("-" if v is None else v["status"] if v["status"] != "ok" else "-")
            else:
                cells.append(f"{fmt_bytes(v['peak_bytes'])} (+{fmt_bytes(v['peak_above_inputs_bytes'])})")
        body.append(cells)
    return md_table(header, body)


def bytes_table(result) -> str | None:
    """kda_kcp's byte queries per (layout, H): what one rank's call needs (the first op's row)."""
    seen, body = set(), []
    for r in result["rows"]:
        b = r.get("kda_kcp_bytes")
        if not b or (r["layout"], r["H"]) in seen:
            continue
        seen.add((r["layout"], r["H"]))
        cell = [fmt_bytes(b[k]) if isinstance(b.get(k), int) else str(b.get(k)) for k in
                ("workspace", "workspace_lean2", "saved", "comm")]
        body.append([r["layout"], r["H"], *cell])
    if not body:
        return None
    return md_table(["layout", "H", "workspace GiB (replay)", "workspace GiB (lean, 2 passes)", "saved GiB",
                     "comm GiB per step"], body)


def accuracy_table(acc) -> str:
    header = ["layout", "arm", "o", *GRAD_NAMES]
    body = []
    for r in acc["rows"]:
        if r["errors"] is None:
            word = "error" if r["arm"] in OURS else "unsupported"
            body.append([r["layout"], r["arm"], f"{word} ({r['status']})", *([""] * len(GRAD_NAMES))])
            continue
        cells = [r["layout"], r["arm"]]
        for key in ("o", *GRAD_NAMES):
            e = r["errors"][key]
            cells.append(f"{e:.2e}" + ("*" if not e <= TOLERANCE[key] else ""))
        body.append(cells)
    body.append(["tolerance", "(design §10)", *(f"{TOLERANCE[k]:.0e}" for k in ("o", *GRAD_NAMES))])
    return md_table(header, body)


def report(result):
    meta = result["meta"]
    print("", flush=True)
    acc = result["accuracy"]
    if acc is not None:
        print(f"## Error against the FP64 oracle (relative RMS; slice T = {acc['T']}, H = {acc['H']}; * = over tolerance)")
        print(accuracy_table(acc))
        print("")
    nbytes = bytes_table(result)
    if nbytes is not None:
        print("## kda_kcp byte queries per rank (kda_workspace_bytes_kcp, kda_saved_bytes_kcp, kda_comm_bytes_kcp)")
        print(nbytes)
        print("")
    mem = memory_table(result)
    if mem is not None:
        print("## Peak memory per arm: max_memory_allocated in GiB (+ above the inputs, do and flush buffer), "
              "slowest rank")
        print(mem)
        print("")
    print(f"## Time per call in ms ({meta['device']} x {meta['world']}, {meta['date_utc']}, kda_kcp backend "
          f"{meta['kda_kcp_backend']}, fla {meta['fla']})")
    print(f"command: {meta['command']}")
    if meta.get("activations"):
        print("arms: det / nd = kda_kcp.chunk_kda(deterministic=True / False), fla = fla.ops.kda.chunk_kda, both with "
              "use_qk_l2norm_in_kernel, use_gate_in_kernel (A_log, dt_bias, lower_bound=-5, safe_gate) and "
              "use_beta_sigmoid_in_kernel; control = a second visit of nd")
    else:
        print("arms: det / nd = kda_kcp.chunk_kda_kcp(deterministic=True / False); control = a second visit of nd; "
              "fla = fla.ops.kda.chunk_kda(safe_gate=True, cu_seqlens=...) on the same shard; "
              "fla_cp = chunk_kda(safe_gate=True, cp_context=build_cp_context(cu_seqlens, group, layout=...))")
    print("cell = median over groups of the group medians; speedup a/b = b ms / a ms; "
          f"{DAGGER} = control/nd outside {CONTROL_BAND[0]}-{CONTROL_BAND[1]} or |drift of nd| > {100 * DRIFT_LIMIT:.0f} %"
          + ("; fla at W > 1 = FLA without CP on this rank's shard" if meta["world"] > 1 else ""))
    print(main_table(result))
    print(f"wall time {meta['wall_s']:.0f} s", flush=True)


def plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed (pip install matplotlib, or the 'bench' extra); {path} not written",
              flush=True)
        return
    rows = result["rows"]
    keys = []
    for r in rows:
        for k in r["speedup"]:
            if k not in keys:
                keys.append(k)
    if not any(v is not None for r in rows for v in r["speedup"].values()):
        print(f"--plot: no speedup vs FLA to draw (no FLA arm ran); {path} not written", flush=True)
        return
    W = result["meta"]["world"]
    short = {"contiguous": "contig", "zigzag": "zigzag", "zigzag_per_document": "zz/doc"}
    labels = [(f"{short.get(r['layout'], r['layout'])}\n" if W > 1 else "") + f"H={r['H']} {r['op']}" for r in rows]
    n, m = len(rows), len(keys)
    width = 0.8 / m
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * n * max(1, m / 2) + 2), 4.5))
    for j, key in enumerate(keys):
        vals = [r["speedup"].get(key) for r in rows]
        xs = [i - 0.4 + width * (j + 0.5) for i in range(n)]
        ax.bar(xs, [v if v is not None else 0.0 for v in vals], width, label=key)
        for xpos, v in zip(xs, vals):
            if v is None:
                ax.text(xpos, 0.05, "n/a", ha="center", va="bottom", rotation=90, fontsize=7)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(2.0, color="gray", lw=0.8, ls="--", label="2x target")
    ax.set_xticks(range(n))
    ax.set_xticklabels(labels, rotation=90 if n > 12 else 0, fontsize=8)
    ax.set_ylabel("speedup vs FLA (x)")
    meta = result["meta"]
    ax.set_title(f"kda_kcp vs FLA chunk_kda, W = {W}, {meta['device']}, T = {meta['T']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


# ----------------------------------------------------------------------------------------------------
# processes


def rank_main(rank, args, port):
    W = args.world
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = None
    if W > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        if not cuda:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // W))
        kw = dict(backend="nccl" if cuda else "gloo", rank=rank, world_size=W,
                  timeout=datetime.timedelta(minutes=args.timeout_min))
        if cuda:
            try:
                dist.init_process_group(**kw, device_id=device)
            except TypeError:  # torch without device_id
                dist.init_process_group(**kw)
        else:
            dist.init_process_group(**kw)
        group = dist.group.WORLD
    try:
        Bench(args, rank, device, group).run()
        if W > 1:
            dist.barrier()  # every rank done with the group before any tears it down
    finally:
        if W > 1:
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    args = parse_args(argv)
    if args.world == 1:
        rank_main(0, args, 0)
    else:
        import torch.multiprocessing as mp

        # free_port() releases its socket before rank 0's rendezvous binds it, so another process can take the port
        # in between (seen once in ~20 runs on the device machine): the ranks then die at init_process_group, before
        # any work, and a fresh port is safe to try
        for attempt in range(3):
            try:
                mp.spawn(rank_main, args=(args, free_port()), nprocs=args.world, join=True)
                return
            except mp.ProcessRaisedException as exc:
                if "EADDRINUSE" not in str(exc) or attempt == 2:
                    raise
                print(f"rendezvous port taken (EADDRINUSE), retrying with another one ({attempt + 1} of 2)",
                      flush=True)


if __name__ == "__main__":
    main()
