"""torch.compile(fullgraph=True) of models that call chunk_kda_kcp and chunk_kda (the custom ops of
kda_kcp.library): no graph break, one graph for contexts built every call, o and every gradient bitwise equal to
eager (the ops run the eager call's own code, and the ops around them compute the same way), under
torch.utils.checkpoint too, at W = 1 and over gloo at W = 2."""

from __future__ import annotations

import gc

import pytest
import torch
import torch._dynamo
from torch.utils.checkpoint import checkpoint

import kda_kcp
from helpers import assert_bitwise, first_call_compiled, fresh_compile, make_inputs, offsets, run_distributed

H, K, V = 2, 16, 8
F32 = torch.float32


class Mixer(torch.nn.Module):
    """Projections to q, k, v (no bias: one matmul each, which inductor computes as eager does), then the KDA call."""

    def __init__(self, hidden=24, checkpointed=False):
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.wq, self.wk, self.wv = (torch.nn.Parameter(0.1 * torch.randn(n, hidden, generator=gen))
                                     for n in (H * K, H * K, H * V))
        self.checkpointed = checkpointed

    def mix(self, x, g, beta, ctx):
        q = (x @ self.wq.t()).view(-1, H, K)
        k = (x @ self.wk.t()).view(-1, H, K)
        v = (x @ self.wv.t()).view(-1, H, V)
        return kda_kcp.chunk_kda_kcp(q, k, v, g, beta, ctx)

    def forward(self, x, g, beta, ctx):
        if self.checkpointed:
            return checkpoint(self.mix, x, g, beta, ctx, use_reentrant=False)
        return self.mix(x, g, beta, ctx)


def mixer_inputs(T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 24, generator=gen)
    g = (-5 * torch.rand(T, H, K, generator=gen)).clamp_max(-1e-3).requires_grad_()
    beta = torch.rand(T, H, generator=gen).requires_grad_()
    do = torch.randn(T, H, V, generator=gen)
    return x, g, beta, do


def outputs_and_grads(model, x, g, beta, do, ctx):
    """o, then the gradients of <o, do> to the parameters, g and beta."""
    leaves = [*model.parameters(), g, beta]
    for t in leaves:
        t.grad = None
    o = model(x, g, beta, ctx)
    o.backward(do)
    return [o.detach()] + [t.grad.clone() for t in leaves]






def graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpoint"])
def test_chunk_kda_kcp_compiles_whole_and_equals_eager(checkpointed):
    model = Mixer(checkpointed=checkpointed)
    compiled = fresh_compile(model, "aot_eager")
    for lengths in ([30, 70], [5, 64, 31]):  # a new context (and new offsets) per call, as a training step builds
        ctx = kda_kcp.build_context_kcp(offsets(lengths))
        x, g, beta, do = mixer_inputs(sum(lengths))
        want = outputs_and_grads(model, x, g, beta, do, ctx)
        got = outputs_and_grads(compiled, x, g, beta, do, ctx)
        assert_bitwise(got, want)
    assert graph_breaks() == 0
    assert graphs_compiled() == 1  # the context is a graph input, not a constant guarded on


def test_inductor_equals_eager():
    model = Mixer()
    compiled = fresh_compile(model, "inductor")
    ctx = kda_kcp.build_context_kcp(offsets([40, 60]))
    x, g, beta, do = mixer_inputs(100, seed=2)
    assert_bitwise(outputs_and_grads(compiled, x, g, beta, do, ctx), outputs_and_grads(model, x, g, beta, do, ctx))
    assert graph_breaks() == 0


def test_workspace_and_deterministic_package_under_compile():
    ctx = kda_kcp.build_context_kcp(offsets([64, 36]))
    ws = kda_kcp.WorkspaceKcp(ctx, H, head_dim=K, value_dim=V)
    inputs, do = make_inputs(ctx.cu_seqlens, H=H, K=K, V=V, dtype=F32, seed=3)

    def call(q, k, v, g, beta):
        return kda_kcp.det.chunk_kda_kcp(q, k, v, g, beta, ctx, scale=0.3, workspace=ws)

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        o = fn(*leaves)
        o.backward(do)
        return [o.detach()] + [t.grad for t in leaves]

    compiled = fresh_compile(call, "aot_eager")
    assert_bitwise(run(compiled), run(call))
    assert graph_breaks() == 0


