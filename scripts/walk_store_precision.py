#!/usr/bin/env python
"""What the storage format of the walks' outputs does to the chunk gradients (NOTES.md, session 36).

The CUDA backward's walks store V_new, dV_new and dS (dh) for the gradient kernel. This walks the KDA chunks in FP64
(kda_kcp.chunk, kda_kcp.walk), rounds only those stored operands (and S to bf16 hi, as h holds it), and prints the
relative RMS of each gradient's change against the unrounded FP64 chunk gradients, plus the worst elementwise
relative change over the elements above 1e-3 of their tensor's largest:

    hilo   V_new, dV_new, dS as bf16 hi + lo (before session 36)
    vn16   V_new, dV_new as fp16 at a power of two per 16 value columns x 64 tokens; dS hi + lo
    ds16   dS as fp16 at a power of two per 16 value columns x 128 keys; V_new, dV_new hi + lo
    fp16   all three as fp16 (session 36's formats, kda_bwd.h)
    hi     all three as bf16 hi only

for the benchmark's gates and for keys pinned at the gate floor (-5, and -20: a span of 4e-12 inside one scaled
group of dS). CPU only, a few seconds:  python scripts/walk_store_precision.py
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kda_kcp.chunk import _grads_slab, _masks, chunk_prep  # noqa: E402
from kda_kcp.walk import Steps, reverse_walk, state_walk  # noqa: E402

DT = torch.float64
NAMES = ("dq", "dk", "dv", "dg", "dbeta")


def bf16(x):
    return x.to(torch.bfloat16).to(DT)


def hilo(x):
    h = bf16(x)
    return h + bf16(x - h)


def fp16(x, group=16):
    """x [.., rows, cols] as fp16 at a power of two per 16 columns (over all rows): max |x| 2^-e in [2^14, 2^15)."""
    xg = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    m = xg.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(1e-300)
    s = torch.exp2(14 - torch.floor(torch.log2(m)))
    return ((xg * s).to(torch.float16).to(DT) / s).reshape(x.shape)


# mode -> (V_new and dV_new, dS): how each is stored; S is bf16 hi in every mode (h)
MODES = {"hilo": (hilo, hilo), "vn16": (fp16, hilo), "ds16": (hilo, fp16), "fp16": (fp16, fp16), "hi": (bf16, bf16)}


def grads(inputs, S, dSn, scale, mode=None):
    incl, strict = _masks(64, S.device)
    stored = None
    if mode is not None:
        fv, fs = MODES[mode]
        stored = lambda vn, dvn, s, ds: (fv(vn), fv(dvn), bf16(s), fs(ds))  # noqa: E731
    return dict(zip(NAMES, _grads_slab(*inputs, S, dSn, scale, incl, strict, stored=stored)))


def run(label, gmin, hard_keys=0, T=2048, H=2, D=128):
    bf = lambda x: x.to(torch.bfloat16).to(DT)  # noqa: E731  (BF16 inputs, as the benchmark's)
    q = bf(F.normalize(torch.randn(T, H, D), dim=-1))
    k = bf(F.normalize(torch.randn(T, H, D), dim=-1))
    v = bf(torch.randn(T, H, D))
    g = F.logsigmoid(torch.randn(T, H, D) * 1.5 + 2.0).clamp(min=gmin).to(DT)
    g[:, :, :hard_keys] = gmin  # keys with the strongest decay on every token
    beta = bf(torch.sigmoid(torch.randn(T, H)).clamp(0.05, 0.95))
    do = bf(torch.randn(T, H, D))
    C, scale = 64, D ** -0.5
    N = T // C
    chunked = lambda x: x.reshape(N, C, H, -1).transpose(1, 2).contiguous()  # noqa: E731
    qc, kc, vc, gc, doc = map(chunked, (q, k, v, g, do))
    bc = beta.reshape(N, C, H).transpose(1, 2).contiguous()
    prep = chunk_prep(qc, kc, vc, gc, bc, scale)
    steps = Steps.from_counts([N], q.device)
    h, _, _ = state_walk(prep, steps)
    dh, _, _ = reverse_walk(prep, doc, steps, scale)
    inputs = (qc, kc, vc, gc, bc, doc)
    ref = grads(inputs, h, dh, scale)
    span = (dh.abs().amax(-1).clamp_min(1e-300) / dh.abs().amax((-2, -1)).unsqueeze(-1)).min().item()
    print(f"== {label}: T = {T}, H = {H}, g >= {gmin}, {hard_keys} keys at the floor; smallest key max / chunk-head "
          f"max of dS: {span:.1e}")
    for mode in MODES:
        out = grads(inputs, h, dh, scale, mode)
        row = []
        for n in NAMES:
            r, o = ref[n], out[n]
            rms = ((o - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt()).item()
            # elementwise: worst relative error over elements above 1e-3 of the max
            m = r.abs() > 1e-3 * r.abs().max()
            worst = ((o - r).abs()[m] / r.abs()[m]).max().item()
            row.append(f"{n} {rms:.2e} ({worst:.1e})")
        print(f"  {mode:5s} " + "  ".join(row))

if __name__ == "__main__":
    torch.manual_seed(0)
    run("benchmark gates", -5.0)
    run("benchmark gates, 8 keys at -5", -5.0, hard_keys=8)
    run("gates to -20, 8 keys at -20", -20.0, hard_keys=8)
