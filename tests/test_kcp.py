"""KCP over gloo: W = 2, 3, 4, 8 spawned processes against the single-rank run, for every layout.

Each spawned rank computes the W = 1 result itself (same seeds), runs its shard, and gathers the shards
back to global tensors; a failed assertion in any rank fails the test.
"""

import pytest
import torch
import torch.distributed as dist

import kda_kcp
import kda_kcp.exchange as exchange
from helpers import gather_global, make_inputs, offsets, rel_rms, run_distributed, step

pytestmark = pytest.mark.slow  # spawned gloo groups: over a minute on two cores

NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")
CASES = {
    "ragged": [1, 0, 299, 150, 161],  # T = 611 (no layout divides it), a one-token and an empty document
    "one_document": [517],  # spans every rank; pieces hold only part of it
    "short_documents": [5, 4, 61, 1, 69, 3, 64, 2, 40],
}
H, K, V = 2, 16, 8
SIZES = dict(head_dim=K, value_dim=V, dtype=torch.float64)


def _count_collectives(calls):
    real = exchange._all_gather

    def counting(out, inp, group=None):
        calls.append(inp.numel() * inp.element_size())
        return real(out, inp, group=group)

    exchange._all_gather = counting
    return real


def _kcp_matches_single_rank(rank, world):
    for ci, (case, lengths) in enumerate(CASES.items()):
        cu = offsets(lengths)
        inputs, do = make_inputs(cu, H=H, K=K, V=V, seed=100 + ci)
        ref = step(inputs, do, kda_kcp.build_context_kcp(cu))
        for layout in kda_kcp.LAYOUTS:
            ctx = kda_kcp.build_context_kcp(torch.tensor(cu), dist.group.WORLD, layout)
            local = [ctx.shard(x) for x in inputs]
            calls = []
            real = _count_collectives(calls)
            try:
                got = step(local, ctx.shard(do), ctx)
            finally:
                exchange._all_gather = real
            for name, x, r in zip(NAMES, got, ref):
                err = rel_rms(gather_global(ctx, x), r)
                assert err < 1e-12, (world, case, layout, name, err)
            # kda_comm_bytes_kcp == what this rank handed to and got back from the collectives
            moved = sum(2 * (world - 1) * n for n in calls)
            assert moved == kda_kcp.kda_comm_bytes_kcp(ctx, H, **SIZES), (case, layout, calls)
            assert (len(calls) == 2) == ctx.plan.needs_exchange
            # the non-deterministic package agrees too
            nd = step(local, ctx.shard(do), ctx, deterministic=False)
            for name, x, r in zip(NAMES, nd, got):
                assert rel_rms(x, r) < 1e-12, (case, layout, "nondet", name)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_kcp_matches_single_rank(world):
    run_distributed(_kcp_matches_single_rank, world)


def _saved_and_workspace(rank, world):
    cu = offsets([1, 0, 299, 150, 161])
    inputs, do = make_inputs(cu, H=H, K=K, V=V, seed=7)
    for layout in kda_kcp.LAYOUTS:
        ctx = kda_kcp.build_context_kcp(torch.tensor(cu), dist.group.WORLD, layout)
        local = [ctx.shard(x).requires_grad_() for x in inputs]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            o = kda_kcp.chunk_kda_kcp(*local, ctx)
        inputs_ptrs = {x.untyped_storage().data_ptr() for x in local}
        extra = sum(t.nbytes for t in saved if t.untyped_storage().data_ptr() not in inputs_ptrs)
        assert extra == kda_kcp.kda_saved_bytes_kcp(ctx, H, **SIZES) > 0
        o.backward(ctx.shard(do))
        # a workspace of exactly the queried size gives the same bits; one byte less raises
        ws = kda_kcp.WorkspaceKcp(ctx, H, **SIZES)
        assert ws.nbytes == kda_kcp.kda_workspace_bytes_kcp(ctx, H, **SIZES) > 0
        plain = step([x.detach() for x in local], ctx.shard(do), ctx)
        with_ws = step([x.detach() for x in local], ctx.shard(do), ctx, workspace=ws)
        for a, b in zip(plain, with_ws):
            assert torch.equal(a, b)
        short = kda_kcp.WorkspaceKcp.from_buffer(torch.empty(ws.nbytes - 1, dtype=torch.uint8))
        try:
            kda_kcp.chunk_kda_kcp(*[x.detach() for x in local], ctx, workspace=short)
        except ValueError as exc:
            assert f"needs {ws.nbytes} bytes" in str(exc)
        else:
            raise AssertionError("a workspace one byte short did not raise")


