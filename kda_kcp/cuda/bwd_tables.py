"""The CUDA backward's schedule: the int32 tables its kernels read (rows described in csrc/kda_bwd.h), each a pure
function of the plan, the heads and the SM count (``kda_kcp.cuda.tuning``'s choices), cached in the plan.

    chunk_tables    the plan's chunk table and its whole-run walk rows
    seg_tables      the walks cut into segments: walk, summary and fold-chain rows (``SegTables``)
    walk_groups     the runs whose walks and gradients the pipelined backward launches together (``WalkGroup``)
    lean_passes     the segments of the lean backward's passes (``LeanPass``)
    summary_tables  the rows of the KCP exchange's reverse summaries (``SummaryTables``)

``kda_kcp.cuda.backward`` launches the kernels over them, ``kda_kcp.cuda.bwd_lean`` the lean passes;
``CudaBackend.upload_tables`` makes them all ahead of the calls of a workspace.
"""

from __future__ import annotations

import math

import torch

from ..partition import coalesce_ranges
from . import tuning
from .common import even_split, sm_count

__all__ = ["chunk_tables", "row_table", "SegTables", "seg_tables", "LeanPass", "lean_passes", "SummaryTables",
           "summary_tables", "WalkGroup", "walk_groups"]


def chunk_tables(plan, device):
    """(chunks int32 [Nc, 2], whole-run walk rows int32 [R, 4] = (first chunk, chunks, run, 0)), cached (keyed by the
    device itself: a backward asks before its first launch, and str(torch.device(...)) costs ~1 us)."""
    key = ("cuda_bwd_tables", device if type(device) is torch.device else torch.device(device))
    cache = plan._tables
    if key not in cache:
        t = plan.device_tables(device)
        chunks = torch.stack([t["chunk_start"], t["chunk_len"]], 1).contiguous()
        ptr = t["run_chunk_ptr"]
        R = plan.num_runs
        idx = torch.arange(R, dtype=torch.int32, device=ptr.device)
        runs = torch.stack([ptr[:-1], ptr[1:] - ptr[:-1], idx, torch.zeros_like(idx)], 1).contiguous()
        cache[key] = (chunks, runs)
    return cache[key]


def row_table(rows, device) -> torch.Tensor:
    """A table of 4-int rows (walk, summary or chain rows; kda_bwd.h) as int32 [n, 4] on ``device``."""
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device)


class SegTables:
    """int32 tables of the segmented walks (rows described in csrc/kda_bwd.h)."""

    def __init__(self, plan, heads: int, device):
        C = plan.chunk_size
        run_chunks = [r.num_chunks(C) for r in plan.runs]
        sms = sm_count(device)
        L = tuning.bwd_segment_chunks(run_chunks, heads, sms)
        fwalk, rwalk, fsum, rsum, fch, rch = [], [], [], [], [], []
        nf = nr = 0
        ptr = 0
        for r, n in enumerate(run_chunks):
            parts = even_split(n, math.ceil(n / L)) if n > 0 else []
            starts = []
            for p in parts:
                starts.append(ptr)
                ptr += p
            k = len(parts)
            if k == 0:
                continue
            if k == 1:
                fwalk.append((starts[0], parts[0], r, 0))
                rwalk.append((starts[0], parts[0], r, 0))
                continue
            fch.append((len(fsum), k - 1, r, nf))
            for j in range(k - 1):
                fsum.append((starts[j], parts[j], len(fsum), 0))
            fwalk.append((starts[0], parts[0], r, 0))
            for j in range(1, k):
                fwalk.append((starts[j], parts[j], nf + j - 1, 1))
            nf += k - 1
            rch.append((len(rsum), k - 1, r, nr))
            for j in range(k - 1, 0, -1):
                rsum.append((starts[j], parts[j], len(rsum), 0))
            rwalk.append((starts[k - 1], parts[k - 1], r, 0))
            for j in range(k - 1):
                rwalk.append((starts[j], parts[j], nr + (k - 2 - j), 1))
            nr += k - 1
        # longest rows first: the CTAs that bound a pass start first
        for lst in (fwalk, rwalk, fsum, rsum):
            lst.sort(key=lambda row: -row[1])

        self.seg_chunks = L
        self.host = {"fwalk": fwalk, "rwalk": rwalk, "fsum": fsum, "rsum": rsum}  # for the lean passes
        self.fwalk, self.rwalk, self.fsum, self.rsum, self.fchains, self.rchains = (
            row_table(rows, device) for rows in (fwalk, rwalk, fsum, rsum, fch, rch))
        self.num_fold_f, self.num_fold_r = nf, nr
        self.num_sum_f, self.num_sum_r = len(fsum), len(rsum)
        self.walk_warps = tuning.bwd_walk_warps(len(fwalk), heads, sms)
        self.summary_warps = tuning.bwd_summary_warps(len(fsum), heads, sms)


def seg_tables(plan, heads: int, device) -> SegTables:
    key = ("cuda_bwd_segments", heads, str(torch.device(device))) + tuning.cache_key()
    cache = plan._tables
    if key not in cache:
        cache[key] = SegTables(plan, heads, device)
    return cache[key]


