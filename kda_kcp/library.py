"""The KDA call as ``torch.library`` custom ops: the route of ``chunk_kda_kcp`` and ``chunk_kda`` under torch.compile.

``kda_kcp::fwd`` returns ``(o, state_in, final_state)`` and ``kda_kcp::bwd`` the five gradients and the initial
state's (absent ones as empty tensors); their fake functions give dynamo the shapes, and ``fwd``'s registered
autograd calls ``bwd``. The op boundary keeps dynamo out of the
library's Python (plans, caches, exchanges): a compiled model holds the two ops as nodes of one graph.

A ``KcpContext`` or ``WorkspaceKcp`` is not a tensor, so the ops take its handle instead: a one-element int64 CPU
tensor made with the object (``_graph_handle``). Being a tensor, the handle is a graph input, read when the graph
runs, not a constant that dynamo would guard on: contexts built every step reuse one compiled graph. The registry
from handle to object holds the objects weakly, so it keeps nothing alive; a compiled forward's context (and
workspace) must live until its backward runs, as in the usual training loop.

``chunk_kda`` passes ``cu_seqlens`` itself (or nothing, for B equal rows): the op builds the W = 1 context from it
when it runs, through the same cache as the eager call.

Eager calls never come here; they keep the two autograd nodes of ``kda_kcp.function``.
"""

import zlib
from typing import Optional

import torch

from .backend import select_backend
from .function import backward_kcp, forward_kcp
from .handles import object_of
from .packing import packed_context
from .steps import KdaSaved
from .validate import check_context, check_flag, check_scale, values_requested
from .workspace import WorkspaceKcp

__all__ = ["chunk_kda_op"]


