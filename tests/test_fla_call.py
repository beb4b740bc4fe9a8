"""kda_kcp.chunk_kda, FLA 0.6.0's call: every supported option against the FP64 oracle (tests/fla_oracle.py),
o and the gradients of every input (A_log and dt_bias included); every unsupported option raising ValueError
that names it; initial and final states; output shapes and dtypes; the offsets it caches; W = 2 shards over gloo
(states included)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import kda_kcp
import kda_kcp.fla as fla_call
import kda_kcp.packing as packing
from fla_oracle import oracle_chunk_kda
from helpers import gather_global, offsets, rel_rms, run_distributed

F64 = torch.float64
H, K, V = 2, 8, 6


def make_call_inputs(B, T, seed, HV=H, raw_gate=False, raw_beta=False, raw_qk=False, dtype=F64):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    q, k = rnd(B, T, H, K), rnd(B, T, H, K)
    if not raw_qk:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    v = rnd(B, T, HV, V)
    g = rnd(B, T, HV, K) if raw_gate else -5 * torch.rand(B, T, HV, K, generator=gen, dtype=F64).clamp_min(1e-3)
    beta = rnd(B, T, HV) if raw_beta else torch.rand(B, T, HV, generator=gen, dtype=F64)
    A_log = (0.5 + torch.rand(HV, generator=gen, dtype=F64)).log()  # exp(A_log) in [0.5, 1.5)
    dt_bias = 0.5 * rnd(HV * K)
    do = rnd(B, T, HV, V)
    cast = lambda x: x.to(dtype)  # noqa: E731
    return dict(q=cast(q), k=cast(k), v=cast(v), g=cast(g), beta=cast(beta)), dict(A_log=A_log, dt_bias=dt_bias), do


def run_both(tensors, params, do, **opts):
    """(ours, oracle): o and the gradient of <o, do> for every tensor (and for A_log / dt_bias with the gate)."""
    out = []
    for fn in (kda_kcp.chunk_kda, oracle_chunk_kda):
        leaves = {n: x.detach().clone().requires_grad_() for n, x in tensors.items()}
        extra = {}
        if opts.get("use_gate_in_kernel"):
            extra = {n: x.detach().clone().requires_grad_() for n, x in params.items() if n in opts.get("with", params)}
        kw = {n: v for n, v in opts.items() if n != "with"}
        o = fn(**leaves, **extra, **kw)
        if fn is kda_kcp.chunk_kda:
            o, final = o
            assert final is None
        o.backward(do.to(o.dtype))
        out.append({"o": o.detach(), **{n: x.grad for n, x in {**leaves, **extra}.items()}})
    return out


OPTIONS = {
    "plain": ({}, {}),
    "scale": ({"scale": 0.3}, {}),
    "l2norm": ({"use_qk_l2norm_in_kernel": True}, {"raw_qk": True}),
    "gate_softplus": ({"use_gate_in_kernel": True}, {"raw_gate": True}),
    "gate_softplus_no_bias": ({"use_gate_in_kernel": True, "with": ("A_log",)}, {"raw_gate": True}),
    "gate_lower_bound": ({"use_gate_in_kernel": True, "lower_bound": -5.0}, {"raw_gate": True}),
    "gate_lower_bound_safe": ({"use_gate_in_kernel": True, "lower_bound": -3.0, "safe_gate": True}, {"raw_gate": True}),
    "gate_lower_bound_no_A": ({"use_gate_in_kernel": True, "lower_bound": -4.0, "with": ("dt_bias",)}, {"raw_gate": True}),
    "beta_sigmoid": ({"use_beta_sigmoid_in_kernel": True}, {"raw_beta": True}),
    "allow_neg_eigval": ({"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}, {"raw_beta": True}),
    "all": ({"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "lower_bound": -5.0, "safe_gate": True,
             "use_beta_sigmoid_in_kernel": True}, {"raw_qk": True, "raw_gate": True, "raw_beta": True}),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_matches_oracle(name):
    opts, kinds = OPTIONS[name]
    tensors, params, do = make_call_inputs(1, 75, seed=list(OPTIONS).index(name), **kinds)
    ours, ref = run_both(tensors, params, do, **opts)
    assert ours.keys() == ref.keys()
    expected = {"o", "q", "k", "v", "g", "beta"} | (set(opts.get("with", params)) if opts.get("use_gate_in_kernel") else set())
    assert set(ours) == expected
    for n in ours:
        assert ours[n] is not None and ours[n].abs().sum() > 0, (name, n, "no gradient")
        err = rel_rms(ours[n], ref[n])
        assert err < 1e-10, (name, n, err)


def test_batch_of_equal_rows_and_packed_documents():
    """B > 1 without cu_seqlens is B documents; B = 1 with cu_seqlens (an empty document included)."""
    tensors, params, do = make_call_inputs(3, 40, seed=5, raw_gate=True, raw_beta=True)
    opts = dict(use_gate_in_kernel=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)
    ours, ref = run_both(tensors, params, do, **opts)
    for n in ours:
        assert rel_rms(ours[n], ref[n]) < 1e-10, ("B = 3", n)
    # the same rows as one packed row of three documents give the same o
    packed = {n: x.reshape(1, 120, *x.shape[2:]) for n, x in tensors.items()}
    o_packed, _ = kda_kcp.chunk_kda(**packed, **params, **opts, cu_seqlens=torch.tensor([0, 40, 80, 120]))
    assert torch.equal(o_packed.reshape(3, 40, H, V), ours["o"])

    cu = offsets([30, 0, 70, 1, 19])
    tensors, params, do = make_call_inputs(1, cu[-1], seed=6)
    ours, ref = run_both(tensors, params, do, cu_seqlens=torch.tensor(cu))
    for n in ours:
        assert rel_rms(ours[n], ref[n]) < 1e-10, ("cu_seqlens", n)
    ours_cpu, _ = run_both(tensors, params, do, cu_seqlens=torch.tensor(cu), cu_seqlens_cpu=torch.tensor(cu))
    for n in ours:
        assert torch.equal(ours_cpu[n], ours[n]), ("cu_seqlens_cpu", n)


def test_grouped_value_heads():
    """HV = 2 H: each q, k head serves two value heads (FLA's GVA)."""
    tensors, params, do = make_call_inputs(2, 33, seed=9, HV=2 * H, raw_gate=True, raw_qk=True)
    ours, ref = run_both(tensors, params, do, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
    assert ours["o"].shape == (2, 33, 2 * H, V)
    for n in ours:
        assert rel_rms(ours[n], ref[n]) < 1e-10, n


def test_signature_matches_fla():
    """FLA 0.6.0's parameters, in its order and with its defaults, then kda_kcp's keywords."""
    fla_params = [
        ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
        ("g", inspect.Parameter.empty), ("beta", inspect.Parameter.empty), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("use_qk_l2norm_in_kernel", False), ("use_gate_in_kernel", False),
        ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False), ("safe_gate", False),
        ("lower_bound", None), ("disable_recompute", False), ("return_intermediate_states", False),
        ("state_v_first", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None), ("cp_context", None),
        ("use_graph", False), ("max_num_seqs", None),
    ]
    params = list(inspect.signature(kda_kcp.chunk_kda).parameters.values())
    assert [(p.name, p.default) for p in params[: len(fla_params)]] == fla_params
    rest = {p.name: (p.kind, p.default) for p in params[len(fla_params):]}
    kw = inspect.Parameter.KEYWORD_ONLY
    assert rest == {"A_log": (kw, None), "dt_bias": (kw, None), "deterministic": (kw, True), "workspace": (kw, None),
                    "kwargs": (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty)}


UNSUPPORTED = [  # (id, keywords, what the message must name)
    ("disable_recompute", dict(disable_recompute=True), "disable_recompute"),
    ("return_intermediate_states", dict(return_intermediate_states=True), "return_intermediate_states"),
    ("state_v_first", dict(state_v_first=True), "state_v_first"),
    ("transpose_state_layout", dict(transpose_state_layout=True), "transpose_state_layout"),
    ("use_graph", dict(use_graph=True), "use_graph"),
    ("max_num_seqs", dict(max_num_seqs=4), "max_num_seqs"),
    ("chunk_size", dict(chunk_size=32), "chunk_size"),
    ("unknown_keyword", dict(not_an_option=1), "not_an_option"),
    ("A_log_without_gate", dict(A_log=torch.zeros(H)), "A_log"),
    ("dt_bias_without_gate", dict(dt_bias=torch.zeros(H * K)), "dt_bias"),
    ("allow_neg_eigval_without_sigmoid", dict(allow_neg_eigval=True), "allow_neg_eigval"),
    ("lower_bound_below_-5", dict(use_gate_in_kernel=True, A_log=torch.zeros(H), lower_bound=-6.0), "lower_bound"),
    ("lower_bound_positive", dict(use_gate_in_kernel=True, lower_bound=0.5), "lower_bound"),
    ("gate_without_A_log", dict(use_gate_in_kernel=True), "A_log must be given"),
    ("safe_gate_without_lower_bound", dict(use_gate_in_kernel=True, A_log=torch.zeros(H), safe_gate=True), "safe_gate"),
    ("cu_seqlens_with_B_2", dict(cu_seqlens=torch.tensor([0, 10, 20])), "batch size must be 1"),
    ("cu_seqlens_cpu_alone", dict(cu_seqlens_cpu=torch.tensor([0, 20])), "cu_seqlens_cpu"),
]


def run_with_states(tensors, do, h0, w2, fns=(kda_kcp.chunk_kda, oracle_chunk_kda), **opts):
    """(ours, oracle) of FLA's call with an initial state and the final state out: o, ht and the gradients of
    <o, do> + <ht, w2> to every tensor and to h0."""
    out = []
    for fn in fns:
        leaves = {n: x.detach().clone().requires_grad_() for n, x in {**tensors, "h0": h0}.items()}
        h = leaves.pop("h0")
        o, ht = fn(**leaves, initial_state=h, output_final_state=True, **opts)
        ((o * do.to(o.dtype)).sum() + (ht * w2).sum()).backward()
        out.append({"o": o.detach(), "ht": ht.detach(), "h0": h.grad, **{n: x.grad for n, x in leaves.items()}})
    return out


@pytest.mark.parametrize("packing", ["rows", "cu_seqlens", "grouped_value_heads"])
def test_states_match_oracle(packing):
    """initial_state [N, HV, K, V] and output_final_state as FLA takes them: N = B for equal rows, N = len(cu_seqlens)
    - 1 for packed documents (an empty one included), HV value heads with GVA; with the in-call activations."""
    B, T, HV, cu = 2, 70, H, None
    if packing == "cu_seqlens":
        cu = offsets([30, 0, 70, 1, 39])
        B, T = 1, cu[-1]
    if packing == "grouped_value_heads":
        HV = 2 * H
    tensors, params, do = make_call_inputs(B, T, seed=13, HV=HV, raw_beta=True, raw_qk=True)
    N = B if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(14)
    h0, w2 = torch.randn(N, HV, K, V, generator=gen, dtype=F64), torch.randn(N, HV, K, V, generator=gen, dtype=F64)
    opts = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if cu is not None:
        opts["cu_seqlens"] = torch.tensor(cu)
    ours, ref = run_with_states(tensors, do, h0, w2, **opts)
    assert ours["ht"].shape == (N, HV, K, V)
    for n in ref:
        assert rel_rms(ours[n], ref[n]) < 1e-10, (packing, n)
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, K, V\]"):
        kda_kcp.chunk_kda(**tensors, **opts, initial_state=h0[:1])


