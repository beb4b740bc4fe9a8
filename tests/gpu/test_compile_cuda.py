"""torch.compile(fullgraph=True) on the CUDA backend at W = 1 (tests/test_compile.py runs the same on the CPU, and W = 2
over gloo): chunk_kda_kcp and chunk_kda compile with no graph break into one graph that new contexts reuse, and o and
every gradient are bitwise equal to eager, with aot_eager and inductor, under torch.utils.checkpoint, with a
WorkspaceKcp, and in a process whose first call is the compiled one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch.utils.checkpoint import checkpoint

from gpu_common import DEV, fresh_seed, make_inputs, require_kernel_gpu

require_kernel_gpu("the torch.compile tests on the CUDA backend")

import kda_kcp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import assert_bitwise, first_call_compiled, fresh_compile  # noqa: E402

SEED = fresh_seed("compile cuda")
H = 4
PACKS = ([0, 1000, 1001, 4000], [0, 3000, 4000])  # a new context per call, as a training step builds


def _data(cu, seed):
    gen = torch.Generator().manual_seed(seed)
    inputs = make_inputs(cu[-1], H, gen)
    do = torch.randn(cu[-1], H, 128, generator=gen).bfloat16().to(DEV)
    return inputs, do


def _run(fn, inputs, do, *args):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o = fn(*leaves, *args)
    o.backward(do)
    torch.cuda.synchronize()
    return [o.detach()] + [x.grad for x in leaves]






def _no_break_one_graph():
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def _plain(q, k, v, g, beta, ctx):
    return kda_kcp.chunk_kda_kcp(q, k, v, g, beta, ctx)


def _checkpointed(q, k, v, g, beta, ctx):
    return checkpoint(kda_kcp.chunk_kda_kcp, q, k, v, g, beta, ctx, use_reentrant=False)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("fn", [_plain, _checkpointed], ids=["plain", "checkpoint"])
def test_chunk_kda_kcp_compiled_equals_eager(fn, backend):
    compiled = fresh_compile(fn, backend)
    for i, cu in enumerate(PACKS):
        ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=DEV))
        inputs, do = _data(cu, SEED + i)
        assert_bitwise(_run(compiled, inputs, do, ctx), _run(fn, inputs, do, ctx))
    _no_break_one_graph()


def test_workspace_under_compile():
    cu = PACKS[0]
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=DEV))
    ws = kda_kcp.WorkspaceKcp(ctx, H)

    def call(q, k, v, g, beta):
        return kda_kcp.chunk_kda_kcp(q, k, v, g, beta, ctx, workspace=ws)

    inputs, do = _data(cu, SEED)
    assert_bitwise(_run(fresh_compile(call, "inductor"), inputs, do), _run(call, inputs, do))


def _fla(q, k, v, g, beta, cu_seqlens):
    o, _ = kda_kcp.chunk_kda(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                             cu_seqlens=cu_seqlens)
    return o.squeeze(0)


def _fla_activations(q, k, v, g, beta, cu_seqlens):
    o, _ = kda_kcp.chunk_kda(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=torch.zeros(H, device=DEV),
                             lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_seqlens)
    return o.squeeze(0)


# inductor fuses the in-call activations (l2norm, gate, sigmoid) into its own kernels, whose roundings may differ from
# eager's in the last bit; with them the graph runs on aot_eager, which keeps eager's kernels
@pytest.mark.parametrize("fn,backend", [(_fla, "inductor"), (_fla_activations, "aot_eager")],
                         ids=["inductor", "activations-aot_eager"])
def test_chunk_kda_compiled_equals_eager(fn, backend):
    compiled = fresh_compile(fn, backend)
    for i, cu in enumerate(PACKS):
        cu_seqlens = torch.tensor(cu, device=DEV)
        inputs, do = _data(cu, SEED + i)
        assert_bitwise(_run(compiled, inputs, do, cu_seqlens), _run(fn, inputs, do, cu_seqlens))
    # the two packs' offsets differ in count: dynamo compiles the second with a dynamic cu_seqlens length
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0


# A process whose first kda_kcp call is a compiled one: the CUDA backend is then selected, and its programs and status
# buffers made, while torch.compile traces (the forward op's fake kernel; chunk_kda's own selection). Run in a fresh
# interpreter (helpers.first_call_compiled), since this one has made its first calls before.
FIRST_CALL_COMPILED = f"""
import sys
import torch
from torch.utils.checkpoint import checkpoint
import kda_kcp

sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from gpu_common import make_inputs

which = sys.argv[1]
gen = torch.Generator().manual_seed(5)
T, H = 3000, 4
q, k, v, g, beta = make_inputs(T, H, gen)
do = torch.randn(T, H, 128, generator=gen).bfloat16().cuda()
cu = torch.tensor([0, 1000, 3000], device="cuda")
ctx = kda_kcp.build_context_kcp(cu)

def kcp(q, k, v, g, beta):
    return checkpoint(kda_kcp.chunk_kda_kcp, q, k, v, g, beta, ctx, use_reentrant=False)

def fla(q, k, v, g, beta):  # raw gate, beta logits and q / k: chunk_kda's in-call activations
    o, _ = kda_kcp.chunk_kda(q[None], k[None], v[None], g[None], beta[None], use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, A_log=torch.zeros(H, device="cuda"), lower_bound=-5.0,
                             use_beta_sigmoid_in_kernel=True, cu_seqlens=cu)
    return o[0]

fn = {{"kcp": kcp, "fla": fla}}[which]
inputs = (q, k, v, g, beta)
"""


@pytest.mark.parametrize("which", ["kcp", "fla"])
def test_a_process_whose_first_call_is_compiled(which):
    first_call_compiled(FIRST_CALL_COMPILED, which)
