"""Initial and final states per document (docs/design.md §4b) on the torch backend.

At W = 1 against the FP64 oracle: o, the final states and every gradient (q, k, v, g, beta, the initial state's,
with the loss reading the final states too); a sequence split into two calls chained through the state equals one
call; the fwd/bwd entries equal autograd; torch.utils.checkpoint; the checks. Under KCP over gloo at W = 2 and 3
in every layout (slow): summed over the ranks the final states and the initial state's gradient are the W = 1
ones, and each rank's rows are those of the documents that end (start) on it; the ranks agree on whether states
are passed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import kda_kcp
from kda_kcp.reference import naive_kda
from helpers import gather_global, make_inputs, offsets, rel_rms, run_distributed

H, K, V = 2, 16, 8
F64 = torch.float64
CASES = {
    "ragged": [1, 0, 299, 150, 161],  # a one-token and an empty document
    "one_document": [517],
    "short_documents": [5, 4, 61, 1, 69, 3, 64, 2, 40],
}
NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def state_inputs(cu, seed):
    """Inputs, the output weights, an initial state and the final state's weights (FP64)."""
    inputs, w = make_inputs(cu, H=H, K=K, V=V, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    N = len(cu) - 1
    h0 = torch.randn(N, H, K, V, generator=gen, dtype=F64)
    w2 = torch.randn(N, H, K, V, generator=gen, dtype=F64)
    return inputs, w, h0, w2


def loss_and_grads(call, inputs, w, h0, w2):
    """(o, ht, the gradients of <o, w> + <ht, w2> to q, k, v, g, beta and h0) of ``call(leaves, h0) -> (o, ht)``."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    h = None if h0 is None else h0.detach().clone().requires_grad_()
    o, ht = call(leaves, h)
    ((o * w).sum() + (ht * w2).sum()).backward()
    return [o.detach(), ht.detach(), *[x.grad for x in leaves], None if h is None else h.grad]


def ours(ctx, **kw):
    return lambda leaves, h: kda_kcp.chunk_kda_kcp(*leaves, ctx, initial_state=h, output_final_state=True, **kw)


def oracle(cu):
    return lambda leaves, h: naive_kda(*leaves, cu, initial_state=h, output_final_state=True)


def assert_close(got, want, where, tol=1e-12, names=NAMES):
    for name, a, b in zip(names, got, want):
        if b is None:
            assert a is None, (where, name)
            continue
        assert b.abs().sum() > 0, (where, name, "a zero reference checks nothing")
        err = rel_rms(a, b)
        assert err < tol, (where, name, err)


@pytest.mark.parametrize("with_h0", [True, False], ids=["h0", "zero_start"])
@pytest.mark.parametrize("case", list(CASES))
def test_states_match_oracle(case, with_h0):
    cu = offsets(CASES[case])
    inputs, w, h0, w2 = state_inputs(cu, seed=list(CASES).index(case))
    h0 = h0 if with_h0 else None
    got = loss_and_grads(ours(kda_kcp.build_context_kcp(cu)), inputs, w, h0, w2)
    want = loss_and_grads(oracle(cu), inputs, w, h0, w2)
    assert_close(got, want, case)


def test_final_state_alone_and_initial_state_alone():
    """A loss of the final states only (o's gradient never arrives); an initial state without final states returns
    o alone, as a call without states does."""
    cu = offsets([70, 0, 130])
    inputs, w, h0, w2 = state_inputs(cu, seed=3)
    ctx = kda_kcp.build_context_kcp(cu)
    got = loss_and_grads(ours(ctx), inputs, 0 * w, h0, w2)
    want = loss_and_grads(oracle(cu), inputs, 0 * w, h0, w2)
    at = NAMES.index("dq")  # q reaches o only
    assert torch.count_nonzero(got[at]) == 0 and torch.count_nonzero(want[at]) == 0
    got[at] = want[at] = None
    assert_close(got[1:], want[1:], "final state alone", names=NAMES[1:])
    leaves = [x.clone().requires_grad_() for x in inputs]
    h = h0.clone().requires_grad_()
    o = kda_kcp.chunk_kda_kcp(*leaves, ctx, initial_state=h)
    assert isinstance(o, torch.Tensor)
    (o * w).sum().backward()
    ref = [x.detach().clone().requires_grad_() for x in inputs]
    href = h0.clone().requires_grad_()
    (naive_kda(*ref, cu, initial_state=href) * w).sum().backward()
    for a, b in zip([o.detach(), *[x.grad for x in leaves], h.grad],
                    [naive_kda(*inputs, cu, initial_state=h0), *[x.grad for x in ref], href.grad]):
        assert rel_rms(a, b) < 1e-12


def _pieces(inputs, cu, cuts):
    """The inputs of the first and second parts of every document (document d cut after cuts[d] tokens), with the
    offsets of each part."""
    first, second = [], []
    for s, e, c in zip(cu[:-1], cu[1:], cuts):
        first.append((s, s + c))
        second.append((s + c, e))

    def take(parts):
        rows = torch.cat([torch.arange(s, e) for s, e in parts])
        return [x.index_select(0, rows) for x in inputs], offsets([e - s for s, e in parts]), rows

    return take(first), take(second)


def test_two_chained_calls_equal_one_call():
    """Each document split into two calls, the second starting from the first's final state: o, the final states and
    every gradient (those of the first call's inputs and of h0 flowing back through the chained state) equal one
    call's. Cuts off the chunk grid, at a document's start (its first part empty) and at its end (the second empty)."""
    lengths = [150, 97, 200, 33, 40]
    cuts = [70, 40, 131, 0, 40]
    cu = offsets(lengths)
    inputs, w, h0, w2 = state_inputs(cu, seed=5)
    (in1, cu1, rows1), (in2, cu2, rows2) = _pieces(inputs, cu, cuts)
    ctx1, ctx2 = kda_kcp.build_context_kcp(cu1), kda_kcp.build_context_kcp(cu2)

    def chained(leaves, h):
        T = cu[-1]
        a = [x.index_select(0, rows1) for x in leaves]
        b = [x.index_select(0, rows2) for x in leaves]
        o1, ht1 = kda_kcp.chunk_kda_kcp(*a, ctx1, initial_state=h, output_final_state=True)
        o2, ht2 = kda_kcp.chunk_kda_kcp(*b, ctx2, initial_state=ht1, output_final_state=True)
        o = o1.new_zeros(T, H, V).index_add(0, rows1, o1).index_add(0, rows2, o2)
        return o, ht2

    got = loss_and_grads(chained, inputs, w, h0, w2)
    want = loss_and_grads(ours(kda_kcp.build_context_kcp(cu)), inputs, w, h0, w2)
    assert_close(got, want, "chained")
    assert_close(got, loss_and_grads(oracle(cu), inputs, w, h0, w2), "chained vs oracle")


def test_fwd_bwd_entries_equal_autograd():
    cu = offsets([1, 0, 299, 150])
    inputs, w, h0, w2 = state_inputs(cu, seed=6)
    ctx = kda_kcp.build_context_kcp(cu)
    auto = loss_and_grads(ours(ctx), inputs, w, h0, w2)
    o, ht, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx, initial_state=h0, output_final_state=True)
    grads = kda_kcp.chunk_kda_bwd_kcp(w, saved, ctx, dht=w2)
    assert len(grads) == 6
    for a, b in zip([o, ht, *grads], auto):
        assert torch.equal(a, b)
    # without dht the final states' gradient is zero; without an initial state there is no dh0
    o, ht, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx, output_final_state=True)
    grads = kda_kcp.chunk_kda_bwd_kcp(w, saved, ctx)
    plain_o, plain_saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx)
    assert torch.equal(o, plain_o)
    for a, b in zip(grads, kda_kcp.chunk_kda_bwd_kcp(w, plain_saved, ctx), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_with_states_equals_plain():
    cu = offsets([1, 0, 299, 150, 161])
    inputs, w, h0, w2 = state_inputs(cu, seed=7)
    ctx = kda_kcp.build_context_kcp(cu)

    def checkpointed(leaves, h):
        return checkpoint(lambda *xs: kda_kcp.chunk_kda_kcp(*xs[:5], ctx, initial_state=xs[5], output_final_state=True),
                          *leaves, h, use_reentrant=False)

    plain = loss_and_grads(ours(ctx), inputs, w, h0, w2)
    for a, b in zip(loss_and_grads(checkpointed, inputs, w, h0, w2), plain):
        assert torch.equal(a, b)


def test_double_backward_with_states_raises():
    """With states, the gradients of a create_graph=True backward are the plain ones, dh0 included; differentiating
    any of them again raises, toward h0 too."""
    cu = offsets([70, 0, 130])
    inputs, w, h0, w2 = state_inputs(cu, seed=9)
    ctx = kda_kcp.build_context_kcp(cu)
    plain = loss_and_grads(ours(ctx), inputs, w, h0, w2)
    leaves = [x.clone().requires_grad_() for x in (*inputs, h0)]
    o, ht = kda_kcp.chunk_kda_kcp(*leaves[:5], ctx, initial_state=leaves[5], output_final_state=True)
    grads = torch.autograd.grad((o, ht), leaves, (w, w2), create_graph=True)
    for a, b in zip(plain[2:], grads, strict=True):
        assert torch.equal(a, b)
    for gr in grads:
        with pytest.raises(RuntimeError, match="chunk_kda_kcp is not twice differentiable"):
            torch.autograd.grad((gr * gr).sum(), leaves[5], allow_unused=True)


def test_bad_states_raise_before_running():
    cu = offsets([30, 50])
    inputs, w, h0, w2 = state_inputs(cu, seed=8)
    f32 = [x.float() for x in inputs]
    ctx = kda_kcp.build_context_kcp(cu)
    before = h0.clone()
    bad = [
        (ValueError, r"initial_state must be \[N, H, K, V\] = \[2, 2, 16, 8\]", inputs, h0[:1]),
        (TypeError, "initial_state must be float32", inputs, h0.bfloat16()),
        (TypeError, "initial_state must be float32, got torch.float64", f32, h0),  # FP64 only for FP64 calls
        (ValueError, "initial_state must be contiguous", inputs, h0.transpose(0, 1).contiguous().transpose(0, 1)),
        (ValueError, "initial_state is on meta", inputs, h0.to("meta")),
        (TypeError, "initial_state must be a torch.Tensor", inputs, h0.tolist()),
    ]
    for exc, match, xs, h in bad:
        with pytest.raises(exc, match=match):
            kda_kcp.chunk_kda_kcp(*xs, ctx, initial_state=h)
    with pytest.raises(TypeError, match="output_final_state must be True or False"):
        kda_kcp.chunk_kda_kcp(*inputs, ctx, output_final_state=1)
    assert torch.equal(h0, before)
    # a float32 initial state serves an FP64 call (promoted), and is not written
    h32 = h0.float()
    o = kda_kcp.chunk_kda_kcp(*inputs, ctx, initial_state=h32)
    assert rel_rms(o, naive_kda(*inputs, cu, initial_state=h32)) < 1e-12 and torch.equal(h32, before.float())
    # the backward's final-state gradient
    o, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx, initial_state=h0)
    with pytest.raises(ValueError, match="dht was given but the forward returned no final state"):
        kda_kcp.chunk_kda_bwd_kcp(w, saved, ctx, dht=w2)
    o, ht, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx, initial_state=h0, output_final_state=True)
    with pytest.raises(ValueError, match="dht must have the final state's shape"):
        kda_kcp.chunk_kda_bwd_kcp(w, saved, ctx, dht=w2[:, :1])


# ---- KCP over gloo ----


def _ends_and_starts(ctx):
    """The documents whose final state (ends) and initial-state gradient (starts) this rank reports."""
    runs = ctx.local.runs
    empty = {d for d in range(ctx.num_docs) if ctx.cu_seqlens[d] == ctx.cu_seqlens[d + 1]} if ctx.rank == 0 else set()
    return {r.doc for r in runs if r.ends_doc} | empty, {r.doc for r in runs if r.starts_doc} | empty


def _kcp_states(rank, world):
    for ci, (case, lengths) in enumerate(CASES.items()):
        cu = offsets(lengths)
        inputs, w, h0, w2 = state_inputs(cu, seed=20 + ci)
        ref = loss_and_grads(ours(kda_kcp.build_context_kcp(cu)), inputs, w, h0, w2)
        for layout in kda_kcp.LAYOUTS:
            ctx = kda_kcp.build_context_kcp(torch.tensor(cu), dist.group.WORLD, layout)
            got = loss_and_grads(ours(ctx), [ctx.shard(x) for x in inputs], ctx.shard(w), h0, w2)
            ends, starts = _ends_and_starts(ctx)
            for name, rows in (("ht", ends), ("dh0", starts)):  # this rank's rows only
                x = got[NAMES.index(name)]
                others = [d for d in range(ctx.num_docs) if d not in rows]
                assert torch.count_nonzero(x[others]) == 0, (case, layout, name)
                assert all(x[d].abs().sum() > 0 for d in rows), (case, layout, name)
            for name in ("ht", "dh0"):
                dist.all_reduce(got[NAMES.index(name)])  # every document's, summed over the ranks
            for name in ("o", "dq", "dk", "dv", "dg", "dbeta"):
                got[NAMES.index(name)] = gather_global(ctx, got[NAMES.index(name)])
            assert_close(got, ref, (world, case, layout))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_kcp_states_over_gloo(world):
    run_distributed(_kcp_states, world)


def _disagreeing_states(rank, world):
    cu = offsets([100, 60])
    inputs, w, h0, w2 = state_inputs(cu, seed=30)
    ctx = kda_kcp.build_context_kcp(cu, dist.group.WORLD)
    assert ctx.plan.needs_exchange
    local = [ctx.shard(x) for x in inputs]
    for kw, named in ((dict(initial_state=h0 if rank == 0 else None), "initial_state"),
                      (dict(output_final_state=rank == 1), "output_final_state"),
                      (dict(initial_state=h0 if rank == 0 else h0[:1]), r"initial_state must be \[N, H, K, V\]")):
        with pytest.raises(ValueError, match=named):
            kda_kcp.chunk_kda_kcp(*local, ctx, **kw)
    # the group still works after the errors
    o, ht = kda_kcp.chunk_kda_kcp(*local, ctx, initial_state=h0, output_final_state=True)
    assert ht.shape == h0.shape


@pytest.mark.slow
def test_ranks_agree_on_states():
    run_distributed(_disagreeing_states, 2)