def test_validate_reaches_the_compiled_backward():
    """validate=True under torch.compile: the backward's custom op checks do as the eager backward does."""
    ctx = kda_kcp.build_context_kcp(offsets([50, 30]))
    inputs, do = make_inputs(ctx.cu_seqlens, H=H, K=K, V=V, dtype=F32, seed=4)
    do[7, 1, 2] = float("nan")

    def call(q, k, v, g, beta):
        return kda_kcp.chunk_kda_kcp(q, k, v, g, beta, ctx, validate=True)

    compiled = fresh_compile(call, "aot_eager")
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    o = compiled(*leaves)
    assert graph_breaks() == 0
    with pytest.raises(ValueError, match="do holds non-finite values"):
        o.backward(do)


def test_the_forward_graph_names_the_backward():
    """torch's compile caches key a compiled call on its forward graph and keep the backward traced with it; the
    forward op carries a tag of the bwd op's schema and of the code that calls it, a constant in that graph, so a
    kda_kcp whose backward differs gets a new key instead of a cached backward calling ``bwd`` with old arguments
    (the RuntimeError an upgrade would otherwise bring to a persistent TORCHINDUCTOR_CACHE_DIR)."""
    import kda_kcp.library as library

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ctx = kda_kcp.build_context_kcp(offsets([40, 24]))
    inputs, do = make_inputs(ctx.cu_seqlens, H=H, K=K, V=V, dtype=F32, seed=5)
    compiled = fresh_compile(lambda q, k, v, g, beta: kda_kcp.chunk_kda_kcp(q, k, v, g, beta, ctx), keep)
    compiled(*inputs)
    fwd_op = (torch.ops.kda_kcp.fwd, torch.ops.kda_kcp.fwd.default)
    calls = [n for gm in graphs for n in gm.graph.nodes if n.target in fwd_op]
    assert len(calls) == 1
    assert calls[0].args[-1] == library._BACKWARD_TAG
    schema = str(torch.ops.kda_kcp.bwd.default._schema)
    assert library._BACKWARD_TAG == library._backward_tag(schema, library._backward, library._setup_context)
    # another schema (an argument added) or other code calling it is another tag
    other = schema.replace(") ->", ", bool extra=False) ->")
    assert other != schema
    assert library._backward_tag(other, library._backward, library._setup_context) != library._BACKWARD_TAG
    assert library._backward_tag(schema, library._backward, library._fwd_fake) != library._BACKWARD_TAG


def test_eager_keeps_its_two_autograd_nodes():
    """Outside torch.compile nothing goes through the custom ops (eager's host time does not move)."""
    ctx = kda_kcp.build_context_kcp(offsets([20]))
    inputs, _ = make_inputs(ctx.cu_seqlens, H=H, K=K, V=V, dtype=F32)
    o = kda_kcp.chunk_kda_kcp(*[t.requires_grad_() for t in inputs], ctx)
    assert type(o.grad_fn).__name__ == "KdaKcpOutputBackward"


def test_a_context_gone_before_the_backward_raises():
    def step(x, g, beta):
        ctx = kda_kcp.build_context_kcp(offsets([10, 22]))  # dropped when the forward returns
        return compiled(x, g, beta, ctx)

    compiled = fresh_compile(Mixer(), "aot_eager")
    x, g, beta, do = mixer_inputs(32)
    o = step(x, g, beta)
    gc.collect()
    with pytest.raises(RuntimeError, match="KcpContext of this compiled call no longer exists"):
        o.backward(do)


