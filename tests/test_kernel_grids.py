"""The kernels' grids at any chunk, segment and head count, checked on the CPU.

CUDA bounds gridDim.y and gridDim.z by 65,535 (gridDim.x by 2^31 - 1). The gradient kernel folds its chunks into
gridDim.z (whole pieces of 65,535 chunks, then a launch of the rest); the forward's walks launch 65,535 segments at
a time. Reaching those paths takes 65,536 chunks or segments on the GPU (tests/gpu/test_large_counts.py); here the
CPU emulation of the kernels (tests/emulation/, tests/test_kernel_emulation.py) is built for a device whose
gridDim.y bound is 2 (-DKDA_EMU_MAX_GRID_Y=2: the emulated runtime refuses a launch past it as the GPU does past
65,535, and the kernels' kMaxGridY follows it), so that a few chunks take them. Documents are independent, so a
batch's results equal, bit for bit, those of its documents computed in smaller calls within the bound.
The bounds no launch folds away (heads on gridDim.y or z, the preps' chunk-heads on gridDim.x) raise a ValueError
before any kernel runs."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

import kda_kcp
import kda_kcp.function as function
from kda_kcp.cuda import bwd_layout
from kda_kcp.cuda import forward
from helpers import set_tuning
from test_kernel_emulation import NAMES, SCALE, _build, _case, _p, _use_emulated_programs, _walked

MAX_Y = 2  # the emulated device's gridDim.y bound (>= the heads of these tests: walks and merges put H there)
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the CPU emulation")
pytestmark = pytest.mark.slow  # the kernels built with g++ and run on the CPU emulation: over a minute on two cores


@pytest.fixture(scope="module")
def emu_small_grid(tmp_path_factory):
    return ctypes.CDLL(str(_build(tmp_path_factory.mktemp("kda_emu_grid"), (f"-DKDA_EMU_MAX_GRID_Y={MAX_Y}",))))


def _grads_of(lib, inputs, do, walked, c0, c1, out):
    """The gradient kernel (16 warps) on chunks [c0, c1) of the walked tables (views, as the pipelined backward
    launches it) into ``out``."""
    chunks, prep, h, dh = walked
    H = inputs[0].shape[1]
    rec = H * bwd_layout.PREP_BYTES
    rc = lib.e_grads(*map(_p, (*inputs, do, chunks[c0:c1])), c1 - c0, H, _p(prep[c0 * rec:c1 * rec]), _p(h[c0:c1]),
                     _p(dh[c0:c1]), *map(_p, out), ctypes.c_float(SCALE), 16)
    assert rc == 0, f"the gradient kernel's launch on chunks [{c0}, {c1}) failed ({rc})"


@needs_gxx
def test_gradient_kernel_folds_chunks_past_grid_y(emu_small_grid):
    """7 chunks at H = 2 on a gridDim.y bound of 2: launches (H, 2, 3) over chunks 0-5 and (H, 1) over chunk 6, from
    the first 7 rows of an 8-chunk batch whose records, h and dh are all made, so that a CTA past the last chunk
    would find a valid chunk and write its gradients (tokens 284 onwards stay NaN here). The 7 chunks' gradients
    equal, bit for bit, those of launches of 1 and 2 chunks grouped otherwise ([0, 1), [1, 3), [3, 5), [5, 7))."""
    lib = emu_small_grid
    cu = [0, 70, 150, 220, 290]  # 2 chunks per document
    plan, inputs, do, _, _ = _case(cu, 2, 21)
    walked = _walked(lib, plan, inputs, do)
    n = 7
    assert walked[0].shape[0] == 8 and n > 3 * MAX_Y
    end = int(walked[0][n - 1, 0] + walked[0][n - 1, 1])  # the first token after chunk n - 1
    assert end == cu[3] + 64
    got = [torch.full_like(x, float("nan")) for x in inputs]
    _grads_of(lib, inputs, do, walked, 0, n, got)
    ref = [torch.full_like(x, float("nan")) for x in inputs]
    for c0, c1 in ((0, 1), (1, 3), (3, 5), (5, 7)):
        _grads_of(lib, inputs, do, walked, c0, c1, ref)
    for name, x, r in zip(NAMES, got, ref):
        assert torch.isfinite(x[:end].float()).all(), f"{name}: a chunk's gradients are missing"
        assert torch.equal(x[:end], r[:end]), f"{name}: the folded grid's gradients differ from the bounded launches'"
        assert torch.isnan(x[end:].float()).all(), f"{name}: a CTA past the last chunk wrote gradients"


def _fwd_bwd(cu, inputs, do):
    """o and the five gradients of one W = 1 call through kda_kcp.function (the CUDA backend's wrappers)."""
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu))
    o, saved = function.forward_kcp(*inputs, ctx, None, True, None)
    return (o, *function.backward_kcp(do, saved, ctx, None)), ctx.local


