"""partition_kcp and the plan: coverage, equal sizes without divisibility, layouts, and runs."""

import pytest
import torch

import kda_kcp
from kda_kcp.partition import equal_split
from kda_kcp.plan import build_plan
from helpers import offsets

CUS = [offsets([42024, 57573, 73122, 88673]), offsets([1, 0, 300, 7, 0, 1]), offsets([5]), offsets([0, 3])]


def _tokens(parts):
    return [t for p in parts for s, e in p for t in range(s, e)]


@pytest.mark.parametrize("layout", kda_kcp.LAYOUTS)
@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("cu_i", range(len(CUS)))
def test_every_token_once(layout, W, cu_i):
    cu = CUS[cu_i]
    parts = kda_kcp.partition_kcp(cu, W, layout)
    assert len(parts) == W
    toks = _tokens(parts)
    assert sorted(toks) == list(range(cu[-1]))
    for p in parts:
        assert all(e > s for s, e in p)


@pytest.mark.parametrize("W", [2, 3, 5])
def test_equal_parts_without_divisibility(W):
    T = 1001
    cu = [0, T]
    sizes = [sum(e - s for s, e in p) for p in kda_kcp.partition_kcp(cu, W, "contiguous")]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == T
    halves = equal_split(0, T, 2 * W)
    assert max(e - s for s, e in halves) - min(e - s for s, e in halves) <= 1


def test_zigzag_layout():
    parts = kda_kcp.partition_kcp([0, 40], 2, "zigzag")
    assert parts == [[(0, 10), (30, 40)], [(10, 30)]]  # rank 1's two parts touch and join


def test_zigzag_per_document_layout():
    parts = kda_kcp.partition_kcp([0, 8, 20], 2, "zigzag_per_document")
    assert parts[0] == [(0, 2), (6, 11), (17, 20)]
    assert parts[1] == [(2, 6), (11, 17)]


def test_world_size_one_is_one_piece_for_every_layout():
    cu = offsets([10, 0, 33, 1])
    for layout in kda_kcp.LAYOUTS:
        assert kda_kcp.partition_kcp(cu, 1, layout) == [[(0, 44)]]


def test_runs_and_exchange_slots():
    cu = offsets([10, 30])  # doc 1 spans ranks 0..2 with contiguous W=3 (parts of 13 / 13 / 14)
    plan = build_plan(cu, kda_kcp.partition_kcp(cu, 3, "contiguous"))
    r0, r1, r2 = plan.rank_runs
    assert [(r.doc, r.length, r.starts_doc, r.ends_doc) for r in r0] == [(0, 10, True, True), (1, 3, True, False)]
    assert [(r.doc, r.length, r.starts_doc, r.ends_doc) for r in r1] == [(1, 13, False, False)]
    assert [(r.doc, r.length, r.starts_doc, r.ends_doc) for r in r2] == [(1, 14, False, True)]
    assert plan.fwd_publish == ((1,), (0,), ()) and plan.fwd_slots == 1
    assert plan.bwd_publish == ((), (0,), (0,))
    assert plan.fwd_sources[2] == (((0, 0), (1, 0)),)  # oldest first
    assert plan.bwd_sources[0][1] == ((2, 0), (1, 0))  # from the document end


def test_context_token_index_and_shard():
    cu = offsets([5, 9])
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu), None, "zigzag")
    assert ctx.world_size == 1 and ctx.rank == 0 and ctx.local_tokens == 14
    x = torch.arange(14.0)
    assert torch.equal(ctx.shard(x), x) and torch.equal(ctx.unshard(x), x)


def test_shard_and_unshard_check_their_argument():
    ctx = kda_kcp.build_context_kcp(offsets([5, 9]))
    for move in (ctx.shard, ctx.unshard):
        with pytest.raises(TypeError, match="expects a torch.Tensor"):
            move(list(range(14)))
        with pytest.raises(ValueError, match="rows, got shape"):
            move(torch.tensor(1.0))
        with pytest.raises(ValueError, match="14 .*rows, got shape"):
            move(torch.zeros(13, 2))


@pytest.mark.parametrize(
    "cu, exc",
    [
        ([1, 5], ValueError),
        ([0, 5, 3], ValueError),
        ([0], ValueError),
        (torch.tensor([0.0, 3.0]), TypeError),
        (torch.tensor([[0, 3]]), ValueError),
        ("0,3", TypeError),
        ([0, 2.5], TypeError),
        (torch.tensor([0, 3], device="meta"), ValueError),
    ],
)
def test_bad_cu_seqlens(cu, exc):
    with pytest.raises(exc, match="cu_seqlens"):
        kda_kcp.partition_kcp(cu, 2, "contiguous")
    with pytest.raises(exc, match="cu_seqlens"):
        kda_kcp.build_context_kcp(cu)


def test_bad_layout_and_world_size():
    with pytest.raises(ValueError, match="layout"):
        kda_kcp.partition_kcp([0, 4], 2, "ring")
    with pytest.raises(ValueError, match="layout"):
        kda_kcp.build_context_kcp([0, 4], layout="zig-zag")
    with pytest.raises(ValueError, match="world_size"):
        kda_kcp.partition_kcp([0, 4], 0, "zigzag")
    with pytest.raises(ValueError, match="world_size=2 does not match the group, which has 1"):
        kda_kcp.build_context_kcp([0, 4], None, "zigzag", world_size=2)
    for bad in ("1", 1.0, True):  # not an int: named as such, never compared with the group's size
        with pytest.raises(ValueError, match=f"world_size must be a positive int or None, got {bad!r}"):
            kda_kcp.build_context_kcp([0, 4], None, "zigzag", world_size=bad)


@pytest.mark.parametrize("layout", kda_kcp.LAYOUTS)
@pytest.mark.parametrize("W", [2, 3, 8])
def test_chunks_follow_the_document_grid(layout, W):
    """Every chunk lies on its document's 64-token grid, so a KCP run computes the same chunks as W = 1
    except where a piece boundary cuts one (docs/design.md §2, kda_kcp/plan.py)."""
    cu = offsets([1, 0, 299, 150, 1611, 64, 700])
    single = {(s, s + n) for run in build_plan(cu, [[(0, cu[-1])]]).rank_runs[0] for s, n in
              ((run.global_start + o, n) for o, n in run.chunk_offsets())}
    parts = kda_kcp.partition_kcp(cu, W, layout)
    cuts = {s for p in parts for s, _ in p} | {e for p in parts for _, e in p}
    total = 0
    for runs in build_plan(cu, parts).rank_runs:
        for run in runs:
            doc_start = cu[run.doc]
            for o, n in run.chunk_offsets():
                s, e = run.global_start + o, run.global_start + o + n
                total += n
                assert 0 < n <= 64
                assert (s - doc_start) % 64 == 0 or s in cuts, (s, e)
                assert (e - doc_start) % 64 == 0 or e == cu[run.doc + 1] or e in cuts, (s, e)
                if s not in cuts and e not in cuts:
                    assert (s, e) in single, (s, e)
    assert total == cu[-1]
