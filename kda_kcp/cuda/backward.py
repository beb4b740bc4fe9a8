"""CUDA backward of the chunked KDA (csrc/kda_bwd.cu): the two backward operations of a KCP call.

    bwd_grads      dq, dk, dv, dg, dbeta of every run from its incoming state and outgoing state gradient
    bwd_summaries  (M^T, F) of listed runs from a zero state gradient: dS_in = Mt dS_out + F

Stages (docs/kernels.md §1, §4, §5): a prep kernel per (chunk, head) writes one 160.5 KiB record
(W, Kg, s Qg as bf16; Aqk as bf16 hi + lo, A as bf16 hi; U as fp16 at a power of two; P as fp32; gamma; room for
dV_new); a forward walk per (run, head) (one 8-warp CTA of all 128 value columns) writes h (the state entering each
chunk) and V_new over U; a reverse walk writes dh (the gradient of the state leaving each chunk) and dV_new, or the
summaries; a gradient kernel per (chunk, head) finishes from the record, h and dh. h holds each state as bf16 hi
only, dh as fp16 at a power of two per walk warp, in the walks' register order; V_new and dV_new reach the gradient
kernel as fp16 the same way. Because the forward walk overwrites U, the records of a ``PreparedBackward`` serve one
``grads`` call. Nothing is reduced with atomics: both packages run the same kernels and the result is bitwise
repeatable; ``deterministic`` is accepted for either value.

This module carves each call's buffers and launches the kernels (``PreparedBackward``). The rest of the backward:

    bwd_layout   the byte layouts of the records, h and dh (the sizes the carves take)
    bwd_tables   the schedule: chunk, segment, walk-group, lean-pass and summary tables
    bwd_streams  the two walks on two streams, and the pipelined walk groups with their gradients
    bwd_lean     the lean backward's passes
    tuning       every choice the tables and streams follow

Tensors: q, k, v, do bf16 [T, H, 128]; g fp32 [T, H, 128]; beta bf16 [T, H]; incoming states, their
gradients and the summaries fp32 [R, H, 128, 128] indexed [run, head, key, value].
"""

from __future__ import annotations

import torch

from .. import status
from ..arena import Arena
from ..jit import load_program
from . import tuning
from .bwd_layout import PREP_BYTES, hi_state_shape, scaled_state_shape
from .bwd_lean import lean_grads
from .bwd_streams import both_walks, pipelined_walks_and_grads
from .bwd_tables import chunk_tables, seg_tables, summary_tables, walk_groups
from .common import _D, _c, check_grid_bounds, check_tensors, sm_count

__all__ = ["PreparedBackward", "bwd_grads", "bwd_summaries", "ENTRY_POINTS", "load"]


# the program's entry points the backward's modules call (scripts/check_entry_points.py checks them in every build)
ENTRY_POINTS = ("bwd_prep", "bwd_fwd_walk", "bwd_rev_walk", "bwd_fwd_summary", "bwd_rev_summary", "merge_fold",
                "bwd_grads", "status_fill")


def load(device=None):
    """The tvm_ffi module of kda_bwd (build.json) for the arch of ``device`` (kda_kcp.jit caches it)."""
    return load_program("kda_bwd", device)


def _forward_program(device):
    """The forward's program (kda_kcp.cuda.forward.load), for its affine compose."""
    from . import forward

    return forward.load(device)


def _state(x, n, H, none, name):
    """A state argument of a binding: ``none`` (a 0-element tensor) when absent."""
    if x is None:
        return none
    x = x.to(device=none.device, dtype=torch.float32).contiguous()  # a no-op for the states kda_kcp.steps hands in
    if tuple(x.shape) != (n, H, _D, _D):
        raise ValueError(f"{name} must be [{n}, {H}, {_D}, {_D}], got {tuple(x.shape)}")
    return x