@pytest.mark.parametrize("kw, named", [u[1:] for u in UNSUPPORTED], ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_option_raises_naming_it(kw, named):
    tensors, _, _ = make_call_inputs(2, 20, seed=1)
    before = {n: x.clone() for n, x in tensors.items()}
    with pytest.raises(ValueError, match=named):
        kda_kcp.chunk_kda(**tensors, **kw)
    for n, x in tensors.items():
        assert torch.equal(x, before[n]), n  # nothing the caller passed is modified


def test_a_host_copy_with_other_offsets_raises():
    """cu_seqlens_cpu is cu_seqlens' host copy: when both are on the host, other offsets raise instead of one of
    them being trusted."""
    tensors, _, _ = make_call_inputs(1, 20, seed=1)
    with pytest.raises(ValueError, match="cu_seqlens_cpu holds other offsets"):
        kda_kcp.chunk_kda(**tensors, cu_seqlens=torch.tensor([0, 8, 20]), cu_seqlens_cpu=torch.tensor([0, 12, 20]))
    o, _ = kda_kcp.chunk_kda(**tensors, cu_seqlens=torch.tensor([0, 8, 20]), cu_seqlens_cpu=torch.tensor([0, 8, 20]))
    ref, _ = kda_kcp.chunk_kda(**tensors, cu_seqlens=torch.tensor([0, 8, 20]))
    assert torch.equal(o, ref)


def test_the_supported_values_of_fla_only_options_are_accepted():
    tensors, _, _ = make_call_inputs(1, 20, seed=2)
    ref, _ = kda_kcp.chunk_kda(**tensors)
    o, _ = kda_kcp.chunk_kda(**tensors, chunk_size=64, transpose_state_layout=False, disable_recompute=False,
                             safe_gate=True, lower_bound=-5.0)
    assert torch.equal(o, ref)


def test_lower_bound_takes_numpy_scalars_as_scale_does():
    """lower_bound as a numpy float32 (e.g. read from a config array) computes what the Python float does."""
    np = pytest.importorskip("numpy")
    tensors, _, _ = make_call_inputs(1, 20, seed=2)
    opts = dict(use_gate_in_kernel=True, A_log=torch.zeros(H, dtype=torch.float64))
    ref, _ = kda_kcp.chunk_kda(**tensors, **opts, lower_bound=-4.5)
    o, _ = kda_kcp.chunk_kda(**tensors, **opts, lower_bound=np.float32(-4.5))
    assert torch.equal(o, ref)


def test_rows_without_tokens_are_documents():
    """B rows of T = 0 tokens are B empty sequences, as with T > 0: B initial states go in, and each comes back
    unchanged as its sequence's final state."""
    tensors, _, _ = make_call_inputs(3, 0, seed=2)
    h0 = torch.randn(3, H, K, V, dtype=F64, generator=torch.Generator().manual_seed(3))
    o, ht = kda_kcp.chunk_kda(**tensors, initial_state=h0, output_final_state=True)
    assert o.shape == (3, 0, H, V)
    assert torch.equal(ht, h0)
    _, ht = kda_kcp.chunk_kda(**tensors, output_final_state=True)
    assert ht.shape == (3, H, K, V) and not ht.any()


def test_an_initial_state_of_any_layout():
    """initial_state need not be contiguous, as in FLA (which makes its tensor arguments contiguous): one learned
    state expanded over the B rows gives the materialized state's result, and its gradient is the rows' sum."""
    tensors, _, do = make_call_inputs(3, 20, seed=7)
    learned = torch.randn(1, H, K, V, dtype=F64, generator=torch.Generator().manual_seed(8), requires_grad=True)
    rows = learned.detach().expand(3, H, K, V).clone().requires_grad_()
    o_rows, ht_rows = kda_kcp.chunk_kda(**tensors, initial_state=rows, output_final_state=True)
    o, ht = kda_kcp.chunk_kda(**tensors, initial_state=learned.expand(3, H, K, V), output_final_state=True)
    assert torch.equal(o, o_rows) and torch.equal(ht, ht_rows)
    for out, state in (((o, ht), learned), ((o_rows, ht_rows), rows)):
        ((out[0] * do).sum() + out[1].sum()).backward()
    assert torch.allclose(learned.grad, rows.grad.sum(0, keepdim=True), rtol=1e-12, atol=0)


def test_bad_inputs_raise_before_running():
    tensors, _, _ = make_call_inputs(1, 20, seed=3)
    bad = {
        "k must have q's shape": dict(tensors, k=tensors["k"][:, :10]),
        "v must be": dict(tensors, v=tensors["v"][:, :, :1].expand(1, 20, 3, V)),
        "g must be": dict(tensors, g=tensors["g"][..., :4]),
        "beta must be": dict(tensors, beta=tensors["beta"][..., None]),
        "q must be": dict(tensors, q=tensors["q"][0]),
        "cu_seqlens ends at 19": dict(tensors, cu_seqlens=torch.tensor([0, 19])),
        "at least one head": {n: x[:, :, :0] for n, x in tensors.items()},
        "at least one sequence": {n: x[:0] for n, x in tensors.items()},
    }
    for message, kw in bad.items():
        with pytest.raises(ValueError, match=message):
            kda_kcp.chunk_kda(**kw)
    with pytest.raises(TypeError, match="cp_context must be a kda_kcp.KcpContext"):
        kda_kcp.chunk_kda(**tensors, cp_context=object())
    with pytest.raises(TypeError, match="use_gate_in_kernel must be True or False"):
        kda_kcp.chunk_kda(**tensors, use_gate_in_kernel=1)
    with pytest.raises(ValueError, match="A_log must hold 2 values"):
        kda_kcp.chunk_kda(**{**tensors, "g": tensors["g"]}, use_gate_in_kernel=True, A_log=torch.zeros(3))
    ctx = kda_kcp.build_context_kcp([0, 20])
    with pytest.raises(ValueError, match="cu_seqlens differs from cp_context"):
        kda_kcp.chunk_kda(**tensors, cp_context=ctx, cu_seqlens=torch.tensor([0, 5, 20]))
    with pytest.raises(ValueError, match="local tokens"):
        kda_kcp.chunk_kda(**{n: x[:, :10] for n, x in tensors.items()}, cp_context=ctx)


class _RecordingBackend:
    """The torch backend, but refusing head dims other than (K, V) (as the CUDA backend refuses all but 128) and
    recording whether the fused activation pass was asked for."""

    def __init__(self, real):
        self.real, self.fused_calls = real, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def check_head_dims(self, head_dim, value_dim):
        if (head_dim, value_dim) != (K, V):
            raise ValueError(f"this backend supports head dims {K}, {V} only, got {head_dim}, {value_dim}")

    def fused_activations(self, *args):
        self.fused_calls += 1
        return None


def test_bad_calls_raise_before_the_fused_activations(monkeypatch):
    """With in-call activations, what the KDA call would refuse (the backend's head dims, the scale, the initial
    state) is refused before the backend's fused activation pass runs (on the CUDA backend: before its kernels)."""
    backend = _RecordingBackend(fla_call.TORCH)
    monkeypatch.setattr(fla_call, "TORCH", backend)
    tensors, params, _ = make_call_inputs(1, 20, seed=5, raw_qk=True)
    opts = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor([0, 7, 20]))
    cases = {
        "supports head dims 8, 6 only": dict(tensors, v=torch.randn(1, 20, H, V + 1, dtype=F64)),
        "scale must be a finite positive number": dict(tensors, scale=-1.0),
        "initial_state must be": dict(tensors, initial_state=torch.zeros(3, H, K, V, dtype=F64)),
    }
    for message, kw in cases.items():
        with pytest.raises(ValueError, match=message):
            kda_kcp.chunk_kda(**kw, **opts)
    assert backend.fused_calls == 0
    kda_kcp.chunk_kda(**tensors, **opts)  # a good call reaches it
    assert backend.fused_calls == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_shape_and_dtype(dtype):
    tensors, params, do = make_call_inputs(2, 20, seed=4, HV=2 * H, raw_gate=True, raw_beta=True, dtype=dtype)
    leaves = {n: x.requires_grad_() for n, x in tensors.items()}
    p = {n: x.float().requires_grad_() for n, x in params.items()}
    o, final = kda_kcp.chunk_kda(**leaves, **p, use_gate_in_kernel=True, lower_bound=-5.0,
                                 use_beta_sigmoid_in_kernel=True)
    assert final is None
    assert o.shape == (2, 20, 2 * H, V) and o.dtype == dtype
    o.float().backward(do.float())
    for n, x in {**leaves, **p}.items():
        assert x.grad is not None and x.grad.dtype == x.dtype and x.grad.shape == x.shape, n
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0, n


