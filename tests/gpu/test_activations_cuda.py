"""chunk_kda's fused activations on the GPU (csrc/kda_act.cu through kda_kcp/cuda/activations.py): the fused pass
against kda_kcp.fla's torch ops in FP64 for every option (tests/test_activations_emulation.py checks the same kernels
on the CPU emulation); kda_kcp.chunk_kda with its activations fused against the same call through the torch ops, both
measured against the FP64 oracle of FLA's call (o and every gradient, A_log and dt_bias included); two runs bitwise
equal; and the call under torch.compile(fullgraph=True) bitwise equal to eager. About 20 s."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gpu_common import DEV, fresh_seed, rel, require_kernel_gpu

require_kernel_gpu("the fused activation tests")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kda_kcp  # noqa: E402
from kda_kcp.cuda import CudaBackend  # noqa: E402
from fla_oracle import oracle_chunk_kda  # noqa: E402
from helpers import assert_bitwise, fresh_compile  # noqa: E402
from test_activations_emulation import GATES, _check  # noqa: E402

SEED = fresh_seed("test_activations_cuda")
H, K = 2, 128
LENGTHS = [1, 63, 64, 65, 0, 500, 1]  # T = 694: items of 64 tokens ending inside documents, an empty document


@pytest.fixture(autouse=True)
def on_the_gpu(monkeypatch):
    """The emulation tests' cases, built on the CPU, moved to the GPU inside the fused call."""
    import test_activations_emulation as emu

    make = emu._case

    def on_gpu(*args, **kwargs):
        x, cot = make(*args, **kwargs)
        return ({n: v.to(DEV) if v is not None else None for n, v in x.items()},
                {n: v.to(DEV) for n, v in cot.items()})

    monkeypatch.setattr(emu, "_case", on_gpu)


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("beta", [None, False, True])
def test_fused_pass_against_fp64(gate, beta):
    """Activated tensors and every gradient within BF16 / FP32 rounding of the FP64 torch ops, GVA (4 value heads
    over 2 q/k heads), 2 x 333 tokens."""
    _check(2, 333, 2, 4, GATES[gate], True, beta, (torch.bfloat16, torch.float32, torch.bfloat16, torch.float32),
           seed=SEED)


def _inputs(HV, seed):
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    T = cu[-1]
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    t = {"q": rnd(1, T, H, K).bfloat16(), "k": rnd(1, T, H, K).bfloat16(), "v": rnd(1, T, HV, K).bfloat16(),
         "g": rnd(1, T, HV, K).bfloat16(), "beta": rnd(1, T, HV).bfloat16()}
    # exp(A_log) in [0.2, 0.6], dt_bias ~ N(-2, 0.5): the softplus gate stays inside the kernels' [-5, 0]
    params = {"A_log": (0.2 + 0.4 * torch.rand(HV, generator=gen)).log(), "dt_bias": -2 + 0.5 * rnd(HV * K)}
    do = rnd(1, T, HV, K).bfloat16()
    to = lambda d: {n: x.to(DEV) for n, x in d.items()}  # noqa: E731
    return to(t), to(params), do.to(DEV), torch.tensor(cu, device=DEV)


def _run(fn, tensors, params, do, cu, options, dtype=None):
    leaves = {n: x.to(dtype or x.dtype).clone().requires_grad_() for n, x in {**tensors, **params}.items()}
    out = fn(**leaves, **options, cu_seqlens=cu)
    o = out[0] if isinstance(out, tuple) else out
    names = list(leaves)
    grads = torch.autograd.grad(o, [leaves[n] for n in names], do.to(o.dtype))
    return {"o": o.detach(), **dict(zip(names, grads))}


CALLS = {  # id: (chunk_kda options, HV)
    "all_softplus_gva": ({"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True,
                          "use_beta_sigmoid_in_kernel": True}, 2 * H),
    "all_lower_bound": ({"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "lower_bound": -5.0,
                         "use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}, H),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_chunk_kda_fused_matches_the_torch_ops(case, monkeypatch):
    """kda_kcp.chunk_kda with fused activations: o and every gradient no further from the FP64 oracle than the same
    call through the torch ops (+ 2%, + 1e-4: both round the same BF16 tensors for the KDA kernels, in different
    FP32 orders), and two runs bitwise equal."""
    options, HV = CALLS[case]
    tensors, params, do, cu = _inputs(HV, SEED)
    fused = _run(kda_kcp.chunk_kda, tensors, params, do, cu, options)
    again = _run(kda_kcp.chunk_kda, tensors, params, do, cu, options)
    assert_bitwise(list(fused.values()), list(again.values()))
    ref = _run(oracle_chunk_kda, tensors, params, do, cu, options, dtype=torch.float64)
    monkeypatch.setattr(CudaBackend, "fused_activations", staticmethod(lambda *args: None))  # through the torch ops
    torch_ops = _run(kda_kcp.chunk_kda, tensors, params, do, cu, options)
    for name in ref:
        assert fused[name].dtype == torch_ops[name].dtype and fused[name].shape == torch_ops[name].shape, name
        e_fused, e_torch = rel(fused[name], ref[name]), rel(torch_ops[name], ref[name])
        print(f"{case} {name}: fused {e_fused:.2e}, torch ops {e_torch:.2e}")
        assert e_fused <= 1.02 * e_torch + 1e-4, name


def _call(q, k, v, g, beta, A_log, dt_bias, cu_seqlens):
    o, _ = kda_kcp.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                             dt_bias=dt_bias, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_seqlens)
    return o


def test_chunk_kda_with_activations_compiles_whole_and_equals_eager():
    tensors, params, do, cu = _inputs(2 * H, SEED + 1)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
    leaves = [{**tensors, **params}[n] for n in names]

    def outputs(fn):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        o = fn(*xs, cu)
        o.backward(do)
        return [o.detach()] + [x.grad for x in xs]

    compiled = fresh_compile(_call, "aot_eager")
    assert_bitwise(outputs(compiled), outputs(_call))
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