# A process whose first kda_kcp call is a compiled one: nothing the library binds or selects lazily may do it inside
# the trace (a module global set under torch.utils.checkpoint, warnings.warn, tensors made under the fake mode).
# Run in a fresh interpreter (helpers.first_call_compiled), since this process has made its first calls long before.
FIRST_CALL_COMPILED = """
import sys
import torch
from torch.utils.checkpoint import checkpoint
import kda_kcp

deterministic = sys.argv[1] == "det"
if not deterministic:  # the nondet flag under torch's deterministic mode: kda_kcp.det runs, an eager call warns
    torch.use_deterministic_algorithms(True)

def fn(q, k, v, g, beta):
    return checkpoint(kda_kcp.chunk_kda_kcp, q, k, v, g, beta, ctx, deterministic=deterministic, use_reentrant=False)

gen = torch.Generator().manual_seed(3)
T, H = 90, 2
inputs = [torch.nn.functional.normalize(torch.randn(T, H, 16, generator=gen), dim=-1),
          torch.nn.functional.normalize(torch.randn(T, H, 16, generator=gen), dim=-1),
          torch.randn(T, H, 8, generator=gen), -torch.rand(T, H, 16, generator=gen), torch.rand(T, H, generator=gen)]
do = torch.randn(T, H, 8, generator=gen)
ctx = kda_kcp.build_context_kcp(torch.tensor([0, 40, 90]))
"""


@pytest.mark.parametrize("flag", ["det", "nondet_forced_det"])
def test_a_process_whose_first_call_is_compiled_under_checkpoint(flag):
    first_call_compiled(FIRST_CALL_COMPILED, flag)


def test_a_backend_first_selected_inside_the_fake_kernel_keeps_real_tensors(monkeypatch):
    """In a process whose first call is compiled, the forward op's fake kernel selects the backend under the fake
    tensor mode; what the selection makes and keeps (on CUDA: the status word and its pinned host slots, made when
    the programs load) must be real tensors. Here the torch backend stands for it, its selection making the CPU
    status word, on fresh selection and status caches."""
    from torch._subclasses.fake_tensor import FakeTensor

    import kda_kcp.backend as backend
    from kda_kcp import status

    made = []

    def select(device, deterministic, forced):
        made.append(status.word(device))
        return backend.TORCH

    monkeypatch.setattr(backend, "_selected", {})
    monkeypatch.setattr(backend, "_select", select)
    monkeypatch.setattr(status, "_STATUS", {})
    model = Mixer()
    compiled = fresh_compile(model, "aot_eager")
    ctx = kda_kcp.build_context_kcp(offsets([30, 70]))
    x, g, beta, do = mixer_inputs(100)
    got = outputs_and_grads(compiled, x, g, beta, do, ctx)
    assert len(made) == 1 and not isinstance(made[0], FakeTensor)  # selected once, in the trace, for real
    assert status.word(torch.device("cpu")) is made[0]
    assert_bitwise(got, outputs_and_grads(model, x, g, beta, do, ctx))


def test_a_backend_first_selected_in_traced_code(monkeypatch):
    """chunk_kda selects its backend in the code torch.compile traces; in a process whose first call is compiled
    that selection loads the programs, which no trace can follow (locks, library loads, tensors read on the host):
    it runs for real, once, and the traced call goes on with the backend it made. A torch backend whose selection
    does such work stands for the CUDA one here."""
    import threading

    import kda_kcp.backend as backend

    calls = []

    def select(device, deterministic, forced):
        with threading.Lock():
            calls.append(int(torch.ones(1).numpy()[0]))
        return backend.TORCH

    monkeypatch.setattr(backend, "_selected", {})
    monkeypatch.setattr(backend, "_select", select)

    def f(x):
        b = backend.select_backend(x.device, True)
        return x.to(b.summary_dtype(x)) * 2

    compiled = fresh_compile(f, "aot_eager")
    assert torch.equal(compiled(torch.ones(3, dtype=torch.float64)), torch.full((3,), 2.0, dtype=torch.float64))
    assert calls == [1]
    assert graph_breaks() == 0