def _one_workspace_many_packs(rank, world):
    """A workspace sized for the largest of several packs serves each of them in turn, bit for bit."""
    packs = [offsets([1, 0, 299, 150, 161]), offsets([517]), offsets([40, 3, 90])]
    ctxs = [kda_kcp.build_context_kcp(cu, dist.group.WORLD, "zigzag") for cu in packs]
    need = max(kda_kcp.kda_workspace_bytes_kcp(c, H, **SIZES) for c in ctxs)
    ws = kda_kcp.WorkspaceKcp.from_buffer(torch.empty(need, dtype=torch.uint8))
    for i, (cu, ctx) in enumerate(zip(packs, ctxs)):
        inputs, do = make_inputs(cu, H=H, K=K, V=V, seed=40 + i)
        local = [ctx.shard(x) for x in inputs]
        for a, b in zip(step(local, ctx.shard(do), ctx), step(local, ctx.shard(do), ctx, workspace=ws)):
            assert torch.equal(a, b), i


def test_one_workspace_serves_several_packs():
    run_distributed(_one_workspace_many_packs, 2)


def test_saved_bytes_and_workspace_at_two_ranks():
    run_distributed(_saved_and_workspace, 2)


def _checkpoint_at_w(rank, world):
    """At W > 1 the checkpoint step equals the plain step bit for bit in every layout, and its recomputation
    redoes the forward exchange (the backward reads the incoming states) but not the output pass."""
    from torch.utils.checkpoint import checkpoint

    from kda_kcp import function

    outputs = []
    finish = function.ForwardCall.finish
    function.ForwardCall.finish = lambda call: outputs.append(1) or finish(call)
    try:
        cu = offsets([1, 0, 299, 150, 161])
        inputs, do = make_inputs(cu, H=H, K=K, V=V, seed=9)
        for layout in kda_kcp.LAYOUTS:
            ctx = kda_kcp.build_context_kcp(torch.tensor(cu), dist.group.WORLD, layout)
            local = [ctx.shard(x) for x in inputs]
            plain = step(local, ctx.shard(do), ctx)
            leaves = [x.clone().requires_grad_() for x in local]
            outputs.clear()
            o = checkpoint(lambda *xs: kda_kcp.chunk_kda_kcp(*xs, ctx), *leaves, use_reentrant=False)
            o.backward(ctx.shard(do))
            assert len(outputs) == 1, (layout, len(outputs))
            for a, b in zip(plain, [o.detach()] + [x.grad for x in leaves]):
                assert torch.equal(a, b), layout
    finally:
        function.ForwardCall.finish = finish


@pytest.mark.parametrize("world", [2, 3])
def test_checkpoint_step_equals_plain_at_w(world):
    run_distributed(_checkpoint_at_w, world)


def _disagreeing_ranks(rank, world):
    cus = [offsets([10, 20]), offsets([10, 21])]
    try:
        kda_kcp.build_context_kcp(cus[rank], dist.group.WORLD, "zigzag")
    except ValueError as exc:
        assert "ranks disagree" in str(exc) and "documents and T" in str(exc), str(exc)
    else:
        raise AssertionError("different cu_seqlens did not raise")
    layouts = ["zigzag", "contiguous"]
    try:
        kda_kcp.build_context_kcp(offsets([10, 20]), dist.group.WORLD, layouts[rank])
    except ValueError as exc:
        assert "layout" in str(exc), str(exc)
    else:
        raise AssertionError("different layouts did not raise")
    # after the errors the group still works: an agreeing context builds and runs
    ctx = kda_kcp.build_context_kcp(offsets([10, 20]), dist.group.WORLD, "zigzag", world_size=world)
    assert ctx.world_size == world


def test_disagreeing_ranks_raise_instead_of_hanging():
    run_distributed(_disagreeing_ranks, 2)
