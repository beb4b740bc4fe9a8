"""Every tuning choice of the CUDA backend, each a pure function of the shapes and the GPU's SM count.

The wrappers (kda_kcp/cuda/forward.py, backward.py) ask this module how to cut and launch a call: how many chunks a
walk segment holds, how many warps a CTA has, which runs' walks and gradients overlap on side streams. A choice
depends only on the run lengths, H and the SM count, so a call is bitwise repeatable on one GPU model
(docs/design.md §9). The backward's walk widths, the streams and the pipelines (run groups, walk groups, walk
pieces) change when and where a kernel runs, never what it computes; segment lengths (where runs are cut) and the
gradient kernel's warps (how dg's and dbeta's partial sums group) move low bits within the accuracy bounds. Units:
a chunk is 64 tokens; a walk step is one chunk of one CTA.

One override, for experiments and A/Bs only: ``KDA_KCP_TUNING="key=value,..."`` (e.g.
``KDA_KCP_TUNING="bwd_seg_chunks=8,fwd_warps=8"``) forces the listed choices; ``KNOBS`` lists the keys and their
values. An unknown key or a bad value raises ValueError at the first call that reads it. Every table cache keys on
``cache_key()``.
"""

from __future__ import annotations

import functools
import math
import os
from types import MappingProxyType

from .common import _D, even_split

__all__ = ["ENV", "KNOBS", "overrides", "cache_key",
           "fwd_warps", "fwd_early_mode", "fwd_early", "fwd_pipeline", "fwd_segment_chunks", "fwd_model_time",
           "fwd_run_groups", "fwd_group_walk_priority",
           "bwd_segment_chunks", "bwd_summary_chunks", "bwd_hidden_gradients", "walk_warps", "bwd_walk_warps",
           "bwd_summary_warps", "bwd_rev_summary_warps", "bwd_grads_warps", "bwd_walk_streams", "bwd_pipeline",
           "bwd_max_walk_groups", "group_runs", "bwd_walk_groups", "bwd_walk_pieces", "REV_STEP_RATIO"]

ENV = "KDA_KCP_TUNING"

# key -> (the values it takes: a tuple, or None for any integer >= 0; what it forces)
KNOBS = {
    "fwd_seg_chunks": (None, "chunks per forward walk segment (0: whole runs)"),
    "fwd_warps": ((2, 4, 8), "warps per forward walk CTA"),
    "fwd_early": ((0, 1, 2), "the KCP forward's early output pass (fwd_early_mode)"),
    "fwd_pipeline": ((0, 1), "whole-run forwards prep and walk by run group"),
    "bwd_seg_chunks": (None, "chunks per backward walk segment (0: whole runs)"),
    "bwd_summary_chunks": (None, "chunks per segment of the KCP exchange's backward summaries (0: whole runs)"),
    "bwd_walk_warps": ((4, 8), "warps per backward walk and summary CTA"),
    "bwd_grads_warps": ((8, 16), "warps per gradient kernel CTA"),
    "bwd_walk_streams": ((0, 1), "the backward's two walk chains on two streams"),
    "bwd_pipeline": ((0, 1), "the backward's walks pipelined with the gradient kernel"),
    "bwd_walk_groups": ((2, 3, 4), "walk groups at most"),
    "bwd_walk_pieces": (tuple(range(1, 17)), "launches per whole-run walk chain"),
}


def _allowed(values) -> str:
    if values is None:
        return "an integer >= 0"
    if len(values) > 4 and values == tuple(range(values[0], values[-1] + 1)):
        return f"an integer in {values[0]}..{values[-1]}"
    return ", ".join(map(str, values[:-1])) + " or " + str(values[-1])