def test_cached_offsets_follow_in_place_changes(monkeypatch):
    """A cu_seqlens tensor is read once while it lives unchanged; written in place, it is read again."""
    reads = []
    real = packing.check_cu_seqlens
    monkeypatch.setattr(packing, "check_cu_seqlens", lambda *a, **kw: reads.append(1) or real(*a, **kw))
    tensors, params, do = make_call_inputs(1, 50, seed=8)
    cu = torch.tensor([0, 20, 50])
    first, _ = kda_kcp.chunk_kda(**tensors, cu_seqlens=cu)
    again, _ = kda_kcp.chunk_kda(**tensors, cu_seqlens=cu)
    assert torch.equal(first, again) and len(reads) == 1
    cu[1] = 35
    moved, _ = kda_kcp.chunk_kda(**tensors, cu_seqlens=cu)
    assert len(reads) == 2
    assert rel_rms(moved, oracle_chunk_kda(**tensors, cu_seqlens=[0, 35, 50])) < 1e-10


def _shards_match_oracle(rank, world):
    cu = offsets([37, 2, 90, 11])
    tensors, params, do = make_call_inputs(1, cu[-1], seed=12, raw_gate=True, raw_beta=True, raw_qk=True)
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)
    _, ref = run_both(tensors, params, do, **opts, cu_seqlens=torch.tensor(cu))
    for layout in kda_kcp.LAYOUTS:
        ctx = kda_kcp.build_context_kcp(torch.tensor(cu), dist.group.WORLD, layout)
        local = {n: ctx.shard(x[0])[None].requires_grad_() for n, x in tensors.items()}
        p = {n: x.clone().requires_grad_() for n, x in params.items()}
        o, _ = kda_kcp.chunk_kda(**local, **p, **opts, cp_context=ctx)
        o.backward(ctx.shard(do[0])[None])
        assert rel_rms(gather_global(ctx, o[0].detach()), ref["o"][0]) < 1e-10, (layout, "o")
        for n, x in local.items():
            assert rel_rms(gather_global(ctx, x.grad[0]), ref[n][0]) < 1e-10, (layout, n)
        for n, x in p.items():  # this rank's share of the parameter gradients, summed over the ranks
            total = x.grad.clone()
            dist.all_reduce(total)
            assert rel_rms(total, ref[n]) < 1e-10, (layout, n)
    # states: every rank passes every document's initial state; its final states and initial-state gradient hold
    # the documents that end (start) on it, so their sums over the ranks are the whole ones
    gen = torch.Generator().manual_seed(15)
    h0, w2 = torch.randn(len(cu) - 1, H, K, V, generator=gen, dtype=F64), torch.randn(len(cu) - 1, H, K, V,
                                                                                         generator=gen, dtype=F64)
    _, ref = run_with_states(tensors, do, h0, w2, **opts, cu_seqlens=torch.tensor(cu))
    for layout in kda_kcp.LAYOUTS:
        ctx = kda_kcp.build_context_kcp(torch.tensor(cu), dist.group.WORLD, layout)
        local = {n: ctx.shard(x[0])[None] for n, x in tensors.items()}
        (got,) = run_with_states(local, ctx.shard(do[0])[None], h0, w2, (kda_kcp.chunk_kda,), **opts, cp_context=ctx)
        for n in ("ht", "h0"):
            dist.all_reduce(got[n])
            assert rel_rms(got[n], ref[n]) < 1e-10, (layout, n)
        for n in ("o", *local):
            assert rel_rms(gather_global(ctx, got[n][0]), ref[n][0]) < 1e-10, (layout, n)


def test_cp_context_shards_over_gloo():
    run_distributed(_shards_match_oracle, 2)
