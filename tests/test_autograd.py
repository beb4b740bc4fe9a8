"""Autograd, torch.utils.checkpoint and the explicit forward/backward entries agree; inputs stay untouched."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import kda_kcp
from kda_kcp import function, steps
from helpers import make_inputs, offsets, step

CU = offsets([70, 1, 0, 130, 64])


@pytest.mark.parametrize("deterministic", [True, False])
def test_checkpoint_equals_plain_step(deterministic):
    inputs, do = make_inputs(CU, dtype=torch.float32, seed=1)
    ctx = kda_kcp.build_context_kcp(CU)
    plain = step(inputs, do, ctx, deterministic=deterministic)
    leaves = [x.clone().requires_grad_() for x in inputs]
    o = checkpoint(
        lambda *xs: kda_kcp.chunk_kda_kcp(*xs, ctx, deterministic=deterministic), *leaves, use_reentrant=False
    )
    o.backward(do)
    for a, b in zip(plain, [o.detach()] + [x.grad for x in leaves]):
        assert torch.equal(a, b)


class _CountPasses:
    """Counts ForwardCall steps: begins (checks, and the exchange at W > 1) and output passes."""

    def __init__(self, monkeypatch):
        self.begins = self.outputs = 0
        start, finish = function.start_forward, function.ForwardCall.finish

        def counted_start(*a, **kw):
            self.begins += 1
            return start(*a, **kw)

        def counted_finish(call):
            self.outputs += 1
            return finish(call)

        monkeypatch.setattr(function, "start_forward", counted_start)
        monkeypatch.setattr(function.ForwardCall, "finish", counted_finish)


def _checkpoint_step(inputs, do, ctx, after=lambda o: o, **kw):
    leaves = [x.clone().requires_grad_() for x in inputs]
    o = checkpoint(lambda *xs: after(kda_kcp.chunk_kda_kcp(*xs, ctx, **kw)), *leaves, use_reentrant=False)
    o.backward(do)
    return [o.detach()] + [x.grad for x in leaves]


def test_checkpoint_recomputation_skips_the_output_pass(monkeypatch):
    """Region = the op alone: the recomputation stops once the inputs the backward saved are back, before
    the output pass (its o would be thrown away); gradients stay bitwise those of the plain step."""
    inputs, do = make_inputs(CU, dtype=torch.float32, seed=6)
    ctx = kda_kcp.build_context_kcp(CU)
    plain = step(inputs, do, ctx)
    n = _CountPasses(monkeypatch)
    got = _checkpoint_step(inputs, do, ctx)
    assert (n.begins, n.outputs) == (2, 1)
    for a, b in zip(plain, got):
        assert torch.equal(a, b)


def test_the_forward_knows_a_checkpoint_recomputation(monkeypatch):
    """The KCP forward's early output pass (kda_kcp.cuda.forward, reserve_early) is launched only outside a backward
    pass: a checkpoint's recomputation never asks for o. steps.in_backward tells the two apart."""
    inputs, do = make_inputs(CU, dtype=torch.float32, seed=9)
    ctx = kda_kcp.build_context_kcp(CU)
    seen = []
    start = function.start_forward

    def noting_start(*a, **kw):
        seen.append(steps.in_backward())
        return start(*a, **kw)

    monkeypatch.setattr(function, "start_forward", noting_start)
    _checkpoint_step(inputs, do, ctx)
    assert seen == [False, True]


def test_checkpoint_recomputes_o_when_the_region_saved_it(monkeypatch):
    """A later op in the region saved o (the square): the recomputation runs the output pass again, and the
    result equals the plain step; so does a recomputation with torch's early stop switched off."""
    inputs, do = make_inputs(CU, dtype=torch.float32, seed=7)
    ctx = kda_kcp.build_context_kcp(CU)
    leaves = [x.clone().requires_grad_() for x in inputs]
    o = kda_kcp.chunk_kda_kcp(*leaves, ctx).square()
    o.backward(do)
    plain = [o.detach()] + [x.grad for x in leaves]
    n = _CountPasses(monkeypatch)
    got = _checkpoint_step(inputs, do, ctx, after=torch.square)
    assert (n.begins, n.outputs) == (2, 2)
    for a, b in zip(plain, got):
        assert torch.equal(a, b)
    n.begins = n.outputs = 0
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        got = _checkpoint_step(inputs, do, ctx)
    assert (n.begins, n.outputs) == (2, 2)
    for a, b in zip(step(inputs, do, ctx), got):
        assert torch.equal(a, b)


