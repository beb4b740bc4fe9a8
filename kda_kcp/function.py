"""The checked KCP calls, forward and backward, and the two autograd nodes around them (KdaKcpInputs, KdaKcpOutput).

Each call runs its checks on every rank and agrees on them (kda_kcp.agreement), splits its workspace, then runs the
steps of kda_kcp.steps (docs/design.md §4).

The workspace of one call is [exchange scratch | arena]. A backend that uses the arena (``Backend.uses_arena``: the
CUDA backend) carves all of its scratch from it (kda_kcp.arena): first the call's chunk records (made once, read by
the KCP summaries and by the local pass), then each phase from the same base, so a call with a workspace allocates
only its outputs (and, in the forward, the incoming states it saves for the backward; with states, the state stages'
scratch, kda_kcp.states). The torch backend uses the exchange part only. kda_kcp.sizing sizes the arena by running
the same steps on meta tensors and an arena that only counts: no kernel, no collective, the same carves.
"""

from __future__ import annotations

import torch

from .agreement import agree_call, agree_failure, call_properties
from .arena import Arena, aligned
from .backend import select_backend
from .sizing import exchange_elements, workspace_bytes
from .steps import ForwardCall, KdaSaved, run_backward
from .validate import (check_context, check_final_state_grad, check_flag, check_gradient_values, check_grad_output,
                       check_initial_state, check_inputs, check_scale, check_values, values_requested)
from .workspace import WorkspaceKcp

__all__ = ["start_forward", "forward_kcp", "backward_kcp", "check_saved", "KdaKcpInputs", "KdaKcpOutput",
           "chunk_kda_autograd"]


def _prepare(q, k, v, g, beta, ctx, scale, deterministic, workspace, validate, initial_state, output_final_state):
    """This rank's checks of one forward call (agreed with every rank by ``agree_call``), then its workspace
    split: (backend, scale, summary dtype, exchange buffer, arena)."""
    backend = select_backend(q.device if isinstance(q, torch.Tensor) else torch.device("cpu"), deterministic)
    check_inputs(q, k, v, g, beta, ctx, backend)
    scale = check_scale(scale, q.shape[-1])
    if workspace is not None and not isinstance(workspace, WorkspaceKcp):
        raise TypeError(f"workspace must be a WorkspaceKcp or None, got {type(workspace).__name__}")
    if values_requested(validate):
        check_values(g, beta, q, k, v)
    backend.check_call(q, k, v, g, beta, ctx.local)
    dt = backend.summary_dtype(q, k, v, g, beta)
    check_flag("output_final_state", output_final_state)
    check_initial_state(initial_state, ctx.num_docs, q, v, dt)
    xbuf, arena = _split_workspace(workspace, ctx, backend, q.shape[1], q.shape[2], v.shape[2], dt, q.device)
    return backend, scale, dt, xbuf, arena


def _forward_properties(checked, q, k, v, g, beta, ctx, scale, deterministic, workspace, validate, initial_state,
                        output_final_state):
    return call_properties(q, k, v, g, beta, None, checked[1], deterministic, workspace, initial_state,
                           output_final_state)


def _describe(ctx) -> str:
    return f"rank {ctx.rank} of {ctx.world_size}, layout {ctx.layout!r}, {ctx.num_docs} documents, T = {ctx.num_tokens}"


def check_saved(saved, ctx) -> None:
    """``saved`` is a forward's KdaSaved and ``ctx`` that forward's context (or this rank's view of the same split)."""
    if not isinstance(saved, KdaSaved):
        raise TypeError(f"saved must be the KdaSaved that chunk_kda_fwd_kcp returned, got {type(saved).__name__}")
    check_context(ctx)
    if not saved.ctx.same_as(ctx):
        mine, fwd = _describe(ctx), _describe(saved.ctx)
        raise ValueError(
            f"ctx is not the forward's context: the forward ran on {fwd}, ctx is {mine}"
            + (" (same sizes, different offsets)" if mine == fwd else "")
            + "; pass the backward the context its forward ran on"
        )
    changed = saved.changed_since_forward()
    if changed:
        raise ValueError(
            f"{', '.join(changed)} changed in place since the forward (the backward reads the forward's tensors by "
            "reference, so it would compute the gradients of other values); write to a clone instead"
        )


def _workspace_layout(ctx, H, backend, device, K, V, dt, passes) -> tuple[int, int, int]:
    """(``workspace_bytes``, the exchange's elements, the arena's first byte) of one call, cached in the context's
    local plan: summing the carves walks every table of the call (~100 us of host time before the first kernel
    could start), and all three are pure functions of the key (the backend names the knobs its tables depend
    on)."""
    key = ("workspace_bytes", H, backend.name, device, K, V, dt, passes, backend.table_knobs())
    cache = ctx.local._tables
    layout = cache.get(key)
    if layout is None:
        numel = exchange_elements(ctx, H, K, V)
        layout = cache[key] = (workspace_bytes(ctx, H, backend, device, K, V, dt, passes), numel,
                               aligned(numel * dt.itemsize))
    return layout


