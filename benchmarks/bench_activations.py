#!/usr/bin/env python
"""The fused in-call activations alone (program kda_act: act_fwd, act_bwd; docs/kernels.md §8): milliseconds and the
bandwidth achieved on the bytes each pass must move.

Shape: the benchmark batch, T = 261,392 tokens (--tokens), H = HV heads (--heads, default 4 and 16) of dim 128;
raw q, k, g, beta randn in BF16 (--raw-dtype), exp(A_log) in [0.2, 0.6] and dt_bias ~ N(-2, 0.5) in FP32, every
activation on: the q/k L2 norm, the gate (--gate: softplus, FLA's default, with A_log and dt_bias; bounded-rate,
the benchmark's --activations row with lower_bound -5; bounded, without A_log) and the beta sigmoid. The backward
reads random gradients of the activated tensors (BF16 q, k, beta, FP32 gate) and writes dq, dk, dg, dbeta and the
per-item partial sums of dA_log and ddt_bias.

Each kernel is called through the program's entry points with every buffer allocated beforehand (no allocation is
timed). Per iteration: L2 flush (write a --flush-mib buffer), CUDA events around the one call; --iters timed
iterations after --warmup untimed ones, the median reported. Bytes per token-head: what the pass reads and writes
(q, k, g, beta and their outputs; the inverse norms; the partial sums counted written and read back by torch's sum),
1,804 forward and 2,590 backward in the default configuration, as docs/kernels.md §8 counts them.

    python benchmarks/bench_activations.py                               # this checkout, H = 4 and 16
    python benchmarks/bench_activations.py --checkout /path/to/main      # another checkout's kda_kcp and programs
    python benchmarks/bench_activations.py --checkout A --checkout B --visits 4   # A/B, one process per visit,
                                                                                # visits in the order A B B A ...
    python benchmarks/bench_activations.py --device cpu --tokens 300 --heads 2 --iters 2   # CPU smoke

--device cpu times the torch ops that the CPU backend runs instead (kda_kcp.fla's l2_normalize, kda_gate,
beta_activation and their autograd backward): a smoke test of this script, not of the kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

GATES = {"softplus": (0, None), "bounded-rate": (1, -5.0), "bounded": (2, -5.0)}  # csrc/kda_act.h GateForm, lower_bound
T_BENCH = 261_392  # the benchmark batch: documents of 42,024, 57,573, 73,122 and 88,673 tokens
D = 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tokens", type=int, default=None, help=f"T (default {T_BENCH:,} on cuda, 300 on cpu)")
    p.add_argument("--heads", nargs="+", type=int, default=None, help="H = HV values (default 4 16; 2 on cpu)")
    p.add_argument("--gate", choices=tuple(GATES), default="softplus")
    p.add_argument("--raw-dtype", choices=("bf16", "fp32"), default="bf16", help="dtype of raw q, k, g, beta")
    p.add_argument("--ops", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"])
    p.add_argument("--iters", type=int, default=20, help="timed iterations per cell (the median is reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--flush-mib", type=int, default=256, help="L2 flush buffer written before every iteration")
    p.add_argument("--checkout", action="append", default=[], metavar="DIR",
                   help="import kda_kcp (and its programs) from DIR; twice or more: one process per checkout and "
                        "visit, alternating, and a table comparing them")
    p.add_argument("--visits", type=int, default=2, help="with several checkouts: visits of each (order A B B A ...)")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.add_argument("--json-lines", action="store_true", help=argparse.SUPPRESS)  # a visit's child: one JSON line
    args = p.parse_args(argv)
    if args.tokens is None:
        args.tokens = T_BENCH if args.device == "cuda" else 300
    if args.heads is None:
        args.heads = [4, 16] if args.device == "cuda" else [2]
    return args


# ---- one process: the kda_kcp of this process ----


def draw(T, H, dtype, device, seed=0):
    """Raw inputs [T, H, ...] of every activation, A_log and dt_bias (FP32), and the gradients of the activated
    tensors."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + H)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    bf16 = torch.bfloat16
    x = dict(q=randn(T, H, D).to(dtype), k=randn(T, H, D).to(dtype), g=randn(T, H, D).to(dtype),
             beta=randn(T, H).to(dtype), A_log=(0.2 + 0.4 * torch.rand(H, generator=gen, device=device)).log(),
             dt_bias=randn(H * D).mul_(0.5).sub_(2.0))
    grads = dict(dqn=randn(T, H, D).to(bf16), dkn=randn(T, H, D).to(bf16), dg_out=randn(T, H, D),
                 dbeta_out=randn(T, H).to(bf16))
    return x, grads


