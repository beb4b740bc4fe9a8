#!/usr/bin/env python3
"""How much do the walks' bf16 hi + lo operands buy? A CPU model of the state walk (no GPU).

The CUDA walks carry two operands as bf16 hi + lo (two tensor-core products instead of one): the state S in
V_new = U - W S and in O = s Qg S, and V_new in the rank-16 update S <- Diag(gamma) S + Kg^T V_new. This walks
one long document in FP64 with the record fields rounded as the kernels store them (W, Kg, s Qg bf16; Aqk
hi + lo; U, S and V_new FP32) and rounds the two operands either way, then prints o's relative RMS error
against an unrounded FP64 walk of the same inputs:

    split   S and V_new as hi + lo (what the kernels do)
    hi      V_new as hi only in the rank-16 update
    S_hi    S as hi only in V_new and O
    all_hi  both

    python scripts/walk_precision_study.py --chunks 1386     # the benchmark's longest document

It models the walk only (the prep is exact here, the chunk-local terms too), so its errors are smaller than
the end-to-end errors the tests and the benchmark measure; what it answers is how the walk's share grows.
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
MODES = ("split", "hi", "S_hi", "all_hi")


def bf(x):
    return x.bfloat16().double()


def f32(x):
    return x.float().double()


def hi_lo(x):
    hi = bf(x)
    return hi + bf(x - hi)


def inputs(n_chunks: int, seed: int):
    """One document of n_chunks * 64 tokens, H = 1, drawn as the benchmark draws them (bf16 q, k, v, beta;
    g = logsigmoid(2 + 1.5 z) clipped below 0), then the FP64 prep of every chunk."""
    gen = torch.Generator().manual_seed(seed)
    T = n_chunks * C
    q, k, v = (bf(torch.randn(T, D, generator=gen)) for _ in range(3))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = F.logsigmoid(2 + 1.5 * torch.randn(T, D, generator=gen)).clamp(-5, -1e-6).double()
    beta = bf(torch.sigmoid(torch.randn(T, generator=gen)))
    incl, strict = (m.double() for m in _masks(C, "cpu"))
    chunked = [x.reshape(n_chunks, C, *x.shape[1:]) for x in (q, k, v, g, beta)]
    _, _, _, _, _, W, U, Aqk, Qg, Kg, gamma = _prep_slab(*chunked, D**-0.5, incl, strict)
    return W, U, Aqk, Qg, Kg, gamma


def walk(prep, mode: str | None) -> torch.Tensor:
    """o of every chunk; mode None: unrounded FP64."""
    W, U, Aqk, Qg, Kg, gamma = prep
    s = D**-0.5
    S = torch.zeros(D, D, dtype=torch.float64)
    out = []
    for j in range(W.shape[0]):
        if mode is None:
            Vn = U[j] - W[j] @ S
            out.append(s * Qg[j] @ S + Aqk[j] @ Vn)
            S = gamma[j][:, None] * S + Kg[j].T @ Vn
            continue
        S_op = bf(S) if mode in ("S_hi", "all_hi") else hi_lo(S)
        Vn = f32(f32(U[j]) - bf(W[j]) @ S_op)
        out.append(f32(s * bf(Qg[j]) @ S_op + hi_lo(Aqk[j]) @ hi_lo(Vn)))
        V_op = bf(Vn) if mode in ("hi", "all_hi") else hi_lo(Vn)
        S = f32(f32(gamma[j])[:, None] * S + bf(Kg[j]).T @ V_op)
    return torch.cat(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=400, help="chunks of 64 tokens in the document")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prep = inputs(args.chunks, args.seed)
    ref = walk(prep, None)
    for mode in MODES:
        o = walk(prep, mode)
        err = ((o - ref).pow(2).mean() / ref.pow(2).mean()).sqrt()
        print(f"{args.chunks} chunks, {mode:6s}: o rel-RMS vs FP64 {err:.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