@functools.lru_cache(maxsize=16)
def _parse(text: str) -> tuple:
    """(the (key, value) pairs of an override string sorted by key, the same as a read-only mapping); checked
    against KNOBS."""
    out = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = (s.strip() for s in item.partition("="))
        if key not in KNOBS:
            raise ValueError(f"{ENV}: unknown key {key!r}; the keys are {', '.join(KNOBS)}")
        values = KNOBS[key][0]
        if key in out:
            raise ValueError(f"{ENV}: {key} is given twice")
        if not sep or not (value.isascii() and value.isdigit()) or (values is not None and int(value) not in values):
            raise ValueError(f"{ENV}: {key} must be {_allowed(values)}, got {value if sep else item.strip()!r}")
        out[key] = int(value)
    items = tuple(sorted(out.items()))
    return items, MappingProxyType(dict(items))


def _current() -> tuple:
    return _parse(os.environ.get(ENV, ""))


def overrides() -> dict:
    """The choices ``KDA_KCP_TUNING`` forces (key -> int); {} when it is unset or empty."""
    return dict(_current()[1])


def cache_key() -> tuple:
    """What every table cache keys on besides the shapes: the overridden choices, () by default."""
    return _current()[0]


def _forced(key: str):
    """The value ``KDA_KCP_TUNING`` forces for ``key``, or None."""
    return _current()[1].get(key)


def _or(key: str, default: int) -> int:
    v = _forced(key)
    return default if v is None else v


def _best_length(run_chunks: list[int], cost, least: int, most_segments: int) -> int:
    """The chunks per segment L that minimise ``cost(L)`` over the candidates (the longest run's length, and
    ceil(longest / n) for n up to ``most_segments`` if at least ``least``), the longest first on ties."""
    longest = max(run_chunks, default=1)
    best = None
    for L in sorted({longest} | {max(1, math.ceil(longest / n)) for n in range(1, most_segments + 1)}, reverse=True):
        if L < least and L != longest:
            continue
        t = cost(L)
        if best is None or t < best[0] - 1e-9:
            best = (t, L)
    return best[1]


# =====================================================================================================
# forward
# =====================================================================================================
def fwd_warps() -> int:
    """Warps per forward walk CTA: 4. Two 4-warp CTAs share an SM; 2 warps ran slower at every H and 8 gained no
    residency (docs/kernels.md, rejected ideas)."""
    return _or("fwd_warps", 4)


def fwd_early_mode() -> int:
    """The KCP forward's early output pass: 0 (the default) walks every run after the exchange; 1 walks the runs
    whose incoming state is zero on a side stream once this rank's summaries are done, beside the all-gather and
    the merge; 2 beside the summaries too. Off because its A/B is mixed (H200: 1 gained up to 1.3 ms on zigzag rows
    at W = 2 and was even or 0.1-0.2 ms slower on contiguous H = 16)."""
    return _or("fwd_early", 0)


def fwd_early() -> bool:
    """Whether the KCP forward walks the runs whose incoming state is zero before the exchange."""
    return fwd_early_mode() != 0


def fwd_pipeline() -> bool:
    """Whether a whole-run forward may prep and walk by run group (``fwd_run_groups``): yes."""
    return _or("fwd_pipeline", 1) == 1


# ---- cost model of one walk step (one chunk of one CTA), in units of an output step at NW = 4 ----
SUMMARY_STEP = 0.57  # [M | E] tiles: (256 + 296) / 2 mma per warp against 484 (priced on the mma.sync walk)
CTAS_PER_SM = 2  # walk CTAs resident per SM (smem 86.5 KB at NW = 4, 218 registers)
MERGE_STEP = 1.5  # one fold step (128 x 128 x 128) in output steps, priced on the FP32-FMA merge (now ~0.6 of it)
CTA_START = 1.0  # a CTA's first loads and state in/out, in output steps
# A CTA alone on its SM steps faster than one of two sharing it: whole runs at H = 16 (128 CTAs on 132
# SMs) took 0.62 of the shared step time (H200: fwd 13.29 -> 11.45 ms against 58-chunk segments).
LONE_STEP = 0.62


