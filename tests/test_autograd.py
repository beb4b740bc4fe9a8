"""Autograd, torch.utils.checkpoint and the explicit forward/backward entries agree; inputs stay untouched."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import kda_kcp
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