def _counts(plan, H):
    """(forward output segments, forward summaries, chunks) of one call: the counts that ride on gridDim.y."""
    tabs = forward.forward_tables(plan, H, "cpu")
    return tabs.out.shape[0], tabs.summary.shape[0], plan.num_chunks


@needs_gxx
def test_fwd_bwd_past_grid_y_equals_smaller_calls(emu_small_grid, monkeypatch):
    """A forward + backward of 4 documents (2, 2, 2 and 1 chunks) on a gridDim.y bound of 2: the forward in 1-chunk
    segments (7 output segments and 3 summaries: walk launches of 2, 2, 2, 1 and 2, 1 segments), the backward's
    gradients in one call of 7 chunks (launches (1, 2, 3) and (1, 1)); o and every gradient equal, bit for bit,
    those of each document in a call of its own, whose every count stays within the bound."""
    _use_emulated_programs(emu_small_grid, monkeypatch.setattr, monkeypatch.setenv)
    # the forward in 1-chunk segments; the backward in whole runs (no summaries: their rows ride on gridDim.x) and
    # one gradient call of every chunk
    set_tuning(monkeypatch, fwd_seg_chunks=1, bwd_seg_chunks=0, bwd_pipeline=0)
    cu = [0, 70, 170, 298, 299]  # 2, 2, 2 and 1 chunks
    H = 1
    _, inputs, do, _, _ = _case(cu, H, 22)
    got, plan = _fwd_bwd(cu, inputs, do)
    assert _counts(plan, H) == (7, 3, 7)
    ref = [[] for _ in got]
    for a in range(len(cu) - 1):
        t0, t1 = cu[a], cu[a + 1]
        part, sub_plan = _fwd_bwd([0, t1 - t0], [x[t0:t1] for x in inputs], do[t0:t1])
        assert max(_counts(sub_plan, H)) <= MAX_Y, "a reference call reaches the bound"
        for lst, x in zip(ref, part):
            lst.append(x)
    for name, x, parts in zip(("o", *NAMES), got, ref):
        r = torch.cat(parts)
        assert torch.isfinite(x.float()).all(), name
        assert torch.equal(x, r), f"{name}: the batch past the grid bound differs from its documents in smaller calls"


class _NoKernels:
    """Stands for the emulated library: any kernel entry fails the test (a bound must raise before any launch)."""

    def __getattr__(self, name):
        raise AssertionError(f"{name} ran: a kernel was launched before the bounds were checked")


@pytest.mark.parametrize("T, H, what", [
    (64, 65536, "65,535 heads"),  # the walks' and merges' gridDim.y / z
    (32769 * 64, 65535, "2\\^31 - 1 chunk-heads"),  # the preps' gridDim.x: 32,769 chunks x 65,535 heads
])
def test_grid_bounds_raise_before_any_kernel(monkeypatch, T, H, what):
    """Shapes past a grid bound that no launch folds away raise a ValueError naming it, in the forward and in the
    backward, before any kernel runs (tensors on the meta device: no memory behind them)."""
    _use_emulated_programs(_NoKernels(), monkeypatch.setattr, monkeypatch.setenv)
    q, k, v, do = (torch.empty(T, H, 128, dtype=torch.bfloat16, device="meta") for _ in range(4))
    g = torch.empty(T, H, 128, dtype=torch.float32, device="meta")
    beta = torch.empty(T, H, dtype=torch.bfloat16, device="meta")
    ctx = kda_kcp.build_context_kcp(torch.tensor([0, T]))
    with pytest.raises(ValueError, match=f"at most {what}"):
        function.forward_kcp(q, k, v, g, beta, ctx, None, True, None)
    saved = function.KdaSaved(q, k, v, g, beta, None, SCALE, True, ctx)
    with pytest.raises(ValueError, match=f"at most {what}"):
        function.backward_kcp(do, saved, ctx, None)
