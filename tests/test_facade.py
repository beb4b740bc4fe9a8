"""The facade's routing rules and the mode packages' own entries (docs/design.md §6)."""

import warnings

import pytest
import torch

import kda_kcp
import kda_kcp.det as det
import kda_kcp.nondet as nondet
from kda_kcp import backend as backend_mod
from helpers import make_inputs, offsets

CU = offsets([40, 30])


@pytest.fixture
def batch():
    inputs, _ = make_inputs(CU, dtype=torch.float32)
    return inputs, kda_kcp.build_context_kcp(CU)


def _spy(monkeypatch):
    seen = []
    for pkg in (det, nondet):
        real = pkg.chunk_kda_kcp

        def wrapped(*a, _real=real, _pkg=pkg, **kw):
            seen.append(_pkg.__name__)
            return _real(*a, **kw)

        monkeypatch.setattr(pkg, "chunk_kda_kcp", wrapped)
    return seen


def test_routing_on_the_flag(monkeypatch, batch):
    inputs, ctx = batch
    seen = _spy(monkeypatch)
    kda_kcp.chunk_kda_kcp(*inputs, ctx)
    kda_kcp.chunk_kda_kcp(*inputs, ctx, deterministic=True)
    kda_kcp.chunk_kda_kcp(*inputs, ctx, deterministic=False)
    assert seen == ["kda_kcp.det", "kda_kcp.det", "kda_kcp.nondet"]


def test_nondet_under_torch_deterministic_mode_runs_det_and_warns_once(monkeypatch, batch):
    inputs, ctx = batch
    seen = _spy(monkeypatch)
    monkeypatch.setattr(kda_kcp, "_warned_forced_det", False)
    torch.use_deterministic_algorithms(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kda_kcp.chunk_kda_kcp(*inputs, ctx, deterministic=False)
            kda_kcp.chunk_kda_kcp(*inputs, ctx, deterministic=False)
            o, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx, deterministic=False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen == ["kda_kcp.det", "kda_kcp.det"]
    assert saved.deterministic is True
    relevant = [w for w in caught if "use_deterministic_algorithms" in str(w.message)]
    assert len(relevant) == 1
    assert relevant[0].filename == __file__  # attributed to the caller's line, not to the library


def test_packages_reject_the_other_mode(batch):
    inputs, ctx = batch
    with pytest.raises(ValueError, match="kda_kcp.det runs deterministic=True only"):
        det.chunk_kda_kcp(*inputs, ctx, deterministic=False)
    with pytest.raises(ValueError, match="kda_kcp.nondet runs deterministic=False only"):
        nondet.chunk_kda_kcp(*inputs, ctx, deterministic=True)
    for fn in ("chunk_kda_fwd_kcp", "kda_workspace_bytes_kcp", "kda_saved_bytes_kcp", "kda_comm_bytes_kcp", "WorkspaceKcp"):
        with pytest.raises(ValueError, match="deterministic"):
            args = inputs + [ctx] if fn == "chunk_kda_fwd_kcp" else [ctx, 2]
            getattr(det, fn)(*args, deterministic=False)
    o, saved = det.chunk_kda_fwd_kcp(*inputs, ctx)
    with pytest.raises(ValueError, match="deterministic"):
        nondet.chunk_kda_bwd_kcp(torch.ones_like(o), saved, ctx)
    # their own mode works and matches the facade
    assert torch.equal(det.chunk_kda_kcp(*inputs, ctx), kda_kcp.chunk_kda_kcp(*inputs, ctx))
    assert torch.equal(nondet.chunk_kda_kcp(*inputs, ctx, deterministic=False), o)


@pytest.mark.parametrize("bad", [None, 1, "yes", 0])
def test_deterministic_must_be_a_bool(batch, bad):
    inputs, ctx = batch
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        kda_kcp.chunk_kda_kcp(*inputs, ctx, deterministic=bad)


def test_backend_environment_variable(monkeypatch, batch):
    inputs, ctx = batch
    monkeypatch.setenv("KDA_KCP_BACKEND", "torch")
    ref = kda_kcp.chunk_kda_kcp(*inputs, ctx)
    monkeypatch.setenv("KDA_KCP_BACKEND", "cuda")
    with pytest.raises(backend_mod.BackendUnavailable, match="not a CUDA device"):
        kda_kcp.chunk_kda_kcp(*inputs, ctx)
    monkeypatch.setenv("KDA_KCP_BACKEND", "triton")
    with pytest.raises(ValueError, match="KDA_KCP_BACKEND"):
        kda_kcp.chunk_kda_kcp(*inputs, ctx)
    monkeypatch.delenv("KDA_KCP_BACKEND")
    assert torch.equal(kda_kcp.chunk_kda_kcp(*inputs, ctx), ref)


def test_backend_choice_is_made_once(monkeypatch, batch):
    """select_backend decides once per (device, mode, KDA_KCP_BACKEND): later calls take the kept answer (no
    capability query per call), and a change of the variable is a new key."""
    inputs, ctx = batch
    made = []
    real = backend_mod._select
    monkeypatch.setattr(backend_mod, "_selected", {})
    monkeypatch.setattr(backend_mod, "_select", lambda *a: made.append(a) or real(*a))
    monkeypatch.delenv("KDA_KCP_BACKEND", raising=False)
    for _ in range(3):
        kda_kcp.chunk_kda_kcp(*inputs, ctx)
    assert len(made) == 1
    monkeypatch.setenv("KDA_KCP_BACKEND", "torch")
    kda_kcp.chunk_kda_kcp(*inputs, ctx)
    assert len(made) == 2 and made[1][2] == "torch"
