"""Serial stages of the torch backend: the state walks over the chunks of each run, and the affine merges.

A walk advances all runs together, one chunk per step (a run drops out once its chunks are done), so
the serial depth is the longest run's chunk count. ``Steps`` holds, per step, which chunk each active
run is on.

Forward, per chunk:  S_next = Diag(gamma) S + Kg^T (U - W S) = M_c S + E_c.
Backward, per chunk: dS = s Qg^T dO + Diag(gamma) dS_next - W^T (Aqk^T dO + Kg dS_next) = M_c^T dS_next + F_c.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .chunk import Prep

__all__ = ["Steps", "state_walk", "reverse_walk", "affine_merge"]


@dataclass
class Steps:
    """Chunk schedule of a set of runs: ``chunks[j]`` / ``runs[j]`` are the chunk ids and run slots
    active at step j (long tensors on the device)."""

    num_runs: int
    chunks: list[torch.Tensor]
    runs: list[torch.Tensor]

    @classmethod
    def from_counts(cls, counts: list[int], device) -> "Steps":
        ptr = [0]
        for n in counts:
            ptr.append(ptr[-1] + n)
        chunks, runs = [], []
        for j in range(max(counts, default=0)):
            active = [r for r, n in enumerate(counts) if n > j]
            runs.append(torch.tensor(active, dtype=torch.long, device=device))
            chunks.append(torch.tensor([ptr[r] + j for r in active], dtype=torch.long, device=device))
        return cls(len(counts), chunks, runs)


def _walk_buffers(prep: Prep, R: int, start: torch.Tensor | None, summary: bool):
    """What a walk over R runs works in: its state (a copy of ``start`` [R, H, K, V], zeros when None), the per-chunk
    output [N, H, K, V] it fills, and with ``summary`` the identity [R, H, K, K] its chunk maps multiply into."""
    H, K, V = prep.W.shape[1], prep.W.shape[-1], prep.U.shape[-1]
    S = prep.W.new_zeros(R, H, K, V) if start is None else start.to(prep.W.dtype).clone()
    per_chunk = torch.empty(prep.W.shape[0], H, K, V, dtype=S.dtype, device=S.device)
    maps = torch.eye(K, dtype=S.dtype, device=S.device).expand(R, H, K, K).clone() if summary else None
    return S, per_chunk, maps


def state_walk(prep: Prep, steps: Steps, state_in: torch.Tensor | None = None, summary: bool = False):
    """Walk every run forward from ``state_in`` ([R, H, K, V], None = zeros).

    Returns (h, state_out, M): h [N, H, K, V] the state entering each chunk, state_out the state leaving
    each run, and (when ``summary``) M [R, H, K, K] the product of the run's chunk maps, so that
    state_out = M state_in + E with E the state_out of a zero start.
    """
    S, h, M = _walk_buffers(prep, steps.num_runs, state_in, summary)
    for c, r in zip(steps.chunks, steps.runs):
        p = prep.take(c)
        s = S.index_select(0, r)
        h.index_copy_(0, c, s)
        s_next = p.gamma.unsqueeze(-1) * s + p.Kg.transpose(-1, -2) @ (p.U - p.W @ s)
        S.index_copy_(0, r, s_next)
        if summary:
            M.index_copy_(0, r, p.chunk_map() @ M.index_select(0, r))
    return h, S, M


def reverse_walk(
    prep: Prep, do: torch.Tensor, steps: Steps, scale: float, dstate_out: torch.Tensor | None = None, summary: bool = False
):
    """Walk every run backward from ``dstate_out`` (gradient of the state leaving each run, None = zeros).

    Returns (dh, dstate_in, Mt): dh [N, H, K, V] the gradient of the state leaving each chunk,
    dstate_in [R, H, K, V], and (when ``summary``) Mt = M^T of each run, so that
    dstate_in = Mt dstate_out + F with F the dstate_in of a zero start.
    """
    dS, dh, Mt = _walk_buffers(prep, steps.num_runs, dstate_out, summary)
    for c, r in zip(reversed(steps.chunks), reversed(steps.runs)):
        # reversed steps visit each run's chunks last-first; runs shorter than the step count join late,
        # at their own last chunk, which is exactly where their walk starts.
        p = prep.take(c)
        ds = dS.index_select(0, r)
        dh.index_copy_(0, c, ds)
        doc = do.index_select(0, c)
        dvn = p.Aqk.transpose(-1, -2) @ doc + p.Kg @ ds
        ds_prev = scale * (p.Qg.transpose(-1, -2) @ doc) + p.gamma.unsqueeze(-1) * ds - p.W.transpose(-1, -2) @ dvn
        dS.index_copy_(0, r, ds_prev)
        if summary:
            Mt.index_copy_(0, r, p.chunk_map().transpose(-1, -2) @ Mt.index_select(0, r))
    return dh, dS, Mt


def affine_merge(maps: torch.Tensor, offsets: torch.Tensor, sources, out: torch.Tensor,
                 tmp: torch.Tensor | None = None, init: torch.Tensor | None = None, init_rows=None) -> torch.Tensor:
    """Fold published summaries into incoming states, in a fixed order.

    maps [W, slots, H, K, K] and offsets [W, slots, H, K, V] are the gathered summaries;
    ``sources[r]`` lists (rank, slot) to fold for local run r, oldest first:
    acc = 0; for each source: acc = maps @ acc + offsets. Writes out[r] (runs with no source keep zeros).
    With ``init`` ([N, H, K, V], the documents' initial states) the fold of run r starts from
    acc = init[init_rows[r]] instead (runs with no source get that row).
    The backward uses the same fold with (M^T, F) and sources listed from the document end (and the final
    states' gradients as ``init``).
    ``tmp`` ([H, K, V], optional) holds each product, so the fold allocates nothing.
    """
    if init is None:
        out.zero_()
    for r, src in enumerate(sources):
        acc = out[r]
        if init is not None:
            acc.copy_(init[init_rows[r]])
            rest = src
        elif not src:
            continue
        else:
            (w0, s0), rest = src[0], src[1:]
            acc.copy_(offsets[w0, s0])
        if rest and tmp is None:
            tmp = torch.empty_like(acc)
        for w, s in rest:
            torch.matmul(maps[w, s], acc, out=tmp)
            torch.add(tmp, offsets[w, s], out=acc)
    return out
