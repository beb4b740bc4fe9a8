"""FP64 oracle: the KDA recurrence walked token by token over packed documents.

This is the definition every other path is checked against (DESIGN.md section 1):

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t

with S restarting at zero at every document start. It is written for clarity, not speed: one step per
token, all heads at once. Gradients come from autograd through the loop.
"""

from __future__ import annotations

import torch

__all__ = ["naive_kda"]


def _offsets(cu_seqlens) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        return [int(x) for x in cu_seqlens.detach().cpu().tolist()]
    return [int(x) for x in cu_seqlens]


def naive_kda(q, k, v, g, beta, cu_seqlens, scale=None, dtype=torch.float64):
    """Token-by-token KDA over packed documents.

    q, k: [T, H, K]; v: [T, H, V]; g: [T, H, K] (log decay); beta: [T, H]; cu_seqlens: N + 1 offsets.
    Returns o [T, H, V] in ``dtype`` (FP64 by default: the oracle). Differentiable.
    """
    cu = _offsets(cu_seqlens)
    T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    outs = []
    for start, end in zip(cu[:-1], cu[1:]):
        state = q.new_zeros(H, K, V)
        for t in range(start, end):
            kt = k[t]  # [H, K]
            state = state * torch.exp(g[t]).unsqueeze(-1)
            # (I - beta k k^T) S + beta k v^T  ==  S + beta k (v - k^T S)^T
            pred = torch.einsum("hk,hkv->hv", kt, state)
            state = state + (beta[t].unsqueeze(-1) * kt).unsqueeze(-1) * (v[t] - pred).unsqueeze(1)
            outs.append(scale * torch.einsum("hk,hkv->hv", q[t], state))
    if not outs:
        return q.new_zeros(0, H, V)
    return torch.stack(outs, 0)
