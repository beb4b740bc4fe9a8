#!/usr/bin/env python
"""Compile FLA 0.6.0's chunk_kda Triton kernels (forward and backward) into Triton's on-disk cache before
the benchmark needs them, on small inputs of the benchmark's shapes.

Triton specializes a kernel on its integer arguments (divisible by 16 or not), so every head count is
warmed at a token count divisible by 16 (the W = 1 batch, T = 261392) and one that is not (a rank's shard at
W = 2, T = 130696). Run one process per head count in the background while other work uses the GPU:

    python scripts/warm_fla_cache.py --heads 16 --device 1 &
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def warm(H: int, T: int, device: torch.device) -> None:
    from fla.ops.kda import chunk_kda

    lengths = [T // 4, T // 4, T // 2, T - T // 4 - T // 4 - T // 2]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    q = F.normalize(torch.randn(1, T, H, 128, device=device), dim=-1).bfloat16().requires_grad_()
    k = F.normalize(torch.randn(1, T, H, 128, device=device), dim=-1).bfloat16().requires_grad_()
    v = torch.randn(1, T, H, 128, device=device).bfloat16().requires_grad_()
    g = F.logsigmoid(2 + 1.5 * torch.randn(1, T, H, 128, device=device)).clamp_min(-5).requires_grad_()
    beta = torch.sigmoid(torch.randn(1, T, H, device=device)).bfloat16().requires_grad_()
    o, _ = chunk_kda(q=q, k=k, v=v, g=g, beta=beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, safe_gate=True,
                     cu_seqlens=cu.to(device).long(), cu_seqlens_cpu=cu.long())
    torch.autograd.grad(o, (q, k, v, g, beta), torch.randn_like(o))
    torch.cuda.synchronize(device)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", type=int, default=[4, 16, 64])
    p.add_argument("--tokens", nargs="+", type=int, default=[8192, 8200], help="one divisible by 16, one not")
    p.add_argument("--device", type=int, default=0)
    args = p.parse_args()
    device = torch.device("cuda", args.device)
    for H in args.heads:
        for T in args.tokens:
            t0 = time.perf_counter()
            warm(H, T, device)
            print(f"warm_fla_cache: H={H} T={T} {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
