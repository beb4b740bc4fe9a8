"""GPU tests of the kernels' grids past CUDA's bound of 65,535 on gridDim.y and gridDim.z. Skips, with its reason,
without an sm_90a / sm_100a / sm_103a GPU.

A forward + backward (kda_kcp.chunk_kda_kcp and autograd) of a batch with more than 65,535 chunks (the gradient kernel
launches whole pieces of 65,535 chunks folded into gridDim.z, then the rest) and, in the second case, more than
65,535 documents (the forward's output walk launches 65,535 segments at a time): 32,768 documents of 65 tokens at
H = 2 (65,536 chunks, T = 2,129,920: one chunk past the first piece), and 70,000 documents of 65 to 128 tokens at
H = 1 (140,000 chunks, two whole pieces and a rest; the backward's scratch ~225 KiB per chunk-head, ~31 GiB).
Each is compared with the same documents in 4 smaller calls (contiguous quarters of the documents, each within the
bound). Documents are independent and every kernel computes a chunk or a run from its own rows only, with a fixed
order of operations and no atomics; the calls choose the same whole-run walks (short documents) and the choices
that differ between them (walk CTA widths, pipelined run groups) give the same bits. So o and every gradient must
equal the smaller calls' bit for bit; a first, looser check (relative error at most 2^-8, BF16's rounding of one
element) tells a wrong result from a rounding difference. The CPU emulation reaches the same paths with a few chunks
(tests/test_kernel_grids.py). compute-sanitizer on one forward + backward of each batch (the pytest cases, with their
smaller calls beside, need more GPU memory than the sanitizer leaves):

    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/profile_step.py --heads 2 --docs 65x32768
    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/profile_step.py --heads 1 --docs 128x70000
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kda_kcp

from gpu_common import DEV, fresh_seed, poison_like, rel, require_kernel_gpu

require_kernel_gpu("the large-count tests")

from kda_kcp.cuda import forward  # noqa: E402

SEED = fresh_seed("test_large_counts")
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")
PARTS = 4  # smaller calls per case
MAX_GRID_Y = 65535


def offsets(lengths) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def device_inputs(T, H, gen):
    """q, k L2-normalised BF16, v BF16, the benchmark's gates (logsigmoid(2 + 1.5 z), clipped at -5) with a quarter
    of the channels slow (|g| < 0.02: states carry across chunks), beta in (0.05, 0.95), and an output gradient,
    drawn on the GPU (millions of tokens)."""
    def randn(*shape):
        return torch.randn(*shape, device=DEV, generator=gen)

    q = F.normalize(randn(T, H, 128), dim=-1).bfloat16()
    k = F.normalize(randn(T, H, 128), dim=-1).bfloat16()
    v = randn(T, H, 128).bfloat16()
    g = F.logsigmoid(2 + 1.5 * randn(T, H, 128))
    slow = torch.rand(1, H, 128, device=DEV, generator=gen) < 0.25
    g = torch.where(slow, -0.02 * torch.rand(T, H, 128, device=DEV, generator=gen), g).clamp(-5.0, -1e-6)
    beta = (0.05 + 0.9 * torch.rand(T, H, device=DEV, generator=gen)).bfloat16()
    do = randn(T, H, 128).bfloat16()
    return [q, k, v, g.float(), beta], do


def fwd_bwd(cu, inputs, do):
    """(o, dq, dk, dv, dg, dbeta) of one call through chunk_kda_kcp and autograd, and its context."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=DEV))
    o = kda_kcp.chunk_kda_kcp(*leaves, ctx)
    grads = torch.autograd.grad(o, leaves, do)
    return (o.detach(), *grads), ctx


def case_lengths(case, gen):
    if case == "65536_chunks":
        return [65] * 32768, 2
    return torch.randint(65, 129, (70000,), generator=gen).tolist(), 1  # 2 chunks each


@pytest.mark.parametrize("case", ["65536_chunks", "140000_chunks"])
def test_counts_past_grid_bound_equal_smaller_calls(case):
    """o and every gradient of a batch past the grid bound equal those of its documents in 4 smaller calls, bit for
    bit (after a check to BF16 rounding, 2^-8 relative); every output finite (the outputs' memory NaN-poisoned
    before the call)."""
    gen = torch.Generator().manual_seed(SEED)
    lengths, H = case_lengths(case, gen)
    cu = offsets(lengths)
    T = cu[-1]
    dgen = torch.Generator(device=DEV).manual_seed(SEED)
    inputs, do = device_inputs(T, H, dgen)
    q, _, _, g, beta = inputs
    poison_like(q, q, q, q, g, beta)  # o, dq, dk, dv, dg, dbeta
    got, ctx = fwd_bwd(cu, inputs, do)
    torch.cuda.synchronize()
    nchunks = ctx.local.num_chunks
    nseg = forward.forward_tables(ctx.local, H, q.device).out.shape[0]  # (the call's tables, cached)
    print(f"[{case}] T = {T:,}, H = {H}: {nchunks:,} chunks, {nseg:,} forward output segments")
    assert nchunks == 2 * len(lengths) and nchunks > MAX_GRID_Y
    if case == "140000_chunks":
        assert nseg > MAX_GRID_Y, "the forward's segments stay within one launch"
    for name, x in zip(NAMES, got):
        assert torch.isfinite(x.float()).all(), f"{name}: not finite (an unwritten or wrong element)"
    bounds = [round(i * len(lengths) / PARTS) for i in range(PARTS + 1)]
    for a, b in zip(bounds, bounds[1:]):  # documents [a, b)
        t0, t1 = cu[a], cu[b]
        ref, sub_ctx = fwd_bwd([x - t0 for x in cu[a:b + 1]], [x[t0:t1] for x in inputs], do[t0:t1])
        assert sub_ctx.local.num_chunks <= MAX_GRID_Y and b - a <= MAX_GRID_Y
        for name, x, r in zip(NAMES, got, ref):
            x = x[t0:t1]
            err = rel(x, r)
            assert err <= 2.0**-8, f"{name}, documents {a}..{b - 1}: relative error {err:.2e} against smaller calls"
            assert torch.equal(x, r), (f"{name}, documents {a}..{b - 1}: not bitwise the smaller calls' (relative "
                                       f"{err:.2e}, max |diff| {(x.double() - r.double()).abs().max().item():.3e})")
        del ref
