"""The FP64 oracle against the recurrence written literally with explicit matrices."""

import torch

from kda_kcp.reference import naive_kda
from helpers import make_inputs, offsets


def _literal(q, k, v, g, beta, cu, scale, h0=None):
    """S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T, o_t = scale S_t^T q_t, each document
    from S = h0[d] (zero without h0). Returns (o, the final S of every document)."""
    T, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(T, H, V, dtype=torch.float64)
    ht = torch.zeros(len(cu) - 1, H, K, V, dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    for d, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        for h in range(H):
            S = torch.zeros(K, V, dtype=torch.float64) if h0 is None else h0[d, h].clone()
            for t in range(s, e):
                kt = k[t, h].unsqueeze(1)
                S = (eye - beta[t, h] * kt @ kt.T) @ torch.diag(torch.exp(g[t, h])) @ S + beta[t, h] * kt @ v[t, h].unsqueeze(0)
                o[t, h] = scale * S.T @ q[t, h]
            ht[d, h] = S
    return o, ht


def test_oracle_equals_the_literal_recurrence():
    cu = offsets([9, 0, 1, 14])
    (q, k, v, g, beta), _ = make_inputs(cu, H=2, K=6, V=5, seed=9)
    got = naive_kda(q, k, v, g, beta, cu, scale=0.7)
    assert torch.allclose(got, _literal(q, k, v, g, beta, cu, 0.7)[0], rtol=1e-12, atol=1e-14)


def test_oracle_with_states_equals_the_literal_recurrence():
    """Each document starts from its initial state; the final state of an empty document is its initial state."""
    cu = offsets([9, 0, 1, 14])
    (q, k, v, g, beta), _ = make_inputs(cu, H=2, K=6, V=5, seed=10)
    h0 = torch.randn(4, 2, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    o, ht = naive_kda(q, k, v, g, beta, cu, scale=0.7, initial_state=h0, output_final_state=True)
    want_o, want_ht = _literal(q, k, v, g, beta, cu, 0.7, h0)
    assert torch.allclose(o, want_o, rtol=1e-12, atol=1e-14)
    assert torch.allclose(ht, want_ht, rtol=1e-12, atol=1e-14)
    assert torch.equal(ht[1], h0[1])
    _, ht0 = naive_kda(q, k, v, g, beta, cu, scale=0.7, output_final_state=True)
    assert torch.allclose(ht0, _literal(q, k, v, g, beta, cu, 0.7)[1], rtol=1e-12, atol=1e-14)


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

