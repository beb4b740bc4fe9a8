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


class _Event:
    def __init__(self):
        self.recorded = 0

    def record(self, stream=None):
        self.recorded += 1

    def query(self):
        return True


class _Program:
    """Stands for a program's status_fill: stores the word into the slot as the kernel does, or refuses a slot as
    the binding does for memory that is not mapped."""

    def __init__(self, maps=True, fails=None):
        self.maps, self.fails, self.calls = maps, fails, []

    def status_fill(self, word, report, *outputs):
        self.calls.append(report.numel())
        if self.fails is not None:
            raise self.fails
        if report.numel():
            if not self.maps:
                raise ValueError("status report slot is not mapped pinned host memory")
            report.copy_(word)


@pytest.fixture
def fake_cuda_status(monkeypatch):
    """A _Status whose slots and events behave as on a GPU (the word and the slots on the CPU)."""
    from kda_kcp import status
    st = status._Status(torch.device("cpu"))
    st.cuda = st.mapped = True
    st.events = [_Event() for _ in range(status._SLOTS)]
    monkeypatch.setattr(status, "_status", lambda device: st)
    monkeypatch.setattr(status, "_capturing", lambda s: False)
    monkeypatch.setattr(status.torch.cuda, "current_stream", lambda device=None: None)
    return status, st


def test_finish_publishes_the_word_through_a_slot(fake_cuda_status):
    status, st = fake_cuda_status
    mod = _Program()
    status.finish(mod, "cpu", torch.zeros(3))
    assert mod.calls == [1] and len(st.pending) == 1 and len(st.free) == status._SLOTS - 1
    assert status.pending_error(st) is None and len(st.free) == status._SLOTS  # the slot is free again
    st.word.fill_(status.G_BELOW)
    status.finish(mod, "cpu", torch.zeros(3))
    msg = status.pending_error(st)
    assert msg is not None and "g below -5" in msg
    assert st.word.item() == 0  # the error reset the word


def test_finish_copies_the_word_where_the_slot_is_refused(fake_cuda_status):
    status, st = fake_cuda_status
    mod = _Program(maps=False)
    st.word.fill_(status.NONFINITE)
    status.finish(mod, "cpu", torch.zeros(3))
    assert mod.calls == [1, 0] and not st.mapped  # refused, then the fill without a slot and the copy
    assert "non-finite" in status.pending_error(st)
    status.finish(mod, "cpu", torch.zeros(3))
    assert mod.calls == [1, 0, 0]  # no slot offered again in this process
    assert status.pending_error(st) is None and len(st.free) == status._SLOTS


def test_finish_returns_the_slot_when_the_fill_raises(fake_cuda_status):
    status, st = fake_cuda_status
    mod = _Program(fails=TypeError("status_fill outputs must be bfloat16 or float32"))
    with pytest.raises(TypeError):
        status.finish(mod, "cpu", torch.zeros(3, dtype=torch.int64))
    assert len(st.free) == status._SLOTS and not st.pending and st.mapped