class PreparedBackward:
    """One backward call: with the replay arena (``passes`` None) every chunk's prep record is made once
    and read by the backward summaries of the runs a rank publishes (KCP) and by the local gradients; the
    lean backward (``passes`` 1..8) preps per pass instead. Scratch comes from ``arena``
    (``kda_kcp.arena.Arena``; None: allocated); the records are its first carve. On an arena that only counts,
    every step carves what it carves on the GPU and launches nothing (``mod`` None): that sizes the call."""

    def __init__(self, q, k, v, g, beta, do, scale, plan, arena=None, passes=None, checked=False):
        """``checked``: q, k, v, g, beta passed ``kda_kcp.validate.check_inputs`` for the CUDA backend in the
        forward and ``do`` is the backward's checked, bf16, contiguous output gradient (``CudaBackend.bwd_prepare``
        from ``backward_kcp``): then nothing is checked again before the prep's launch. That runs on autograd's
        device thread right after it wakes, where each Python step costs several times its warm time (on the
        H200 the first launch came 875 us into the H = 16 backward)."""
        if not checked:
            check_tensors("CUDA backward", q, k, v, g, beta, do)
            q, k, v, g, beta, do = (_c(x) for x in (q, k, v, g, beta, do))
        self.q, self.k, self.v, self.g, self.beta, self.do = q, k, v, g, beta, do
        self.scale, self.plan, self.passes = float(scale), plan, passes
        self.arena = arena if arena is not None else Arena(None, q.device)
        self.dev = self.arena.device  # the inputs' (meta when the arena only counts: then the one sized for)
        counting = self.arena.counting
        self.word = None if counting else status.word(self.dev)
        self.H = q.shape[1]
        check_grid_bounds(self.H, plan.num_chunks)
        self.active = q.shape[0] > 0 and plan.num_runs > 0
        self.mod = load(self.dev) if self.active and not counting else None  # None: nothing to launch
        self.prep, self.used = None, False
        if self.active and passes is None:
            chunks, _ = chunk_tables(plan, self.dev)
            self.prep = self.arena.empty((chunks.shape[0] * self.H * PREP_BYTES,), torch.uint8)
            if self.mod is not None:
                self.mod.bwd_prep(q, k, v, g, beta, chunks, self.prep, self.scale, self.word)
        self.e0 = self.arena.empty((0,), torch.float32)  # an absent optional argument (0 bytes: no carve moves)

    def summaries(self, run_ids, arena=None):
        """(Mt [n, H, K, K], F [n, H, K, V]) fp32 of the listed runs: dS_in = Mt dS_out + F; scratch from ``arena``
        (None: the call's)."""
        H, arena = self.H, self.arena if arena is None else arena
        run_ids = tuple(int(r) for r in run_ids)
        Mt = arena.empty((len(run_ids), H, _D, _D), torch.float32)
        F = arena.empty((len(run_ids), H, _D, _D), torch.float32)
        if not run_ids:
            return Mt, F
        tabs = summary_tables(self.plan, run_ids, self.dev, own_chunks=self.prep is None, heads=H)
        prep = self.prep
        if prep is None:  # lean: these runs' records apart
            prep = arena.empty((tabs.chunks.shape[0] * H * PREP_BYTES,), torch.uint8)
        if tabs.chains is not None:  # segments: every segment's summary, then each run's chain composed
            mt = arena.empty((tabs.num_rows, H, _D, _D), torch.float32)
            f = arena.empty((tabs.num_rows, H, _D, _D), torch.float32)
        if self.mod is None:
            return Mt, F
        if self.prep is None:  # (lean)
            self.mod.bwd_prep(self.q, self.k, self.v, self.g, self.beta, tabs.chunks, prep, self.scale, self.word)
        warps = tuning.bwd_rev_summary_warps(tabs.num_rows, H, sm_count(self.dev))
        if tabs.chains is None:
            self.mod.bwd_rev_summary(self.do, prep, tabs.chunks, tabs.rows, Mt, F, warps)
            status.fill(self.mod, self.dev, Mt, F)  # NaN, not garbage, for the other ranks (kda_kcp.status)
            return Mt, F
        # (the forward's program exports the affine compose; both programs are loaded with the backend)
        self.mod.bwd_rev_summary(self.do, prep, tabs.chunks, tabs.rows, mt, f, warps)
        _forward_program(self.dev).merge_compose(mt, f, tabs.chains, Mt, F)
        status.fill(self.mod, self.dev, Mt, F)
        return Mt, F

    def grads(self, state_in=None, dstate_out=None):
        """dq, dk, dv (bf16), dg (fp32), dbeta (bf16) of every run, from each run's incoming state and
        the gradient of its outgoing state (None: zero); NaN if the status word is set (kda_kcp.status), which
        then reaches the host (status.finish)."""
        grads = self._grads(state_in, dstate_out)
        if self.mod is not None:
            status.finish(self.mod, self.dev, *grads)
        return grads

    def _grads(self, state_in, dstate_out):
        if self.used:  # the forward walk wrote V_new over the records' U
            raise RuntimeError("PreparedBackward.grads runs once per prepared backward")
        self.used = True
        q, k, v, g, beta, do = self.q, self.k, self.v, self.g, self.beta, self.do
        grads = tuple(torch.empty_like(x) for x in (q, k, v, g, beta))
        if not self.active:
            return grads
        H, R, arena, mod, e0 = self.H, self.plan.num_runs, self.arena, self.mod, self.e0
        sin = _state(state_in, R, H, e0, "state_in")
        dso = _state(dstate_out, R, H, e0, "dstate_out")
        if self.passes is not None:
            lean_grads(mod, q, k, v, g, beta, do, self.scale, self.plan, sin, dso, e0, arena, self.passes,
                            grads)
            return grads
        dq, dk, dv, dg, dbeta = grads
        chunks, _ = chunk_tables(self.plan, self.dev)
        nc, prep = chunks.shape[0], self.prep
        st = seg_tables(self.plan, H, self.dev)
        groups = walk_groups(self.plan, H, self.dev) if tuning.bwd_pipeline() else None
        # every buffer of both chains is carved here, on the current stream, before any fork
        h = arena.empty(hi_state_shape(nc, H), torch.bfloat16)
        dh = arena.empty(scaled_state_shape(nc, H), torch.uint8)
        ffold = rfold = e0
        if st.num_sum_f:
            m = arena.empty((st.num_sum_f, H, _D, _D), torch.float32)
            e = arena.empty((st.num_sum_f, H, _D, _D), torch.float32)
            ffold = arena.empty((st.num_fold_f, H, _D, _D), torch.float32)
        if st.num_sum_r:
            mt = arena.empty((st.num_sum_r, H, _D, _D), torch.float32)
            f = arena.empty((st.num_sum_r, H, _D, _D), torch.float32)
            rfold = arena.empty((st.num_fold_r, H, _D, _D), torch.float32)
        # the split walks' hand-off buffers (one state per row of a group, each way; every piece of a chain reads
        # and writes its rows' slots in place)
        handoff = {id(grp): tuple(arena.empty((grp.rows, H, _D, _D), torch.float32) for _ in "rf")
                   for grp in groups or () if grp.pieces > 1}
        if mod is None:
            return grads

        def fwd_folds():  # the segments' incoming states (segmented walks only)
            if st.num_sum_f:
                mod.bwd_fwd_summary(prep, chunks, st.fsum, m, e, st.summary_warps)
                mod.merge_fold(m, e, st.fchains, sin, ffold)

        def rev_folds():  # the segments' outgoing state gradients
            if st.num_sum_r:
                mod.bwd_rev_summary(do, prep, chunks, st.rsum, mt, f, st.summary_warps)
                mod.merge_fold(mt, f, st.rchains, dso, rfold)

        def fwd_chain():
            fwd_folds()
            mod.bwd_fwd_walk(prep, chunks, st.fwalk, sin, ffold, e0, h, st.walk_warps)

        def rev_chain():
            rev_folds()
            mod.bwd_rev_walk(do, prep, chunks, st.rwalk, dso, rfold, e0, dh, st.walk_warps)

        if groups is None:
            both_walks(rev_chain, fwd_chain, self.dev)
            mod.bwd_grads(q, k, v, g, beta, do, chunks, prep, h, dh, dq, dk, dv, dg, dbeta, self.scale,
                          tuning.bwd_grads_warps())
            return grads
        if st.num_sum_f or st.num_sum_r:  # segmented: every segment's state before any walk
            both_walks(rev_folds, fwd_folds, self.dev)

        def launch_walk(grp, which, p):  # piece p of a chain (in its launch order)
            last = p == grp.pieces - 1
            if grp.pieces == 1:
                fold_in, out = (rfold if which == "rev" else ffold), e0
            else:
                buf = handoff[id(grp)][0 if which == "rev" else 1]
                fold_in, out = (e0 if p == 0 else buf), (e0 if last else buf)
            if which == "rev":
                mod.bwd_rev_walk(do, prep, chunks, grp.rev_pieces[p], dso, fold_in, out, dh, st.walk_warps)
            else:
                mod.bwd_fwd_walk(prep, chunks, grp.fwd_pieces[p], sin, fold_in, out, h, st.walk_warps)

        rec, scale, grads_warps = H * PREP_BYTES, self.scale, tuning.bwd_grads_warps()

        def launch_grads(ranges):
            for c0, c1 in ranges:  # views of the chunk rows, records, h and dh of one range
                mod.bwd_grads(q, k, v, g, beta, do, arena.rows(chunks, c0, c1), arena.rows(prep, c0 * rec, c1 * rec),
                              arena.rows(h, c0, c1), arena.rows(dh, c0, c1), dq, dk, dv, dg, dbeta, scale, grads_warps)

        pipelined_walks_and_grads(groups, launch_walk, launch_grads, self.dev)
        return grads


def bwd_grads(q, k, v, g, beta, do, scale, plan, state_in=None, dstate_out=None, deterministic=True, arena=None,
              passes=None):
    """dq, dk, dv (bf16), dg (fp32), dbeta (bf16) of every run of ``plan`` (``CudaBackend.bwd_grads``).
    ``passes`` (1..8) runs the lean backward, bitwise equal to the default (replay) one."""
    return PreparedBackward(q, k, v, g, beta, do, scale, plan, arena, passes).grads(state_in, dstate_out)


def bwd_summaries(q, k, v, g, beta, do, scale, plan, run_ids, arena=None):
    """(Mt, F) fp32 of the listed runs: dS_in = Mt dS_out + F (``CudaBackend.bwd_summaries``)."""
    return PreparedBackward(q, k, v, g, beta, do, scale, plan, arena).summaries(run_ids)