def _context(ctx_handle, cu_seqlens, packed_rows: int, num_tokens: int):
    """The call's KcpContext: the handle's (``packed_rows`` 0, chunk_kda_kcp), or as ``chunk_kda`` makes it for
    ``packed_rows`` rows (its cp_context, or the W = 1 context of cu_seqlens or of the equal rows)."""
    ctx = object_of(ctx_handle, "KcpContext")
    if packed_rows == 0:
        return ctx
    return packed_context(packed_rows, num_tokens // packed_rows, cu_seqlens, None, ctx)


def _state_dtype(q, k, v, g, beta, deterministic: bool) -> torch.dtype:

    return select_backend(q.device, deterministic).summary_dtype(q, k, v, g, beta)


# the schemas are inferred from these annotations (typing.Optional: what every torch since 2.4 reads)
Tensor = torch.Tensor


@torch.library.custom_op("kda_kcp::fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
         ctx_handle: Optional[Tensor], cu_seqlens: Optional[Tensor], packed_rows: int, scale: Optional[float],
         deterministic: bool, workspace_handle: Optional[Tensor], validate: bool, output_final_state: bool,
         num_docs: int, backward_tag: int) -> tuple[Tensor, Tensor, Tensor]:

    ctx = _context(ctx_handle, cu_seqlens, packed_rows, q.shape[0])
    if output_final_state and num_docs != ctx.num_docs:
        raise RuntimeError(f"kda_kcp: the compiled call was traced for {num_docs} documents, its context has "
                           f"{ctx.num_docs}")
    workspace = object_of(workspace_handle, "WorkspaceKcp")
    out = forward_kcp(q, k, v, g, beta, ctx, scale, deterministic, workspace, validate, initial_state,
                      output_final_state)
    o, saved = out[0], out[-1]
    dtype = _state_dtype(q, k, v, g, beta, deterministic)
    empty = q.new_empty(0, q.shape[1], q.shape[2], v.shape[2], dtype=dtype)  # an absent state (an op returns tensors)
    state_in = saved.state_in if saved.state_in is not None else empty
    return o, state_in, out[1] if output_final_state else empty.clone()


@_fwd.register_fake
def _fwd_fake(q, k, v, g, beta, initial_state, ctx_handle, cu_seqlens, packed_rows, scale, deterministic,
              workspace_handle, validate, output_final_state, num_docs, backward_tag):
    runs = torch.library.get_ctx().new_dynamic_size()  # the context's run count is known when the op runs
    state_dtype = _state_dtype(q, k, v, g, beta, deterministic)
    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    return (q.new_empty(q.shape[0], H, V), q.new_empty(runs, H, K, V, dtype=state_dtype),
            q.new_empty(num_docs if output_final_state else 0, H, K, V, dtype=state_dtype))


@torch.library.custom_op("kda_kcp::bwd", mutates_args=())
def _bwd(do: Tensor, dht: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
         state_in: Tensor, initial_state: Optional[Tensor], ctx_handle: Optional[Tensor], cu_seqlens: Optional[Tensor],
         packed_rows: int, scale: Optional[float], deterministic: bool, workspace_handle: Optional[Tensor],
         output_final_state: bool, validate: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:

    ctx = _context(ctx_handle, cu_seqlens, packed_rows, q.shape[0])
    workspace = object_of(workspace_handle, "WorkspaceKcp")
    saved = KdaSaved(q, k, v, g, beta, state_in if ctx.plan.needs_exchange else None, check_scale(scale, q.shape[-1]),
                     deterministic, ctx, initial_state, output_final_state, validate=validate)
    grads = backward_kcp(do, saved, ctx, workspace, dht)
    if len(grads) == 5:  # no initial state: an empty stand-in for its gradient
        grads = (*grads, q.new_empty(0, q.shape[1], q.shape[2], v.shape[2], dtype=torch.float32))
    return grads


@_bwd.register_fake
def _bwd_fake(do, dht, q, k, v, g, beta, state_in, initial_state, ctx_handle, cu_seqlens, packed_rows, scale,
              deterministic, workspace_handle, output_final_state, validate):
    dh0 = (initial_state.new_empty(initial_state.shape) if initial_state is not None
           else q.new_empty(0, q.shape[1], q.shape[2], v.shape[2], dtype=torch.float32))
    return (*(x.new_empty(x.shape) for x in (q, k, v, g, beta)), dh0)


def _setup_context(ctx, inputs, output):  # ctx: autograd's (torch passes it by this name)
    (q, k, v, g, beta, initial_state, ctx_handle, cu_seqlens, packed_rows, scale, deterministic, workspace_handle,
     validate, output_final_state, _, _) = inputs
    ctx.save_for_backward(q, k, v, g, beta, output[1], initial_state, ctx_handle, cu_seqlens, workspace_handle)
    ctx.call = (packed_rows, scale, deterministic, output_final_state, validate)


def _backward(ctx, do, _dstate_in, dht):
    q, k, v, g, beta, state_in, initial_state, ctx_handle, cu_seqlens, workspace_handle = ctx.saved_tensors
    packed_rows, scale, deterministic, output_final_state, validate = ctx.call
    if do is None:  # only the final states reached the loss
        do = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    grads = torch.ops.kda_kcp.bwd(do, dht if output_final_state else None, q, k, v, g, beta, state_in, initial_state,
                                  ctx_handle, cu_seqlens, packed_rows, scale, deterministic, workspace_handle,
                                  output_final_state, validate)
    dh0 = grads[5] if initial_state is not None else None
    return (*grads[:5], dh0, *[None] * 10)


_fwd.register_autograd(_backward, setup_context=_setup_context)

# What torch's compile caches (the FX graph and AOT autograd caches, on disk across processes) key a compiled call
# on is the forward graph; the backward graph, traced from ``_backward``, is stored with it. A kda_kcp whose ``bwd``
# op or ``_backward`` differs would then run a cached backward that calls ``bwd`` with the old arguments (a
# RuntimeError "missing value for argument" in a training run after an upgrade). The forward passes this tag of
# both, a constant in its graph, so that such a change is a new key.
def _code_key(fn) -> tuple:
    code = fn.__code__  # (its constants but nested code objects, whose repr carries an address)
    return code.co_code, tuple(c for c in code.co_consts if not isinstance(c, type(code)))


def _backward_tag(schema: str, *fns) -> int:
    """The tag of a backward op's schema and of the functions that call it (a non-negative int64 constant)."""
    return zlib.crc32(repr((schema, *map(_code_key, fns))).encode()) & 0x7FFFFFFF


_BACKWARD_TAG = _backward_tag(str(torch.ops.kda_kcp.bwd.default._schema), _backward, _setup_context)


def chunk_kda_op(q, k, v, g, beta, ctx, scale, deterministic: bool, workspace=None, validate=None, cu_seqlens=None,
                 packed_rows: int = 0, initial_state=None, output_final_state: bool = False):
    """o of one call through the custom ops (what chunk_kda_kcp runs under torch.compile), or (o, final states) with
    ``output_final_state``. ``ctx`` is a KcpContext, or, for ``chunk_kda`` (``packed_rows`` = B), its cp_context or
    None; ``cu_seqlens`` is chunk_kda's."""

    if ctx is not None:
        check_context(ctx)
    if workspace is not None and not isinstance(workspace, WorkspaceKcp):
        raise TypeError(f"workspace must be a WorkspaceKcp or None, got {type(workspace).__name__}")
    if initial_state is not None and not isinstance(initial_state, torch.Tensor):
        raise TypeError(f"initial_state must be a torch.Tensor or None, got {type(initial_state).__name__}")
    check_flag("output_final_state", output_final_state)
    if scale is not None:
        scale = check_scale(scale, q.shape[-1])
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
    # the final states' row count, for the fake: from a tensor's shape (a size the graph keeps symbolic once it
    # changes, so a new document count reuses the graph), or B equal rows
    num_docs = 0
    if output_final_state:
        if initial_state is not None:
            num_docs = initial_state.shape[0]
        elif ctx is not None:
            num_docs = ctx._doc_count.shape[0]
        elif cu_seqlens is not None:
            num_docs = cu_seqlens.shape[0] - 1
        else:
            num_docs = packed_rows
    o, _, ht = torch.ops.kda_kcp.fwd(q, k, v, g, beta, initial_state, None if ctx is None else ctx._graph_handle,
                                     cu_seqlens, packed_rows, scale, deterministic,
                                     None if workspace is None else workspace._graph_handle, values_requested(validate),
                                     output_final_state, num_docs, _BACKWARD_TAG)
    return (o, ht) if output_final_state else o
