"""``KimiDeltaAttention``: the KDA token mixer of Kimi Linear, built on ``kda_kcp.chunk_kda``.

Per token x (hidden size D), with H heads of key size K and value size V:

- q, k, v = SiLU(short causal depthwise convolution of the projections of x) (one convolution over the
  concatenated q, k, v channels; it never reaches across a document start);
- the decay gate: a low-rank projection of x activated inside the call with ``A_log`` and ``dt_bias`` (FLA's gate;
  by default its bounded form ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` with lower_bound = -5, which keeps
  the log decay in the kernels' range [-5, 0));
- beta = sigmoid(b_proj(x)); q and k L2-normalised inside the call;
- o = KDA(q, k, v, gate, beta), then per head RMSNorm(o) * weight * sigmoid(low-rank output gate of x);
- the output projection back to D.

Under context parallelism (a ``KcpContext`` for ``cp_context``) the input is this rank's shard; the convolution
fetches the last tokens before each of its pieces that starts inside a document from the ranks that hold them
(one all-gather forward, one all-reduce backward, per layer).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .agreement import agree_call, layer_properties
from .exchange import all_gather_flat, collective_device
from .fla import chunk_kda
from .packing import packed_context
from .validate import check_positive_int

__all__ = ["KimiDeltaAttention", "ShortConvTables", "conv_tables", "short_conv"]


class ShortConvTables:
    """Where each tap of a causal convolution of ``size`` taps reads from, for one rank's tokens of a context.

    The convolution reads ``ext = [x_local (N rows); halo (world_size * published rows); one zero row]``:
    ``taps[s - 1, i]`` is the row of token i's input s tokens back (s = 1 .. size - 1): the token s rows earlier in
    the same piece, a halo row when that token sits on an earlier piece (this rank's or another's), or the zero
    row when it lies before the document's start. Each rank publishes the last size - 1 tokens of each of its pieces
    (``publish``: rows of ``[x_local; zero row]``), padded to the same count on every rank so one all-gather
    carries them. ``exchange`` is False when no piece of any rank starts inside a document (W = 1 always).
    """

    def __init__(self, ctx, size: int):
        back = size - 1
        cu = torch.tensor(ctx.cu_seqlens, dtype=torch.long)
        all_pieces = [(s, e, r, p) for r, pieces in enumerate(ctx.parts) for p, (s, e) in enumerate(pieces)]
        starts = set(ctx.cu_seqlens)
        self.exchange = back > 0 and any(s not in starts for s, _, _, _ in all_pieces)
        N = ctx.local_tokens
        max_pieces = max(len(p) for p in ctx.parts) if self.exchange else 0
        slots = max_pieces * back  # rows each rank publishes
        zero_row = N + ctx.world_size * slots

        tok = torch.cat([torch.arange(s, e, dtype=torch.long) for s, e in ctx.pieces]) if N else torch.zeros(0, dtype=torch.long)
        local_piece_start = torch.cat([torch.full((e - s,), s, dtype=torch.long) for s, e in ctx.pieces]) if N else tok
        doc_start = cu[torch.searchsorted(cu, tok, right=True) - 1]
        order = sorted(all_pieces)
        piece_starts = torch.tensor([s for s, _, _, _ in order], dtype=torch.long)
        # the halo row of global token u of a piece (rank r's p-th) is row0 + u: its slot is u - (e - back)
        piece_row0 = torch.tensor([(r * max_pieces + p) * back - (e - back) for s, e, r, p in order], dtype=torch.long)
        taps = []
        for s in range(1, size):
            u = tok - s
            same_piece = u >= local_piece_start
            in_doc = u >= doc_start
            src = torch.full_like(tok, zero_row)
            local_idx = torch.arange(N, dtype=torch.long) - s
            src = torch.where(in_doc & same_piece, local_idx, src)
            if self.exchange:
                halo = in_doc & ~same_piece
                which = (torch.searchsorted(piece_starts, u, right=True) - 1).clamp_min(0)
                src = torch.where(halo, N + piece_row0[which] + u, src)
            taps.append(src)
        self.taps = torch.stack(taps) if taps else torch.zeros(0, N, dtype=torch.long)

        publish = []
        if self.exchange:
            offset = 0
            for s, e in ctx.pieces:
                for j in range(back):
                    u = e - back + j
                    publish.append(offset + u - s if u >= s else N)
                offset += e - s
            publish += [N] * (slots - len(publish))
        self.publish = torch.tensor(publish, dtype=torch.long)
        self._on = {}

    def on(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(taps, publish) on ``device``, copied there once."""
        key = str(device)
        if key not in self._on:
            self._on[key] = (self.taps.to(device), self.publish.to(device))
        return self._on[key]