def pass_bytes(x, grads, op, items):
    """Bytes the pass reads and writes (A_log and dt_bias aside: per head, not per token)."""
    raw = sum(x[n].nbytes for n in ("q", "k", "g", "beta"))
    T, H = x["q"].shape[:2]
    norms = 2 * T * H * 4
    if op == "fwd":  # writes bf16 q, k, fp32 g, bf16 beta and the inverse norms
        return raw + 2 * grads["dqn"].nbytes + grads["dg_out"].nbytes + grads["dbeta_out"].nbytes + norms
    partial = items * H * (D + 1) * 4
    return 2 * raw + norms + sum(g.nbytes for g in grads.values()) + 2 * partial


class Cuda:
    """act_fwd / act_bwd of this process's kda_kcp program, on buffers allocated once per H."""

    def __init__(self, args):
        import torch
        from kda_kcp import jit
        from kda_kcp.cuda import activations

        self.torch, self.dev = torch, torch.device("cuda", torch.cuda.current_device())
        self.prog = activations.load(self.dev)
        self.rows_per_item = int(self.prog.act_rows_per_item())
        self.program_path = str(jit.program_path("kda_act", jit.arch_of_device(self.dev)))
        self.flush_buf = torch.empty(args.flush_mib * 2**20, dtype=torch.uint8, device=self.dev)
        self.args = args

    def setup(self, H):
        torch, a = self.torch, self.args
        dtype = torch.bfloat16 if a.raw_dtype == "bf16" else torch.float32
        T = a.tokens
        x, grads = draw(T, H, dtype, self.dev)
        form, lb = GATES[a.gate]
        a_log = x["A_log"] if form != 2 else x["A_log"].new_empty(0)
        items = -(-T // self.rows_per_item)
        f32, bf16 = torch.float32, torch.bfloat16
        def empty(*shape, dtype):
            return torch.empty(*shape, dtype=dtype, device=self.dev)

        out = dict(qn=empty(T, H, D, dtype=bf16), kn=empty(T, H, D, dtype=bf16), rq=empty(T, H, dtype=f32),
                   rk=empty(T, H, dtype=f32), g_act=empty(T, H, D, dtype=f32), beta_act=empty(T, H, dtype=bf16))
        bwd = dict(dq=torch.empty_like(x["q"]), dk=torch.empty_like(x["k"]), dg=torch.empty_like(x["g"]),
                   dbeta=torch.empty_like(x["beta"]),
                   part_a=empty(items, H, dtype=f32) if form != 2 else a_log, part_dt=empty(items, H, D, dtype=f32))
        options = (T, H, H, form, float(lb or 0.0), 1.0)
        raw = (x["q"], x["k"], x["g"], x["beta"], a_log, x["dt_bias"])

        def fwd():
            self.prog.act_fwd(*raw, *(out[n] for n in ("qn", "kn", "rq", "rk", "g_act", "beta_act")), *options)

        def bwd_call():
            self.prog.act_bwd(*raw, out["rq"], out["rk"], grads["dqn"], grads["dkn"], grads["dg_out"],
                              grads["dbeta_out"], *(bwd[n] for n in ("dq", "dk", "dg", "dbeta", "part_a", "part_dt")),
                              *options)

        fwd()  # the inverse norms the backward reads
        torch.cuda.synchronize()
        return {"fwd": fwd, "bwd": bwd_call}, {op: pass_bytes(x, grads, op, items) for op in ("fwd", "bwd")}

    def time(self, fn, iters, warmup):
        torch = self.torch
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            self.flush_buf.zero_()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times


class Cpu:
    """The torch ops of the CPU backend (kda_kcp.fla), forward and autograd backward: a smoke test of the script."""

    def __init__(self, args):
        import time

        import torch

        self.torch, self.time_fn, self.args = torch, time.perf_counter, args
        self.program_path = "torch ops (kda_kcp.fla)"
        self.rows_per_item = 64

    def setup(self, H):
        torch, a = self.torch, self.args
        from kda_kcp import fla

        dtype = torch.bfloat16 if a.raw_dtype == "bf16" else torch.float32
        x, grads = draw(a.tokens, H, dtype, torch.device("cpu"))
        form, lb = GATES[a.gate]
        leaves = {n: v.detach().requires_grad_() for n, v in x.items()}
        A_log = leaves["A_log"] if form != 2 else None

        def forward():
            q, k = fla.l2_normalize(leaves["q"]).bfloat16(), fla.l2_normalize(leaves["k"]).bfloat16()
            gate = fla.kda_gate(leaves["g"], A_log, leaves["dt_bias"], lb)
            return q, k, gate, fla.beta_activation(leaves["beta"]).bfloat16()

        def fwd():
            with torch.no_grad():
                forward()

        def bwd():
            outs = forward()
            torch.autograd.grad(outs, [v for n, v in leaves.items() if n != "A_log" or A_log is not None],
                                (grads["dqn"], grads["dkn"], grads["dg_out"], grads["dbeta_out"]))

        items = -(-a.tokens // self.rows_per_item)
        return {"fwd": fwd, "bwd": bwd}, {op: pass_bytes(x, grads, op, items) for op in ("fwd", "bwd")}

    def time(self, fn, iters, warmup):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = self.time_fn()
            fn()
            times.append((self.time_fn() - t0) * 1e3)
        return times


def measure(args):
    """Rows {H, op, ms, TB/s, bytes per token-head, times} of this process's kda_kcp."""
    import kda_kcp

    runner = Cuda(args) if args.device == "cuda" else Cpu(args)
    meta = dict(kda_kcp=str(Path(kda_kcp.__file__).resolve().parent), program=runner.program_path,
                device=_device_name(args.device))
    rows = []
    for H in args.heads:
        fns, nbytes = runner.setup(H)
        for op in args.ops:
            times = runner.time(fns[op], args.iters, args.warmup)
            ms = statistics.median(times)
            rows.append(dict(H=H, op=op, ms=ms, tbps=nbytes[op] / (ms * 1e-3) / 1e12,
                             bytes_per_token_head=nbytes[op] / (args.tokens * H), times_ms=times))
        del fns
    return meta, rows


def _device_name(device):
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


# ---- several checkouts: one child process per visit ----


def _child_argv(args, checkout):
    argv = [sys.executable, str(Path(__file__).resolve()), "--checkout", checkout, "--json-lines", "--device",
            args.device, "--tokens", str(args.tokens), "--heads", *map(str, args.heads), "--gate", args.gate,
            "--raw-dtype", args.raw_dtype, "--ops", *args.ops, "--iters", str(args.iters), "--warmup",
            str(args.warmup), "--flush-mib", str(args.flush_mib)]
    return argv


def compare(args):
    """Visits in the order A B .. B A (repeated up to --visits each), each in its own process; per checkout and cell,
    the median over all its iterations."""
    order = []
    while len(order) < args.visits * len(args.checkout):
        order += args.checkout if (len(order) // len(args.checkout)) % 2 == 0 else args.checkout[::-1]
    results = {c: [] for c in args.checkout}
    metas = {}
    for c in order:
        where = str(Path(c).resolve())
        proc = subprocess.run(_child_argv(args, where), capture_output=True, text=True, cwd=where)
        line = next((ln for ln in proc.stdout.splitlines()[::-1] if ln.startswith("{")), None)
        if proc.returncode != 0 or line is None:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"bench_activations: the visit of {c} failed (rc {proc.returncode})")
        res = json.loads(line)
        metas[c] = res["meta"]
        results[c].append(res["rows"])
        print(f"visit {c}: " + ", ".join(f"H={r['H']} {r['op']} {r['ms']:.3f} ms" for r in res["rows"]), flush=True)
    table = []
    for c in args.checkout:
        cells = {}
        for rows in results[c]:
            for r in rows:
                cells.setdefault((r["H"], r["op"]), dict(r, times_ms=[]))["times_ms"] += r["times_ms"]
        for (H, op), r in cells.items():
            r["ms"] = statistics.median(r["times_ms"])
            r["tbps"] = r["bytes_per_token_head"] * args.tokens * H / (r["ms"] * 1e-3) / 1e12
            table.append(dict(r, checkout=c))
    return metas, table


def print_table(rows, ref=None):
    print(f"| checkout | H | op | ms | TB/s | B per token-head |{' vs first |' if ref else ''}")
    print(f"|---|---|---|---|---|---|{'---|' if ref else ''}")
    for r in rows:
        rel = ""
        if ref:
            base = ref.get((r["H"], r["op"]))
            rel = f" {r['ms'] / base:.3f} |" if base else " |"
        print(f"| {r.get('checkout', '.')} | {r['H']} | {r['op']} | {r['ms']:.3f} | {r['tbps']:.3f} | "
              f"{r['bytes_per_token_head']:.0f} |{rel}")


def main(argv=None):
    args = parse_args(argv)
    if len(args.checkout) > 1:
        metas, table = compare(args)
        ref = {(r["H"], r["op"]): r["ms"] for r in table if r["checkout"] == args.checkout[0]}
        for c, m in metas.items():
            print(f"{c}: kda_kcp {m['kda_kcp']}, program {m['program']}, {m['device']}")
        print_table(table, ref)
        out = dict(meta=metas, rows=table, args=vars(args))
    else:
        if args.checkout:
            sys.path.insert(0, str(Path(args.checkout[0]).resolve()))
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        meta, rows = measure(args)
        if args.json_lines:
            print(json.dumps(dict(meta=meta, rows=rows)))
            return 0
        print(f"kda_kcp {meta['kda_kcp']}, program {meta['program']}, {meta['device']}, T = {args.tokens:,}, "
              f"gate {args.gate}, raw {args.raw_dtype}, median of {args.iters}")
        print_table(rows)
        out = dict(meta=meta, rows=rows, args=vars(args))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
