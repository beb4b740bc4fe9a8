"""The CUDA forward (csrc/kda_fwd.cu, docs/kernels.md §1-3): a parallel chunk prep, then V-tiled walks.

    fwd_prep      one CTA per (chunk, head): writes a 59,904-byte record (-W, Qg, Kg, Aqk, A diag(beta),
                  gamma) per (chunk, head) into a workspace
    walk_summary  one CTA per (segment, head, 16 NW of the 256 columns [M | E]): segment summaries from a
                  zero state (only for segments that are not the last of their run, or for fwd_summaries)
    merge_fold    the affine fold (S_in(j + 1) = M_j S_in(j) + E_j) of FP32 states, 3xTF32 products, fixed order
                  (csrc/kda_affine_merge.cuh)
    walk_output   one CTA per (segment, head, 16 NW value columns): o from each segment's S_in

Whole-run forwards of runs of unlike lengths prep and walk by run group, longest runs first, each group's
walk on a side stream once its own records are made (``run_group_tables``); o is bitwise the same either way. A
KCP forward can walk the runs whose document starts on the rank beside the exchange
(``PreparedForward.reserve_early``; off by default).

``fwd_output`` and ``fwd_summaries`` keep the contract of ``kda_kcp.cuda.CudaBackend``. The segment length, the
walk width, the run groups and the early pass are the choices of ``kda_kcp.cuda.tuning``, pure functions of (run
lengths, H, SM count), so results are bitwise repeatable on one GPU model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import status
from ..arena import Arena
from ..jit import load_program
from ..partition import coalesce_ranges
from . import tuning
from .common import _D, CallStreams, _c, check_grid_bounds, check_tensors, even_split, side_streams, sm_count

__all__ = ["load", "PreparedForward", "fwd_output", "fwd_summaries", "forward_tables", "RECORD_BYTES", "ENTRY_POINTS",
           "run_group_tables", "call_tables", "early_runs", "late_runs"]

CHUNK = 64
RECORD_BYTES = 59904  # kda::kFwdRecordBytes (fp16 tiles, csrc/kda_fwd.h)


def early_runs(plan) -> tuple:
    """The local runs a KCP forward walks before the exchange: those whose document starts in them (their incoming
    state is zero, whatever the other ranks publish); () unless ``tuning.fwd_early``."""
    if not tuning.fwd_early():
        return ()
    return tuple(i for i, run in enumerate(plan.runs) if run.starts_doc and run.length > 0)


def late_runs(plan, early: tuple) -> tuple:
    """The local runs the output pass walks after the exchange when ``early`` were walked before it."""
    return tuple(r for r in range(plan.num_runs) if r not in early)


@dataclass
class ForwardTables:
    chunks: torch.Tensor  # int32 [nchunk, 2]: tok_start, nrows (record index = chunk * H + head)
    out: torch.Tensor  # int32 [nseg, 8]: tok_start, ntok, first chunk, idx, kind (0: state_in[idx], 1: sin[idx]), chunks
    summary: torch.Tensor  # int32 [nsum, 8]: tok_start, ntok, first chunk, out slot, 0, chunks
    chains: torch.Tensor  # int32 [nchain, 4] for the merge (first summary, count, init run or -1, out slot)
    num_chunks: int
    num_sin: int
    num_summary: int
    seg_chunks: int
    out_rows: tuple = ()  # the rows of ``out`` on the host


def _segments(run, first_chunk: int, L: int):
    """(tok_start, ntok, first chunk, chunks) of the segments of one run (whole chunks of its grid)."""
    bounds = run.chunk_offsets(CHUNK)
    parts = even_split(len(bounds), max(1, math.ceil(len(bounds) / L)))
    out, start = [], 0
    for p in parts:
        off = bounds[start][0]
        ntok = sum(n for _, n in bounds[start:start + p])
        out.append((run.local_start + off, ntok, first_chunk + start, p))
        start += p
    return out


def _chunk_table(plan, device):
    """(int32 [Nc, 2] (tok_start, rows) of every chunk of the plan, each run's first chunk index), cached."""
    key = ("cuda_forward_chunks", str(device))
    cache = plan._tables
    if key not in cache:
        rows, firsts = [], []
        for run in plan.runs:
            firsts.append(len(rows))
            rows += [(run.local_start + off, n) for off, n in run.chunk_offsets(CHUNK)]
        cache[key] = (torch.tensor(rows, dtype=torch.int32).reshape(-1, 2).to(device), tuple(firsts), len(rows))
    return cache[key]


def forward_tables(plan, heads: int, device, run_ids=None, sms: int | None = None, out_runs=None) -> ForwardTables:
    """Tables for the output walk (of every run, or of the runs ``out_runs`` lists) or for the whole-run summaries
    of ``run_ids``. All index one chunk table, every chunk of the plan, so one prep's records serve them all.

    Pure host arithmetic (cached per plan); ``sms`` overrides the device's SM count (CPU tests)."""
    device = torch.device(device)
    summaries_only = run_ids is not None
    runs = plan.runs
    if summaries_only:
        ids = tuple(int(r) for r in run_ids)
    elif out_runs is not None:
        ids = tuple(sorted(int(r) for r in out_runs))
    else:
        ids = tuple(range(len(runs)))
    key = ("cuda_forward", ids, summaries_only, heads, str(device), sms) + tuning.cache_key()
    cache = plan._tables
    if key in cache:
        return cache[key]
    nsm = sms if sms is not None else sm_count(device)
    L = tuning.fwd_segment_chunks([runs[r].num_chunks(CHUNK) for r in ids], heads, nsm)
    chunks, firsts, nchunks = _chunk_table(plan, device)
    out, summ, chains = [], [], []
    nsin = 0
    for i, r in enumerate(ids):
        run = runs[r]
        segs = _segments(run, firsts[r], L) if run.length > 0 else []
        if summaries_only:
            chains.append((len(summ), len(segs), -1, i))
            for t0, n, c0, nc in segs:
                summ.append((t0, n, c0, len(summ), 0, nc, 0, 0))
            continue
        if len(segs) > 1:
            chains.append((len(summ), len(segs) - 1, r, nsin))
            for t0, n, c0, nc in segs[:-1]:
                summ.append((t0, n, c0, len(summ), 0, nc, 0, 0))
        if not segs:  # an empty run: no CTA (its o has no rows)
            continue
        for j, (t0, n, c0, nc) in enumerate(segs):
            if j == 0:
                out.append((t0, n, c0, r, 0, nc, 0, 0))
            else:
                out.append((t0, n, c0, nsin, 1, nc, 0, 0))
                nsin += 1
    # longest segments first: the CTAs that bound a pass start first
    out.sort(key=lambda row: -row[1])
    summ.sort(key=lambda row: -row[1])

    def t(rows, cols):
        return torch.tensor(rows, dtype=torch.int32).reshape(-1, cols).to(device)

    tabs = ForwardTables(chunks, t(out, 8), t(summ, 8), t(chains, 4), nchunks, nsin, len(summ), L, tuple(out))
    cache[key] = tabs
    return tabs


# ---- the prep and the output walk by run group (whole-run walks) ----
class RunGroup:
    """Runs whose prep and output walk go together: their chunk ranges [c0, c1) of the plan's chunk table
    (consecutive runs merged) and their rows of the output-walk table."""

    def __init__(self, ranges, out, device):
        self.ranges = ranges
        self.out = torch.tensor(out, dtype=torch.int32).reshape(-1, 8).to(device)
        self.priority = 0  # of the stream its walk runs on


def run_group_tables(plan, heads: int, device, sms: int | None = None):
    """The RunGroups of a whole-run forward, longest runs first, or None (segments, or ``tuning.fwd_run_groups``
    None). Why: the output walk of a run needs only that run's records, and a whole run's walk is serial in its
    chunks, so the longest run's walk (the forward's critical path at H >= 16) can start once its own records
    are made, while the prep of the shorter runs goes on beside it. A pure function of the plan (cached)."""
    device = torch.device(device)
    key = ("cuda_forward_groups", heads, str(device), sms) + tuning.cache_key()
    cache = plan._tables
    if key in cache:
        return cache[key]
    tabs = forward_tables(plan, heads, device, sms=sms)
    out = None
    if tabs.num_summary == 0 and tabs.out_rows:
        nsm = sms if sms is not None else sm_count(device)
        rows = {row[3]: row for row in tabs.out_rows}  # whole runs: one row per run, idx = the run id
        lengths = {r: row[5] for r, row in rows.items()}
        ids = tuning.fwd_run_groups(lengths, heads, nsm)
        if ids is not None:
            out = tuple(RunGroup(coalesce_ranges(sorted((rows[r][2], rows[r][2] + rows[r][5]) for r in grp)),
                                 [row for row in tabs.out_rows if row[3] in grp], device) for grp in ids)
            priority = tuning.fwd_group_walk_priority(len(tabs.out_rows), heads, nsm)
            for grp in out:
                grp.priority = priority
    cache[key] = out
    return out


def call_tables(plan, heads: int, device, groups: bool):
    """(``forward_tables`` of the whole plan, its ``run_group_tables`` when ``groups``, else None) as one entry of the
    plan's cache: a call reads the tuning knobs and finds the tables its prep launch needs in one look-up (each of the
    two functions reads the knobs and builds its own key)."""
    key = ("cuda_forward_call", heads, device, groups) + tuning.cache_key()
    cache = plan._tables
    tables = cache.get(key)
    if tables is None:
        tables = cache[key] = (forward_tables(plan, heads, device),
                               run_group_tables(plan, heads, device) if groups else None)
    return tables


# the program's entry points this module calls (scripts/check_entry_points.py checks them in every build)
ENTRY_POINTS = ("fwd_prep", "fwd_walk_summary", "fwd_walk_output", "merge_fold", "merge_compose", "fwd_record_bytes",
                "status_fill")


def load(device=None):
    """The tvm_ffi module of kda_fwd (build.json) for the arch of ``device`` (kda_kcp.jit caches it)."""
    return load_program("kda_fwd", device)


def _state_shape(n: int, H: int) -> tuple[int, int, int, int]:
    return (n, H, _D, _D)


class PreparedForward:
    """One forward call's chunk records, made once (fwd_prep over every chunk of the plan), then read by
    the summary walks of the runs a rank publishes (KCP) and by the output walk. Scratch comes from
    ``arena`` (``kda_kcp.arena.Arena``; None: allocated); the records are its first carve. On an arena that only
    counts, every step carves what it carves on the GPU and launches nothing (``mod`` None): that sizes the call."""

    def __init__(self, q, k, v, g, beta, scale, plan, arena=None, checked=False, output_next=False, lead=False):
        """``checked``: the caller has run ``kda_kcp.validate.check_inputs`` for the CUDA backend on these
        tensors in this call (dtypes, shapes, device, contiguity), so they are used as they are.
        ``output_next``: the caller's next step is ``output`` (no KCP summaries, no exchange in between), so the
        records may be made by run group, each group's just before its walk (``run_group_tables``); otherwise
        they are all made now (a KCP rank waits for the others' summaries with its records done). ``lead``: the
        caller launches nothing before ``output`` either, so the first group's records are made now (the launches
        and their order are those of ``output`` alone; the GPU starts sooner)."""
        if not checked:
            check_tensors("CUDA backend", q, k, v, g, beta)
            q, k, v, g, beta = (_c(x) for x in (q, k, v, g, beta))
        self.q, self.k, self.v, self.g, self.beta = q, k, v, g, beta
        self.scale, self.plan = float(scale), plan
        self.arena = arena if arena is not None else Arena(None, self.q.device)
        self.dev = self.arena.device  # the inputs' (meta when the arena only counts: then the one sized for)
        counting = self.arena.counting
        self.word = None if counting else status.word(self.dev)
        self.H = self.q.shape[1]
        check_grid_bounds(self.H, plan.num_chunks)
        self.tabs, groups = call_tables(plan, self.H, self.dev, output_next and not counting)
        self.mod = load(self.dev) if plan.num_runs and not counting else None  # None: nothing to launch
        self.none = self.arena.empty((0,), torch.float32)  # an absent optional argument (0 bytes)
        self.ws = None
        self.groups = None  # run groups whose records are made by ``output``, each before its own walk
        self._led = False  # the first group's records are made (``lead``)
        self._o = self._side = None  # the KCP forward's early pass (``reserve_early``): o, its stream
        self._late = ()  # the runs ``output`` walks after an early pass
        if self.q.shape[0] and plan.num_runs and self.tabs.num_chunks:
            self.ws = self.arena.empty((self.tabs.num_chunks * self.H * RECORD_BYTES,), torch.uint8)
            if self.mod is not None:
                self.groups = groups
                if self.groups is None:
                    self._prep(((0, self.tabs.num_chunks),))
                elif lead:
                    self._prep(self.groups[0].ranges)
                    self._led = True

    def _prep(self, ranges) -> None:
        """Records of the chunk ranges [c0, c1) of the plan's chunk table (views of the table and the records, kept
        by the arena; the whole table and records themselves for the whole range: the same tensors)."""
        rec, n, rows = self.H * RECORD_BYTES, self.tabs.num_chunks, self.arena.rows
        for c0, c1 in ranges:
            whole = c0 == 0 and c1 == n
            chunks = self.tabs.chunks if whole else rows(self.tabs.chunks, c0, c1)
            ws = self.ws if whole else rows(self.ws, c0 * rec, c1 * rec)
            self.mod.fwd_prep(self.q, self.k, self.g, self.beta, chunks, ws, self.scale, self.word)

    def _prep_rest(self) -> None:
        """The records ``output`` would have made group by group, all now (the KCP summaries read them first)."""
        if self.groups is not None:
            groups, self.groups = self.groups, None
            if self._led:
                self._prep(coalesce_ranges(sorted(r for grp in groups[1:] for r in grp.ranges)))
            else:
                self._prep(((0, self.tabs.num_chunks),))

    def summaries(self, run_ids, arena=None):
        """(M, E) [len(run_ids), H, 128, 128] fp32 of the listed runs from a zero state (S_next = M S + E); scratch
        from ``arena`` (None: the call's)."""
        H, arena = self.H, self.arena if arena is None else arena
        run_ids = tuple(int(r) for r in run_ids)
        self._prep_rest()
        M = arena.empty(_state_shape(len(run_ids), H), torch.float32)
        E = arena.empty(_state_shape(len(run_ids), H), torch.float32)
        if not run_ids:
            return M, E
        tabs = forward_tables(self.plan, H, self.dev, run_ids=run_ids)
        if tabs.num_summary > 0:  # the segments' summaries, composed into each run's
            m = arena.empty(_state_shape(tabs.num_summary, H), torch.float32)
            e = arena.empty(_state_shape(tabs.num_summary, H), torch.float32)
        else:
            m = e = arena.empty(_state_shape(0, H), torch.float32)
        if self.mod is None:
            return M, E
        if tabs.num_summary > 0:
            self.mod.fwd_walk_summary(self.v, self.ws, tabs.chunks, tabs.summary, m, e, tuning.fwd_warps())
        # empty runs: chains of count 0 give M = I, E = 0 (the compose kernel starts from [I | 0])
        self.mod.merge_compose(m, e, tabs.chains, M, E)
        status.fill(self.mod, self.dev, M, E)  # NaN, not garbage, for the other ranks if a value was out of domain
        return M, E

    def reserve_early(self):
        """The KCP forward's early pass: o, and the scratch of the output pass of ``early_runs`` (runs whose incoming
        state is zero) carved now, before the exchange's own carves. Returns the function that launches that pass on
        a side stream once ``ready`` (a CUDA event recorded after this rank's summaries; None: the current stream's
        work so far) has passed, or None (no such run, or nothing to launch). ``output`` then walks the other runs on
        the current stream and joins the side stream."""
        ids = early_runs(self.plan)
        if not ids or self.ws is None:
            return None
        self._prep_rest()
        H = self.H
        self._o = torch.empty(self.q.shape[0], H, _D, dtype=torch.bfloat16, device=self.q.device)
        tabs = forward_tables(self.plan, H, self.dev, out_runs=ids)
        carves = self._carve(tabs)
        self._late = late_runs(self.plan, ids)
        if self.mod is None:
            return None
        records = None
        if tuning.fwd_early_mode() == 2 and self.dev.type == "cuda":  # start beside this rank's summaries
            records = torch.cuda.Event()
            records.record()

        def launch(ready=None):
            if self.dev.type != "cuda":  # (the CPU emulation of the kernels)
                self._output_pass(tabs, self.none, self._o, carves)
                return
            side = side_streams("fwd_early", self.dev, 1)[0]
            if records is not None:
                ready = records
            if ready is not None:
                side.wait_event(ready)  # the records, o, this rank's summaries
            else:
                side.wait_stream(torch.cuda.current_stream(self.dev))
            with torch.cuda.stream(side):
                self._output_pass(tabs, self.none, self._o, carves)
            self._side = side

        return launch

    def _carve(self, tabs):
        """(summaries M, E, segment states) of one output pass, from the arena (None: a pass without segments)."""
        if tabs.num_summary == 0:
            return None
        H, arena = self.H, self.arena
        m = arena.empty(_state_shape(tabs.num_summary, H), torch.float32)
        e = arena.empty(_state_shape(tabs.num_summary, H), torch.float32)
        return m, e, arena.empty(_state_shape(tabs.num_sin, H), torch.float32)

    def _output_pass(self, tabs, sin_t, o, carves) -> None:
        """Summary walk, fold and output walk of the segments in ``tabs`` (``carves``: ``_carve``'s)."""
        if self.mod is None:
            return
        warps = tuning.fwd_warps()
        seg_states = self.none
        if carves is not None:
            m, e, seg_states = carves
            self.mod.fwd_walk_summary(self.v, self.ws, tabs.chunks, tabs.summary, m, e, warps)
            self.mod.merge_fold(m, e, tabs.chains, sin_t, seg_states)
        self.mod.fwd_walk_output(self.v, self.ws, tabs.chunks, tabs.out, sin_t, seg_states, o, warps)

    def output(self, state_in=None):
        """o [T, H, 128] bf16 of every run from its incoming state (``state_in`` [R, H, 128, 128] fp32 or
        None = zero); NaN if the status word is set (kda_kcp.status), which then reaches the host (status.finish)."""
        o = self._output(state_in)
        if self.mod is not None:
            status.finish(self.mod, self.dev, o)
        return o

    def _output(self, state_in):
        T, H = self.q.shape[0], self.H
        early = self._o is not None
        o = self._o if early else torch.empty(T, H, _D, dtype=torch.bfloat16, device=self.q.device)
        if self.ws is None:
            return o
        sin_t = self.none
        if state_in is not None:
            sin_t = state_in.to(torch.float32).contiguous()  # a no-op for the states kda_kcp.steps hands in
            if tuple(sin_t.shape) != _state_shape(self.plan.num_runs, H):
                raise ValueError(f"state_in must be [{self.plan.num_runs}, {H}, {_D}, {_D}], got "
                                 f"{tuple(state_in.shape)}")
        if early:
            if self._late:
                tabs = forward_tables(self.plan, H, self.dev, out_runs=self._late)
                self._output_pass(tabs, sin_t, o, self._carve(tabs))
            if self._side is not None:  # o and the early pass's scratch are used (or freed) on main only after this
                torch.cuda.current_stream(self.dev).wait_stream(self._side)
            return o
        if self.groups is not None:
            self._pipelined_output(sin_t, o, tuning.fwd_warps())
            return o
        self._output_pass(self.tabs, sin_t, o, self._carve(self.tabs))
        return o

    def _pipelined_output(self, sin_t, o, warps) -> None:
        """Each run group's prep on the current stream, longest runs first, and its output walk on a side stream
        of its own once its records are made, beside the next groups' preps; joined at the end. Every CTA
        computes what it does unpipelined, so o is bitwise the same. On the CPU (the emulated kernels) the same
        launches run in order."""
        groups, self.groups = self.groups, None
        chunks = self.tabs.chunks

        def walk(grp):
            self.mod.fwd_walk_output(self.v, self.ws, chunks, grp.out, sin_t, self.none, o, warps)

        led, self._led = self._led, False
        if self.dev.type != "cuda":
            for i, grp in enumerate(groups):
                if i or not led:
                    self._prep(grp.ranges)
                walk(grp)
            return
        streams = CallStreams(self.dev)
        main = streams.main
        sides = side_streams("fwd_groups", self.dev, len(groups), groups[0].priority)
        for i, (grp, side) in enumerate(zip(groups, sides)):
            if i or not led:  # (the first group's records are made when ``lead``)
                self._prep(grp.ranges)
            streams.join(side, main)  # this group's records (and o, the tables, the incoming states)
            with streams.on(side):
                walk(grp)
        for side in sides:
            streams.join(main, side)  # o and the records are used (or freed) on main only after this


def fwd_output(q, k, v, g, beta, scale, plan, state_in=None, arena=None):
    """o [T, H, 128] bf16 of every run of ``plan`` from its incoming state (``CudaBackend.fwd_output``)."""
    return PreparedForward(q, k, v, g, beta, scale, plan, arena, output_next=True).output(state_in)


def fwd_summaries(q, k, v, g, beta, scale, plan, run_ids, arena=None):
    """(M, E) of the listed runs from a zero state (``CudaBackend.fwd_summaries``)."""
    return PreparedForward(q, k, v, g, beta, scale, plan, arena).summaries(run_ids)
