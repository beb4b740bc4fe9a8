"""One KCP call, forward and backward, and the two autograd nodes around it (KdaKcpInputs, KdaKcpOutput).

Forward (docs/design.md §4): summaries of the runs whose document continues later -> one all-gather
-> affine merge into each run's incoming state -> fwd_output. Backward mirrors it with (M^T, F) of the
runs whose document started earlier, folded from the document end into each run's outgoing state
gradient, then the local gradients. Initial and final states per document (kda_kcp.states, §4b) enter
as the folds' start values and leave through the summaries of the runs that start and end a document.

The workspace of one call is [exchange scratch | arena]. The CUDA backend carves all of its scratch from
the arena (kda_kcp.arena): first the call's chunk records (made once, read by the KCP summaries and by the
local pass), then each phase from the same base, so a call with a workspace allocates only its outputs (and, in
the forward, the incoming states it saves for the backward; with states, the state stages' scratch,
kda_kcp.states). The torch backend uses the exchange part only. ``arena_parts`` sizes the arena by running the
calls' own steps below (``ForwardCall.checked`` and ``finish``, ``_backward``) on meta tensors and an arena that
only counts: no kernel, no collective, the same carves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .agreement import agree_call, call_properties
from .arena import Arena, aligned
from .backend import select_backend
from .context import KcpContext
from .exchange import gather_summaries
from .states import doc_runs, final_states, initial_state_grad, run_rows
from .validate import (check_final_state_grad, check_flag, check_grad_output, check_initial_state, check_inputs,
                       check_scale, check_values, values_requested)
from .walk import affine_merge
from .workspace import WorkspaceKcp, exchange_elements, workspace_bytes

__all__ = ["KdaSaved", "ForwardCall", "forward_kcp", "backward_kcp", "check_saved", "KdaKcpInputs", "KdaKcpOutput",
           "chunk_kda_autograd", "local_arena_bytes"]


@dataclass
class KdaSaved:
    """What the forward hands the backward: the inputs (by reference), each run's incoming state from the exchange,
    the forward's context (the backward must run on the same split), its initial states (by reference) and
    whether it returned final states."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state_in: torch.Tensor | None  # [R, H, K, V], None when no document crosses a piece
    scale: float
    deterministic: bool
    ctx: KcpContext
    initial_state: torch.Tensor | None = None  # [N, H, K, V], the caller's
    final_state: bool = False

    def tensors(self):
        return (self.q, self.k, self.v, self.g, self.beta, self.state_in, self.initial_state)

    def incoming_states(self, docs, dtype) -> torch.Tensor | None:
        """Each run's incoming state [R, H, K, V]: the exchange's, or the initial states of the runs' documents
        (every run starts its document when nothing is exchanged), or None (zero)."""
        if self.state_in is not None or self.initial_state is None:
            return self.state_in
        return run_rows(self.initial_state, docs, dtype)


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
        call = ForwardCall.checked(backend, q, k, v, g, beta, ctx, K**-0.5, True, dt, None, arena, None, walk_early)
        call.finish()
        fwd, saved = max(fwd, arena.peak), call.saved
    arena = Arena.count_only(device)
    _backward(backend, do, saved, ctx, dt, None, arena, passes, None)
    return fwd, arena.peak


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
    if not isinstance(ctx, KcpContext):
        raise TypeError(f"ctx must be a KcpContext from build_context_kcp, got {type(ctx).__name__}")
    if not saved.ctx.same_as(ctx):
        mine, fwd = _describe(ctx), _describe(saved.ctx)
        raise ValueError(
            f"ctx is not the forward's context: the forward ran on {fwd}, ctx is {mine}"
            + (" (same sizes, different offsets)" if mine == fwd else "")
            + "; pass the backward the context its forward ran on"
        )


def _workspace_need(ctx, H, backend, device, K, V, dt, passes) -> int:
    """``workspace_bytes`` of one call, cached in the context's local plan: summing the carves walks every table
    of the call (~100 us of host time before the first kernel could start), and it is a pure function of the key
    (the backend names the knobs its tables depend on)."""
    key = ("workspace_bytes", H, backend.name, str(device), K, V, dt, passes, backend.table_knobs())
    cache = ctx.local._tables
    if key not in cache:
        cache[key] = workspace_bytes(ctx, H, backend, device, K, V, dt, passes)
    return cache[key]


