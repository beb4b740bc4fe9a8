"""One KCP call, forward and backward, and the ``torch.autograd.Function`` around it.

Forward (DESIGN.md section 2): summaries of the runs whose document continues later -> one all-gather
-> affine merge into each run's incoming state -> fwd_output. Backward mirrors it with (M^T, F) of the
runs whose document started earlier, folded from the document end into each run's outgoing state
gradient, then the local gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import select_backend
from .exchange import gather_summaries, summary_elements
from .torch_backend import compute_dtype
from .validate import check_grad_output, check_inputs, check_scale, check_values, values_requested
from .walk import affine_merge
from .workspace import WorkspaceKcp

__all__ = ["KdaSaved", "forward_kcp", "backward_kcp", "KdaKcpFunction"]


@dataclass
class KdaSaved:
    """What the forward hands the backward: the inputs (by reference) and each run's incoming state."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state_in: torch.Tensor | None  # [R, H, K, V], None when no document crosses a piece
    scale: float
    deterministic: bool

    def tensors(self):
        return (self.q, self.k, self.v, self.g, self.beta, self.state_in)


def _summary_dtype(backend, *xs) -> torch.dtype:
    return torch.float32 if backend.name == "cuda" else compute_dtype(*xs)


def _exchange_buffer(workspace, ctx, H, K, V, dtype, device):
    if workspace is None:
        return None
    slots = max(ctx.plan.fwd_slots, ctx.plan.bwd_slots)
    numel = (1 + ctx.world_size) * slots * summary_elements(H, K, V)
    return workspace.take(numel, dtype, device, "the KCP exchange")


def _prepare(q, k, v, g, beta, ctx, scale, deterministic, workspace, validate):
    backend = select_backend(q.device if isinstance(q, torch.Tensor) else torch.device("cpu"), deterministic)
    check_inputs(q, k, v, g, beta, ctx, backend.name)
    scale = check_scale(scale, q.shape[-1])
    if workspace is not None and not isinstance(workspace, WorkspaceKcp):
        raise TypeError(f"workspace must be a WorkspaceKcp or None, got {type(workspace).__name__}")
    if values_requested(validate):
        check_values(g, beta, q, k, v)
    return backend, scale


def _exchange_and_merge(ctx, summarize, publish, slots, sources, q, v, dt, workspace):
    """This rank's summaries of the runs it publishes -> one all-gather -> the fixed-order fold into
    every local run: incoming states (forward) or outgoing state gradients (backward), [R, H, K, V]."""
    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    ids = publish[ctx.rank]
    if ids:
        maps, offsets = summarize(ids)
    else:
        maps, offsets = q.new_zeros(0, H, K, K, dtype=dt), q.new_zeros(0, H, K, V, dtype=dt)
    buf = _exchange_buffer(workspace, ctx, H, K, V, dt, q.device)
    maps, offsets = gather_summaries(maps.to(dt), offsets.to(dt), slots, ctx.world_size, ctx.group, buf)
    return affine_merge(maps, offsets, sources[ctx.rank], q.new_empty(ctx.local.num_runs, H, K, V, dtype=dt))


def forward_kcp(q, k, v, g, beta, ctx, scale, deterministic, workspace=None, validate=None):
    """Returns (o, KdaSaved). Inputs are read, never written."""
    backend, scale = _prepare(q, k, v, g, beta, ctx, scale, deterministic, workspace, validate)
    plan, local = ctx.plan, ctx.local
    state_in = None
    if plan.needs_exchange:
        state_in = _exchange_and_merge(
            ctx, lambda ids: backend.fwd_summaries(q, k, v, g, beta, scale, local, ids),
            plan.fwd_publish, plan.fwd_slots, plan.fwd_sources, q, v, _summary_dtype(backend, q, k, v, g, beta), workspace,
        )
    o = backend.fwd_output(q, k, v, g, beta, scale, local, state_in)
    return o, KdaSaved(q, k, v, g, beta, state_in, scale, deterministic)


def backward_kcp(do, saved: KdaSaved, ctx, workspace=None):
    """Returns (dq, dk, dv, dg, dbeta) in the input dtypes."""
    q, k, v, g, beta = saved.q, saved.k, saved.v, saved.g, saved.beta
    backend = select_backend(q.device, saved.deterministic)
    check_grad_output(do, q, v)
    if workspace is not None and not isinstance(workspace, WorkspaceKcp):
        raise TypeError(f"workspace must be a WorkspaceKcp or None, got {type(workspace).__name__}")
    if backend.name == "cuda":
        do = do.to(torch.bfloat16)  # the kernels read the output's dtype
    do = do.contiguous()
    plan, local = ctx.plan, ctx.local
    dstate_out = None
    if plan.needs_exchange:
        dstate_out = _exchange_and_merge(
            ctx, lambda ids: backend.bwd_summaries(q, k, v, g, beta, do, saved.scale, local, ids),
            plan.bwd_publish, plan.bwd_slots, plan.bwd_sources, q, v, _summary_dtype(backend, q, k, v, g, beta), workspace,
        )
    grads = backend.bwd_grads(q, k, v, g, beta, do, saved.scale, local, saved.state_in, dstate_out)
    return tuple(gr.to(x.dtype) for gr, x in zip(grads, (q, k, v, g, beta)))


class KdaKcpFunction(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, g, beta, ctx, scale, deterministic, workspace, validate):
        o, saved = forward_kcp(q, k, v, g, beta, ctx, scale, deterministic, workspace, validate)
        extra = () if saved.state_in is None else (saved.state_in,)
        fctx.save_for_backward(q, k, v, g, beta, *extra)
        fctx.kcp = (ctx, saved.scale, deterministic, workspace)
        return o

    @staticmethod
    def backward(fctx, do):
        ctx, scale, deterministic, workspace = fctx.kcp
        q, k, v, g, beta, *extra = fctx.saved_tensors
        saved = KdaSaved(q, k, v, g, beta, extra[0] if extra else None, scale, deterministic)
        grads = backward_kcp(do, saved, ctx, workspace)
        return (*grads, None, None, None, None, None)