def _split_workspace(workspace, ctx, backend, H, K, V, dt, device):
    """(exchange buffer or None, Arena or None) of one call; the workspace's size and device are checked
    here, before any kernel runs."""
    if workspace is None:
        return None, (Arena(None, device) if backend.uses_arena else None)
    need, numel, start = _workspace_layout(ctx, H, backend, device, K, V, dt, workspace.lean_passes)
    if workspace.nbytes < need:
        raise ValueError(
            f"workspace too small: this call needs {need} bytes, the workspace has {workspace.nbytes}; size "
            "it with kda_workspace_bytes_kcp(ctx, num_heads, ...) for this context"
        )
    if workspace.buffer.device != device:
        raise ValueError(f"workspace is on {workspace.buffer.device} but the inputs are on {device}")
    workspace.begin_use()  # ordered after its previous use on another stream
    xbuf = workspace.take(numel, dt, device, "the KCP exchange") if numel else None
    arena = workspace.arena(start, need, device) if backend.uses_arena else None
    return xbuf, arena


def start_forward(q, k, v, g, beta, ctx, scale, deterministic, workspace=None, validate=None, initial_state=None,
                  output_final_state=False) -> ForwardCall:
    """The first step of a forward call (``ForwardCall``), after its checks (agreed by every rank) and its
    workspace split."""
    backend, scale, dt, xbuf, arena = agree_call(
        ctx, "forward", _prepare, _forward_properties, q, k, v, g, beta, ctx, scale, deterministic, workspace,
        validate, initial_state, output_final_state)
    return ForwardCall(backend, q, k, v, g, beta, ctx, scale, deterministic, dt, xbuf, arena, workspace, None,
                       initial_state, output_final_state, validate=values_requested(validate))


def forward_kcp(q, k, v, g, beta, ctx, scale, deterministic, workspace=None, validate=None, initial_state=None,
                output_final_state=False):
    """Returns (o, KdaSaved), or (o, final states, KdaSaved) with ``output_final_state``. Inputs are read, never
    written."""
    call = start_forward(q, k, v, g, beta, ctx, scale, deterministic, workspace, validate, initial_state,
                         output_final_state)
    o, ht = call.finish()
    return (o, call.saved) if ht is None else (o, ht, call.saved)


def _backward_checks(do, saved, ctx, workspace, dht):
    """This rank's checks of one backward call (agreed with every rank by ``agree_call``), then its workspace
    split: (backend, summary dtype, exchange buffer, arena)."""
    check_saved(saved, ctx)
    q, v = saved.q, saved.v
    backend = select_backend(q.device, saved.deterministic)
    check_grad_output(do, q, v)
    if dht is not None and not saved.final_state:
        raise ValueError("dht was given but the forward returned no final state (output_final_state=False)")
    check_final_state_grad(dht, ctx.num_docs, q, v)
    if saved.validate:
        check_gradient_values(do, dht)
    if workspace is not None and not isinstance(workspace, WorkspaceKcp):
        raise TypeError(f"workspace must be a WorkspaceKcp or None, got {type(workspace).__name__}")
    backend.check_call(q, saved.k, v, saved.g, saved.beta, ctx.local)
    dt = backend.summary_dtype(q, saved.k, v, saved.g, saved.beta)
    xbuf, arena = _split_workspace(workspace, ctx, backend, q.shape[1], q.shape[2], v.shape[2], dt, q.device)
    return backend, dt, xbuf, arena


def _backward_properties(checked, do, saved, ctx, workspace, dht):
    return call_properties(saved.q, saved.k, saved.v, saved.g, saved.beta, do, saved.scale, saved.deterministic,
                           workspace, saved.initial_state, saved.final_state)


def backward_kcp(do, saved: KdaSaved, ctx, workspace=None, dht=None, initial_state_grad_wanted=True):
    """Returns (dq, dk, dv, dg, dbeta) in the input dtypes, and dh0 (in the initial states' dtype; None unless
    ``initial_state_grad_wanted``) after them when the forward took initial states. ``dht``: the gradient of the
    final states the forward returned (None: zero)."""
    # the ranks agree on the forward's context: every rank has it, even one that passed a wrong ctx
    fwd_ctx = saved.ctx if isinstance(saved, KdaSaved) else ctx
    backend, dt, xbuf, arena = agree_call(fwd_ctx, "backward", _backward_checks, _backward_properties, do, saved, ctx,
                                          workspace, dht)
    passes = workspace.lean_passes if workspace is not None else None
    return run_backward(backend, do, saved, ctx, dt, xbuf, arena, passes, workspace, dht, initial_state_grad_wanted)


