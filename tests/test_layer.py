"""kda_kcp.nn.KimiDeltaAttention against the same layer written out in FP64 with the oracle (per-document
convolutions with F.conv1d, FLA's activations, naive_kda), on packed batches of several documents (some shorter
than the convolution); B equal rows; W = 2 shards over gloo against W = 1 in every layout."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import kda_kcp
from fla_oracle import oracle_chunk_kda
from helpers import gather_global, offsets, rel_rms, run_distributed
from kda_kcp.nn import KimiDeltaAttention

D, H, K = 16, 2, 8
LENGTHS = [1, 2, 37, 0, 70, 5]  # T = 115: documents shorter than the 4-tap convolution, an empty one


def make_layer(seed, lower_bound=-5.0, conv_size=4):
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(D, H, head_dim=K, expand_v=0.75, conv_size=conv_size, gate_lower_bound=lower_bound)
    with torch.no_grad():  # gates and norm away from their initial values, so every parameter matters
        layer.o_norm_weight.add_(0.1 * torch.randn_like(layer.o_norm_weight))
        layer.g_proj[1].bias.add_(0.1 * torch.randn_like(layer.g_proj[1].bias))
    return layer.double()


def reference_layer(layer, x, cu):
    """The layer in FP64, one document at a time for the convolution, the oracle for KDA. x [1, T, D]."""
    Hn, Kd, Vd = layer.num_heads, layer.head_dim, layer.value_dim
    xt = x[0]
    proj = xt @ layer.qkv_proj.weight.T  # [T, C]
    size = layer.conv_size
    conv = []
    for s, e in zip(cu[:-1], cu[1:]):
        if e == s:
            continue
        seg = F.pad(proj[s:e].T[None], (size - 1, 0))  # zeros before the document's start
        conv.append(F.conv1d(seg, layer.conv_weight[:, None, :], groups=proj.shape[1])[0].T)
    qkv = F.silu(torch.cat(conv))
    q, k, v = qkv.split([Hn * Kd, Hn * Kd, Hn * Vd], dim=-1)
    T = xt.shape[0]
    g = (xt @ layer.f_proj[0].weight.T) @ layer.f_proj[1].weight.T
    beta = xt @ layer.b_proj.weight.T
    o = oracle_chunk_kda(
        q.reshape(1, T, Hn, Kd), k.reshape(1, T, Hn, Kd), v.reshape(1, T, Hn, Vd), g.reshape(1, T, Hn, Kd),
        beta.reshape(1, T, Hn), cu_seqlens=cu, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        A_log=layer.A_log, dt_bias=layer.dt_bias, lower_bound=layer.gate_lower_bound, use_beta_sigmoid_in_kernel=True,
    )[0]
    gate = ((xt @ layer.g_proj[0].weight.T) @ layer.g_proj[1].weight.T + layer.g_proj[1].bias).reshape(T, Hn, Vd)
    rms = torch.sqrt(o.square().mean(-1, keepdim=True) + layer.norm_eps)
    o = o / rms * layer.o_norm_weight * torch.sigmoid(gate)
    return (o.reshape(T, Hn * Vd) @ layer.o_proj.weight.T)[None]


def grads_of(layer, x, out, dy):
    """Gradients of <out, dy> for x and every parameter, by name."""
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    tensors = [x] + [p for _, p in layer.named_parameters()]
    return dict(zip(names, torch.autograd.grad(out, tensors, dy)))


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded_gate", "softplus_gate"])
def test_layer_matches_fp64_oracle_on_a_packed_batch(lower_bound):
    cu = offsets(LENGTHS)
    layer = make_layer(0, lower_bound)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, cu[-1], D, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(1, cu[-1], D, generator=gen, dtype=torch.float64)
    out = layer(x, cu_seqlens=torch.tensor(cu))
    ref = reference_layer(layer, x, cu)
    assert out.shape == (1, cu[-1], D)
    assert rel_rms(out, ref) < 1e-10
    got, want = grads_of(layer, x, out, dy), grads_of(layer, x, ref, dy)
    assert len(got) == 13  # x and the 12 parameters
    for name in want:
        assert got[name].abs().sum() > 0, name
        assert rel_rms(got[name], want[name]) < 1e-10, name


def test_convolution_stops_at_document_starts():
    """Changing one document's tokens changes no other document's output."""
    cu = offsets([20, 3, 30])
    layer = make_layer(2)
    x = torch.randn(1, cu[-1], D, dtype=torch.float64)
    y = x.clone()
    y[0, 20:23] += 1.0  # the middle document
    a, b = layer(x, cu_seqlens=cu), layer(y, cu_seqlens=cu)
    assert torch.equal(a[0, :20], b[0, :20]) and torch.equal(a[0, 23:], b[0, 23:])
    assert not torch.equal(a[0, 20:23], b[0, 20:23])


def test_rows_are_documents():
    """x [B, T, D] without cu_seqlens: each row is its own sequence."""
    layer = make_layer(3)
    x = torch.randn(3, 25, D, dtype=torch.float64)
    out = layer(x)
    for b in range(3):
        assert rel_rms(out[b], layer(x[b:b + 1])[0]) < 1e-12, b


def test_bad_input_raises():
    layer = make_layer(4)
    with pytest.raises(ValueError, match=r"expects x \[B, T, 16\]"):
        layer(torch.zeros(2, 5, D + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="batch size must be 1"):
        layer(torch.zeros(2, 5, D, dtype=torch.float64), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"expects x \[B, T, 16\] with B >= 1, got \(0, 5, 16\)"):
        layer(torch.zeros(0, 5, D, dtype=torch.float64))
    with pytest.raises(TypeError, match="expects x, a torch.Tensor"):
        layer(torch.zeros(1, 5, D).tolist())
    for name in ("hidden_size", "num_heads", "head_dim", "conv_size"):
        for bad in (0, 2.0, True):
            sizes = {**dict(hidden_size=D, num_heads=2, head_dim=4, conv_size=4), name: bad}
            with pytest.raises(ValueError, match=f"{name} must be a positive int, got {bad!r}"):
                kda_kcp.nn.KimiDeltaAttention(**sizes)


def _shards_match_single_rank(rank, world):
    # pieces that start inside documents, and (zigzag_per_document) pieces shorter than the convolution's reach
    cu = offsets([5, 40, 3, 1, 21])
    layer = make_layer(5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, cu[-1], D, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(1, cu[-1], D, generator=gen, dtype=torch.float64)
    ref_out = layer(x, cu_seqlens=cu)
    ref = grads_of(layer, x, ref_out, dy)
    halo_layouts = 0
    for layout in kda_kcp.LAYOUTS:
        ctx = kda_kcp.build_context_kcp(torch.tensor(cu), dist.group.WORLD, layout)
        halo_layouts += kda_kcp.nn.conv_tables(ctx, layer.conv_size).exchange
        xl = ctx.shard(x.detach()[0])[None].requires_grad_()
        out = layer(xl, cp_context=ctx)
        got = grads_of(layer, xl, out, ctx.shard(dy[0])[None])
        assert rel_rms(gather_global(ctx, out.detach()[0]), ref_out.detach()[0]) < 1e-10, (layout, "out")
        assert rel_rms(gather_global(ctx, got.pop("x")[0]), ref["x"][0]) < 1e-10, (layout, "x")
        for name, grad in got.items():
            total = grad.clone()
            dist.all_reduce(total)
            assert rel_rms(total, ref[name]) < 1e-10, (layout, name)
    assert halo_layouts == len(kda_kcp.LAYOUTS)  # every layout had a piece start inside a document


def test_layer_shards_over_gloo():
    run_distributed(_shards_match_single_rank, 2)


def _ranks_whose_layers_differ_raise(rank, world):
    """The last rank's layer or shard differs; the convolution's exchange comes first under KCP, so the ranks agree
    before it: every rank raises the same ValueError within seconds (a gloo group with a short timeout: a rank left
    waiting fails on gloo's timeout instead), rather than one rank raising while the others wait in the exchange, or
    the exchange's sizes mismatching (gloo aborts the process)."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=10))
    cu = offsets([5, 40, 3, 1, 21])
    ctx = kda_kcp.build_context_kcp(cu, group)
    odd = rank == world - 1
    x = torch.randn(1, ctx.local_tokens, D, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    failed = r"^kda_kcp: a rank failed its checks, so every rank raises: rank %d \(a KimiDeltaAttention forward\): " % (
        world - 1)
    cases = [
        ("a shard of another length", make_layer(4), x[:, :-1] if odd else x,
         failed + "ValueError: chunk_kda: cp_context gives rank %d" % (world - 1)),
        ("another dtype", make_layer(4).float() if odd else make_layer(4), x.float() if odd else x,
         r"^kda_kcp: the ranks' layer calls disagree: projections dtype: rank 0 has torch.float64, "),
        ("another convolution size", make_layer(4, conv_size=3 if odd else 4), x,
         r"^kda_kcp: the ranks' layer calls disagree: conv_size: rank 0 has 4, .*rank %d has 3$" % (world - 1)),
    ]
    for name, layer, xl, pattern in cases:
        start = time.monotonic()
        with pytest.raises(ValueError) as info:
            layer(xl, cp_context=ctx)
        assert time.monotonic() - start < 10, name
        msg = str(info.value)
        messages = [None] * world
        dist.all_gather_object(messages, msg, group=group)
        assert all(m == msg for m in messages), (name, messages)
        assert re.search(pattern, msg), (name, pattern, msg)


def test_ranks_whose_layers_differ_raise_on_every_rank():
    run_distributed(_ranks_whose_layers_differ_raise, 2)
