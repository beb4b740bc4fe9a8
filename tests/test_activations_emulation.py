"""The fused activations of chunk_kda (csrc/kda_act.cu, unchanged) on the CPU: compiled with g++ against the CUDA
emulation of tests/emulation/ (as tests/test_kernel_emulation.py builds the KDA kernels) and called through
kda_kcp/cuda/activations.py, the CUDA path's own wrapper, with the emulated program standing for the loaded one.
Against kda_kcp.fla's torch ops in FP64: every option combination (softplus gate, lower_bound with and without A_log,
with and without dt_bias, the beta sigmoid with allow_neg_eigval), GVA, token counts that end inside a 64-token
item, BF16 and FP32 raw inputs; the gradients of A_log and dt_bias bitwise repeatable; NaN propagating. And
csrc/kda_warp_rows.cuh's warp_sum_rows against warp_sum, bit for bit."""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess

import pytest
import torch

from kda_kcp import fla
from kda_kcp.cuda import activations
from test_kernel_emulation import EMU, ROOT, _emulated, _p

pytestmark = [pytest.mark.slow,  # compiles with g++ (about half a minute on two cores)
              pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the CPU emulation")]

BF16_U = 2.0 ** -8  # bf16's unit roundoff (8 significant bits): a rounding is within it, relative
FP32_RTOL = 1e-5  # FP32 arithmetic: a few ulp per op over chains of < 10 ops and sums of <= 128 terms


def _build(out):
    inc = out / "inc"
    inc.mkdir()
    for f in ("cuda_runtime.h", "cuda_bf16.h", "cuda_fp16.h", "kda_common.cuh"):
        shutil.copy(EMU / f, inc / f)
    unit = out / "kda_act_emu.cpp"
    unit.write_text(_emulated((ROOT / "csrc" / "kda_act.cu").read_text()))
    lib = out / "libkda_act_emu.so"
    subprocess.run(["g++", "-std=c++20", "-O2", "-pthread", "-fPIC", "-shared", f"-I{inc}", f"-I{ROOT / 'csrc'}",
                    "-x", "c++", str(unit), str(EMU / "act_driver.cpp"), "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_INPUTS = [_P, _P, _I, _P, _I, _P, _I, _P, _P, _I64, _I, _I, _I, _F, _F]


class _ActProgram:
    """Stands for the loaded kda_act program: act_fwd and act_bwd map their tensors onto the emulated launchers
    as csrc/kda_act_binding.cu maps them onto kda::act's argument structs (checks aside; numel 0: absent)."""

    def __init__(self, lib):
        self.lib = lib
        lib.e_act_fwd.argtypes = _INPUTS + [_P] * 6
        lib.e_act_bwd.argtypes = _INPUTS + [_P] * 12
        lib.e_warp_sums.argtypes = [_P, _I, _P, _P, _P]

    @staticmethod
    def _inputs(q, k, g, beta, a_log, dt_bias, N, H, HV, form, lb, bs):
        code = lambda x: int(x.dtype == torch.float32)  # kda_act.h Dtype
        return (_p(q), _p(k), code(q), _p(g), code(g), _p(beta), code(beta), _p(a_log), _p(dt_bias), N, H, HV, form,
                lb, bs)

    def act_fwd(self, q, k, g, beta, a_log, dt_bias, *outs_and_options):
        outs, options = outs_and_options[:6], outs_and_options[6:]
        assert self.lib.e_act_fwd(*self._inputs(q, k, g, beta, a_log, dt_bias, *options), *map(_p, outs)) == 0

    def act_bwd(self, q, k, g, beta, a_log, dt_bias, *rest):
        tensors, options = rest[:12], rest[12:]
        assert self.lib.e_act_bwd(*self._inputs(q, k, g, beta, a_log, dt_bias, *options), *map(_p, tensors)) == 0

    def act_rows_per_item(self):
        return self.lib.e_act_rows_per_item()


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return _ActProgram(_build(tmp_path_factory.mktemp("kda_act_emu")))


@pytest.fixture
def emulated(program, monkeypatch):
    monkeypatch.setattr(activations, "load", lambda device: program)
    return program


def test_rows_per_item_matches_the_kernel(emulated):
    assert emulated.act_rows_per_item() == activations.ROWS_PER_ITEM


def _order_sensitive_partials(R, seed):
    """[R, 32] FP32 partials whose FP32 sum depends on the order of the additions: magnitudes over 16 binades, signs
    mixed, and in every row a pair of about 3e7 that cancels exactly (the small values added to either one first lose
    their low bits)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(R, 32, generator=gen) * 2.0 ** torch.randint(-8, 9, (R, 32), generator=gen).float()
    x[:, 0] = 3e7 * (1 + torch.rand(R, generator=gen))
    x[:, 1] = -x[:, 0]
    return x.contiguous()


def _butterfly(x):
    """warp_sum's tree in FP32 (lane l adds lane l ^ o's value, offsets 16 .. 1), lane 0's result per row."""
    x = x.clone()
    for o in (16, 8, 4, 2, 1):
        x = x + x[:, torch.arange(32) ^ o]
    return x[:, 0]


@pytest.mark.parametrize("R", [1, 2, 4, 8, 16, 32])
def test_warp_sum_rows_adds_as_warp_sum_per_row(program, R):
    """csrc/kda_warp_rows.cuh: the sums of R rows from one butterfly sequence equal warp_sum's of each row bit for bit,
    on every lane, and each lane's own row comes back to it; on partials where another order of the same additions
    (left to right) gives other bits, so that the check sees the order."""
    p = _order_sensitive_partials(R, seed=R)
    rows, single, own = torch.empty(R, 32), torch.empty(R, 32), torch.empty(32)
    assert program.lib.e_warp_sums(_p(p), R, _p(rows), _p(own), _p(single)) == 0
    assert torch.equal(single, _butterfly(p)[:, None].expand(R, 32)), "warp_sum is the butterfly of offsets 16 .. 1"
    assert torch.equal(rows.view(torch.int32), single.view(torch.int32))
    assert torch.equal(own.view(torch.int32), rows[torch.arange(32) // (32 // R), torch.arange(32)].view(torch.int32))
    left_to_right = p[:, 0]
    for lane in range(1, 32):
        left_to_right = left_to_right + p[:, lane]
    assert (left_to_right != single[:, 0]).all(), "the partials do not tell the orders apart"


# (gate: None off | (A_log, dt_bias, lower_bound)), beta: None off | allow_neg_eigval
GATES = {"off": None, "softplus": (True, True, None), "softplus_no_bias": (True, False, None),
         "bounded_rate": (True, True, -5.0), "bounded_rate_no_bias": (True, False, -3.0),
         "bounded": (False, True, -5.0), "bounded_no_bias": (False, False, -1.5)}


def _case(B, T, H, HV, gate, norm, beta, dtypes, seed):
    """Raw inputs [B, T, ...] (norm False: no q, k; gate None: no g; beta None: no beta) and random cotangents of the
    activated outputs in the dtypes the KDA kernels return them in."""
    gen = torch.Generator().manual_seed(seed)
    qk_dt, g_dt, b_dt, p_dt = dtypes
    x = {}
    if norm:
        x["q"], x["k"] = (torch.randn(B, T, H, 128, generator=gen).to(qk_dt) for _ in range(2))
    if gate is not None:
        with_a, with_dt, _ = gate
        x["g"] = (1.5 * torch.randn(B, T, HV, 128, generator=gen)).to(g_dt)
        x["A_log"] = (torch.rand(HV, generator=gen) * 2 - 1).to(p_dt) if with_a else None
        x["dt_bias"] = (0.5 * torch.randn(HV * 128, generator=gen)).to(p_dt) if with_dt else None
    if beta is not None:
        x["beta"] = (2 * torch.randn(B, T, HV, generator=gen)).to(b_dt)
    cot = {"q": torch.randn(B, T, HV, 128, generator=gen).bfloat16(),
           "k": torch.randn(B, T, HV, 128, generator=gen).bfloat16(),
           "g": torch.randn(B, T, HV, 128, generator=gen),
           "beta": torch.randn(B, T, HV, generator=gen).bfloat16()}
    return x, cot


def _leaves(x, dtype=None):
    return {n: (v.detach().to(dtype or v.dtype).requires_grad_() if v is not None else None) for n, v in x.items()}


def _fused(x, HV, gate, beta):
    lb = gate[2] if gate is not None else None
    return activations.fused_activations(x.get("q"), x.get("k"), x.get("g"), x.get("beta"), x.get("A_log"),
                                         x.get("dt_bias"), HV, lb, 2.0 if beta else 1.0)


def _reference(x, HV, gate, beta):
    """kda_kcp.fla's torch ops on FP64 leaves: the activated q, k (repeated for the value heads), g, beta."""
    H = x["q"].shape[2] if "q" in x else HV
    out = [None] * 4
    if "q" in x:
        out[0], out[1] = (fla.l2_normalize(x[n]).repeat_interleave(HV // H, dim=2) for n in ("q", "k"))
    if gate is not None:
        out[2] = fla.kda_gate(x["g"], x["A_log"], x["dt_bias"], gate[2])
    if beta is not None:
        out[3] = fla.beta_activation(x["beta"], beta)
    return out


def _grads(outs, cot, leaves):
    pairs = [(o, c) for o, c in zip(outs, (cot["q"], cot["k"], cot["g"], cot["beta"])) if o is not None]
    names = [n for n, v in leaves.items() if v is not None]
    got = torch.autograd.grad([o for o, _ in pairs], [leaves[n] for n in names],
                              [c.to(o.dtype) for o, c in pairs])
    return dict(zip(names, got))


def _close(name, got, ref, rtol):
    """|got - ref| <= rtol |ref| + FP32_RTOL max |ref| elementwise (the second term: FP32 cancellation in sums and
    differences, against the tensor's scale)."""
    got, ref = got.double(), ref.detach()
    assert got.shape == ref.shape, name
    bound = rtol * ref.abs() + FP32_RTOL * ref.abs().max()
    bad = (got - ref).abs() > bound
    assert not bad.any(), f"{name}: {int(bad.sum())} values off, worst {((got - ref).abs() - bound).max():.3e}"


def _rtol(dtype):
    return BF16_U + FP32_RTOL if dtype == torch.bfloat16 else FP32_RTOL


def _check(B, T, H, HV, gate, norm, beta, dtypes, seed=0):
    x, cot = _case(B, T, H, HV, gate, norm, beta, dtypes, seed)
    leaves, leaves64 = _leaves(x), _leaves(x, torch.float64)
    outs, refs = _fused(leaves, HV, gate, beta), _reference(leaves64, HV, gate, beta)
    for name, o, r, dt in zip(("q", "k", "g", "beta"), outs, refs,
                              (torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16)):
        assert (o is None) == (r is None), name
        if o is not None:
            assert o.dtype == dt and o.shape == r.shape, name
            _close(f"activated {name}", o, r, _rtol(dt))
    got, ref = _grads(outs, cot, leaves), _grads(refs, cot, leaves64)
    for name in ref:
        assert got[name].dtype == x[name].dtype and got[name].shape == x[name].shape, name
        if name in ("A_log", "dt_bias"):  # sums over the tokens: FP32 accumulation, norm-wise
            err = ((got[name].double() - ref[name]).norm() / ref[name].norm()).item()
            assert err <= _rtol(x[name].dtype), f"d{name}: relative error {err:.2e}"
        else:
            _close(f"d{name}", got[name], ref[name], _rtol(x[name].dtype))
    return got


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("beta", [None, False, True])
def test_every_gate_and_beta_option(emulated, gate, beta):
    """q/k norm always on, GVA (2 q/k heads, 4 value heads), 2 x 35 tokens: items of 64 and 6 tokens."""
    _check(2, 35, 2, 4, GATES[gate], True, beta, (BF16, BF16, BF16, F32), seed=len(gate) + 3 * (beta is None))


@pytest.mark.parametrize("norm, gate, beta", [(True, None, None), (False, "softplus", None), (False, None, True)])
def test_one_activation_alone(emulated, norm, gate, beta):
    _check(1, 131, 3, 3, GATES.get(gate), norm, beta, (BF16, BF16, BF16, F32))


@pytest.mark.parametrize("dtypes", list(itertools.product((BF16, F32), (BF16, F32), (BF16, F32), (F32, BF16)))[::3])
def test_raw_dtypes(emulated, dtypes):
    """q/k, g, beta in BF16 or FP32 each (the kernels' instantiations), A_log / dt_bias in FP32 or BF16; gradients
    in the same dtypes."""
    _check(1, 70, 1, 2, GATES["bounded_rate"], True, False, dtypes, seed=7)


def test_parameter_gradients_repeat_bitwise(emulated):
    """Per-item partial sums, then a fixed-order sum: two backward passes give the same bits."""
    x, cot = _case(1, 200, 2, 4, GATES["softplus"], True, True, (BF16, BF16, BF16, F32), seed=3)
    runs = []
    for _ in range(2):
        leaves = _leaves(x)
        runs.append(_grads(_fused(leaves, 4, GATES["softplus"], True), cot, leaves))
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


def test_nan_and_inf_propagate(emulated):
    """A non-finite raw value stays non-finite in what the KDA kernels read, as with the torch ops, so that their
    value check (kda_status.cuh) still reports it: a NaN in q, g or beta, an Inf in k and in a softplus gate."""
    x, _ = _case(1, 70, 1, 1, GATES["softplus"], True, False, (BF16, F32, F32, F32), seed=5)
    x["q"][0, 3, 0, 7] = float("nan")
    x["k"][0, 9, 0, 1] = float("inf")
    x["g"][0, 40, 0, 100] = float("nan")
    x["g"][0, 41, 0, 5] = float("inf")
    x["beta"][0, 66, 0] = float("nan")
    with torch.no_grad():
        qn, kn, g_act, b_act = _fused(x, 1, GATES["softplus"], False)
        refs = _reference(_leaves(x, torch.float64), 1, GATES["softplus"], False)
    for name, o, r in zip("qkgb", (qn, kn, g_act, b_act), refs):
        assert torch.equal(torch.isfinite(o), torch.isfinite(r)), name
        assert not torch.isfinite(o).all(), name


def test_custom_ops_under_compile_equal_eager(emulated):
    """The compiled route (kda_kcp::act_fwd / act_bwd with fake functions and registered autograd) compiles with
    fullgraph=True and gives the eager route's activated tensors and gradients bit for bit; every activation on and
    one off."""
    from helpers import fresh_compile

    for gate, beta in (("bounded_rate", True), ("softplus", None)):
        x, cot = _case(1, 70, 1, 2, GATES[gate], True, beta, (BF16, F32, BF16, F32), seed=11)

        def call(q, k, g, beta_raw, A_log, dt_bias):
            outs = activations.fused_activations(q, k, g, beta_raw, A_log, dt_bias, 2, GATES[gate][2],
                                                 2.0 if beta else 1.0)
            return [o for o in outs if o is not None]

        results = []
        for fn in (call, fresh_compile(call, "aot_eager")):
            leaves = _leaves(x)
            args = [leaves.get(n) for n in ("q", "k", "g", "beta", "A_log", "dt_bias")]
            outs = fn(*args)
            results.append([o.detach() for o in outs] + list(_grads(outs + [None] * (4 - len(outs)), cot,
                                                                    leaves).values()))
        assert torch._dynamo.utils.counters["graph_break"] == {}
        for a, b in zip(*results):
            assert a.dtype == b.dtype and torch.equal(a, b)