class LeanPass:
    """One pass of the lean backward: its chunks (rows of the plan's chunk table) and its rows of the walk
    and summary tables, chunk indices local to the pass (summary and fold indices stay global)."""

    def __init__(self, chunks, rows: dict, device):
        self.num_chunks = int(chunks.shape[0])
        self.chunks = chunks
        for name, lst in rows.items():
            setattr(self, name, row_table(lst, device))
        self.has_summaries = bool(rows["fsum"] or rows["rsum"])


def lean_passes(plan, heads: int, device, passes: int) -> list[LeanPass]:
    """The segments of the backward's walks assigned to ``passes`` passes, longest first to the pass with
    the fewest chunks so far (a pure function of the segment table): each pass holds whole segments, so
    every kernel sees exactly the chunks and states it sees in one pass, and results are bitwise equal."""
    key = ("cuda_bwd_lean", heads, str(torch.device(device)), passes) + tuning.cache_key()
    cache = plan._tables
    if key in cache:
        return cache[key]
    st = seg_tables(plan, heads, device)
    chunks, _ = chunk_tables(plan, device)
    segs = sorted({(r[0], r[1]) for r in st.host["fwalk"]}, key=lambda fc: (-fc[1], fc[0]))
    load, members = [0] * passes, [[] for _ in range(passes)]
    for first, count in segs:
        p = min(range(passes), key=lambda i: (load[i], i))
        load[p] += count
        members[p].append((first, count))
    out = []
    for mem in members:
        if not mem:
            continue
        mem.sort()
        local, ids = {}, []
        for first, count in mem:
            local[first] = len(ids)
            ids.extend(range(first, first + count))
        rows = {name: [(local[r[0]], *r[1:]) for r in st.host[name] if r[0] in local]
                for name in ("fwalk", "rwalk", "fsum", "rsum")}
        sub = chunks.index_select(0, torch.tensor(ids, dtype=torch.long, device=chunks.device))
        out.append(LeanPass(sub, rows, device))
    cache[key] = out
    return out


class SummaryTables:
    """The KCP exchange's reverse summaries of some runs: ``chunks`` (the chunk table the rows index), ``rows``
    (first chunk, chunks, out slot, 0) of the walks and, when the runs are cut into segments, ``chains`` (first
    slot, count, -1, run's index in run_ids) that compose each run's segment summaries, its last segment's first
    (the reverse walk's order: dS_in = Mt_1 (... (Mt_n dS_out + F_n) ...) + F_1); None: one walk per whole run."""

    def __init__(self, chunks, rows, chains):
        self.chunks, self.rows, self.chains = chunks, rows, chains
        self.num_rows = rows.shape[0]


def summary_tables(plan, run_ids, device, own_chunks: bool, heads: int = 1) -> SummaryTables:
    """The SummaryTables of ``run_ids`` (segments of ``tuning.bwd_summary_chunks``). own_chunks False: rows index the
    plan's chunk table (the replay records cover it); True: a table of just these runs' chunks (the lean backward
    preps them apart). Cached."""
    device = torch.device(device)
    key = ("cuda_bwd_summary_tables", tuple(run_ids), str(device), own_chunks, heads) + tuning.cache_key()
    cache = plan._tables
    if key not in cache:
        C = plan.chunk_size
        L = tuning.bwd_summary_chunks([plan.runs[r].num_chunks(C) for r in run_ids], heads, sm_count(device))
        firsts = [0]
        for run in plan.runs:
            firsts.append(firsts[-1] + run.num_chunks(C))
        chunks, spans = [], []  # spans: (first chunk, segment lengths) per listed run
        for r in run_ids:
            run = plan.runs[r]
            bounds = run.chunk_offsets(C)
            spans.append((len(chunks) if own_chunks else firsts[r],
                          even_split(len(bounds), math.ceil(len(bounds) / L)) if bounds else []))
            if own_chunks:
                chunks += [(run.local_start + off, n) for off, n in bounds]
        segmented = any(len(parts) > 1 for _, parts in spans)
        rows, chains = [], []
        for i, (first, parts) in enumerate(spans):
            if not segmented:  # one walk per run, its summary straight into slot i
                rows.append((first, sum(parts), i, 0))
                continue
            starts = [first + sum(parts[:j]) for j in range(len(parts))]
            chains.append((len(rows), len(parts), -1, i))  # (an empty run: a chain of none, M = I, E = 0)
            for j in reversed(range(len(parts))):  # the last segment's summary first: the chain's order
                rows.append((starts[j], parts[j], len(rows), 0))
        if own_chunks:
            ct = torch.tensor(chunks, dtype=torch.int32).reshape(-1, 2).to(device)
        else:
            ct = chunk_tables(plan, device)[0]
        rt = row_table(rows, device)
        ch = row_table(chains, device) if segmented else None
        cache[key] = SummaryTables(ct, rt, ch)
    return cache[key]


