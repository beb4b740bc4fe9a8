"""The steps of one KCP call once its checks have passed and its workspace is split (kda_kcp.function makes the
checked calls; kda_kcp.sizing runs the same steps on meta inputs and an arena that only counts, to size a workspace).

Forward (docs/design.md §4): summaries of the runs whose document continues later -> one all-gather -> affine merge
into each run's incoming state -> the output pass (``ForwardCall``). Backward (``run_backward``) mirrors it with
(M^T, F) of the runs whose document started earlier, folded from the document end into each run's outgoing state
gradient, then the local gradients. Initial and final states per document (kda_kcp.states, §4b) enter as the folds'
start values and leave through the summaries of the runs that start and end a document.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from .context import KcpContext
from .exchange import gather_summaries
from .states import doc_runs, final_states, initial_state_grad, run_rows
from .walk import affine_merge

__all__ = ["KdaSaved", "ForwardCall", "run_backward", "in_backward"]


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
    # the caller's tensors' version counters when the forward read them (record_versions); None: not recorded
    versions: tuple | None = None
    # validate=True (or KDA_KCP_VALIDATE=1) in the forward: the backward checks its gradients' values too
    validate: bool = False

    CALLER_TENSORS = ("q", "k", "v", "g", "beta", "initial_state")

    def tensors(self):
        return (self.q, self.k, self.v, self.g, self.beta, self.state_in, self.initial_state)

    def _versions(self) -> tuple:
        # an inference tensor keeps no version counter (and cannot be written outside inference mode)
        return tuple(None if x is None or x.is_inference() else x._version
                     for x in (getattr(self, name) for name in self.CALLER_TENSORS))

    def record_versions(self) -> None:
        """Keep the version counters of the caller's tensors, so the backward can tell one written in place since."""
        self.versions = self._versions()

    def changed_since_forward(self) -> list[str]:
        """The names of the caller's tensors written in place since ``record_versions`` ([] when not recorded)."""
        if self.versions is None:
            return []
        return [name for name, a, b in zip(self.CALLER_TENSORS, self.versions, self._versions()) if a != b]

    def incoming_states(self, docs, dtype) -> torch.Tensor | None:
        """Each run's incoming state [R, H, K, V]: the exchange's, or the initial states of the runs' documents
        (every run starts its document when nothing is exchanged), or None (zero)."""
        if self.state_in is not None or self.initial_state is None:
            return self.state_in
        return run_rows(self.initial_state, docs, dtype)


_AUTOCAST_DEVICES = ("cpu", "cuda")  # the device types of the library's backends


def _without_autocast(step):
    """``step`` with torch.autocast off: a call computes in its own dtypes (states and summaries FP32, FP64 for
    FP64 inputs), while inside an autocast region torch's matmuls would return BF16 and mix with them."""

    @functools.wraps(step)
    def run(*args, **kwargs):
        on = [device for device in _AUTOCAST_DEVICES if torch.is_autocast_enabled(device)]
        if not on:
            return step(*args, **kwargs)
        with contextlib.ExitStack() as region:
            for device in on:
                region.enter_context(torch.autocast(device, enabled=False))
            return step(*args, **kwargs)

    return run


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


def in_backward() -> bool:
    """Whether this runs inside a backward pass (a checkpoint's recomputation of the forward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class ForwardCall:
    """One forward call in two steps, its checks passed. Making it: the chunk records; when the plan exchanges (W > 1
    with a document crossing a piece), then this rank's summaries, the all-gather and the merge into each run's
    incoming state (``saved.state_in``; with initial states the folds start from them). ``finish``: the records if
    the first step made none, then the output pass (and the final states when asked for). Inputs are read, never
    written."""

    @_without_autocast
    def __init__(self, backend, q, k, v, g, beta, ctx, scale, deterministic, dt, xbuf, arena, workspace=None,
                 walk_early=None, initial_state=None, output_final_state=False, records_now=None, validate=False):
        """``dt``: the states' dtype; ``xbuf``: the exchange buffer (None: allocated); ``arena``: the backend's
        scratch (None: allocated); ``walk_early``: whether the runs whose document starts here may be walked beside
        the exchange (None: unless this runs inside a backward pass; never with initial states, which those runs
        start from); ``records_now``: whether a call without exchange makes its records here rather than in
        ``finish`` (None: unless this runs inside a backward pass); ``validate``: the call's value checks were asked
        for (its backward then checks its gradients' values too)."""
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
                walk_early = not in_backward()
            if walk_early and initial_state is None:
                early = self.prepared.reserve_early()  # its scratch carved before the exchange's
            state_in = q.new_empty(local.num_runs, H, K, V, dtype=dt)  # saved for the backward: not scratch
            _exchange_and_merge(ctx, self.prepared.summaries, plan.fwd_publish, plan.fwd_slots, plan.fwd_sources, q,
                                v, dt, xbuf, self.arena, state_in, after_summaries=early, init=initial_state,
                                docs=self.docs)
        else:
            # Nothing to exchange: the records (the prep, the call's first kernel) are made here, so the GPU starts
            # while the host still builds the autograd nodes around the call. Not in a checkpoint's recomputation:
            # it may stop before ``finish`` (torch's early stop), and then runs no kernel at all. With run groups,
            # the first group's records too, unless ``finish`` launches something first (the initial states' rows).
            if records_now is None:
                records_now = not in_backward()
            if records_now:
                self.prepared = self.backend.fwd_prepare(q, k, v, g, beta, scale, local, self.arena, output_next=True,
                                                         lead=initial_state is None)
        self.saved = KdaSaved(q, k, v, g, beta, state_in, scale, deterministic, ctx, initial_state,
                              bool(output_final_state), validate=validate)
        self.saved.record_versions()  # the saved tensors are references: the backward checks they are unchanged

    @_without_autocast
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



@_without_autocast
def run_backward(backend, do, saved, ctx, dt, xbuf, arena, passes, workspace, dht=None,
                 initial_state_grad_wanted=True):
    """The backward of ``saved`` with its checks passed (kda_kcp.function.backward_kcp): (dq, dk, dv, dg, dbeta) in
    the input dtypes, and dh0 after them when the forward took initial states. ``passes``: the lean backward's pass
    count (None: replay)."""
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
    grads = tuple(gr if gr.dtype == x.dtype else gr.to(x.dtype) for gr, x in zip(grads, (q, k, v, g, beta)))
    return grads if h0 is None else (*grads, dh0)
