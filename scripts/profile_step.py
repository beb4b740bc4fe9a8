#!/usr/bin/env python
"""One CUDA forward + backward of kda_kcp on the benchmark batch (W = 1), for a profiler or a checker to
watch:

    ncu --clock-control none -k regex:"prep_kernel|walk_kernel|grads_kernel|fold_kernel|merge_kernel" \
        python scripts/profile_step.py --heads 16 [--gates strong]
    compute-sanitizer --tool memcheck python scripts/profile_step.py --heads 2 --docs 1 65 700 300
    compute-sanitizer --tool memcheck python scripts/profile_step.py --heads 1 --docs 128x70000  # 140,000 chunks
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kda_kcp  # noqa: E402

DOCS = (42024, 57573, 73122, 88673)


def offsets(docs) -> list[int]:
    """cu_seqlens of documents of these lengths, packed."""
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    return cu


def step_inputs(docs, H, dev, gates="bench"):
    """Offsets cu and q, k, v, g, beta of a packed batch of ``docs`` (the benchmark's distributions; ``gates``
    names the benchmark's gate law, as its --gates does: ``bench`` logsigmoid(2 + 1.5 z) clipped at -5, ``strong``
    uniform in (-5, 0])."""
    cu = offsets(docs)
    T = cu[-1]
    q = F.normalize(torch.randn(T, H, 128, device=dev), dim=-1).bfloat16()
    k = F.normalize(torch.randn(T, H, 128, device=dev), dim=-1).bfloat16()
    v = torch.randn(T, H, 128, device=dev).bfloat16()
    if gates == "strong":
        g = torch.rand(T, H, 128, device=dev).mul_(-5.0)
    else:
        g = F.logsigmoid(2 + 1.5 * torch.randn(T, H, 128, device=dev)).clamp_min(-5)
    beta = torch.sigmoid(torch.randn(T, H, device=dev)).bfloat16()
    return cu, q, k, v, g, beta


def run_step(docs, H, deterministic=True, gates="bench"):
    """One forward + backward on the GPU: (o, dq, dk, dv, dg, dbeta)."""
    dev = torch.device("cuda")
    cu, *inputs = step_inputs(docs, H, dev, gates)
    q, k, v, g, beta = (x.requires_grad_() for x in inputs)
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=dev))
    o = kda_kcp.chunk_kda_kcp(q, k, v, g, beta, ctx, deterministic=deterministic)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v, g, beta), torch.randn_like(o)))


def doc_lengths(items) -> list[int]:
    """Document lengths from ``--docs`` items: N, or NxM for M documents of N tokens (70,000 documents fit a
    command line only that way)."""
    out = []
    for item in items:
        n, _, m = item.partition("x")
        if not n.isdigit() or (m and not m.isdigit()):
            raise SystemExit(f"profile_step: --docs item {item!r} is neither N nor NxM")
        out += [int(n)] * (int(m) if m else 1)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--deterministic", type=int, default=1)
    p.add_argument("--docs", nargs="+", default=[str(n) for n in DOCS],
                   help="document lengths: N, or NxM for M documents of N tokens (e.g. 65x32768)")
    p.add_argument("--gates", choices=("bench", "strong"), default="bench",
                   help="gate law, as the benchmark's --gates: bench (logsigmoid(2 + 1.5 z)) or strong (uniform "
                        "in (-5, 0])")
    args = p.parse_args()
    args.docs = doc_lengths(args.docs)
    run_step(args.docs, args.heads, bool(args.deterministic), args.gates)
    torch.cuda.synchronize()
    print(f"profile_step: H={args.heads} T={sum(args.docs)} done")


if __name__ == "__main__":
    main()