_tables: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # KcpContext -> {size: ShortConvTables}


def conv_tables(ctx, size: int) -> ShortConvTables:
    per_ctx = _tables.setdefault(ctx, {})
    if size not in per_ctx:
        per_ctx[size] = ShortConvTables(ctx, size)
    return per_ctx[size]


class _GatherHalo(torch.autograd.Function):
    """All-gather of every rank's published rows; the backward sums every rank's gradient of them (all-reduce)
    and keeps this rank's part."""

    @staticmethod
    def forward(fctx, rows, group, world_size, rank):
        fctx.group, fctx.rank = group, rank
        dev = collective_device(group)
        send = rows.to(dev).contiguous()
        out = send.new_empty(world_size * rows.shape[0], *rows.shape[1:])
        all_gather_flat(out, send, group)
        return out.to(rows.device)

    @staticmethod
    def backward(fctx, grad):
        total = grad.to(collective_device(fctx.group)).contiguous().clone()
        dist.all_reduce(total, group=fctx.group)
        n = total.shape[0] // dist.get_world_size(fctx.group)
        return total[fctx.rank * n:(fctx.rank + 1) * n].to(grad.device), None, None, None


def short_conv(x: torch.Tensor, weight: torch.Tensor, ctx) -> torch.Tensor:
    """Causal depthwise convolution of this rank's tokens ``x [N, C]`` with ``weight [C, size]`` (the last tap
    is the token itself), restarting at every document start of ``ctx``; no activation."""
    size = weight.shape[1]
    tables = conv_tables(ctx, size)
    taps, publish = tables.on(x.device)
    zero = x.new_zeros(1, x.shape[1])
    parts = [x]
    if tables.exchange:
        rows = torch.cat([x, zero]).index_select(0, publish)
        parts.append(_GatherHalo.apply(rows, ctx.group, ctx.world_size, ctx.rank))
    ext = torch.cat(parts + [zero])
    y = x * weight[:, size - 1]
    for s in range(1, size):
        y = y + ext.index_select(0, taps[s - 1]) * weight[:, size - 1 - s]
    return y