def _split_workspace(workspace, ctx, backend, H, K, V, dt, device):
    """(exchange buffer or None, Arena or None) of one call; the workspace's size and device are checked
    here, before any kernel runs."""
    if workspace is None:
        return None, (Arena(None, device) if backend.uses_arena else None)
    need = _workspace_need(ctx, H, backend, device, K, V, dt, workspace.lean_passes)
    if workspace.nbytes < need:
        raise ValueError(
            f"workspace too small: this call needs {need} bytes, the workspace has {workspace.nbytes}; size "
            "it with kda_workspace_bytes_kcp(ctx, num_heads, ...) for this context"
        )
    if workspace.buffer.device != torch.device(device):
        raise ValueError(f"workspace is on {workspace.buffer.device} but the inputs are on {device}")
    workspace.begin_use()  # ordered after its previous use on another stream
    numel = exchange_elements(ctx, H, K, V)
    xbuf = workspace.take(numel, dt, device, "the KCP exchange") if numel else None
    arena = None
    if backend.uses_arena:
        start = aligned(numel * dt.itemsize)
        arena = workspace.arena(start, need, device)
    return xbuf, arena


def _exchange_and_merge(ctx, summarize, publish, slots, sources, q, v, dt, xbuf, arena, out, after_summaries=None,
                        init=None, docs=None):
    """This rank's summaries of the runs it publishes -> one all-gather -> the fixed-order fold into
    every local run: incoming states (forward) or outgoing state gradients (backward), written to ``out``
    [R, H, K, V]; each run's fold starts from row ``docs.run_docs`` of ``init`` [N, H, K, V] (the initial states,
    or the final states' gradient; None: zero). ``after_summaries`` (optional) is called once the all-gather is enqueued, with a CUDA event
    recorded after this rank's summaries and before the all-gather (None off CUDA): what it launches on a side
    stream then waits for the summaries but not for the other ranks, and goes after the collective in launch order.
    With an arena nothing here allocates; with one that only counts, nothing is exchanged or merged either (the
    call is being sized)."""
    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    ids = publish[ctx.rank]
    base = arena.mark() if arena is not None else 0
    if ids:
        maps, offsets = summarize(ids)
    elif arena is not None:
        maps, offsets = arena.empty((0, H, K, K), dt), arena.empty((0, H, K, V), dt)
    else:
        maps, offsets = q.new_zeros(0, H, K, K, dtype=dt), q.new_zeros(0, H, K, V, dtype=dt)
    exchange = arena is None or not arena.counting
    if exchange:
        ready = None
        if after_summaries is not None and q.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        maps, offsets = gather_summaries(maps.to(dt), offsets.to(dt), slots, ctx.world_size, ctx.group, xbuf)
        if after_summaries is not None:
            after_summaries(ready)
    tmp = None
    if arena is not None:
        arena.release(base)  # this rank's summaries are in the exchange buffer now
        tmp = arena.empty((H, K, V), dt)
    if exchange:
        affine_merge(maps, offsets, sources[ctx.rank], out, tmp, init, None if init is None else docs.doc_list)
    if arena is not None:
        arena.release(base)
    return out