class WalkGroup:
    """Runs whose walks and gradients go together: their rows of the whole-run walk tables and their chunk
    ranges [c0, c1) of the plan's chunk table (consecutive runs merged). With ``pieces`` k > 1 (whole-run walks
    only; ``tuning.bwd_walk_pieces``) each run's chunks are cut into k blocks (``even_split``) and each chain is
    launched block by block: forward piece j walks block j of every run of the group (rows ``fwd_pieces[j]``), the
    reverse chain blocks k - 1 down to 0 (``rev_pieces``, in launch order). A piece starts from the state its run's
    previous piece left in the group's hand-off buffer (row i of a piece is row i of every piece: src 1, idx i) and writes the one it leaves
    there; the first piece of a chain starts from the run's state_in / dstate_out as a whole-run row does. The
    gradients of block j (``blocks[j]``: chunk ranges) wait for forward piece j and the reverse piece of block j
    only; ``ready[j]`` is when both are expected done (in forward walk steps from the walks' start). k = 1: one
    piece, the whole-run (or segment) rows."""

    def __init__(self, fwalk, rwalk, ranges, device, pieces: int = 1):
        self.fwalk, self.rwalk = row_table(fwalk, device), row_table(rwalk, device)
        self.ranges = ranges
        self.rows = len(fwalk)
        self.longest = max((row[1] for row in fwalk), default=0)  # chunks of the group's longest walk row
        self.pieces = k = max(1, min(pieces, self.longest))
        if k == 1:
            self.fwd_pieces, self.rev_pieces, self.rev_blocks = [self.fwalk], [self.rwalk], [0]
            self.blocks = [ranges]
            self.ready = [tuning.REV_STEP_RATIO * self.longest]
            return
        cuts = []  # per row: the (first chunk, count) of its k blocks
        for first, count, _, _ in fwalk:
            parts, at = [], first
            for n in even_split(count, k):
                parts.append((at, n))
                at += n
            cuts.append(parts)
        runs = [row[2] for row in fwalk]

        def piece(j, opens):  # rows of block j; `opens`: the chain's first piece (the run's own state enters)
            return row_table([(*cuts[i][j], runs[i], 0) if opens else (*cuts[i][j], i, 1) for i in range(len(fwalk))],
                              device)

        self.fwd_pieces = [piece(j, j == 0) for j in range(k)]
        self.rev_blocks = list(range(k - 1, -1, -1))  # the reverse chain's launch order
        self.rev_pieces = [piece(j, j == k - 1) for j in self.rev_blocks]
        self.blocks = [coalesce_ranges(sorted((a, a + n) for a, n in (c[j] for c in cuts) if n > 0)) for j in range(k)]
        ratio = tuning.REV_STEP_RATIO
        self.ready = [self.longest * max((j + 1) / k, ratio * (k - j) / k) for j in range(k)]  # fwd steps


def walk_groups(plan, heads: int, device):
    """WalkGroups of the backward walks, or None (one segment, or whole runs all alike in one piece). Whole-run
    walks: the shortest runs' first and the longest's last. The walks of a run are serial in its chunks, so the
    shorter runs' walks end well before the longest one's and their SMs would idle: each group's gradient kernel
    starts as soon as its own walks end, beside the longer groups' walks; with ``tuning.bwd_walk_pieces`` > 1 (even
    for one group) the gradients of each block of a group's chunks start once both walks have passed it. Segmented walks
    (all about one length): the first and the second half of the chunk table, so that one half's gradients fill
    the SMs the walks' last wave leaves.
    Every kernel sees the same rows and chunks as unpipelined, so the results are bitwise equal. A pure function of
    the plan (cached)."""
    key = ("cuda_bwd_walk_groups", heads, str(torch.device(device))) + tuning.cache_key()
    cache = plan._tables
    if key in cache:
        return cache[key]
    st = seg_tables(plan, heads, device)
    fw, rw = st.host["fwalk"], st.host["rwalk"]

    def group(keep, pieces=1) -> WalkGroup:  # the walk rows `keep` accepts (a segment's rows of both tables together)
        f, r = [row for row in fw if keep(row)], [row for row in rw if keep(row)]
        return WalkGroup(f, r, coalesce_ranges([(first, first + count) for first, count, _, _ in sorted(f)]), device,
                         pieces)

    out = None
    if not (st.num_sum_f or st.num_sum_r) and fw:  # whole runs (rows carry the run id)
        runs = tuning.bwd_walk_groups({row[2]: row[1] for row in fw})
        pieces = tuning.bwd_walk_pieces(len(fw), heads, st.walk_warps, sm_count(device))
        if len(runs) > 1 or pieces > 1:
            out = tuple(group(lambda row, ids=frozenset(ids): row[2] in ids, pieces) for ids in runs)
    elif len(fw) > 1:  # segments: the first half of the chunk table (whole segments), then the rest
        total, acc, firsts = sum(row[1] for row in fw), 0, set()
        for first, count, _, _ in sorted(fw):
            if acc + count / 2 > total / 2:
                break
            firsts.add(first)
            acc += count
        if 0 < len(firsts) < len(fw):
            out = (group(lambda row: row[0] in firsts), group(lambda row: row[0] not in firsts))
    cache[key] = out
    return out
