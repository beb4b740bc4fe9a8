"""kda_kcp.chunk_kda against FLA's fla.ops.kda.chunk_kda on the GPU, option by option: the same BF16 inputs to
both, o and every gradient (A_log and dt_bias included) measured against the FP64 oracle of the call
(tests/fla_oracle.py), side by side. Ours must be no worse than FACTOR times FLA's error on every tensor.
Skips, saying why, without an sm_90a / sm_100a / sm_103a GPU or without FLA (``pip install fla-core==0.6.0``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gpu_common import DEV, fresh_seed, rel, require_kernel_gpu

require_kernel_gpu("the FLA parity tests")
fla_kda = pytest.importorskip("fla.ops.kda", reason="FLA is not installed (pip install fla-core==0.6.0)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fla_oracle import fp64_gate, oracle_chunk_kda  # noqa: E402

import kda_kcp  # noqa: E402

FACTOR = 2.0  # ours <= FACTOR x FLA's relative RMS error against FP64, per tensor
SEED = fresh_seed("test_fla_parity")
H, K = 4, 128
LENGTHS = [1, 63, 64, 65, 0, 1200, 700, 1]  # T = 2094: short documents, an empty one, long ones

CASES = {  # id: (options, B, T or None for LENGTHS with cu_seqlens, HV)
    "precomputed": ({}, 1, None, H),
    "batch_rows": ({}, 2, 1024, H),
    "l2norm": ({"use_qk_l2norm_in_kernel": True}, 1, None, H),
    "gate_softplus": ({"use_gate_in_kernel": True}, 1, None, H),
    "gate_lower_bound": ({"use_gate_in_kernel": True, "lower_bound": -5.0}, 1, None, H),
    "gate_safe": ({"use_gate_in_kernel": True, "lower_bound": -5.0, "safe_gate": True}, 2, 1024, H),
    "beta_sigmoid": ({"use_beta_sigmoid_in_kernel": True}, 1, None, H),
    "allow_neg_eigval": ({"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}, 1, None, H),
    "grouped_values": ({"use_qk_l2norm_in_kernel": True}, 1, None, 2 * H),
    "all": ({"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "lower_bound": -5.0, "safe_gate": True,
             "use_beta_sigmoid_in_kernel": True}, 1, None, H),
}


def make_case(options, B, T, HV, seed):
    gen = torch.Generator().manual_seed(seed)
    cu = None
    if T is None:
        cu = [0]
        for n in LENGTHS:
            cu.append(cu[-1] + n)
        T = cu[-1]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = rnd(B, T, H, K), rnd(B, T, H, K)
    if not options.get("use_qk_l2norm_in_kernel"):
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    v = rnd(B, T, HV, K)
    params = {}
    if options.get("use_gate_in_kernel"):
        g = rnd(B, T, HV, K)
        # exp(A_log) in [0.2, 0.6] and dt_bias ~ N(-2, 0.5): the softplus gate stays above -5, the kernels' domain
        params = {"A_log": (0.2 + 0.4 * torch.rand(HV, generator=gen)).log(), "dt_bias": -2 + 0.5 * rnd(HV * K)}
    else:
        g = -5 * torch.sigmoid(2 * rnd(B, T, HV, K) - 1)
    beta = rnd(B, T, HV) if options.get("use_beta_sigmoid_in_kernel") else 0.05 + 0.9 * torch.rand(B, T, HV, generator=gen)
    tensors = {"q": q.bfloat16(), "k": k.bfloat16(), "v": v.bfloat16(), "g": g.float(), "beta": beta.bfloat16()}
    do = rnd(B, T, HV, K).bfloat16()
    to = lambda x: x.to(DEV)  # noqa: E731
    cu_t = torch.tensor(cu, dtype=torch.long, device=DEV) if cu is not None else None
    return {n: to(x) for n, x in tensors.items()}, {n: to(x) for n, x in params.items()}, to(do), cu_t


def run(fn, tensors, params, do, cu, options, dtype=None):
    """o and the gradient of <o, do> for every input; ``dtype``: the leaves' (FP64 for the oracle, whose gradients
    would otherwise come back rounded to the inputs' BF16)."""
    leaves = {n: x.to(dtype or x.dtype).clone().requires_grad_() for n, x in {**tensors, **params}.items()}
    out = fn(**leaves, **options, cu_seqlens=cu)
    o = out[0] if isinstance(out, tuple) else out
    o.backward(do.to(o.dtype))
    torch.cuda.synchronize()
    return {"o": o.detach(), **{n: x.grad for n, x in leaves.items()}}


@pytest.mark.parametrize("case", list(CASES))
def test_errors_no_worse_than_fla(case):
    options, B, T, HV = CASES[case]
    tensors, params, do, cu = make_case(options, B, T, HV, SEED + list(CASES).index(case))
    if options.get("use_gate_in_kernel"):
        gate = fp64_gate(tensors["g"], params["A_log"], params["dt_bias"], options.get("lower_bound"))
        assert gate.min() >= -5.0, "the test's gate inputs left the kernels' domain [-5, 0)"
    ref = run(oracle_chunk_kda, tensors, params, do, cu, options, torch.float64)
    ours = run(kda_kcp.chunk_kda, tensors, params, do, cu, options)
    fla = run(fla_kda.chunk_kda, tensors, params, do, cu, options)
    assert ours.keys() == fla.keys() == ref.keys()
    rows, worse = [], []
    for name in ref:
        assert ours[name].dtype == fla[name].dtype and ours[name].shape == fla[name].shape, (name, ours[name].dtype)
        assert torch.isfinite(ours[name].float()).all(), (name, "non-finite")
        e_ours, e_fla = rel(ours[name], ref[name]), rel(fla[name], ref[name])
        rows.append(f"  {name:8s} ours {e_ours:.3e}  FLA {e_fla:.3e}  ratio {e_ours / max(e_fla, 1e-30):.2f}")
        if e_ours > FACTOR * e_fla:
            worse.append(name)
    print(f"[{case}] relative RMS error against FP64 (B = {B}, T = {tensors['q'].shape[1]}, H = {H}, HV = {HV}):")
    print("\n".join(rows))
    assert not worse, f"{case}: ours worse than {FACTOR} x FLA's error on {worse}"
