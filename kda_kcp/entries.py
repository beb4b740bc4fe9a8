"""The entry points of one mode package (``kda_kcp.det`` or ``kda_kcp.nondet``).

Both packages share the core (plan, exchanges, torch backend, build); what differs is the backend's
kernels that reduce in parallel, chosen by the ``deterministic`` flag handed to ``select_backend``.
A package's own entries take the same ``deterministic`` keyword as the facade and raise ValueError
for the other mode's value.
"""

from __future__ import annotations

import torch
from torch.compiler import is_compiling  # bound once: the check runs on every eager call

from . import workspace as _ws
from .agreement import agree_failure
from .function import backward_kcp, chunk_kda_autograd, forward_kcp
from .library import chunk_kda_op
from .steps import KdaSaved
from .validate import check_flag

__all__ = ["ENTRY_NAMES", "make_entries"]

ENTRY_NAMES = (
    "chunk_kda_kcp",
    "chunk_kda_fwd_kcp",
    "chunk_kda_bwd_kcp",
    "kda_workspace_bytes_kcp",
    "kda_saved_bytes_kcp",
    "kda_comm_bytes_kcp",
    "WorkspaceKcp",
)


def make_entries(package: str, mode: bool) -> dict:
    def _own(deterministic, ctx=None, kind="forward") -> None:
        """The flag is this package's; in a call on ``ctx`` a failure raises on every rank (kda_kcp.agreement)."""
        try:
            check_flag("deterministic", deterministic)
            if deterministic is not mode:
                other = "kda_kcp.nondet" if mode else "kda_kcp.det"
                raise ValueError(
                    f"{package} runs deterministic={mode} only; got deterministic={deterministic} "
                    f"(use {other}, or the facade kda_kcp, which routes on the flag)"
                )
        except (TypeError, ValueError) as exc:
            agree_failure(ctx, kind, exc)

    def chunk_kda_kcp(q, k, v, g, beta, ctx, scale=None, deterministic=mode, workspace=None, validate=None,
                      initial_state=None, output_final_state=False):
        """Differentiable KDA over this rank's shard: returns o [T, H, V], or (o, final_state) with
        output_final_state=True (see kda_kcp.chunk_kda_kcp)."""
        _own(deterministic, ctx)
        if is_compiling():  # one custom op node in the graph instead of tracing the library
            return chunk_kda_op(q, k, v, g, beta, ctx, scale, mode, workspace, validate, initial_state=initial_state,
                                output_final_state=output_final_state)
        return chunk_kda_autograd(q, k, v, g, beta, ctx, scale, mode, workspace, validate, initial_state,
                                  output_final_state)

    def chunk_kda_fwd_kcp(q, k, v, g, beta, ctx, scale=None, deterministic=mode, workspace=None, validate=None,
                          initial_state=None, output_final_state=False):
        """Forward without autograd: returns (o, saved), or (o, final_state, saved) with output_final_state=True,
        for chunk_kda_bwd_kcp."""
        _own(deterministic, ctx)
        with torch.no_grad():
            return forward_kcp(q, k, v, g, beta, ctx, scale, mode, workspace, validate, initial_state,
                               output_final_state)

    def chunk_kda_bwd_kcp(do, saved, ctx, deterministic=mode, workspace=None, dht=None):
        """Backward of chunk_kda_fwd_kcp: returns (dq, dk, dv, dg, dbeta), and dh0 after them when the forward
        took an initial_state (dht: the final state's gradient, or None)."""
        fwd_ctx = saved.ctx if isinstance(saved, KdaSaved) else ctx  # the one the ranks agree on (backward_kcp)
        _own(deterministic, fwd_ctx, "backward")
        if isinstance(saved, KdaSaved) and saved.deterministic is not mode:  # backward_kcp checks the rest
            agree_failure(fwd_ctx, "backward", ValueError(
                f"saved comes from a deterministic={saved.deterministic} forward; {package} is deterministic={mode}"))
        with torch.no_grad():
            return backward_kcp(do, saved, ctx, workspace, dht)

    def kda_workspace_bytes_kcp(ctx, num_heads, deterministic=mode, local_arena="replay", lean_passes=None, **kw):
        _own(deterministic)
        return _ws.kda_workspace_bytes_kcp(ctx, num_heads, mode, local_arena, lean_passes, **kw)

    def kda_saved_bytes_kcp(ctx, num_heads, deterministic=mode, **kw):
        _own(deterministic)
        return _ws.kda_saved_bytes_kcp(ctx, num_heads, mode, **kw)

    def kda_comm_bytes_kcp(ctx, num_heads, deterministic=mode, **kw):
        _own(deterministic)
        return _ws.kda_comm_bytes_kcp(ctx, num_heads, mode, **kw)

    def WorkspaceKcp(ctx, num_heads, device=None, deterministic=mode, local_arena="replay", lean_passes=None, **kw):
        _own(deterministic)
        return _ws.WorkspaceKcp(ctx, num_heads, device, mode, local_arena, lean_passes, **kw)

    scope = locals()
    entries = {name: scope[name] for name in ENTRY_NAMES}
    for name, fn in entries.items():
        fn.__module__, fn.__qualname__ = package, name
    return entries
