"""Chunk stages of the torch backend, parallel over (chunk, head): ``chunk_prep``, ``fwd_o``, ``chunk_grads``.

Tensors here are chunked: [N, H, C, D] (N chunks, C = 64 rows, padding rows are zero and contribute
nothing). Notation of docs/design.md §2, per chunk and head:

    G = cumsum(g),  gamma = exp(G_last),  Dec_ijd = exp(G_id - G_jd) for i >= j (0 above the diagonal)
    P_ij  = sum_d k_id k_jd Dec_ijd,        L = strict_lower(Diag(beta) P),  A = (I + L)^-1
    W = A Diag(beta) (K o exp G),           U = A Diag(beta) V
    Aqk_ij = s sum_d q_id k_jd Dec_ijd (i >= j),   Qg = Q o exp G,   Kg = K o exp(G_last - G)
    V_new = U - W S,   O = s Qg S + Aqk V_new,   S_next = Diag(gamma) S + Kg^T V_new

Every exp(G_i - G_j) is factored around an anchor row in the past of row i (``Pairwise``), never
exp(-G) alone, which overflows over a chunk of strong gates. The stages run in slabs of chunks to
bound the memory of the factored tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Prep", "chunk_prep", "fwd_o", "chunk_grads", "SLAB_ELEMENTS"]

# pairwise-decay elements materialised at once (per slab): bounds the torch backend's peak memory
SLAB_ELEMENTS = 1 << 25


@dataclass
class Prep:
    """Per-chunk quantities the walks and fwd_o consume (all [N, H, C, *] except gamma [N, H, K])."""

    W: torch.Tensor
    U: torch.Tensor
    Aqk: torch.Tensor
    Qg: torch.Tensor
    Kg: torch.Tensor
    gamma: torch.Tensor

    def take(self, idx: torch.Tensor) -> "Prep":
        return Prep(*(t.index_select(0, idx) for t in (self.W, self.U, self.Aqk, self.Qg, self.Kg, self.gamma)))

    def chunk_map(self) -> torch.Tensor:
        """M_c = Diag(gamma) - Kg^T W, the chunk's linear part: S_next = M_c S + Kg^T U."""
        return torch.diag_embed(self.gamma) - self.Kg.transpose(-1, -2) @ self.W


