"""Values outside the domain on the CUDA backend with validate off (kda_kcp.status, csrc/kda_status.cuh): the call
that reads them returns NaN outputs (no finite garbage), the next call raises ValueError naming what was seen, and
kda_kcp.check_status() raises at once; none of it synchronizes the host. NaN, +Inf, g = +0.5, g = -6 and g = -30
(and beta = 2.5) in the tensors each prep reads; v is read by the backward's prep only. Clean inputs give the same
bits as before a bad call and raise nothing; a captured CUDA graph sets its outputs to NaN on a replay with bad
values and check_status() raises after it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gpu_common import DEV, capture, fresh_seed, make_inputs, require_kernel_gpu

require_kernel_gpu("the CUDA value-policy tests")

import kda_kcp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import INPUT_NAMES, with_value  # noqa: E402

SEED = fresh_seed("value policy cuda")
CU = [0, 1, 64, 65, 300, 1000]
H = 2
AT = (500, 1, 17)  # token (inside the last document), head, channel of the bad value

# (tensor, value) -> the words the error names
CASES = {
    **{(n, "nan"): "non-finite q/k/v/g/beta" for n in INPUT_NAMES},
    **{(n, "inf"): "non-finite q/k/v/g/beta" for n in INPUT_NAMES},
    ("g", 0.5): r"g above 0",
    ("g", -6.0): r"g below -5",
    ("g", -30.0): r"g below -5",
    ("beta", 2.5): r"beta outside \[0, 2\]",
}


@pytest.fixture(scope="module")
def data():
    gen = torch.Generator().manual_seed(SEED)
    inputs = make_inputs(CU[-1], H, gen)
    do = torch.randn(CU[-1], H, 128, generator=gen).bfloat16().to(DEV)
    ctx = kda_kcp.build_context_kcp(torch.tensor(CU, device=DEV))
    return inputs, do, ctx


@pytest.fixture(autouse=True)
def clean_status():
    """Each test starts and ends with no value error pending."""
    kda_kcp.check_status()
    yield
    torch.cuda.synchronize()
    kda_kcp.check_status()




def test_the_word_reaches_the_host_without_a_copy(data):
    """The fill kernel that ends a call stores the word into the mapped pinned slot itself (kda_kcp.status.finish):
    the slot holds the word after the call, and the call makes no device-to-host copy."""
    from torch.profiler import ProfilerActivity, profile

    from kda_kcp import status
    inputs, do, ctx = data
    st = status._status(DEV)
    kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx)  # warm: programs loaded, status made
    torch.cuda.synchronize()
    kda_kcp.check_status()
    assert st.mapped, "the binding refused the pinned slot (the copy fallback is in use)"
    st.host.fill_(-1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx)
        torch.cuda.synchronize()
    slot = st.pending[-1][0]
    assert st.host[slot].item() == 0
    copies = [e.name for e in prof.events() if "memcpy" in e.name.lower() and "dtoh" in e.name.lower()]
    assert not copies, copies
    bad = [x.clone() for x in inputs]
    bad[3][AT] = -6.0
    kda_kcp.chunk_kda_fwd_kcp(*bad, ctx)
    torch.cuda.synchronize()
    assert st.host[st.pending[-1][0]].item() == status.G_BELOW
    _raises_next(inputs, ctx, "g below -5")


def _step(inputs, do, ctx, workspace=None):
    o, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx, workspace=workspace)
    return (o, *kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx, workspace=workspace))


def _all_nan(x):
    return bool(torch.isnan(x.float()).all())


def _raises_next(inputs, ctx, words):
    """The next call (a clean forward) raises, naming ``words``."""
    with pytest.raises(ValueError, match=r"a call issued earlier on cuda:\d read input values outside the domain "
                                         rf"\({words}.*\): its outputs were set to NaN"):
        kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx)


@pytest.mark.parametrize("name, value", list(CASES))
def test_bad_value_nan_outputs_then_error_at_the_next_call(data, name, value):
    """The forward with the bad value (but v, which its prep does not read), then a backward whose saved input was set
    to it after a clean forward: each returns NaN everywhere and the call after it raises; clean calls after that
    give the clean results bitwise."""
    inputs, do, ctx = data
    clean = _step(inputs, do, ctx)
    torch.cuda.synchronize()
    assert all(torch.isfinite(x.float()).all() for x in clean)
    bad = with_value(inputs, name, value, AT)
    if name != "v":
        o, _ = kda_kcp.chunk_kda_fwd_kcp(*bad, ctx)
        torch.cuda.synchronize()  # the status copy has landed: the next call sees it
        assert _all_nan(o), f"{name} = {value}: o is not NaN everywhere"
        _raises_next(inputs, ctx, CASES[name, value])
    mine = [x.clone() for x in inputs]
    _, saved = kda_kcp.chunk_kda_fwd_kcp(*mine, ctx)
    # the saved tensors are references; written through .data, which their version counters do not see (a write
    # they see raises before any kernel: tests/test_backward_context.py), so the backward prep's value check runs
    mine[INPUT_NAMES.index(name)].data.copy_(bad[INPUT_NAMES.index(name)])
    grads = kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx)
    torch.cuda.synchronize()
    assert all(_all_nan(x) for x in grads), f"{name} = {value}: a gradient is not NaN everywhere"
    _raises_next(inputs, ctx, CASES[name, value])
    again = _step(inputs, do, ctx)  # the error reset the status
    for x, y in zip(again, clean):
        assert torch.equal(x, y)


def test_check_status_raises_at_once_and_resets(data):
    inputs, do, ctx = data
    o, _ = kda_kcp.chunk_kda_fwd_kcp(*with_value(inputs, "g", -6.0, AT), ctx)
    with pytest.raises(ValueError, match=r"a call on cuda:\d read input values outside the domain \(g below -5\)"):
        kda_kcp.check_status()
    assert _all_nan(o)
    kda_kcp.check_status()  # reset
    kda_kcp.chunk_kda_fwd_kcp(*with_value(inputs, "beta", 2.5, AT), ctx)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"beta outside \[0, 2\]"):
        kda_kcp.check_status(synchronize=False)


def test_no_host_synchronization(data):
    """A bad fwd + bwd, and the next call that raises, under torch's sync debug mode "error" (with a workspace, as
    tests/gpu/test_workspace_cuda.py runs calls that never block the host)."""
    inputs, do, ctx = data
    ws = kda_kcp.WorkspaceKcp(ctx, H)
    _step(inputs, do, ctx, ws)
    bad = with_value(inputs, "g", 0.5, AT)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, saved = kda_kcp.chunk_kda_fwd_kcp(*bad, ctx, workspace=ws)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert _all_nan(o)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(ValueError, match="g above 0"):
            kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx, workspace=ws)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_graph_replay_with_bad_values(data):
    """fwd + bwd captured with a workspace: a replay with g = -30 copied in gives NaN outputs and check_status()
    raises; a replay with the clean values again gives the eager results bitwise and nothing pending."""
    inputs, do, ctx = data
    ws = kda_kcp.WorkspaceKcp(ctx, H)
    ref = _step(inputs, do, ctx, ws)
    static = [x.clone() for x in (*inputs, do)]
    graph, outs = capture(lambda *a: _step(list(a[:5]), a[5], ctx, ws), static)
    kda_kcp.check_status()  # the warm-up calls were clean
    for s, x in zip(static, (*with_value(inputs, "g", -30.0, AT), do)):
        s.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert all(_all_nan(x) for x in outs)
    with pytest.raises(ValueError, match="g below -5"):
        kda_kcp.check_status()
    for s, x in zip(static, (*inputs, do)):
        s.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(outs, ref):
        assert torch.equal(x, y)
