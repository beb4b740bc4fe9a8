"""The lean backward (``local_arena="lean"``): the walks' segments in 1..8 passes (``bwd_tables.lean_passes``), each
pass prepping, walking and finishing its own chunks on buffers sized for the largest pass, bitwise equal to the
replay backward (``kda_kcp.cuda.backward.PreparedBackward``, which calls ``lean_grads``).
"""

from __future__ import annotations

import torch

from .. import status
from . import tuning
from .bwd_layout import PREP_BYTES, hi_state_shape, scaled_state_shape
from .bwd_streams import both_walks
from .bwd_tables import lean_passes, seg_tables
from .common import _D

__all__ = ["lean_grads"]


def lean_grads(mod, q, k, v, g, beta, do, scale, plan, sin, dso, e0, arena, passes, grads):
    """The lean backward: per-pass prep records, h and dh (sized for the largest pass); ``mod`` None: the carves
    only."""
    H = q.shape[1]
    dev = arena.device
    st = seg_tables(plan, H, dev)
    lean = lean_passes(plan, H, dev, passes)
    ncmax = max(p.num_chunks for p in lean)
    prep_all = arena.empty((ncmax * H * PREP_BYTES,), torch.uint8)
    h_all = arena.empty(hi_state_shape(ncmax, H), torch.bfloat16)
    dh_all = arena.empty(scaled_state_shape(ncmax, H), torch.uint8)

    def views(p):  # exact-size buffers of one pass
        return prep_all[: p.num_chunks * H * PREP_BYTES], h_all[: p.num_chunks], dh_all[: p.num_chunks]

    # the segments' summaries and their folds
    m = e = mt = f = None
    if st.num_sum_f:
        m = arena.empty((st.num_sum_f, H, _D, _D), torch.float32)
        e = arena.empty((st.num_sum_f, H, _D, _D), torch.float32)
    if st.num_sum_r:
        mt = arena.empty((st.num_sum_r, H, _D, _D), torch.float32)
        f = arena.empty((st.num_sum_r, H, _D, _D), torch.float32)
    ffold = arena.empty((st.num_fold_f, H, _D, _D), torch.float32) if st.num_sum_f else e0
    rfold = arena.empty((st.num_fold_r, H, _D, _D), torch.float32) if st.num_sum_r else e0
    if mod is None:
        return
    word = status.word(dev)
    if st.num_sum_f or st.num_sum_r:
        # summaries of every segment first (they need every pass's records), then the folds
        for p in lean:
            if not p.has_summaries:
                continue
            prep, _, _ = views(p)
            mod.bwd_prep(q, k, v, g, beta, p.chunks, prep, scale, word)
            if p.fsum.shape[0]:
                mod.bwd_fwd_summary(prep, p.chunks, p.fsum, m, e, st.summary_warps)
            if p.rsum.shape[0]:
                mod.bwd_rev_summary(do, prep, p.chunks, p.rsum, mt, f, st.summary_warps)
        if st.num_sum_f:
            mod.merge_fold(m, e, st.fchains, sin, ffold)
        if st.num_sum_r:
            mod.merge_fold(mt, f, st.rchains, dso, rfold)
    dq, dk, dv, dg, dbeta = grads
    for p in lean:  # (each pass walks a subset of the rows at the whole table's widths: not measured per pass)
        prep, h, dh = views(p)
        mod.bwd_prep(q, k, v, g, beta, p.chunks, prep, scale, word)
        both_walks(lambda: mod.bwd_rev_walk(do, prep, p.chunks, p.rwalk, dso, rfold, e0, dh, st.walk_warps),
                    lambda: mod.bwd_fwd_walk(prep, p.chunks, p.fwalk, sin, ffold, e0, h, st.walk_warps), dev)
        mod.bwd_grads(q, k, v, g, beta, do, p.chunks, prep, h, dh, dq, dk, dv, dg, dbeta, scale,
                      tuning.bwd_grads_warps())