class KimiDeltaAttention(nn.Module):
    """The KDA mixer of Kimi Linear on ``kda_kcp.chunk_kda`` (see the module docstring).

    ``forward(x, cu_seqlens=None, cp_context=None)``: x ``[B, T, hidden_size]`` holds B sequences; with
    ``cu_seqlens`` (B = 1) the row is a packed batch of documents; with ``cp_context`` (a ``KcpContext``) x is this
    rank's shard ``[1, T_local, hidden_size]`` (``cp_context.shard`` of the packed rows). Returns the same shape.

    ``head_dim`` is the key size K (the CUDA kernels take K = V = 128); the value size is ``head_dim * expand_v``.
    ``gate_low_rank_dim`` (default: the value size) is the rank of the decay and output gates' projections.
    ``gate_lower_bound=None`` selects FLA's unbounded gate ``-exp(A_log) * softplus(g + dt_bias)``, whose values
    can leave the kernels' range [-5, 0).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int = 128, expand_v: float = 1.0,
                 conv_size: int = 4, gate_low_rank_dim: int | None = None, gate_lower_bound: float | None = -5.0,
                 norm_eps: float = 1e-5, deterministic: bool = True, device=None, dtype=None):
        super().__init__()
        for name, size in (("hidden_size", hidden_size), ("num_heads", num_heads), ("head_dim", head_dim),
                           ("conv_size", conv_size)):
            check_positive_int(name, size)
        value_dim = int(head_dim * expand_v)
        if value_dim < 1 or value_dim != head_dim * expand_v:
            raise ValueError(f"head_dim * expand_v must be a positive integer, got {head_dim} * {expand_v}")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_dim, self.value_dim = head_dim, value_dim
        self.conv_size, self.gate_lower_bound = conv_size, gate_lower_bound
        self.norm_eps, self.deterministic = norm_eps, deterministic
        rank = gate_low_rank_dim or value_dim
        kw = dict(device=device, dtype=dtype)
        H, K, V = num_heads, head_dim, value_dim
        self.qkv_proj = nn.Linear(hidden_size, H * (2 * K + V), bias=False, **kw)
        self.conv_weight = nn.Parameter(torch.empty(H * (2 * K + V), conv_size, **kw))
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, rank, bias=False, **kw), nn.Linear(rank, H * K, bias=False, **kw))
        self.A_log = nn.Parameter(torch.empty(H, **kw))
        self.dt_bias = nn.Parameter(torch.empty(H * K, **kw))
        self.b_proj = nn.Linear(hidden_size, H, bias=False, **kw)
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, rank, bias=False, **kw), nn.Linear(rank, H * V, bias=True, **kw))
        self.o_norm_weight = nn.Parameter(torch.empty(V, **kw))
        self.o_proj = nn.Linear(H * V, hidden_size, bias=False, **kw)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """The convolution like a depthwise Conv1d's default; A = exp(A_log) uniform in [1, 16]; dt_bias the inverse
        softplus of dt log-uniform in [1e-3, 0.1] (Mamba's); the output norm's weight ones."""
        bound = 1.0 / math.sqrt(self.conv_size)
        self.conv_weight.uniform_(-bound, bound)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(0.1)).exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.o_norm_weight.fill_(1.0)

    def forward(self, x: torch.Tensor, cu_seqlens=None, cp_context=None) -> torch.Tensor:
        H, K, V = self.num_heads, self.head_dim, self.value_dim

        def checked():
            if not isinstance(x, torch.Tensor):
                raise TypeError(
                    f"KimiDeltaAttention expects x, a torch.Tensor [B, T, {self.hidden_size}], got {type(x).__name__}")
            if x.dim() != 3 or x.shape[-1] != self.hidden_size or x.shape[0] < 1:
                raise ValueError(
                    f"KimiDeltaAttention expects x [B, T, {self.hidden_size}] with B >= 1, got {tuple(x.shape)}")
            B, T, D = x.shape
            xt = x.reshape(B * T, D)
            return packed_context(B, T, cu_seqlens, None, cp_context), xt, self.qkv_proj(xt)

        def properties(result):
            return layer_properties(result[2], H, K, V, self.conv_weight, self.deterministic)

        # under KCP the convolution exchanges first: a failure above on one rank, or ranks whose layers differ,
        # raise on every rank (kda_kcp.agreement) instead of hanging or mismatching in that exchange
        ctx, xt, qkv = agree_call(cp_context, "layer", checked, properties)
        B, T, D = x.shape
        N = B * T
        qkv = F.silu(short_conv(qkv, self.conv_weight, ctx))
        q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
        o, _ = chunk_kda(
            q.reshape(1, N, H, K), k.reshape(1, N, H, K), v.reshape(1, N, H, V),
            self.f_proj(xt).reshape(1, N, H, K), self.b_proj(xt).reshape(1, N, H),
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            lower_bound=self.gate_lower_bound, cp_context=ctx, A_log=self.A_log, dt_bias=self.dt_bias,
            deterministic=self.deterministic,
        )
        o = o.reshape(N, H, V)
        gate = self.g_proj(xt).reshape(N, H, V)
        of = o.float() if o.dtype in (torch.bfloat16, torch.float16) else o
        of = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + self.norm_eps) * self.o_norm_weight.to(of.dtype)
        o = (of * torch.sigmoid(gate.to(of.dtype))).to(o.dtype)
        return self.o_proj(o.reshape(N, H * V)).reshape(B, T, D)
