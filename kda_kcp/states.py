"""The documents' initial and final states in one call (docs/design.md §4b).

A call may take an initial state per document, ``h0`` [N, H, K, V], and return each document's final state
``ht`` [N, H, K, V]. On this rank:

- the incoming state of a run that starts its document is ``h0[doc]``; the fold of a later run of that document
  (``walk.affine_merge``) starts from ``h0[doc]`` instead of zero, so the exchanged summaries do not change;
- the final state of a document that ends here is ``M state_in + E`` of the run that ends it, with (M, E) that
  run's summary from a zero state (the backends' ``summaries``; no kernel of its own);
- in the backward, the outgoing state gradient of the run that ends a document is ``dht[doc]`` and the fold from
  the document end starts from it; the gradient of ``h0[doc]`` is ``Mt dstate_out + F`` of the run that starts
  the document, with (Mt, F) its backward summary from a zero state gradient.

So ``ht`` rows are nonzero only on the rank where their document ends, ``dh0`` rows only on the rank where it
starts; a document without tokens belongs to rank 0 (``ht = h0``, ``dh0 = dht``). Summed over the ranks both are
the single-rank result.

The summaries here carve their scratch from an arena of their own (plain allocations), not from a call's
workspace: a workspace is sized for calls without states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .arena import Arena

__all__ = ["DocRuns", "doc_runs", "run_rows", "final_states", "initial_state_grad"]


@dataclass(frozen=True)
class DocRuns:
    """Where this rank's documents start and end, as tables of its runs (a pure function of the plan). The int64
    index tensors live on one device."""

    doc_list: tuple[int, ...]  # the document of each local run
    run_docs: torch.Tensor  # [R]: ``doc_list`` as a tensor
    starts: tuple[int, ...]  # local runs that start their document
    ends: tuple[int, ...]  # local runs that end their document
    start_runs: torch.Tensor  # [len(starts)]: ``starts`` as a tensor
    end_runs: torch.Tensor
    start_docs: torch.Tensor  # [len(starts)]: their documents
    end_docs: torch.Tensor
    empty_docs: torch.Tensor  # the documents without tokens this rank reports (rank 0 only)
    whole: bool  # local run r is document r, for every document (rows of [N, ...] need no gather)


def doc_runs(ctx, device) -> DocRuns:
    """The DocRuns of ``ctx`` with its index tensors on ``device`` (made once per device, kept in the local plan)."""
    device = torch.device(device)
    key = ("doc_runs", str(device))
    cache = ctx.local._tables
    if key not in cache:
        runs, cu = ctx.local.runs, ctx.cu_seqlens
        starts = tuple(i for i, r in enumerate(runs) if r.starts_doc)
        ends = tuple(i for i, r in enumerate(runs) if r.ends_doc)
        empty = [d for d in range(ctx.num_docs) if cu[d] == cu[d + 1]] if ctx.rank == 0 else []

        def index(rows):
            return torch.tensor(rows, dtype=torch.long).to(device)

        run_docs = [r.doc for r in runs]
        cache[key] = DocRuns(tuple(run_docs), index(run_docs), starts, ends, index(starts), index(ends),
                             index([runs[i].doc for i in starts]), index([runs[i].doc for i in ends]), index(empty),
                             run_docs == list(range(ctx.num_docs)))
    return cache[key]


def run_rows(x: torch.Tensor, docs: DocRuns, dtype: torch.dtype) -> torch.Tensor:
    """[R, H, K, V]: row ``run_docs[r]`` of the per-document ``x`` [N, H, K, V] for every local run, in ``dtype``
    (``x`` itself when it already is that, which is the W = 1 case without empty documents)."""
    if docs.whole:
        return x.to(dtype).contiguous()
    return x.index_select(0, docs.run_docs).to(dtype)


def _apply(summaries, run_ids: tuple, ids: torch.Tensor, rows: torch.Tensor | None, device) -> torch.Tensor:
    """``A x + B`` for each listed run (``run_ids``, and as the tensor ``ids``): (A, B) its summary [n, H, K, K],
    [n, H, K, V] from ``summaries``, x its row of ``rows`` [R, H, K, V] (None: zero, so just B)."""
    A, B = summaries(run_ids, Arena(None, device))
    if rows is None:
        return B
    n, H, K, V = B.shape
    x = rows if n == rows.shape[0] else rows.index_select(0, ids)  # every run listed: they are in order
    x = x.to(B.dtype)
    return torch.baddbmm(B.reshape(n * H, K, V), A.reshape(n * H, K, K), x.reshape(n * H, K, V)).view(n, H, K, V)


def final_states(summaries, docs: DocRuns, state_in, h0, shape, dtype, device) -> torch.Tensor:
    """ht [N, H, K, V] in ``dtype``: rows of the documents that end on this rank (and of the empty documents it
    reports: their h0), zeros elsewhere. ``summaries(run_ids, arena)``: the forward summaries of the prepared call;
    ``state_in``: each run's incoming state (None: zero); ``h0``: the initial states or None."""
    ht = torch.zeros(shape, dtype=dtype, device=device)
    if docs.ends:
        ht.index_copy_(0, docs.end_docs, _apply(summaries, docs.ends, docs.end_runs, state_in, device).to(dtype))
    if h0 is not None and docs.empty_docs.numel():
        ht.index_copy_(0, docs.empty_docs, h0.index_select(0, docs.empty_docs).to(dtype))
    return ht


def initial_state_grad(summaries, docs: DocRuns, dstate_out, dht, like: torch.Tensor) -> torch.Tensor:
    """dh0 shaped and typed like ``like`` (the initial states): rows of the documents that start on this rank (and
    of the empty documents it reports: their dht), zeros elsewhere. ``summaries(run_ids, arena)``: the backward
    summaries of the prepared call (before its gradients); ``dstate_out``: each run's outgoing state gradient
    (None: zero); ``dht``: the final states' gradient or None."""
    dh0 = torch.zeros_like(like, memory_format=torch.contiguous_format)
    if docs.starts:
        dh0.index_copy_(0, docs.start_docs, _apply(summaries, docs.starts, docs.start_runs, dstate_out, like.device).to(like.dtype))
    if dht is not None and docs.empty_docs.numel():
        dh0.index_copy_(0, docs.empty_docs, dht.index_select(0, docs.empty_docs).to(like.dtype))
    return dh0