def _pass_steps(lengths: list[int], ctas_per_seg: int, step: float, slots: int) -> float:
    """Estimate (in output steps) of one pass of CTAs, `slots` resident at a time. When every CTA is resident from
    the start nothing waits for a slot, and the longest CTA sets the time: at the lone step with one CTA per SM,
    at the shared step otherwise (some SMs hold one, but the block scheduler doubles up the SMs of the first CTAs,
    so the longest runs' CTAs mostly share). Past that, the list-scheduling bound."""
    if not lengths:
        return 0.0
    n = len(lengths) * ctas_per_seg
    longest = (max(lengths) + CTA_START) * step
    if n <= slots // CTAS_PER_SM:  # one CTA per SM: the longest alone sets the time
        return longest * LONE_STEP
    if n <= slots:  # all resident at once (the bound priced 256 whole-run CTAs on 264 slots at 1.7x)
        return longest
    work = sum(length + CTA_START for length in lengths) * ctas_per_seg * step
    return work / slots + longest * (1.0 - 1.0 / slots)


def fwd_model_time(run_chunks: list[int], heads: int, sms: int, L: int, warps: int = 4) -> float:
    """Walk time (output steps) with segments of L chunks: summary pass + fold + output pass."""
    tiles_out = _D // (16 * warps)
    slots = CTAS_PER_SM * sms
    fwd, summ, steps = [], [], 0
    for c in run_chunks:
        n = max(1, math.ceil(c / L))
        parts = even_split(c, n)
        fwd += parts * heads
        summ += parts[:-1] * heads
        steps = max(steps, n - 1)
    t = _pass_steps(fwd, tiles_out, 1.0, slots)
    t += _pass_steps(summ, 2 * tiles_out, SUMMARY_STEP, slots)
    return t + MERGE_STEP * steps


def fwd_segment_chunks(run_chunks: list[int], heads: int, sms: int, warps: int | None = None) -> int:
    """Chunks per forward walk segment: the length (at least 4, or whole runs) that minimises ``fwd_model_time``,
    so that few long runs still fill the SMs (segments cost a summary pass and a fold)."""
    forced = _forced("fwd_seg_chunks")
    run_chunks = [c for c in run_chunks if c > 0]
    if forced is not None:
        return forced if forced > 0 else max(run_chunks, default=1)
    if not run_chunks:
        return 1
    warps = fwd_warps() if warps is None else warps
    return _best_length(run_chunks, lambda L: fwd_model_time(run_chunks, heads, sms, L, warps), 4, 256)


# ---- the prep and the output walk by run group (whole-run walks) ----
MAX_RUN_GROUPS = 4
PREP_CTAS_PER_SM = 2  # prep CTAs resident per SM (101.75 KB of shared memory, 256 threads)
GROUP_PREP_WAVES = 2  # a group (but the last) preps at least this many waves of prep CTAs
# Preps and walks that run at once slow each other (a walk step ~1.35x, the prep on those SMs ~2x, H200; much of
# the prep's share was SMs configured by a walk with no room for a prep CTA, which the kernels' whole shared-memory
# carveout removes), so the pipeline pays only through the walks of the shorter runs that end before the longest
# one: the last group's walk, which starts after every prep, must be clearly shorter than the first's (4 documents
# of 1,021 chunks at H = 16: 10.44 against 8.10 ms). Benchmark batch: H = 64 fwd 30.9 against 32.0 ms, H = 16 8.91
# against 9.22 ms.
LAST_FRACTION = 0.75  # pipelined only if the last group's longest run is at most this fraction of the first's


def fwd_run_groups(lengths: dict, heads: int, sms: int) -> list | None:
    """Run ids (``lengths``: run id -> chunks, whole runs) in the groups a forward preps and walks in turn, longest
    runs first, or None (one group). A group is closed once it holds GROUP_PREP_WAVES waves of prep CTAs
    (chunk-heads), at most MAX_RUN_GROUPS groups (the last takes the rest): the longest run's walk, the forward's
    critical path at H >= 16, starts once its own records are made, beside the shorter runs' preps. None also when
    the last group's longest run is longer than LAST_FRACTION of the first's (the pipeline then costs more than it
    hides) or ``fwd_pipeline`` is off."""
    if not fwd_pipeline():
        return None
    least = GROUP_PREP_WAVES * PREP_CTAS_PER_SM * sms
    groups, work = [], 0
    for r in sorted(lengths, key=lambda r: (-lengths[r], r)):
        if not groups or (work >= least and len(groups) < MAX_RUN_GROUPS):
            groups.append([])
            work = 0
        groups[-1].append(r)
        work += lengths[r] * heads
    if len(groups) > 1 and max(lengths[r] for r in groups[-1]) <= LAST_FRACTION * max(lengths[r] for r in groups[0]):
        return groups
    return None


