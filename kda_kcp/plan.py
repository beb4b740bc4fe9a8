"""The plan of one call: runs, chunks and the KCP exchange slots (host arithmetic, built once per context).

A *run* is a maximal range of local tokens that belongs to one document inside one piece. Every run
is walked as its own chain of chunks of 64 tokens on its document's grid: a run that starts inside a
document (at a piece boundary) opens with a partial chunk up to the next multiple of 64 from the
document start, so every later chunk holds exactly the tokens it holds in the single-GPU run and KCP
computes the same chunk products as W = 1 everywhere but in the chunk the boundary cuts. A run whose
document continues on a later piece publishes its forward summary (M, E); a run whose document
started on an earlier piece publishes its backward summary (M^T, F). Because the partition is a pure
function of (cu_seqlens, world size, layout), every rank knows every rank's runs and slot numbers, so
each exchange is one all-gather of equally sized buffers.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field

import torch

from .partition import Piece

__all__ = ["CHUNK", "Run", "LocalPlan", "KcpPlan", "build_plan"]

CHUNK = 64


@dataclass(frozen=True)
class Run:
    local_start: int  # first local token
    length: int
    doc: int
    global_start: int
    starts_doc: bool  # the document starts with this run (state enters as zero)
    ends_doc: bool  # the document ends with this run (no state leaves it)
    doc_offset: int = 0  # tokens of the document before this run

    def chunk_lengths(self, size: int = CHUNK) -> list[int]:
        """Rows of each chunk of this run, on the document's grid (the first may be partial)."""
        head = min((-self.doc_offset) % size, self.length)
        full, tail = divmod(self.length - head, size)
        return ([head] if head else []) + [size] * full + ([tail] if tail else [])

    def chunk_offsets(self, size: int = CHUNK) -> list[tuple[int, int]]:
        """(first row relative to the run start, rows) of each chunk of this run."""
        out, off = [], 0
        for n in self.chunk_lengths(size):
            out.append((off, n))
            off += n
        return out

    def num_chunks(self, size: int = CHUNK) -> int:
        return len(self.chunk_lengths(size))


@dataclass
class LocalPlan:
    """What one rank computes: its runs and their chunks."""

    num_tokens: int
    runs: tuple[Run, ...]
    chunk_size: int = CHUNK
    _tables: dict = field(default_factory=dict, repr=False)

    @property
    def num_runs(self) -> int:
        return len(self.runs)

    @property
    def num_chunks(self) -> int:
        """Chunks of every run (counted once, then cached)."""
        if "num_chunks" not in self._tables:
            self._tables["num_chunks"] = sum(run.num_chunks(self.chunk_size) for run in self.runs)
        return self._tables["num_chunks"]

    def chunk_bounds(self) -> list[tuple[int, int, int]]:
        """(local_start, length, run) of every chunk, runs in order, chunks in token order."""
        out = []
        for r, run in enumerate(self.runs):
            for off, n in run.chunk_offsets(self.chunk_size):
                out.append((run.local_start + off, n, r))
        return out

    def device_tables(self, device) -> dict[str, torch.Tensor]:
        """int32 index tables on ``device``, built once per device and cached.

        chunk_start [Nc], chunk_len [Nc], chunk_run [Nc], run_chunk_ptr [R + 1], run_start [R], run_len [R].
        """
        device = torch.device(device)
        key = str(device)
        if key not in self._tables:
            chunks = self.chunk_bounds()
            ptr = [0]
            for run in self.runs:
                ptr.append(ptr[-1] + run.num_chunks(self.chunk_size))
            host = {
                "chunk_start": [c[0] for c in chunks],
                "chunk_len": [c[1] for c in chunks],
                "chunk_run": [c[2] for c in chunks],
                "run_chunk_ptr": ptr,
                "run_start": [r.local_start for r in self.runs],
                "run_len": [r.length for r in self.runs],
            }
            self._tables[key] = {k: torch.tensor(v, dtype=torch.int32, device=device) for k, v in host.items()}
        return self._tables[key]


@dataclass(frozen=True)
class KcpPlan:
    """Every rank's runs plus the exchange layout; identical on all ranks."""

    world_size: int
    rank_runs: tuple[tuple[Run, ...], ...]
    # forward: runs whose document continues later publish (M, E); slot = index in this list
    fwd_publish: tuple[tuple[int, ...], ...]  # per rank: local run ids
    bwd_publish: tuple[tuple[int, ...], ...]  # per rank: local run ids whose document started earlier
    # per rank, per local run: [(rank, slot), ...] to fold, in fold order
    fwd_sources: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    bwd_sources: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]

    @property
    def fwd_slots(self) -> int:
        return max((len(p) for p in self.fwd_publish), default=0)

    @property
    def bwd_slots(self) -> int:
        return max((len(p) for p in self.bwd_publish), default=0)

    @functools.cached_property  # (read on every call's way to its first kernel; the plan is frozen)
    def needs_exchange(self) -> bool:
        return self.fwd_slots > 0


def _runs_of(pieces: list[Piece], cu: list[int]) -> tuple[Run, ...]:
    runs = []
    local = 0
    for s, e in pieces:
        t = s
        while t < e:
            d = bisect.bisect_right(cu, t) - 1  # document holding token t (skips empty documents)
            end = min(e, cu[d + 1])
            runs.append(Run(local + (t - s), end - t, d, t, t == cu[d], end == cu[d + 1], t - cu[d]))
            t = end
        local += e - s
    return tuple(runs)


def build_plan(cu: list[int], parts: list[list[Piece]]) -> KcpPlan:
    W = len(parts)
    rank_runs = tuple(_runs_of(p, cu) for p in parts)
    fwd_publish = tuple(tuple(i for i, r in enumerate(runs) if not r.ends_doc) for runs in rank_runs)
    bwd_publish = tuple(tuple(i for i, r in enumerate(runs) if not r.starts_doc) for runs in rank_runs)
    fwd_slot = {(w, i): s for w in range(W) for s, i in enumerate(fwd_publish[w])}
    bwd_slot = {(w, i): s for w in range(W) for s, i in enumerate(bwd_publish[w])}
    # every run of every document, in global order
    by_doc: dict[int, list[tuple[int, int, int]]] = {}
    for w, runs in enumerate(rank_runs):
        for i, r in enumerate(runs):
            by_doc.setdefault(r.doc, []).append((r.global_start, w, i))
    for lst in by_doc.values():
        lst.sort()
    fwd_sources = []
    bwd_sources = []
    for w, runs in enumerate(rank_runs):
        fsrc, bsrc = [], []
        for i, r in enumerate(runs):
            chain = by_doc[r.doc]
            pos = next(j for j, (_, ww, ii) in enumerate(chain) if ww == w and ii == i)
            # forward: fold earlier runs oldest first; backward: fold later runs from the document end
            fsrc.append(tuple((ww, fwd_slot[(ww, ii)]) for _, ww, ii in chain[:pos]))
            bsrc.append(tuple((ww, bwd_slot[(ww, ii)]) for _, ww, ii in reversed(chain[pos + 1 :])))
        fwd_sources.append(tuple(fsrc))
        bwd_sources.append(tuple(bsrc))
    return KcpPlan(W, rank_runs, fwd_publish, bwd_publish, tuple(fwd_sources), tuple(bwd_sources))
