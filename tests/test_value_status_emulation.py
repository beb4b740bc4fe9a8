"""The CUDA backend's value-domain status (csrc/kda_status.cuh, kda_kcp/status.py) under the CPU emulation of the
kernels (tests/emulation/, built as in tests/test_kernel_emulation.py): the real chunk preps of the forward and the
backward set the status word's bits for each kind of value outside the domain (every value finite, g in [-5, 0],
beta in [0, 2]) and leave it zero inside it, its edges included; the fill kernel sets a call's outputs to NaN only
when the word is set; and through kda_kcp.cuda's wrappers a call with such values returns NaN outputs and the next
call raises ValueError naming what was seen (kda_kcp.check_status raises at once)."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

import kda_kcp
import kda_kcp.function as function
from kda_kcp import status
from kda_kcp.cuda import CudaBackend
from kda_kcp.cuda import backward as cb
from kda_kcp.cuda import bwd_layout, bwd_tables
from kda_kcp.cuda import forward
from helpers import with_value
from test_kernel_emulation import SCALE, _build, _case, _p, _Programs, _use_emulated_programs

pytestmark = [pytest.mark.slow,  # the kernels built with g++ and run on the CPU emulation: minutes on two cores
              pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the CPU emulation")]

CU = [0, 40, 104]  # two documents, one chunk each (the second a full one)
H = 1
AT = (70, 0, 5)  # the bad value: token 70 (the second chunk), channel 5

NF, ABOVE, BELOW, BETA = status.NONFINITE, status.G_ABOVE, status.G_BELOW, status.BETA_RANGE
# (tensor, value) -> (the forward prep's bits, the backward prep's): the forward prep does not read v
CASES = {
    ("q", "nan"): (NF, NF), ("q", "inf"): (NF, NF),
    ("k", "nan"): (NF, NF), ("k", "-inf"): (NF, NF),
    ("v", "nan"): (0, NF), ("v", "inf"): (0, NF),
    ("g", "nan"): (NF, NF), ("g", "inf"): (NF, NF), ("g", "-inf"): (NF, NF),
    ("g", 0.5): (ABOVE, ABOVE), ("g", -6.0): (BELOW, BELOW), ("g", -30.0): (BELOW, BELOW),
    ("beta", "nan"): (NF, NF), ("beta", "inf"): (NF, NF), ("beta", 2.5): (BETA, BETA), ("beta", -0.5): (BETA, BETA),
}


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return ctypes.CDLL(str(_build(tmp_path_factory.mktemp("kda_emu_status"))))


@pytest.fixture
def clean_status():
    """Every test leaves the CPU status word as it found it: zero."""
    yield
    word = status.word("cpu")
    left = int(word[0])
    word.zero_()
    assert left == 0, f"the test left status bits {left:#x}"




def _prep_bits(emu, plan, inputs, fwd=True):
    """(status word after the forward prep, after the backward prep) of every chunk of ``plan`` (``fwd`` False: the
    backward prep's alone)."""
    q, k, v, g, beta = inputs
    chunks, _ = bwd_tables.chunk_tables(plan, "cpu")
    nc = chunks.shape[0]
    bits = []
    word = torch.zeros(1, dtype=torch.int32)
    if fwd:
        ws = torch.empty(nc * H * forward.RECORD_BYTES, dtype=torch.uint8)
        assert emu.e_fwd_prep(*map(_p, (q, k, g, beta, chunks)), nc, H, ctypes.c_float(SCALE), _p(ws), _p(word)) == 0
        bits.append(int(word[0]))
        word.zero_()
    prep = torch.empty(nc * H * bwd_layout.PREP_BYTES, dtype=torch.uint8)
    assert emu.e_prep(*map(_p, (q, k, v, g, beta, chunks)), nc, H, ctypes.c_float(SCALE), _p(prep), _p(word)) == 0
    bits.append(int(word[0]))
    return tuple(bits)


def test_preps_leave_the_word_zero_inside_the_domain(emu):
    """Random inputs, then the domain's edges: g = -5 over a whole chunk, g = +0 and -0, beta = 0 and 1."""
    plan, inputs, *_ = _case(CU, H, 3)
    assert _prep_bits(emu, plan, inputs) == (0, 0)
    q, k, v, g, beta = (x.clone() for x in inputs)
    g[40:104] = -5.0
    g[3] = 0.0
    g[4] = -0.0
    beta[5] = 0.0
    beta[6] = 1.0
    assert _prep_bits(emu, plan, (q, k, v, g, beta)) == (0, 0)


@pytest.mark.parametrize("name, value", list(CASES))
def test_preps_set_the_bit_of_each_bad_value(emu, name, value):
    plan, inputs, *_ = _case(CU, H, 3)
    assert _prep_bits(emu, plan, with_value(inputs, name, value, AT)) == CASES[name, value]


@pytest.mark.parametrize("at", [(40, 0, 0), (103, 0, 127), (57, 0, 70)])
def test_backward_prep_sees_v_everywhere(emu, at):
    """The backward prep probes v in the B fragments of one row block per warp pair (kda_chunk_prep.cuh): the first
    and last row and column of a full chunk, and one inside it."""
    plan, inputs, *_ = _case(CU, H, 3)
    assert _prep_bits(emu, plan, with_value(inputs, "v", "nan", at), fwd=False) == (NF,)


@pytest.mark.parametrize("gates", ["benchmark", "strong"])
@pytest.mark.parametrize("name, value, at", [
    ("q", "inf", (40, 0, 0)), ("k", "nan", (40, 0, 127)), ("q", "nan", (55, 0, 64)), ("k", "inf", (56, 0, 3)),
    ("q", "-inf", (71, 0, 100)), ("k", "-inf", (88, 0, 17)), ("q", "nan", (103, 0, 127)), ("k", "nan", (103, 0, 0)),
])
def test_preps_see_q_and_k_in_every_row(emu, gates, name, value, at):
    """q and k are checked through the diagonal blocks of Aqk (kda_chunk_prep.cuh lq_blocks): a NaN or Inf in any row
    of a chunk (its first and last row, the rows around the 16-row blocks' edges) and any column is seen by both preps,
    with the chunk's one anchor (benchmark gates) and with one anchor per row block (g = -5 throughout), also where
    the other factor of that column is 0 (0 x Inf is NaN)."""
    plan, inputs, *_ = _case(CU, H, 3)
    q, k, v, g, beta = (x.clone() for x in inputs)
    if gates == "strong":
        g[40:104] = -5.0
    other = k if name == "q" else q
    other[at] = 0.0
    assert _prep_bits(emu, plan, with_value((q, k, v, g, beta), name, value, at)) == (NF, NF)


def test_preps_report_q_k_products_that_overflow(emu):
    """Finite k of 1e6 under gates of -5 per token: the column side of the anchored products, k exp(G_a - G), leaves
    bf16's range at a row block's last row (1e6 e^75 > 3.4e38), so the chunk's products would be garbage; the preps
    report it as non-finite. The same k under the test's gates stays in range and nothing is reported."""
    plan, inputs, *_ = _case(CU, H, 3)
    q, k, v, g, beta = (x.clone() for x in inputs)
    k[40:104] = 1e6
    assert _prep_bits(emu, plan, (q, k, v, g, beta)) == (0, 0)
    g[40:104] = -5.0
    assert _prep_bits(emu, plan, (q, k, v, g, beta)) == (NF, NF)


def test_fill_sets_outputs_to_nan_only_with_a_set_word(emu):
    gen = torch.Generator().manual_seed(1)
    outs = [torch.randn(300, 7, generator=gen).bfloat16(), torch.randn(1001, generator=gen),
            torch.randn(5, generator=gen).bfloat16()]
    kept = [x.clone() for x in outs]
    programs = _Programs(emu)
    none = torch.empty(0)
    word = torch.zeros(1, dtype=torch.int32)
    slot = torch.full((1,), -1, dtype=torch.int32)  # the host slot the kernel publishes the word to
    programs.status_fill(word, slot, *outs, none, none)
    assert all(torch.equal(x, y) for x, y in zip(outs, kept))
    assert slot.item() == 0
    word.fill_(BELOW)
    programs.status_fill(word, torch.empty(0, dtype=torch.int32), *outs, none, none)  # no slot: outputs only
    assert all(torch.isnan(x.float()).all() for x in outs)
    assert slot.item() == 0
    programs.status_fill(word, slot, none, none, none, none, none)  # no output: the word still reaches the slot
    assert slot.item() == BELOW


def test_cuda_path_returns_nan_and_the_next_call_raises(emu, monkeypatch, clean_status):
    """Through kda_kcp.cuda's wrappers (the emulated kernels for the programs): a forward with g = -6 returns o all
    NaN and the next call raises naming "g below -5", then calls run clean again; a NaN in v (read by the backward
    prep only) makes every gradient NaN and the next call raises; kda_kcp.check_status raises at once."""
    _use_emulated_programs(emu, monkeypatch.setattr, monkeypatch.setenv)
    plan, inputs, do, *_ = _case(CU, H, 5)
    ctx = kda_kcp.build_context_kcp(torch.tensor(CU))
    o, saved = function.forward_kcp(*inputs, ctx, None, True)
    grads = function.backward_kcp(do, saved, ctx)
    assert all(torch.isfinite(x.float()).all() for x in (o, *grads))

    o_bad, _ = function.forward_kcp(*with_value(inputs, "g", -6.0, AT), ctx, None, True)
    assert torch.isnan(o_bad.float()).all()
    with pytest.raises(ValueError, match=r"a call issued earlier on cpu read input values outside the domain "
                                         r"\(g below -5\): its outputs were set to NaN"):
        function.forward_kcp(*inputs, ctx, None, True)
    o2, saved = function.forward_kcp(*inputs, ctx, None, True)
    assert torch.equal(o2, o)

    bad_v = with_value(inputs, "v", "nan", AT)
    _, saved_v = function.forward_kcp(*bad_v, ctx, None, True)
    grads_v = function.backward_kcp(do, saved_v, ctx)
    assert all(torch.isnan(x.float()).all() for x in grads_v)
    with pytest.raises(ValueError, match=r"non-finite q/k/v/g/beta"):
        function.backward_kcp(do, saved, ctx)
    assert all(torch.equal(x, y) for x, y in zip(function.backward_kcp(do, saved, ctx), grads))

    function.forward_kcp(*with_value(inputs, "beta", 2.5, AT), ctx, None, True)
    with pytest.raises(ValueError, match=r"beta outside \[0, 2\]"):
        kda_kcp.check_status()
    kda_kcp.check_status()  # reset by the first


def test_published_summaries_are_nan(emu, monkeypatch, clean_status):
    """The summaries a KCP rank publishes (forward M, E; backward M^T, F) are set to NaN when its preps saw a value
    outside the domain, so the other ranks' outputs turn NaN rather than wrong."""
    _use_emulated_programs(emu, monkeypatch.setattr, monkeypatch.setenv)
    plan, inputs, do, *_ = _case(CU, H, 5)
    M, E = forward.PreparedForward(*inputs, SCALE, plan).summaries((1,))
    assert torch.isfinite(M).all() and torch.isfinite(E).all()
    bad = with_value(inputs, "g", -30.0, AT)
    M, E = forward.PreparedForward(*bad, SCALE, plan).summaries((1,))
    assert torch.isnan(M).all() and torch.isnan(E).all()
    with pytest.raises(ValueError, match="g below -5"):  # the next call's checks
        CudaBackend.check_call(*inputs, plan)
    Mt, F = cb.PreparedBackward(*bad, do, SCALE, plan).summaries((1,))
    assert torch.isnan(Mt).all() and torch.isnan(F).all()
    with pytest.raises(ValueError, match="g below -5"):
        kda_kcp.check_status()