def fwd_group_walk_priority(rows: int, heads: int, sms: int) -> int:
    """Stream priority of the run groups' output walks (``rows`` whole-run rows): -1 (high) when the walk CTAs fit one
    per SM, so each group's walk takes the next free slot before the later preps (at the default priority the later
    groups' walks waited for the last prep: H = 16 9.7 against 8.91 ms); 0 when they fill the GPU (they would take
    the preps' slots)."""
    ctas = rows * heads * (_D // (16 * fwd_warps()))
    return -1 if ctas <= sms else 0


# =====================================================================================================
# backward
# =====================================================================================================
def bwd_grads_warps() -> int:
    """Warps per gradient kernel CTA: 16 (half the accumulator registers per thread, twice the warps per SM; 47.9 ms
    against 69.9 ms for 8 warps, bwd at H = 16 on the H200)."""
    return _or("bwd_grads_warps", 16)


def bwd_walk_streams() -> bool:
    """Whether the two walk chains (forward: h, V_new; reverse: dh, dV_new) run on two streams: yes, they are
    independent and overlap their summaries and folds (bwd at H = 4: -0.21 ms)."""
    return _or("bwd_walk_streams", 1) == 1


def bwd_pipeline() -> bool:
    """Whether the backward's walks are pipelined with the gradient kernel (walk groups and pieces): yes."""
    return _or("bwd_pipeline", 1) == 1


MAX_WALK_GROUPS = 4  # (two streams each)


def bwd_max_walk_groups() -> int:
    """Walk groups at most: MAX_WALK_GROUPS."""
    return _or("bwd_walk_groups", MAX_WALK_GROUPS)


# ---- segments: runs split into pieces of whole chunks, walked in parallel (affine merge) ----
SEG_CTA_OVERHEAD = 2.0  # start-up of one walk CTA, in chunk steps
FOLD_STEP_COST = 1.0  # one fold step, in chunk steps
# The gradient kernel on one (chunk, head), in the estimate's unit (half a walk step, ~1.6 us on the H200): one
# 16-warp CTA per SM, 19.5 ms for the 65,344 chunk-heads of H = 16 on 132 SMs is ~39 us.
GRAD_STEP_COST = 25.0


def _pass_time(lengths, copies: int, slots: int) -> float:
    if not lengths:
        return 0.0
    work = (sum(lengths) + SEG_CTA_OVERHEAD * len(lengths)) * copies
    return work / slots + max(lengths) + SEG_CTA_OVERHEAD


def bwd_segment_chunks(run_chunks: list[int], heads: int, sms: int) -> int:
    """Chunks per backward walk segment (at least 8, or whole runs) minimising a list-scheduling estimate of the two
    walks. The estimate counts work in 64-column tiles of the state: 2 per (segment, head) for a walk, 4 per
    (non-final segment, head) for a summary, one tile per SM at a time. That is the unit it was calibrated in
    (4-warp walk CTAs of 64 columns); counting an 8-warp CTA of 128 columns as one slot chose 66-chunk segments at
    H = 16, measured 38.4 ms against 32.3 ms for whole runs. Whole runs are credited with the gradient time their
    pipelined walk groups hide (``bwd_hidden_gradients``; the lean path's passes do not pipeline, and use the same
    choice). With the chains on two streams their tiles share the SMs and the longest segment's steps count once;
    counted one after the other, the estimate chose 45-chunk segments for the benchmark batch at H = 4, measured
    9.14 ms against 8.44 ms for whole runs."""
    longest = max(run_chunks, default=1)
    forced = _forced("bwd_seg_chunks")
    if forced is not None:
        return longest if forced <= 0 else forced
    streams = bwd_walk_streams()
    hidden = bwd_hidden_gradients(run_chunks, heads, sms) if bwd_pipeline() and streams else 0.0

    def cost(L: int) -> float:
        walk, summ, steps = [], [], 0
        for c in run_chunks:
            parts = even_split(c, math.ceil(c / L))
            walk += parts
            summ += parts[:-1]
            steps = max(steps, len(parts) - 1)
        if streams:
            t = _pass_time(walk, 4 * heads, sms) + _pass_time(summ, 8 * heads, sms)
        else:
            t = 2 * (_pass_time(walk, 2 * heads, sms) + _pass_time(summ, 4 * heads, sms))
        t += 2 * FOLD_STEP_COST * steps
        return t - hidden if L >= longest else t

    return _best_length(run_chunks, cost, 8, 128)


def bwd_hidden_gradients(run_chunks: list[int], heads: int, sms: int) -> float:
    """Gradient time that whole-run walks hide, in ``bwd_segment_chunks``' unit: each walk group but the longest
    starts its gradients when its own walks end, beside the longer walks, i.e. for up to (longest - its longest run)
    units (its two walks run at once); all of them within the first group's window. Segmented walks end together
    and hide almost none. Without it the estimate chose 66- and 77-chunk segments for one rank's runs at W = 2,
    H = 16 (contiguous [658, 1386], zigzag [536, 1143, 365] chunks), measured 1.7 and 2.1 ms slower than whole
    runs."""
    lengths = {r: c for r, c in enumerate(run_chunks) if c > 0}  # an empty run has no walk, so no group
    groups = bwd_walk_groups(lengths)
    if len(groups) < 2:
        return 0.0
    longest = max(run_chunks)
    hidden = 0.0
    for ids in groups[:-1]:
        window = longest - max(lengths[r] for r in ids)
        hidden += min(window, GRAD_STEP_COST * heads * sum(lengths[r] for r in ids) / sms)
    return min(hidden, longest - max(lengths[r] for r in groups[0]))


# One composed segment, in chunk steps. Fitted to a probe of one published run (H200): at H = 16, 486 chunks
# took 0.575 / 0.638 / 0.705 / 0.754 ms in segments of 64 / 32 / 27 / 16 chunks, 1386 chunks 1.573 / 1.635 / 1.887
# ms in 64 / 32 / 16 (whole runs 1.383 and 3.816 ms): more segments than the GPU needs cost more than the fold's
# 1 step each.
COMPOSE_STEP_COST = 3.0


def bwd_summary_chunks(run_chunks: list[int], heads: int, sms: int) -> int:
    """Chunks per segment of the KCP exchange's reverse summaries (at least 8, or whole runs): each published run is
    cut into segments whose summaries are walked at once, then composed in order. A whole run's summary is one
    serial walk of all its chunks (4 tiles per head, one SM each: 64 of the 132 SMs at H = 16), on the critical path
    of every rank (the others wait for it in the all-gather). The estimate is ``bwd_segment_chunks``' list
    scheduling of the summary pass plus COMPOSE_STEP_COST per composed segment."""
    forced = _forced("bwd_summary_chunks")
    if forced is not None:
        return max(run_chunks, default=1) if forced <= 0 else forced

    def cost(L: int) -> float:
        parts, steps = [], 0
        for c in run_chunks:
            ps = even_split(c, math.ceil(c / L)) if c > 0 else []
            parts += ps
            steps = max(steps, len(ps) - 1)
        return _pass_time(parts, 4 * heads, sms) + COMPOSE_STEP_COST * steps

    return _best_length(run_chunks, cost, 8, 128)


# SMs a (row, head) of a launch takes at 4 warps per CTA (``walk_warps``' demand): a reverse walk is 2 CTAs of
# 219 KB (one per SM), a forward walk 2 CTAs of 86 KB (two share an SM); the two chains run at once. A summary
# has twice the columns. The KCP exchange's reverse summaries run alone.
WALK_SMS = 3
SUMMARY_SMS = 2 * WALK_SMS
REV_SUMMARY_SMS = 4


def walk_warps(demand4: int, sms: int) -> int:
    """Warps per walk or summary CTA of a launch (csrc/kda_bwd.cu WalkShape): 4 (64 state columns per CTA) when
    ``demand4``, the SMs the launch (with whatever runs beside it) takes at 4 warps, fits on the GPU, else 8 (128
    columns: the records read once per step, half the CTAs; docs/kernels.md §4). An 8-warp CTA steps slower than a
    4-warp one alone on its SM, so a launch that fits keeps 4. The results are bitwise equal either way."""
    forced = _forced("bwd_walk_warps")
    if forced is not None:
        return forced
    return 4 if demand4 <= sms else 8


def bwd_walk_warps(rows: int, heads: int, sms: int) -> int:
    """Warps per CTA of the backward's walks (``rows`` walk rows, both chains at once)."""
    return walk_warps(WALK_SMS * rows * heads, sms)


def bwd_summary_warps(rows: int, heads: int, sms: int) -> int:
    """Warps per CTA of the segmented walks' summaries (``rows`` summary rows per chain, both chains at once)."""
    return walk_warps(SUMMARY_SMS * rows * heads, sms)


def bwd_rev_summary_warps(rows: int, heads: int, sms: int) -> int:
    """Warps per CTA of the KCP exchange's reverse summaries (``rows`` summary rows, alone on the GPU)."""
    return walk_warps(REV_SUMMARY_SMS * rows * heads, sms)


LATE_FRACTION = 0.75  # a run joins a group if its walk is at least this fraction of the group's longest one


def group_runs(lengths: dict, max_groups: int) -> list:
    """Run ids grouped by walk length, the shortest group first: runs taken longest first, a run joins the
    current group if its length is at least LATE_FRACTION of the group's longest, else opens the next group
    (the last group open takes the rest once ``max_groups`` are open)."""
    order = sorted(lengths, key=lambda r: (-lengths[r], r))
    groups = []
    for r in order:
        if not groups or (lengths[r] < LATE_FRACTION * lengths[groups[-1][0]] and len(groups) < max_groups):
            groups.append([r])
        else:
            groups[-1].append(r)
    return groups[::-1]


def bwd_walk_groups(lengths: dict) -> list:
    """The walk groups of whole runs (``lengths``: run id -> chunks; ``group_runs`` at ``bwd_max_walk_groups``): the
    walks of a run are serial in its chunks, so the shorter runs' walks end well before the longest one's, and each
    group's gradients start as soon as its own walks end, on the SMs those walks leave."""
    return group_runs(lengths, bwd_max_walk_groups())


WALK_PIECES = 4  # launches per whole-run walk chain when the walks leave SMs to the gradient kernel
# A reverse walk step over a forward one (H200, H = 4: 3.70 / 2.71 ms for the 1,386 chunks of the longest run):
# orders the pieces' gradient launches by when their chunks' h and dh are both written (nothing else depends on it)
REV_STEP_RATIO = 1.37


def bwd_walk_pieces(rows: int, heads: int, warps: int, sms: int) -> int:
    """Pieces each whole-run walk chain is launched in: WALK_PIECES when the walks' CTAs all fit on the GPU at once
    (at 4 warps a (row, head) takes WALK_SMS SMs, at 8 warps 2: one reverse and one forward CTA per SM), so that the
    gradients of the chunks both walks have passed run beside the rest of the walks, and each next piece finds the
    SMs its chain's last one frees; else 1 (walk CTAs already wait for SMs). Measured (bwd, the benchmark batch,
    det, H200): 4 pieces against 1, 7.413 / 7.398 against 7.776 / 7.838 ms at H = 4 (walks at 48 of 132 SMs),
    26.18 / 26.23 against 26.46 ms at H = 16 (128 of 132); 6 or 8 pieces within noise of 4."""
    forced = _forced("bwd_walk_pieces")
    if forced is not None:
        return forced
    demand = (WALK_SMS if warps == 4 else 2) * rows * heads
    return WALK_PIECES if demand <= sms else 1
