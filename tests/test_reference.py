"""The FP64 oracle against the recurrence written literally with explicit matrices."""

import torch

from kda_kcp.reference import naive_kda
from helpers import make_inputs, offsets


def _literal(q, k, v, g, beta, cu, scale):
    """S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T, o_t = scale S_t^T q_t."""
    T, H, K = q.shape
    o = torch.zeros(T, H, v.shape[-1], dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    for s, e in zip(cu[:-1], cu[1:]):
        for h in range(H):
            S = torch.zeros(K, v.shape[-1], dtype=torch.float64)
            for t in range(s, e):
                kt = k[t, h].unsqueeze(1)
                S = (eye - beta[t, h] * kt @ kt.T) @ torch.diag(torch.exp(g[t, h])) @ S + beta[t, h] * kt @ v[t, h].unsqueeze(0)
                o[t, h] = scale * S.T @ q[t, h]
    return o


def test_oracle_equals_the_literal_recurrence():
    cu = offsets([9, 0, 1, 14])
    (q, k, v, g, beta), _ = make_inputs(cu, H=2, K=6, V=5, seed=9)
    got = naive_kda(q, k, v, g, beta, cu, scale=0.7)
    assert torch.allclose(got, _literal(q, k, v, g, beta, cu, 0.7), rtol=1e-12, atol=1e-14)


def test_first_token_closed_form_and_document_isolation():
    cu = offsets([3, 4])
    (q, k, v, g, beta), _ = make_inputs(cu, H=1, K=4, V=3, seed=2)
    o = naive_kda(q, k, v, g, beta, cu, scale=1.0)
    for t in (0, 3):  # the first token of each document sees only itself: o = beta (q . k) v
        expect = beta[t, 0] * (q[t, 0] @ k[t, 0]) * v[t, 0]
        assert torch.allclose(o[t, 0], expect, rtol=1e-13)
    v2 = v.clone()
    v2[:3] += 1.0  # change document 0 only
    assert torch.equal(naive_kda(q, k, v2, g, beta, cu)[3:], naive_kda(q, k, v, g, beta, cu)[3:])