def _masks(C: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    incl = torch.ones(C, C, dtype=torch.bool, device=device).tril()
    strict = incl.clone().fill_diagonal_(False)
    return incl, strict


class Pairwise:
    """Products weighted by exp(G_i - G_j), i >= j, as plain matrix products.

    Rows are grouped in blocks of ``BLOCK``; block I is anchored at its first row a_I, which lies in the
    past of (or at) every row of the block: exp(G_i - G_j) = exp(G_i - G_a) * exp(G_a - G_j). The row
    factor is <= 1; the column factor is <= 1 for earlier blocks and at most exp(5 * 15) inside the
    block (g >= -5), so nothing overflows in FP32. Columns past block I get factor 0 (masked before exp).
    """

    BLOCK = 16

    def __init__(self, G: torch.Tensor):
        C = G.shape[-2]
        nb = -(-C // self.BLOCK)
        rows = torch.arange(C, device=G.device)
        anchor_row = (rows // self.BLOCK) * self.BLOCK
        self.nb, self.C = nb, C
        self.row = (G - G[..., anchor_row, :]).exp()  # [.., C, K]
        Ga = G[..., anchor_row[:: self.BLOCK], :].unsqueeze(-2)  # [.., nb, 1, K]
        expo = Ga - G.unsqueeze(-3)  # [.., nb, C, K]
        visible = rows.unsqueeze(0) < (torch.arange(nb, device=G.device).unsqueeze(1) + 1) * self.BLOCK  # [nb, C]
        self.col = torch.where(visible.unsqueeze(-1), expo, torch.full_like(expo, float("-inf"))).exp()

    def _blocks(self, x):  # [.., C, *] -> [.., nb, BLOCK, *]
        return x.reshape(*x.shape[:-2], self.nb, self.BLOCK, x.shape[-1])

    def gram(self, a, b):
        """X_ij = sum_d a_id b_jd exp(G_id - G_jd) for j in or before i's block ([.., C, C]; mask it)."""
        X = self._blocks(a * self.row) @ (b.unsqueeze(-3) * self.col).transpose(-1, -2)  # [.., nb, B, C]
        return X.reshape(*X.shape[:-3], self.C, self.C)

    def rows(self, X, y):
        """Y_id = sum_j X_ij y_jd exp(G_id - G_jd) (X masked to i >= j)."""
        Y = self._blocks(X) @ (y.unsqueeze(-3) * self.col)  # [.., nb, B, K]
        return Y.reshape(*Y.shape[:-3], self.C, Y.shape[-1]) * self.row

    def cols(self, X, y):
        """Z_jd = sum_i X_ij y_id exp(G_id - G_jd) (X masked to i >= j)."""
        Z = self._blocks(X).transpose(-1, -2) @ self._blocks(y * self.row)  # [.., nb, C, K]
        return (Z * self.col).sum(-3)


def _slabs(n: int, per_item: int):
    step = max(1, SLAB_ELEMENTS // max(1, per_item))
    for s in range(0, n, step):
        yield s, min(n, s + step)


def _inverse_unit_lower(L: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device).expand_as(L)
    return torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)


def _prep_slab(q, k, v, g, beta, scale, incl, strict):
    G = g.cumsum(-2)
    pw = Pairwise(G)
    P = pw.gram(k, k)
    b = beta.unsqueeze(-1)
    A = _inverse_unit_lower(b * P * strict)
    eG = G.exp()
    Kexp = k * eG
    W = A @ (b * Kexp)
    U = A @ (b * v)
    Aqk = scale * pw.gram(q, k) * incl
    Glast = G[..., -1:, :]
    return G, pw, P, A, Kexp, W, U, Aqk, q * eG, k * (Glast - G).exp(), Glast.squeeze(-2).exp()


def chunk_prep(q, k, v, g, beta, scale: float) -> Prep:
    """Gate cumsum, L and A = (I + L)^-1, W, U, Aqk, Qg, Kg, gamma for every chunk (chunked inputs)."""
    N, H, C, K = k.shape
    if N == 0:
        z = k.new_zeros(0, H, C, K)
        return Prep(z, v.new_zeros(0, H, C, v.shape[-1]), k.new_zeros(0, H, C, C), z, z, k.new_zeros(0, H, K))
    incl, strict = _masks(C, k.device)
    parts = []
    for s, e in _slabs(N, H * 4 * C * K):
        out = _prep_slab(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], scale, incl, strict)
        parts.append((out[5], out[6], out[7], out[8], out[9], out[10]))
    return Prep(*(torch.cat(list(t), 0) for t in zip(*parts)))


def fwd_o(prep: Prep, h: torch.Tensor, scale: float) -> torch.Tensor:
    """O = s Qg S + Aqk (U - W S) for every chunk, given the state h entering it ([N, H, K, V])."""
    return scale * (prep.Qg @ h) + prep.Aqk @ (prep.U - prep.W @ h)


def chunk_grads(q, k, v, g, beta, do, h, dh, scale: float):
    """Gradients of one chunk's inputs given the state h entering it and dh, the gradient of the state
    leaving it (both [N, H, K, V]). Returns dq, dk, dv, dg [N, H, C, *] and dbeta [N, H, C].

    Derived by hand (reverse mode through the forward above); the torch autograd of the same forward
    is the check (tests/test_chunked.py).
    """
    N, H, C, K = k.shape
    outs = [[] for _ in range(5)]
    if N == 0:
        return q.clone(), k.clone(), v.clone(), g.clone(), beta.clone()
    incl, strict = _masks(C, k.device)
    for s, e in _slabs(N, H * 4 * C * K):
        res = _grads_slab(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], do[s:e], h[s:e], dh[s:e], scale, incl, strict)
        for lst, t in zip(outs, res):
            lst.append(t)
    return tuple(torch.cat(lst, 0) for lst in outs)


def _grads_slab(q, k, v, g, beta, do, S, dSn, scale, incl, strict):
    """One slab's chunk gradients."""
    G, pw, P, A, Kexp, W, U, Aqk, Qg, Kg, gamma = _prep_slab(q, k, v, g, beta, scale, incl, strict)
    b = beta.unsqueeze(-1)
    T_ = lambda x: x.transpose(-1, -2)  # noqa: E731
    Vn = U - W @ S
    # V_new feeds O (through Aqk) and S_next (through Kg)
    dVn = T_(Aqk) @ do + Kg @ dSn
    dAqk = (do @ T_(Vn)) * incl
    dQg = scale * (do @ T_(S))
    dKg = Vn @ T_(dSn)
    dgamma = (dSn * S).sum(-1)
    dW = -dVn @ T_(S)
    # U = A (beta V),  W = A (beta Kexp)
    dA = dVn @ T_(b * v) + dW @ T_(b * Kexp)
    dVb = T_(A) @ dVn
    dKb = T_(A) @ dW
    # A = (I + L)^-1  ->  dL = -A^T dA A^T on the strict lower triangle
    dL = -(T_(A) @ dA @ T_(A)) * strict
    dP = b * dL
    dbeta = (dL * P).sum(-1) + (dKb * Kexp).sum(-1) + (dVb * v).sum(-1)
    dv = b * dVb
    # pairwise terms, weighted by exp(G_i - G_j): the row side (index i) and the column side (index j)
    sdA = scale * dAqk
    row_k = pw.rows(dP, k)  # d/dKexp . exp(G)
    row_q = pw.rows(sdA, k)  # d/dQg from Aqk, . exp(G)
    col = pw.cols(dP, k) + pw.cols(sdA, q)
    eG = G.exp()
    dq = dQg * eG + row_q
    decay_last = (G[..., -1:, :] - G).exp()
    dk = b * dKb * eG + row_k + col + dKg * decay_last
    # dG: each factor exp(+G_i) contributes x * d/dx, each exp(-G_j) minus that
    dG = dQg * Qg + q * row_q + b * dKb * Kexp + k * row_k - k * col - dKg * Kg
    dG_last = (dKg * Kg).sum(-2) + dgamma * gamma
    dG = dG.clone()
    dG[..., -1, :] += dG_last
    dg = dG.flip(-2).cumsum(-2).flip(-2)
    return dq, dk, dv, dg, dbeta
