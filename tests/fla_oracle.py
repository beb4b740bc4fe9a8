"""FP64 oracle of FLA's ``chunk_kda`` call: its in-call activations written out from FLA 0.6.0's definitions, then
the token-by-token recurrence (kda_kcp.reference.naive_kda). Shared by tests/test_fla_call.py, tests/test_layer.py
and tests/gpu/test_fla_parity.py; independent of kda_kcp.fla's own code."""

from __future__ import annotations

import torch

from kda_kcp.reference import naive_kda

F64 = torch.float64


def fp64_l2norm(x):
    x = x.to(F64)
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def fp64_gate(g, A_log=None, dt_bias=None, lower_bound=None):
    """FLA's gate over g [..., H, K]: -exp(A) softplus(g + b), or lower_bound * sigmoid(exp(A) (g + b))."""
    H, K = g.shape[-2:]
    x = g.to(F64) + (dt_bias.to(F64).view(H, K) if dt_bias is not None else 0.0)
    a = A_log.to(F64).view(H, 1).exp() if A_log is not None else None
    if lower_bound is None:
        return -a * torch.log1p(torch.exp(x))
    return lower_bound * torch.sigmoid(x if a is None else a * x)


def oracle_chunk_kda(q, k, v, g, beta, scale=None, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                     use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False, cu_seqlens_cpu=None,
                     initial_state=None, output_final_state=False):
    """o [B, T, HV, V] in FP64 for FLA's call on [B, T, H, K] tensors (differentiable through every input), and the
    final states [N, HV, K, V] after it with ``output_final_state``; ``initial_state`` [N, HV, K, V] (N sequences:
    len(cu_seqlens) - 1, else B). safe_gate (FLA's kernel choice for bounded gates) and cu_seqlens_cpu (a host copy)
    change no value."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    q, k, v, g, beta = (x.to(F64) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = fp64_l2norm(q), fp64_l2norm(k)
    if use_gate_in_kernel:
        g = fp64_gate(g, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    cu = [int(x) for x in cu_seqlens] if cu_seqlens is not None else list(range(0, B * T + 1, T))

    def flat(x):
        return x.reshape(B * T, *x.shape[2:])

    out = naive_kda(flat(q), flat(k), flat(v), flat(g), flat(beta), cu, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state)
    if output_final_state:
        return out[0].reshape(B, T, HV, -1), out[1]
    return out.reshape(B, T, HV, -1)