def fla_inputs(B, T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen),
               torch.randn(B, T, H, V, generator=gen), torch.randn(B, T, H, K, generator=gen),
               torch.randn(B, T, H, generator=gen), (0.5 + torch.rand(H, generator=gen)).log()]
    return [t.requires_grad_() for t in tensors], torch.randn(B, T, H, V, generator=gen)


def fla_call(q, k, v, g, beta, A_log, cu_seqlens=None, cp_context=None):
    o, final = kda_kcp.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                 lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_seqlens,
                                 cp_context=cp_context)
    return o


def fla_outputs_and_grads(fn, tensors, do, **kw):
    """o of ``fn(*tensors, **kw)`` and the gradients of <o, do> to ``tensors``."""
    for t in tensors:
        t.grad = None
    o = fn(*tensors, **kw)
    o.backward(do)
    return [o.detach()] + [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("packing", ["rows", "cu_seqlens"])
def test_chunk_kda_compiles_whole_and_equals_eager(packing):
    compiled = fresh_compile(fla_call, "aot_eager")
    for step_offsets in ([0, 17, 100], [0, 64, 100]):  # new offsets of one shape: no recompile
        if packing == "rows":
            tensors, do = fla_inputs(2, 50)
            cu = None
        else:
            tensors, do = fla_inputs(1, 100)
            cu = torch.tensor(step_offsets)
        assert_bitwise(fla_outputs_and_grads(compiled, tensors, do, cu_seqlens=cu),
                       fla_outputs_and_grads(fla_call, tensors, do, cu_seqlens=cu))
    assert graph_breaks() == 0
    assert graphs_compiled() == 1


def states_call(q, k, v, g, beta, A_log, h0, w2, cu_seqlens=None, cp_context=None):
    """FLA's call with an initial state and the final state out; o, and the final states' share of the loss."""
    o, ht = kda_kcp.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                              use_gate_in_kernel=True, A_log=A_log, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True,
                              cu_seqlens=cu_seqlens, cp_context=cp_context)
    return o + (ht * w2).sum()


@pytest.mark.parametrize("packing", ["rows", "cu_seqlens"])
def test_chunk_kda_with_states_compiles_whole_and_equals_eager(packing):
    compiled = fresh_compile(states_call, "aot_eager")
    for step_offsets in ([0, 17, 100], [0, 64, 100]):  # new offsets of one shape: no recompile
        tensors, do = fla_inputs(*((2, 50) if packing == "rows" else (1, 100)))
        cu = None if packing == "rows" else torch.tensor(step_offsets)
        gen = torch.Generator().manual_seed(len(step_offsets))
        h0 = torch.randn(2, H, K, V, generator=gen).requires_grad_()
        w2 = torch.randn(2, H, K, V, generator=gen)
        kw = dict(cu_seqlens=cu)
        assert_bitwise(fla_outputs_and_grads(compiled, [*tensors, h0], do, w2=w2, **kw),
                       fla_outputs_and_grads(states_call, [*tensors, h0], do, w2=w2, **kw))
    assert graph_breaks() == 0
    assert graphs_compiled() == 1


class StateMixer(Mixer):
    """Mixer whose call takes an initial state and returns the final state (its share of the output's loss)."""

    def mix(self, x, g, beta, ctx, h0=None, w2=None):
        q = (x @ self.wq.t()).view(-1, H, K)
        k = (x @ self.wk.t()).view(-1, H, K)
        v = (x @ self.wv.t()).view(-1, H, V)
        o, ht = kda_kcp.chunk_kda_kcp(q, k, v, g, beta, ctx, initial_state=h0, output_final_state=True)
        return o + (ht * w2).sum()

    def forward(self, x, g, beta, ctx, h0=None, w2=None):
        if self.checkpointed:
            return checkpoint(self.mix, x, g, beta, ctx, h0, w2, use_reentrant=False)
        return self.mix(x, g, beta, ctx, h0, w2)


