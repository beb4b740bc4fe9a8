#!/usr/bin/env python3
"""How precise must the forward walk's operands be? A CPU model of the state walk (no GPU).

The walk's products take their operands rounded to a tensor-core type: W, Qg, Kg, Aqk and A diag(beta) from the
prep's record, S and V_new from their FP32 accumulators, V from the input. This walks one document in FP64 with each
operand rounded as a kernel form would round it, and prints o's relative RMS error against the unrounded FP64 walk
of the same inputs and, with --segments, how far a walk cut into 1-chunk segments (summaries from a zero state,
folded in FP64, each chunk walked again from its incoming state) lies from the whole walk: the agreement the GPU
tests bound (1e-3), which the roundings that feed back into the state decide, not o's own error.

Forms (`--modes`; the default is all):

    bf16_pairs  sessions 1-19: W, Qg, Kg bf16; Aqk, A diag(beta), S and V_new as bf16 hi + lo pairs
    bf16_hi     the same with S and V_new as hi only (session 6's KDA_WALK_HI_ONLY, measured and dropped)
    f16         every operand fp16, one product each
    f16_vn      f16 with V_new as an fp16 pair in the state update (session 20: csrc/kda_fwd.cu's default)
    f16_s_vn    f16_vn with S as a pair in V_new = U - W S too (KDA_FWD_S_LO=1)
    f16_vn_raw  f16_vn without the walk's power-of-two operand scale: fp16's own range (6e-5 .. 65504)

The kernel's scale makes fp16 rounding relative at any magnitude, so the f16 forms round to 11 significant bits with
an unbounded exponent; f16_vn_raw shows what the scale is for (`--v-scale 1e-5`).

    python scripts/walk_precision_study.py --chunks 200 --gates mixed --segments
    python scripts/walk_precision_study.py --chunks 24 --v-scale 1e-5 --modes f16_vn f16_vn_raw

It models the walk only (the prep is exact here), so its errors are smaller than the end-to-end errors the tests and
the benchmark measure; what it answers is how each form's share grows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kda_kcp.chunk import _masks, _prep_slab  # noqa: E402

C, D = 64, 128
MODES = ("bf16_pairs", "bf16_hi", "f16", "f16_vn", "f16_s_vn", "f16_vn_raw")


def bf(x):
    return x.bfloat16().double()


def bf_pair(x):
    hi = bf(x)
    return hi + bf(x - hi)


def f32(x):
    return x.float().double()


def f16(x):
    """x to 11 significant bits, round to nearest even, any exponent (the scaled walk's fp16 operands)."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 2048.0) / 2048.0, e)


def f16_raw(x):
    return x.half().double()


def f16_pair(x):
    hi = f16(x)
    return hi + f16(x - hi)


def inputs(n_chunks: int, seed: int, gates: str, v_scale: float):
    """One document of n_chunks * 64 tokens, H = 1: bf16 q, k (L2-normalised), v, beta; g as the benchmark draws it
    (`bench`: logsigmoid(2 + 1.5 z) clipped below 0) or as the GPU tests' mixed gates (`mixed`: a quarter of the
    channels slow). Returns the FP64 prep (W, A diag(beta), V, Aqk, s Qg, Kg, gamma) of every chunk."""
    gen = torch.Generator().manual_seed(seed)
    T = n_chunks * C
    q, k = (F.normalize(torch.randn(T, D, generator=gen), dim=-1).bfloat16().double() for _ in range(2))
    v = (torch.randn(T, D, generator=gen).double() * v_scale).bfloat16().double()
    if gates == "bench":
        g = F.logsigmoid(2 + 1.5 * torch.randn(T, D, generator=gen)).clamp(-5, -1e-6).double()
    else:
        g = -5 * torch.sigmoid(torch.randn(T, D, generator=gen) * 2 - 1)
        slow = torch.rand(1, D, generator=gen) < 0.25
        g = torch.where(slow, -0.02 * torch.rand(T, D, generator=gen), g).clamp(-5, -1e-6).double()
    beta = (0.05 + 0.9 * torch.rand(T, generator=gen)).bfloat16().double()
    incl, strict = (m.double() for m in _masks(C, "cpu"))
    ch = [x.reshape(n_chunks, C, *x.shape[1:]) for x in (q, k, v, g, beta)]
    _, _, _, A, _, W, _, Aqk, Qg, Kg, gamma = _prep_slab(*ch, D**-0.5, incl, strict)
    return W, A * beta.reshape(n_chunks, C)[..., None, :], ch[2], Aqk, Qg * D**-0.5, Kg, gamma


def step(prep, j: int, S, mode: str | None, with_u: bool = True):
    """One chunk of the walk: (o of the chunk, the state leaving it); mode None: unrounded FP64."""
    W, Ab, V, Aqk, Qg, Kg, gam = prep
    if mode is None:
        U = Ab[j] @ V[j] if with_u else 0
        Vn = U - W[j] @ S
        return Qg[j] @ S + Aqk[j] @ Vn, gam[j][:, None] * S + Kg[j].T @ Vn
    if mode.startswith("bf16"):
        U = f32(bf_pair(Ab[j]) @ V[j]) if with_u else 0
        s_op = bf(S) if mode == "bf16_hi" else bf_pair(S)
        Vn = f32(U - bf(W[j]) @ s_op)
        o = f32(bf(Qg[j]) @ s_op + bf_pair(Aqk[j]) @ bf_pair(Vn))
        v_op = bf(Vn) if mode == "bf16_hi" else bf_pair(Vn)
        return o, f32(f32(gam[j])[:, None] * S + bf(Kg[j]).T @ v_op)
    r = f16_raw if mode == "f16_vn_raw" else f16
    pair = (lambda x: r(x) + r(x - r(x)))
    U = f32(r(Ab[j]) @ r(V[j])) if with_u else 0
    Vn = f32(U - r(W[j]) @ (pair(S) if mode == "f16_s_vn" else r(S)))
    o = f32(r(Qg[j]) @ r(S) + r(Aqk[j]) @ r(Vn))
    v_op = r(Vn) if mode == "f16" else pair(Vn)
    return o, f32(f32(gam[j])[:, None] * S + r(Kg[j]).T @ v_op)


def rel(a, b) -> float:
    return (((a - b) ** 2).mean() / (b**2).mean()).sqrt().item()


def walk(prep, mode, S0=None):
    S = torch.zeros(D, D, dtype=torch.float64) if S0 is None else S0.clone()
    out = []
    for j in range(prep[0].shape[0]):
        o, S = step(prep, j, S, mode)
        out.append(o)
    return torch.cat(out)


def one_chunk_segments(prep, mode, S0):
    """Every chunk its own segment: its summary (M from the identity without U, E from zero), the fold in FP64,
    then the chunk walked again from its incoming state."""
    S_in, out = S0.clone(), []
    eye, zero = torch.eye(D, dtype=torch.float64), torch.zeros(D, D, dtype=torch.float64)
    for j in range(prep[0].shape[0]):
        o, _ = step(prep, j, f32(S_in), mode)
        out.append(o)
        _, M = step(prep, j, eye, mode, with_u=False)
        _, E = step(prep, j, zero, mode)
        S_in = f32(M) @ S_in + f32(E)
    return torch.cat(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=200, help="chunks of 64 tokens in the document")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gates", choices=("bench", "mixed"), default="mixed")
    ap.add_argument("--v-scale", type=float, default=1.0, help="v (and the initial state) times this")
    ap.add_argument("--segments", action="store_true", help="also 1-chunk segments against the whole walk")
    ap.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    args = ap.parse_args()
    prep = inputs(args.chunks, args.seed, args.gates, args.v_scale)
    S0 = 0.3 * args.v_scale * torch.randn(D, D, generator=torch.Generator().manual_seed(args.seed + 1)).double()
    ref = walk(prep, None, S0)
    for mode in args.modes:
        o = walk(prep, mode, S0)
        line = f"{args.chunks} chunks, {mode:10s}: o rel-RMS vs FP64 {rel(o, ref):.3e}"
        if args.segments:
            line += f", 1-chunk segments vs the whole walk {rel(one_chunk_segments(prep, mode, S0), o):.3e}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
