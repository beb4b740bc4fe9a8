"""Segments: the chunk ranges the CUDA forward walks in parallel (host arithmetic, cached per plan).

Every run is split into segments of whole chunks. Each segment is walked by one CTA per head; a run of
n > 1 segments first computes the (M, E) summaries of its first n - 1 segments from a zero state, folds
them (S_in(j+1) = M_j S_in(j) + E_j, FP32) and then every segment emits its output from its own S_in.
The segment length is a pure function of (run lengths, H, SM count), so results are repeatable bit for
bit on one GPU model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

CHUNK = 64
SUMMARY_COST = 0.75  # a summary CTA's time per chunk relative to a forward CTA's (measured, H200, v2)
CTA_OVERHEAD = 1.0  # start-up (first loads, state in/out) of one CTA, in forward-chunk times
MERGE_STEP_COST = 0.5  # one fold step, in forward-chunk times


def _split(nchunks: int, nseg: int) -> list[int]:
    base, extra = divmod(nchunks, nseg)
    return [base + (1 if i < extra else 0) for i in range(nseg)]


def _pass_time(lengths: list[int], copies: int, sms: int) -> float:
    if not lengths:
        return 0.0
    work = (sum(lengths) + CTA_OVERHEAD * len(lengths)) * copies
    return work / sms + (max(lengths) + CTA_OVERHEAD) * (1.0 - 1.0 / sms)


def choose_segment_chunks(run_chunks: list[int], heads: int, sms: int) -> int:
    """Chunks per segment that minimises a simple list-scheduling estimate of the forward.

    ``KDA_KCP_SEG_CHUNKS=n`` forces n (tests use it to compare segmentations)."""
    forced = os.environ.get("KDA_KCP_SEG_CHUNKS", "").strip()
    if forced:
        return max(1, int(forced))
    if not run_chunks:
        return 1
    longest = max(run_chunks)
    cands = {longest}
    for n in range(1, 129):
        cands.add(max(1, math.ceil(longest / n)))
    best = None
    for L in sorted(cands, reverse=True):
        if L < 4 and L != longest:
            continue
        fwd, summ, steps = [], [], 0
        for c in run_chunks:
            n = math.ceil(c / L)
            parts = _split(c, n)
            fwd += parts
            summ += parts[:-1]
            steps = max(steps, n - 1)
        t = _pass_time(fwd, heads, sms) + SUMMARY_COST * _pass_time(summ, heads, sms)
        t += MERGE_STEP_COST * steps
        if best is None or t < best[0] - 1e-9:
            best = (t, L)
    return best[1]


@dataclass
class SegmentTables:
    fwd: torch.Tensor  # int32 [nseg, 4]: tok_start, ntok, idx, kind (0: state_in[run] or zero, 1: sin slot)
    summary: torch.Tensor  # int32 [nsum, 4]: tok_start, ntok, out slot, 0
    chains: torch.Tensor  # int32 [nchain, 4]: first summary slot, count, run (init), first sin slot
    num_sin: int
    num_summary: int
    seg_chunks: int


def _segments_of_run(run, L: int):
    c = math.ceil(run.length / CHUNK)
    parts = _split(c, math.ceil(c / L))
    out, start = [], 0
    for p in parts:
        tok = start * CHUNK
        ntok = min(run.length, (start + p) * CHUNK) - tok
        out.append((run.local_start + tok, ntok))
        start += p
    return out


def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def forward_tables(plan, heads: int, device) -> SegmentTables:
    key = ("cuda_fwd_segments", heads, str(device), os.environ.get("KDA_KCP_SEG_CHUNKS", ""))
    cache = plan._tables
    if key in cache:
        return cache[key]
    runs = plan.runs
    L = choose_segment_chunks([math.ceil(r.length / CHUNK) for r in runs], heads, _sm_count(device))
    fwd, summ, chains = [], [], []
    nsin = 0
    for r, run in enumerate(runs):
        segs = _segments_of_run(run, L)
        if len(segs) > 1:
            chains.append((len(summ), len(segs) - 1, r, nsin))
            for j, (t0, n) in enumerate(segs[:-1]):
                summ.append((t0, n, len(summ), 0))
        for j, (t0, n) in enumerate(segs):
            if j == 0:
                fwd.append((t0, n, r, 0))
            else:
                fwd.append((t0, n, nsin, 1))
                nsin += 1
    # longest segments first: the CTAs that bound the pass start first
    fwd.sort(key=lambda row: -row[1])
    summ.sort(key=lambda row: -row[1])

    def t(rows):
        return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device)

    tabs = SegmentTables(t(fwd), t(summ), t(chains), nsin, len(summ), L)
    cache[key] = tabs
    return tabs


def summary_tables(plan, run_ids, heads: int, device):
    """Tables for the whole-run summaries of ``run_ids``: (summary rows, compose chains, n summaries)."""
    run_ids = tuple(int(r) for r in run_ids)
    key = ("cuda_sum_segments", run_ids, heads, str(device), os.environ.get("KDA_KCP_SEG_CHUNKS", ""))
    cache = plan._tables
    if key in cache:
        return cache[key]
    runs = plan.runs
    L = choose_segment_chunks([math.ceil(runs[r].length / CHUNK) for r in run_ids], heads, _sm_count(device))
    summ, chains = [], []
    for i, r in enumerate(run_ids):
        segs = _segments_of_run(runs[r], L)
        chains.append((len(summ), len(segs), -1, i))
        for t0, n in segs:
            summ.append((t0, n, len(summ), 0))
    summ.sort(key=lambda row: -row[1])

    def t(rows):
        return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device)

    out = (t(summ), t(chains), len(summ))
    cache[key] = out
    return out
