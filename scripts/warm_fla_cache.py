#!/usr/bin/env python
"""Compile FLA 0.6.0's chunk_kda Triton kernels (forward and backward) into Triton's on-disk cache before
the benchmark needs them, on small inputs of the benchmark's shapes.

Triton specializes a kernel on its integer arguments (divisible by 16 or not), so every head count is
warmed at a token count divisible by 16 (the W = 1 batch, T = 261392) and one that is not (a rank's shard at
W = 2, T = 130696). Run one process per head count in the background while other work uses the GPU:

    python scripts/warm_fla_cache.py --heads 16 --device 1 &

``--cp`` warms FLA's context-parallel path instead (``build_cp_context`` + ``chunk_kda(cp_context=...)``,
both layouts FLA has): ``--world`` processes (2 by default) joined by NCCL, one per GPU, as the benchmark's
fla_cp arm runs it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kda_kcp from this checkout (shards for --cp)


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


def warm_cp(rank: int, world: int, port: int, heads: list[int], tokens: list[int]) -> None:
    """One rank of FLA's CP path on a small packed batch of the benchmark's shape (4 documents)."""
    import os

    import torch.distributed as dist
    from fla.ops.cp import build_cp_context
    from fla.ops.kda import chunk_kda

    import kda_kcp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    group = dist.group.WORLD
    try:
        for H in heads:
            for T in tokens:  # the global T; each rank holds T / world tokens
                for layout in ("contiguous", "zigzag"):
                    t0 = time.perf_counter()
                    lengths = [T // 4, T // 4, T // 2, T - T // 4 - T // 4 - T // 2]
                    cu = [0]
                    for n in lengths:
                        cu.append(cu[-1] + n)
                    cu_cpu = torch.tensor(cu, dtype=torch.int64)
                    ctx = kda_kcp.build_context_kcp(cu_cpu.to(device), group, layout)
                    cp = build_cp_context(cu_cpu.to(device), group=group, cu_seqlens_cpu=cu_cpu, layout=layout)
                    gen = torch.Generator(device=device).manual_seed(H)

                    def rnd(*shape):
                        return ctx.shard(torch.randn(*shape, generator=gen, device=device))

                    x = [F.normalize(rnd(T, H, 128), dim=-1).bfloat16(), F.normalize(rnd(T, H, 128), dim=-1).bfloat16(),
                         rnd(T, H, 128).bfloat16(), F.logsigmoid(2 + 1.5 * rnd(T, H, 128)).clamp_min(-5),
                         torch.sigmoid(rnd(T, H)).bfloat16()]
                    x = [t.contiguous().requires_grad_() for t in x]
                    o, _ = chunk_kda(q=x[0][None], k=x[1][None], v=x[2][None], g=x[3][None], beta=x[4][None],
                                     scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, safe_gate=True,
                                     cp_context=cp)
                    torch.autograd.grad(o, x, torch.randn_like(o))
                    torch.cuda.synchronize(device)
                    if rank == 0:
                        print(f"warm_fla_cache: cp H={H} T={T} {layout} {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", type=int, default=[4, 16, 64])
    p.add_argument("--tokens", nargs="+", type=int, default=[8192, 8200], help="one divisible by 16, one not")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--cp", action="store_true", help="warm FLA's context-parallel path on --world GPUs (NCCL)")
    p.add_argument("--port", type=int, default=29731, help="rendezvous port of the --cp process group")
    p.add_argument("--world", type=int, default=2, help="ranks of the --cp run (one GPU each)")
    args = p.parse_args()
    if args.cp:
        import torch.multiprocessing as mp

        # global T: W times the W = 1 sizes, so each rank's shard has the token counts above
        w = args.world
        mp.spawn(warm_cp, args=(w, args.port, args.heads, [w * t for t in args.tokens]), nprocs=w, join=True)
        return
    device = torch.device("cuda", args.device)
    for H in args.heads:
        for T in args.tokens:
            t0 = time.perf_counter()
            warm(H, T, device)
            print(f"warm_fla_cache: H={H} T={T} {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