@pytest.mark.parametrize("with_h0", [True, False], ids=["h0", "final_only"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpoint"])
def test_chunk_kda_kcp_with_states_compiles_whole_and_equals_eager(checkpointed, with_h0):
    model = StateMixer(checkpointed=checkpointed)
    compiled = fresh_compile(model, "aot_eager")
    for lengths in ([30, 70], [5, 64, 31], [10, 20, 30, 40]):  # T = 100, the document count changes
        ctx = kda_kcp.build_context_kcp(offsets(lengths))
        x, g, beta, do = mixer_inputs(sum(lengths))
        gen = torch.Generator().manual_seed(len(lengths))
        h0 = torch.randn(len(lengths), H, K, V, generator=gen).requires_grad_() if with_h0 else None
        w2 = torch.randn(len(lengths), H, K, V, generator=gen)
        runs = []
        for fn in (model, compiled):
            leaves = [*model.parameters(), g, beta] + ([h0] if with_h0 else [])
            for t in leaves:
                t.grad = None
            o = fn(x, g, beta, ctx, h0, w2)
            o.backward(do)
            runs.append([o.detach()] + [t.grad.clone() for t in leaves])
        assert_bitwise(runs[1], runs[0])
    assert graph_breaks() == 0
    # the document count is a shape (h0's, or the context's): static in the first graph, dynamic from the second on
    assert graphs_compiled() == 2


def _compiled_equals_eager_on_each_rank(rank, world, lengths, backend):
    ctx = kda_kcp.build_context_kcp(offsets(lengths), group=torch.distributed.group.WORLD)
    assert ctx.plan.needs_exchange  # a document crosses the ranks: the op saves incoming states
    model = Mixer(checkpointed=True)
    x, g, beta, do = (ctx.shard(t.detach()) for t in mixer_inputs(ctx.num_tokens, seed=4))
    g.requires_grad_(), beta.requires_grad_()
    want = outputs_and_grads(model, x, g, beta, do, ctx)
    got = outputs_and_grads(fresh_compile(model, backend), x, g, beta, do, ctx)
    assert_bitwise(got, want)
    assert graph_breaks() == 0

    # chunk_kda on this rank's shard with cp_context, on aot_eager: inductor fuses the in-call activations (l2norm,
    # gate, sigmoid) into kernels of its own, whose roundings may differ from eager's in the last bit
    tensors, do = fla_inputs(1, ctx.num_tokens, seed=6)
    tensors = [ctx.shard(t[0].detach()).unsqueeze(0).requires_grad_() for t in tensors[:5]] + tensors[5:]
    do = ctx.shard(do[0]).unsqueeze(0)

    def fla_cp(q, k, v, g, beta, A_log):
        return fla_call(q, k, v, g, beta, A_log, cp_context=ctx)

    compiled = fresh_compile(fla_cp, "aot_eager")
    assert_bitwise(fla_outputs_and_grads(compiled, tensors, do), fla_outputs_and_grads(fla_cp, tensors, do))
    assert graph_breaks() == 0

    # with states: every rank's initial states in, its documents' final states out
    gen = torch.Generator().manual_seed(7)
    h0 = torch.randn(ctx.num_docs, H, K, V, generator=gen).requires_grad_()
    w2 = torch.randn(ctx.num_docs, H, K, V, generator=gen)

    def states_cp(q, k, v, g, beta, A_log, h0):
        return states_call(q, k, v, g, beta, A_log, h0, w2, cp_context=ctx)

    compiled = fresh_compile(states_cp, "aot_eager")
    assert_bitwise(fla_outputs_and_grads(compiled, [*tensors, h0], do),
                   fla_outputs_and_grads(states_cp, [*tensors, h0], do))
    assert graph_breaks() == 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_kcp_over_gloo_equals_eager(backend):
    run_distributed(_compiled_equals_eager_on_each_rank, 2, [90, 40, 70], backend)