def _in_backward() -> bool:
    """Whether this runs inside a backward pass (a checkpoint's recomputation of the forward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class ForwardCall:
    """One forward call in two steps. Making it: the checks, the workspace split and, when the plan exchanges
    (W > 1 with a document crossing a piece), the chunk records, this rank's summaries, the all-gather and the
    merge into each run's incoming state (``saved.state_in``; with initial states the folds start from them).
    ``finish``: the records if the first step made none, then the output pass (and the final states when asked
    for). Inputs are read, never written."""

    def __init__(self, q, k, v, g, beta, ctx, scale, deterministic, workspace=None, validate=None, initial_state=None,
                 output_final_state=False):
        backend, scale, dt, xbuf, arena = agree_call(
            ctx, "forward", _prepare, _forward_properties, q, k, v, g, beta, ctx, scale, deterministic, workspace,
            validate, initial_state, output_final_state)
        self._start(backend, q, k, v, g, beta, ctx, scale, deterministic, dt, xbuf, arena, workspace, None,
                    initial_state, output_final_state)

    @classmethod
    def checked(cls, backend, q, k, v, g, beta, ctx, scale, deterministic, dt, xbuf, arena, workspace, walk_early,
                initial_state=None, output_final_state=False):
        """The first step of a call whose checks have passed and whose workspace is split (``arena_parts`` sizes a
        call this way, on an arena that only counts)."""
        call = cls.__new__(cls)
        call._start(backend, q, k, v, g, beta, ctx, scale, deterministic, dt, xbuf, arena, workspace, walk_early,
                    initial_state, output_final_state)
        return call

    def _start(self, backend, q, k, v, g, beta, ctx, scale, deterministic, dt, xbuf, arena, workspace, walk_early,
               initial_state, output_final_state):
        """``walk_early``: whether the runs whose document starts here may be walked beside the exchange (None:
        unless this runs inside a backward pass; never with initial states, which those runs start from)."""
        self.backend, self.arena = backend, arena
        plan, local = ctx.plan, ctx.local
        H, K, V = q.shape[1], q.shape[2], v.shape[2]
        self.workspace = workspace
        self.local = local
        self.state_dtype = dt
        self.final_shape = (ctx.num_docs, H, K, V)
        with_states = initial_state is not None or output_final_state
        self.docs = doc_runs(ctx, q.device) if with_states else None
        self.prepared = None
        state_in = None
        if plan.needs_exchange:
            self.prepared = self.backend.fwd_prepare(q, k, v, g, beta, scale, local, self.arena)  # records, once
            # the runs whose document starts here need no incoming state (unless it is an initial state): their
            # output pass can run beside the exchange (tuning.fwd_early; not in a checkpoint's recomputation,
            # which never asks for o)
            early = None
            if walk_early is None:
                walk_early = not _in_backward()
            if walk_early and initial_state is None:
                early = self.prepared.reserve_early()  # its scratch carved before the exchange's
            state_in = q.new_empty(local.num_runs, H, K, V, dtype=dt)  # saved for the backward: not scratch
            _exchange_and_merge(ctx, self.prepared.summaries, plan.fwd_publish, plan.fwd_slots, plan.fwd_sources, q,
                                v, dt, xbuf, self.arena, state_in, after_summaries=early, init=initial_state,
                                docs=self.docs)
        self.saved = KdaSaved(q, k, v, g, beta, state_in, scale, deterministic, ctx, initial_state,
                              bool(output_final_state))

    def finish(self):
        """(o, the final states [N, H, K, V] or None when not asked for)."""
        s = self.saved
        if self.prepared is None:
            self.prepared = self.backend.fwd_prepare(s.q, s.k, s.v, s.g, s.beta, s.scale, self.local, self.arena,
                                                     output_next=True)
        state_in = s.incoming_states(self.docs, self.state_dtype)
        o = self.prepared.output(state_in)
        ht = None
        if s.final_state:  # after the output pass: its records are only read by it
            ht = final_states(self.prepared.summaries, self.docs, state_in, s.initial_state, self.final_shape,
                              self.state_dtype, s.q.device)
        self.prepared = None
        if self.workspace is not None:
            self.workspace.end_use()
        return o, ht


def forward_kcp(q, k, v, g, beta, ctx, scale, deterministic, workspace=None, validate=None, initial_state=None,
                output_final_state=False):
    """Returns (o, KdaSaved), or (o, final states, KdaSaved) with ``output_final_state``. Inputs are read, never
    written."""
    call = ForwardCall(q, k, v, g, beta, ctx, scale, deterministic, workspace, validate, initial_state,
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
    return _backward(backend, do, saved, ctx, dt, xbuf, arena, passes, workspace, dht, initial_state_grad_wanted)


def _backward(backend, do, saved, ctx, dt, xbuf, arena, passes, workspace, dht=None, initial_state_grad_wanted=True):
    """``backward_kcp`` once its checks have passed (``arena_parts`` sizes a call this way, on an arena that only
    counts)."""
    q, k, v, g, beta, h0 = saved.q, saved.k, saved.v, saved.g, saved.beta, saved.initial_state
    do = backend.grad_output(do).contiguous()
    plan, local = ctx.plan, ctx.local
    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    docs = doc_runs(ctx, q.device) if h0 is not None or dht is not None else None
    prepared = backend.bwd_prepare(q, k, v, g, beta, do, saved.scale, local, arena, passes)  # records, once
    dstate_out = None
    if plan.needs_exchange:
        # scratch that lives until the local gradients are done
        if arena is not None:
            dstate_out = arena.empty((local.num_runs, H, K, V), dt)
        else:
            dstate_out = q.new_empty(local.num_runs, H, K, V, dtype=dt)
        _exchange_and_merge(ctx, prepared.summaries, plan.bwd_publish, plan.bwd_slots, plan.bwd_sources, q, v, dt,
                            xbuf, arena, dstate_out, init=dht, docs=docs)
    elif dht is not None:  # every run ends its document
        dstate_out = run_rows(dht, docs, dt)
    dh0 = None
    if h0 is not None and initial_state_grad_wanted:  # before the gradients, which overwrite the CUDA records
        dh0 = initial_state_grad(prepared.summaries, docs, dstate_out, dht, h0)
    grads = prepared.grads(saved.incoming_states(docs, dt), dstate_out)
    if workspace is not None:
        workspace.end_use()
    grads = tuple(gr.to(x.dtype) for gr, x in zip(grads, (q, k, v, g, beta)))
    return grads if h0 is None else (*grads, dh0)


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


# The differentiable call is two autograd nodes. KdaKcpInputs makes the ForwardCall (its first step), keeps
# the inputs (and the incoming states) for the backward and returns a placeholder shaped like o (and one shaped
# like the final states, when asked for); KdaKcpOutput runs the output pass (and makes the final states) and hands
# do (and dht) back to the placeholders, so KdaKcpInputs.backward receives them and computes every gradient.
# Why two: a non-reentrant torch.utils.checkpoint recomputation stops as soon as the tensors the backward saved
# are back (torch's early stop, on by default). They are all saved by KdaKcpInputs, before the output pass, so
# when nothing later in the checkpointed region saved o, the recomputation never runs the output pass (at
# W = 1 it runs no kernel at all); when something did, it runs on and o is recomputed as before.
# Neither node materializes absent output gradients: an unused o or final state costs no zeros.


class KdaKcpInputs(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, g, beta, initial_state, ctx, scale, deterministic, workspace, validate,
                output_final_state, handoff):
        call = ForwardCall(q, k, v, g, beta, ctx, scale, deterministic, workspace, validate, initial_state,
                           output_final_state)
        handoff.append(call)
        saved = call.saved
        fctx.save_for_backward(q, k, v, g, beta, initial_state, saved.state_in)
        fctx.kcp = (ctx, saved.scale, deterministic, workspace, saved.final_state)
        fctx.set_materialize_grads(False)
        # o's shape and the inputs' dtype (the dtype of o on either backend), without storage
        o = q.new_empty(()).expand(q.shape[0], q.shape[1], v.shape[2])
        if not saved.final_state:
            return o
        return o, q.new_empty((), dtype=call.state_dtype).expand(call.final_shape)

    @staticmethod
    def backward(fctx, do, dht=None):
        ctx, scale, deterministic, workspace, final_state = fctx.kcp
        q, k, v, g, beta, h0, state_in = fctx.saved_tensors
        if do is None:  # only the final states reached the loss
            do = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        saved = KdaSaved(q, k, v, g, beta, state_in, scale, deterministic, ctx, h0, final_state)
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
        return (*grads[:5], dh0, None, None, None, None, None, None, None)


class KdaKcpOutput(torch.autograd.Function):
    @staticmethod
    def forward(fctx, handoff, *placeholders):
        fctx.set_materialize_grads(False)
        o, ht = handoff.pop().finish()
        return o if ht is None else (o, ht)

    @staticmethod
    def backward(fctx, *grads):
        return (None, *grads)


def chunk_kda_autograd(q, k, v, g, beta, ctx, scale, deterministic, workspace=None, validate=None, initial_state=None,
                       output_final_state=False):
    """o of one differentiable KCP call (the two nodes above), or (o, final states) with ``output_final_state``."""
    handoff = []
    placeholders = KdaKcpInputs.apply(q, k, v, g, beta, initial_state, ctx, scale, deterministic, workspace, validate,
                                      output_final_state, handoff)
    if not isinstance(placeholders, tuple):
        placeholders = (placeholders,)
    return KdaKcpOutput.apply(handoff, *placeholders)
