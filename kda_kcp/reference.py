"""FP64 oracle: the KDA recurrence walked token by token over packed documents.

This is the definition every other path is checked against (docs/design.md §1):

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t

with S starting at zero (or at the document's initial state) at every document start. It is written for
clarity, not speed: one step per token, all heads at once. Gradients come from autograd through the loop.
"""

from __future__ import annotations

import torch

__all__ = ["naive_kda", "naive_merge"]


def _offsets(cu_seqlens) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        return [int(x) for x in cu_seqlens.detach().cpu().tolist()]
    return [int(x) for x in cu_seqlens]


def naive_kda(q, k, v, g, beta, cu_seqlens, scale=None, dtype=torch.float64, initial_state=None,
              output_final_state=False):
    """Token-by-token KDA over packed documents.

    q, k: [T, H, K]; v: [T, H, V]; g: [T, H, K] (log decay); beta: [T, H]; cu_seqlens: N + 1 offsets;
    initial_state: [N, H, K, V] or None (zeros), the state each document starts from.
    Returns o [T, H, V] in ``dtype`` (FP64 by default: the oracle), or (o, final_state [N, H, K, V]) with
    ``output_final_state`` (an empty document's final state is its initial state). Differentiable.
    Documents advance side by side (step t moves token t of every document long enough), each with its
    own state; that changes nothing in the arithmetic of any one document.
    """
    cu = _offsets(cu_seqlens)
    T, H, K = q.shape
    V = v.shape[-1]
    N = len(cu) - 1
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    h0 = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(device=q.device, dtype=dtype)
    docs = sorted(((e - s, s, d) for d, (s, e) in enumerate(zip(cu[:-1], cu[1:])) if e > s), reverse=True)
    o = q.new_zeros(T, H, V)
    if not docs:
        return (o, h0.clone()) if output_final_state else o
    starts = torch.tensor([s for _, s, _ in docs], device=q.device)
    ids = torch.tensor([d for _, _, d in docs], device=q.device)
    state = h0.index_select(0, ids)  # one row per non-empty document, longest first
    outs, where = [], []
    for t in range(docs[0][0]):
        n = sum(1 for length, _, _ in docs if length > t)  # documents still running: a prefix (sorted)
        tok = starts[:n] + t
        s_old = state[:n] * torch.exp(g[tok]).unsqueeze(-1)
        kt = k[tok]  # [n, H, K]
        # (I - beta k k^T) S + beta k v^T  ==  S + beta k (v - k^T S)^T
        pred = torch.einsum("nhk,nhkv->nhv", kt, s_old)
        s_new = s_old + (beta[tok].unsqueeze(-1) * kt).unsqueeze(-1) * (v[tok] - pred).unsqueeze(-2)
        outs.append(scale * torch.einsum("nhk,nhkv->nhv", q[tok], s_new))
        where.append(tok)
        state = torch.cat([s_new, state[n:]], 0)  # finished documents keep their final state
    o = o.index_put((torch.cat(where),), torch.cat(outs, 0))
    if not output_final_state:
        return o
    return o, h0.index_put((ids,), state)


def naive_merge(m, e, chains, init=None, dtype=torch.float64):
    """The affine merge's oracle (csrc/kda_affine_merge.cuh's fold and compose) in ``dtype``: for each chain row
    (first, count, init row or -1, out) of ``chains``, the fold's states X_j = M[first + j] X_{j - 1} + E[first + j]
    from X = init[row] (or zero), and the whole chain's map (P, F) composed from [I | 0]. ``m``, ``e``: [n, H, K, K]
    and [n, H, K, V]. Returns ({out + j: X_j}, [(P, F) per chain])."""
    m, e = m.to(dtype), e.to(dtype)
    H, K, V = e.shape[1], m.shape[2], e.shape[3]
    states, maps = {}, []
    for first, count, row, out in ([int(x) for x in c] for c in chains):
        X = init[row].to(device=m.device, dtype=dtype) if row >= 0 and init is not None else e.new_zeros(H, K, V)
        P, F = torch.eye(K, dtype=dtype, device=m.device).expand(H, K, K), e.new_zeros(H, K, V)
        for j in range(count):
            X = m[first + j] @ X + e[first + j]
            P, F = m[first + j] @ P, m[first + j] @ F + e[first + j]
            states[out + j] = X
        maps.append((P, F))
    return states, maps
