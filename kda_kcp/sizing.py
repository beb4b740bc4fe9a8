"""The bytes of one call's workspace: the exchange scratch, then the arena its backend carves (when it uses one).

The arena's size is not computed beside the carves: the calls' own steps (kda_kcp.steps) run on meta inputs with an
arena that only counts (``Arena.count_only``), so the size and the carves cannot disagree. kda_kcp.workspace answers
the public byte queries from here, and kda_kcp.function checks a call's workspace against ``workspace_bytes``.
"""

from __future__ import annotations

import torch

from .arena import Arena, aligned
from .exchange import summary_elements
from .steps import ForwardCall, run_backward

__all__ = ["element_bytes", "exchange_elements", "workspace_bytes", "local_arena_bytes", "arena_parts"]


def element_bytes(dtype) -> int:
    """Bytes of one summary element (FP32 or FP64: the torch backend's FP64 tests)."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    return dtype.itemsize


def exchange_elements(ctx, num_heads: int, head_dim: int, value_dim: int | None = None) -> int:
    """Elements of the exchange scratch: (1 + W) rows-of-slots for the larger of the two exchanges."""
    slots = max(ctx.plan.fwd_slots, ctx.plan.bwd_slots)
    return (1 + ctx.world_size) * slots * summary_elements(num_heads, head_dim, value_dim or head_dim)


def workspace_bytes(ctx, num_heads: int, backend, device, head_dim: int = 128, value_dim: int | None = None,
                    dtype=torch.float32, lean_passes: int | None = None) -> int:
    """Bytes of one call's workspace on ``backend``: the exchange scratch, then the arena (``Backend.uses_arena``;
    ``lean_passes``: the lean backward's pass count, None for the replay arena)."""
    ex = exchange_elements(ctx, num_heads, head_dim, value_dim) * element_bytes(dtype)
    arena = local_arena_bytes(ctx, num_heads, backend, device, head_dim, value_dim, lean_passes)
    return aligned(ex) + arena if arena else ex


def local_arena_bytes(ctx, num_heads: int, backend, device, head_dim: int = 128, value_dim: int | None = None,
                      passes: int | None = None) -> int:
    """Arena bytes of the larger of a forward and a backward call of this context on ``backend``
    (``passes``: the lean backward's pass count, None for the replay arena)."""
    return max(arena_parts(ctx, num_heads, backend, device, head_dim, value_dim, passes))


def arena_parts(ctx, num_heads: int, backend, device, head_dim: int = 128, value_dim: int | None = None,
                passes: int | None = None) -> tuple[int, int]:
    """(forward, backward) arena bytes of one call of this context on ``backend`` on ``device``: the peak of its
    carves. The calls' own steps run on meta inputs with an arena that only counts (``Arena.count_only``): the
    carves happen as in a call, nothing is launched or exchanged. The forward runs with and without its early output
    pass (a checkpoint's recomputation has none), so the size fits either."""
    if not backend.uses_arena:
        return 0, 0
    H, K, V = num_heads, head_dim, value_dim or head_dim
    backend.check_head_dims(K, V)
    T, meta = ctx.local_tokens, torch.device("meta")
    q, k, v, do = (torch.empty(T, H, n, dtype=torch.bfloat16, device=meta) for n in (K, K, V, V))
    g = torch.empty(T, H, K, dtype=torch.float32, device=meta)
    beta = torch.empty(T, H, dtype=torch.bfloat16, device=meta)
    dt = backend.summary_dtype(q, k, v, g, beta)
    fwd, saved = 0, None
    for walk_early in (True, False) if ctx.plan.needs_exchange else (False,):
        arena = Arena.count_only(device)
        # (the mode flag only travels in KdaSaved to the caller's backward: no step reads it)
        call = ForwardCall(backend, q, k, v, g, beta, ctx, K**-0.5, True, dt, None, arena, None, walk_early)
        call.finish()
        fwd, saved = max(fwd, arena.peak), call.saved
    arena = Arena.count_only(device)
    run_backward(backend, do, saved, ctx, dt, None, arena, passes, None)
    return fwd, arena.peak