def test_reentrant_checkpoint_and_a_retained_graph_equal_the_plain_step():
    inputs, do = make_inputs(CU, dtype=torch.float32, seed=8)
    ctx = kda_kcp.build_context_kcp(CU)
    plain = step(inputs, do, ctx)
    leaves = [x.clone().requires_grad_() for x in inputs]
    o = checkpoint(lambda *xs: kda_kcp.chunk_kda_kcp(*xs, ctx), *leaves, use_reentrant=True)
    o.backward(do)
    for a, b in zip(plain, [o.detach()] + [x.grad for x in leaves]):
        assert torch.equal(a, b)
    leaves = [x.clone().requires_grad_() for x in inputs]
    o = kda_kcp.chunk_kda_kcp(*leaves, ctx)
    o.backward(do, retain_graph=True)
    first = [x.grad.clone() for x in leaves]
    o.backward(do)  # the saved inputs serve a second backward; the gradients accumulate
    for a, b, x in zip(plain[1:], first, leaves):
        assert torch.equal(a, b) and torch.equal(x.grad, 2 * b)


def test_explicit_entries_equal_autograd():
    inputs, do = make_inputs(CU, dtype=torch.float32, seed=2)
    ctx = kda_kcp.build_context_kcp(CU)
    auto = step(inputs, do, ctx)
    o, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx)
    grads = kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx)
    assert torch.equal(o, auto[0])
    for a, b in zip(grads, auto[1:]):
        assert torch.equal(a, b)
    assert [x.dtype for x in grads] == [x.dtype for x in inputs]


def test_repeat_calls_are_bitwise_identical():
    inputs, do = make_inputs(CU, dtype=torch.float32, seed=3)
    ctx = kda_kcp.build_context_kcp(CU)
    first = step(inputs, do, ctx)
    for _ in range(2):
        for a, b in zip(first, step(inputs, do, ctx)):
            assert torch.equal(a, b)


def test_nothing_the_caller_passed_is_modified():
    inputs, do = make_inputs(CU, dtype=torch.bfloat16, seed=4)
    cu = torch.tensor(CU)
    before = [x.clone() for x in inputs] + [do.clone(), cu.clone()]
    ctx = kda_kcp.build_context_kcp(cu)
    step(inputs, do, ctx)
    o, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx)
    kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx)
    for a, b in zip(before, inputs + [do, cu]):
        assert torch.equal(a, b)


def test_gradients_flow_only_to_inputs_that_ask():
    inputs, do = make_inputs(CU, dtype=torch.float32, seed=5)
    ctx = kda_kcp.build_context_kcp(CU)
    q = inputs[0].clone().requires_grad_()
    o = kda_kcp.chunk_kda_kcp(q, *inputs[1:], ctx)
    o.backward(do)
    assert q.grad is not None and q.grad.shape == q.shape
    assert all(not x.requires_grad for x in inputs[1:])


@pytest.mark.parametrize("deterministic", [True, False])
def test_double_backward_raises(deterministic):
    """The gradients of a create_graph=True backward are the plain ones; differentiating them again raises (the
    kernels are not twice differentiable), also where do does not ask for a gradient."""
    inputs, do = make_inputs(CU, seed=8)
    ctx = kda_kcp.build_context_kcp(CU)
    plain = step(inputs, do, ctx, deterministic=deterministic)
    leaves = [x.clone().requires_grad_() for x in inputs]
    o = kda_kcp.chunk_kda_kcp(*leaves, ctx, deterministic=deterministic)
    grads = torch.autograd.grad(o, leaves, do, create_graph=True)
    for a, b in zip(plain[1:], grads):
        assert torch.equal(a, b)
    for i, gr in enumerate(grads):
        with pytest.raises(RuntimeError, match="chunk_kda_kcp is not twice differentiable"):
            torch.autograd.grad((gr * gr).sum(), leaves, allow_unused=True)
        assert all(x.grad is None for x in leaves), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_autocast_region_changes_nothing(dtype):
    """Inside torch.autocast (a mixed-precision training step) the call computes in its own dtypes: o, the final
    states and every gradient (the backward run inside the region too) equal those of the call outside it, bit for
    bit."""
    inputs, do = make_inputs(CU, dtype=dtype, seed=7)
    ctx = kda_kcp.build_context_kcp(CU)
    q, v = inputs[0], inputs[2]
    h0 = torch.randn(ctx.num_docs, q.shape[1], q.shape[2], v.shape[2], generator=torch.Generator().manual_seed(8))

    def run():
        leaves = [x.clone().requires_grad_() for x in inputs + [h0]]
        o, ht = kda_kcp.chunk_kda_kcp(*leaves[:5], ctx, initial_state=leaves[5], output_final_state=True)
        ((o.float() * do.float()).sum() + ht.square().sum()).backward()
        return [o.detach(), ht.detach()] + [x.grad for x in leaves]

    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = run()
    for a, b in zip(plain, mixed):
        assert a.dtype == b.dtype and torch.equal(a, b)
