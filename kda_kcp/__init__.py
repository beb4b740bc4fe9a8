"""kda_kcp: chunked KDA (Kimi Delta Attention) training with context parallelism (KCP).

The facade routes on ``deterministic`` to the sibling packages ``kda_kcp.det`` (bitwise repeatable) and
``kda_kcp.nondet`` (may use atomics). ``deterministic=False`` while
``torch.use_deterministic_algorithms(True)`` is on runs the deterministic package and warns once.
"""

from __future__ import annotations

import warnings

import torch

from . import det, nondet
from . import nn
from .agreement import agree_failure
from .context import KcpContext, build_context_kcp
from .fla import chunk_kda
from .partition import LAYOUTS, partition_kcp
from .status import check_status
from .steps import KdaSaved
from .validate import check_flag
from .workspace import WorkspaceKcp

__version__ = "0.1.0"

__all__ = [
    "LAYOUTS",
    "KcpContext",
    "WorkspaceKcp",
    "build_context_kcp",
    "partition_kcp",
    "chunk_kda_kcp",
    "chunk_kda_fwd_kcp",
    "chunk_kda_bwd_kcp",
    "kda_workspace_bytes_kcp",
    "kda_saved_bytes_kcp",
    "kda_comm_bytes_kcp",
    "chunk_kda",
    "nn",
    "check_status",
]

_warned_forced_det = False


def _package(deterministic, stacklevel=3):
    """det or nondet for this flag (nondet is overridden by torch's deterministic mode, with one warning from the first
    eager call, attributed ``stacklevel`` frames up: the caller's line)."""
    global _warned_forced_det
    if not check_flag("deterministic", deterministic):
        if not torch.are_deterministic_algorithms_enabled():
            return nondet
        # (not while torch.compile traces the call: dynamo cannot trace warnings.warn, and setting the flag would
        # mutate this module inside the trace, which it refuses under torch.utils.checkpoint)
        if not _warned_forced_det and not torch.compiler.is_compiling():
            _warned_forced_det = True
            warnings.warn(
                "kda_kcp: deterministic=False while torch.use_deterministic_algorithms(True) is on; "
                "running the deterministic package kda_kcp.det",
                UserWarning,
                stacklevel=stacklevel,
            )
    return det


def _call_package(deterministic, ctx, kind):
    """``_package`` of a call on ``ctx``: a bad flag on one rank raises on every rank (kda_kcp.agreement)."""
    try:
        return _package(deterministic, stacklevel=4)
    except (TypeError, ValueError) as exc:  # agreed with the other ranks, which wait in the call's agreement
        agree_failure(ctx, kind, exc)


def chunk_kda_kcp(q, k, v, g, beta, ctx, scale=None, deterministic=True, workspace=None, validate=None,
                  initial_state=None, output_final_state=False):
    """KDA over this rank's shard of a packed batch; differentiable (works under torch.utils.checkpoint).

    q, k [T, H, K] and v [T, H, V] (BF16 on the CUDA backend), g [T, H, K] FP32 log decay in [-5, 0),
    beta [T, H] in (0, 1), ctx from build_context_kcp, scale default K^-1/2. Returns o [T, H, V].

    ``initial_state`` [N, H, K, V] FP32 (N = ctx.num_docs; FP64 too on the torch backend with FP64 inputs): each
    document's starting state, the same tensor on every rank; it enters on the rank where its document starts.
    ``output_final_state=True`` returns (o, final_state [N, H, K, V]): each rank's rows are the final states of the
    documents that end on it, zeros elsewhere. Likewise the gradient of ``initial_state`` on each rank holds the
    rows of the documents that start there (sum over the ranks for the whole gradient). Documents without tokens
    belong to rank 0.
    """
    pkg = _call_package(deterministic, ctx, "forward")
    return pkg.chunk_kda_kcp(q, k, v, g, beta, ctx, scale, pkg.DETERMINISTIC, workspace, validate, initial_state,
                             output_final_state)


def chunk_kda_fwd_kcp(q, k, v, g, beta, ctx, scale=None, deterministic=True, workspace=None, validate=None,
                      initial_state=None, output_final_state=False):
    """Forward only: returns (o, saved), or (o, final_state, saved) with output_final_state=True; pass saved to
    chunk_kda_bwd_kcp."""
    pkg = _call_package(deterministic, ctx, "forward")
    return pkg.chunk_kda_fwd_kcp(q, k, v, g, beta, ctx, scale, pkg.DETERMINISTIC, workspace, validate, initial_state,
                                 output_final_state)


def chunk_kda_bwd_kcp(do, saved, ctx, deterministic=True, workspace=None, dht=None):
    """Backward of chunk_kda_fwd_kcp: returns (dq, dk, dv, dg, dbeta) in the input dtypes, then dh0 when the
    forward took an initial_state. ``dht``: the gradient of the forward's final state (None: zero)."""
    pkg = _call_package(deterministic, saved.ctx if isinstance(saved, KdaSaved) else ctx, "backward")
    return pkg.chunk_kda_bwd_kcp(do, saved, ctx, pkg.DETERMINISTIC, workspace, dht)


def kda_workspace_bytes_kcp(ctx, num_heads, deterministic=True, local_arena="replay", lean_passes=None, **kw):
    """Bytes of workspace a call of this context needs (size a WorkspaceKcp with the same arguments)."""
    pkg = _package(deterministic)
    return pkg.kda_workspace_bytes_kcp(ctx, num_heads, pkg.DETERMINISTIC, local_arena, lean_passes, **kw)


def kda_saved_bytes_kcp(ctx, num_heads, deterministic=True, **kw):
    """Bytes the forward keeps for the backward beyond references to the inputs."""
    pkg = _package(deterministic)
    return pkg.kda_saved_bytes_kcp(ctx, num_heads, pkg.DETERMINISTIC, **kw)


def kda_comm_bytes_kcp(ctx, num_heads, deterministic=True, **kw):
    """Bytes this rank sends plus receives over the group in one forward + backward step."""
    pkg = _package(deterministic)
    return pkg.kda_comm_bytes_kcp(ctx, num_heads, pkg.DETERMINISTIC, **kw)