DOUBLE_BACKWARD = (
    "kda_kcp: chunk_kda_kcp is not twice differentiable (its backward kernels have no backward of their own): the "
    "gradients of a backward(create_graph=True) through it cannot be differentiated again"
)


def _not_differentiable(grads, sources):
    """``grads`` (of a create_graph=True backward) behind one autograd node whose backward raises DOUBLE_BACKWARD.
    The node takes the tensors the gradients depend on (``sources``) as inputs too, so that any later backward
    toward them runs it, instead of treating the gradients as constants."""
    node = torch._C._functions.DelayedError(DOUBLE_BACKWARD.encode(), len(grads) + len(sources))
    return node(*grads, *sources)[: len(grads)]


# The differentiable call is two autograd nodes around a ForwardCall started just before them (its checks and first
# step, with grad mode off as inside a node's forward: Function.apply's own work before a forward, ~14 us of host
# time, then follows the call's first kernel instead of preceding it). KdaKcpInputs keeps the inputs (and the
# incoming states) for the backward and returns a placeholder shaped like o (and one shaped like the final states,
# when asked for); KdaKcpOutput runs the output pass (and makes the final states) and hands do (and dht) back to the
# placeholders, so KdaKcpInputs.backward receives them and computes every gradient.
# Why two: a non-reentrant torch.utils.checkpoint recomputation stops as soon as the tensors the backward saved
# are back (torch's early stop, on by default). They are all saved by KdaKcpInputs, before the output pass, so
# when nothing later in the checkpointed region saved o, the recomputation never runs the output pass (at
# W = 1 it runs no kernel at all: the first step makes the records only outside a backward pass, so that a plain
# forward's first kernel starts before the second node is built); when something did, it runs on and o is
# recomputed as before.
# Neither node materializes absent output gradients: an unused o or final state costs no zeros.


class KdaKcpInputs(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, g, beta, initial_state, call):
        saved = call.saved
        fctx.save_for_backward(q, k, v, g, beta, initial_state, saved.state_in)
        fctx.kcp = (saved.ctx, saved.scale, saved.deterministic, call.workspace, saved.final_state, saved.validate)
        fctx.set_materialize_grads(False)
        # o's shape and the inputs' dtype (the dtype of o on either backend), without storage
        o = q.new_empty(()).expand(q.shape[0], q.shape[1], v.shape[2])
        if not saved.final_state:
            return o
        return o, q.new_empty((), dtype=call.state_dtype).expand(call.final_shape)

    @staticmethod
    def backward(fctx, do, dht=None):
        ctx, scale, deterministic, workspace, final_state, validate = fctx.kcp
        try:  # autograd's check of the saved tensors (one written in place since) fails on this rank alone
            q, k, v, g, beta, h0, state_in = fctx.saved_tensors
        except RuntimeError as exc:
            agree_failure(ctx, "backward", exc)
        if do is None:  # only the final states reached the loss
            do = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        saved = KdaSaved(q, k, v, g, beta, state_in, scale, deterministic, ctx, h0, final_state, validate=validate)
        wanted = fctx.needs_input_grad[5]
        if not torch.is_grad_enabled():
            grads = backward_kcp(do, saved, ctx, workspace, dht, wanted)
        else:  # backward(create_graph=True): the kernels have no backward, so one through these gradients raises
            with torch.no_grad():
                grads = backward_kcp(do, saved, ctx, workspace, dht, wanted)
            sources = tuple(x for x in (q, k, v, g, beta, do, h0, dht) if x is not None)
            given = tuple(x for x in grads if x is not None)
            given = iter(_not_differentiable(given, sources))
            grads = tuple(None if x is None else next(given) for x in grads)
        dh0 = grads[5] if len(grads) > 5 else None
        return (*grads[:5], dh0, None)


class KdaKcpOutput(torch.autograd.Function):
    @staticmethod
    def forward(fctx, call, *placeholders):
        fctx.set_materialize_grads(False)
        o, ht = call.finish()
        return o if ht is None else (o, ht)

    @staticmethod
    def backward(fctx, *grads):
        return (None, *grads)


def chunk_kda_autograd(q, k, v, g, beta, ctx, scale, deterministic, workspace=None, validate=None, initial_state=None,
                       output_final_state=False):
    """o of one differentiable KCP call (the two nodes above), or (o, final states) with ``output_final_state``."""
    grad_mode = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # (torch.no_grad()'s own work, without its Python context manager)
    try:
        call = start_forward(q, k, v, g, beta, ctx, scale, deterministic, workspace, validate, initial_state,
                             output_final_state)
    finally:
        torch._C._set_grad_enabled(grad_mode)
    placeholders = KdaKcpInputs.apply(q, k, v, g, beta, initial_state, call)
    if not isinstance(placeholders, tuple):
        placeholders = (placeholders,)
    return KdaKcpOutput.apply(call, *placeholders)
