"""Values outside the domain (kda_kcp.status: every value finite, g in [-5, 0], beta in [0, 2]) never pass silently
on the torch backend: without validate=True a call raises ValueError naming what it saw, before it computes
anything, in the forward and (for tensors changed after it) in the backward. Inputs inside the domain, its edges
included, run as before. (The CUDA backend's status word: tests/test_value_status_emulation.py on the CPU,
tests/gpu/test_value_policy_cuda.py on the GPU.)"""

import pytest
import torch

import kda_kcp
import kda_kcp.torch_backend as tb
from kda_kcp.reference import naive_kda
from helpers import make_inputs, offsets

CU = offsets([40, 90])
NAMES = ("q", "k", "v", "g", "beta")
T_BAD, H_BAD = 70, 1  # a token of the second document, past its first chunk

# (tensor, value) -> the phrase the error names
CASES = {
    **{(name, "nan"): f"non-finite q/k/v/g/beta: {name} holds non-finite" for name in NAMES},
    **{(name, "inf"): f"non-finite q/k/v/g/beta: {name} holds non-finite" for name in NAMES},
    ("g", 0.5): "g above 0: g must lie in \\[-5, 0\\], its largest value is 0.5",
    ("g", -6.0): "g below -5: g must lie in \\[-5, 0\\], its smallest value is -6",
    ("g", -30.0): "g below -5: g must lie in \\[-5, 0\\], its smallest value is -30",
    ("beta", 2.5): "beta outside \\[0, 2\\]",
    ("beta", -0.5): "beta outside \\[0, 2\\]",
}


@pytest.fixture
def args():
    inputs, do = make_inputs(CU, H=2, K=16, V=8, dtype=torch.float32)
    return inputs, do, kda_kcp.build_context_kcp(CU)


def _bad(inputs, name, value):
    """A copy of the inputs with one value of ``name`` set (one channel of one token; beta: one token)."""
    out = [x.clone() for x in inputs]
    x = out[NAMES.index(name)]
    fill = {"nan": float("nan"), "inf": float("inf")}.get(value, value)
    if x.dim() == 3:
        x[T_BAD, H_BAD, 3] = fill
    else:
        x[T_BAD, H_BAD] = fill
    return out


@pytest.fixture
def no_compute(monkeypatch):
    """Any chunk computation of the torch backend fails the test: the check must come first."""

    def refuse(*a, **kw):
        raise AssertionError("the torch backend computed before checking the values")

    for fn in ("chunk_prep", "chunk_grads", "state_walk", "reverse_walk"):
        monkeypatch.setattr(tb, fn, refuse)


@pytest.mark.parametrize("name, value", list(CASES))
def test_bad_value_raises_before_computing(args, no_compute, name, value):
    inputs, _, ctx = args
    with pytest.raises(ValueError, match=CASES[name, value]):
        kda_kcp.chunk_kda_kcp(*_bad(inputs, name, value), ctx)
    with pytest.raises(ValueError, match=CASES[name, value]):
        kda_kcp.chunk_kda_fwd_kcp(*_bad(inputs, name, value), ctx)


@pytest.mark.parametrize("name, value", [("g", "nan"), ("g", -6.0), ("beta", 2.5), ("v", "inf")])
def test_backward_checks_the_saved_inputs(args, name, value):
    """A value put out of the domain between the forward and the backward (the saved tensors are references),
    written through .data, which the tensor's version counter does not see (a write it sees raises first:
    tests/test_backward_context.py): the backward's own value check catches it."""
    inputs, do, ctx = args
    inputs = [x.clone() for x in inputs]
    o, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx)
    assert torch.isfinite(o).all()
    bad = _bad(inputs, name, value)[NAMES.index(name)]
    inputs[NAMES.index(name)].data.copy_(bad)
    with pytest.raises(ValueError, match=CASES[name, value]):
        kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx)


def test_validate_true_uses_the_same_words(args):
    inputs, _, ctx = args
    bad = _bad(inputs, "g", -6.0)
    with pytest.raises(ValueError) as default:
        kda_kcp.chunk_kda_kcp(*bad, ctx)
    with pytest.raises(ValueError) as requested:
        kda_kcp.chunk_kda_kcp(*bad, ctx, validate=True)
    assert str(default.value) == str(requested.value)


def test_several_problems_are_all_named(args):
    inputs, _, ctx = args
    bad = _bad(_bad(_bad(inputs, "g", -6.0), "beta", 2.5), "q", "nan")
    with pytest.raises(ValueError, match=r"non-finite q/k/v/g/beta: q holds .*g below -5.*beta outside \[0, 2\]"):
        kda_kcp.chunk_kda_kcp(*bad, ctx)


def test_domain_edges_pass(args):
    """g = -5 and g = 0 (+0 and -0), beta = 0 and 1: inside the domain, computed as the FP64 oracle."""
    inputs, do, ctx = args
    q, k, v, g, beta = (x.clone() for x in inputs)
    g[5] = -5.0
    g[6] = 0.0
    g[7] = -0.0
    g[T_BAD:T_BAD + 64] = -5.0  # a whole chunk at the lower bound
    beta[8] = 0.0
    beta[9] = 1.0
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o = kda_kcp.chunk_kda_kcp(*leaves, ctx)
    o.backward(do)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta)]
    ref = naive_kda(*ref_leaves, CU)
    ref.backward(do.double())
    assert torch.allclose(o.double(), ref, atol=1e-5, rtol=1e-4)
    for x, r in zip(leaves, ref_leaves):
        assert torch.isfinite(x.grad).all()
        assert torch.allclose(x.grad.double(), r.grad, atol=1e-4, rtol=1e-3)
