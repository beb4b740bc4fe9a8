"""GPU tests of the CUDA backward (kda_kcp.cuda.backward). Each skips, with its reason, without an sm_90+ GPU.

Inputs are drawn fresh each run (seed printed), never zeros; every gradient buffer is poisoned with NaN
before each call (through the caching allocator), so an unwritten element shows as NaN.
"""

from __future__ import annotations


import pytest
import torch

from kda_kcp.plan import LocalPlan, build_plan
from kda_kcp.reference import naive_kda

from gpu_common import DEV, fresh_seed, local_plan, poison_like, random_docs, rel, require_kernel_gpu, set_tuning
from gpu_common import make_inputs as _inputs
import records  # noqa: E402  (tests/ is on the path through gpu_common)

require_kernel_gpu("the CUDA backward tests")

from kda_kcp import status  # noqa: E402
from kda_kcp.cuda import backward as cb  # noqa: E402
from kda_kcp.cuda import bwd_layout, bwd_tables  # noqa: E402
from kda_kcp.cuda import tuning  # noqa: E402
from kda_kcp.torch_backend import TorchBackend  # noqa: E402

SEED = fresh_seed("test_bwd_cuda")
SCALE = 128**-0.5
TOL = {"dq": 6e-3, "dk": 6e-3, "dv": 6e-3, "dg": 1e-2, "dbeta": 1e-2}
NAMES = ("dq", "dk", "dv", "dg", "dbeta")


def make_inputs(T, H, gen, gate="mixed"):
    """The forward inputs, then an output gradient drawn from the same generator."""
    inputs = _inputs(T, H, gen, gate)
    return inputs, torch.randn(T, H, 128, generator=gen).bfloat16().to(DEV)


def run_bwd(inputs, do, plan, state_in=None, dstate_out=None, deterministic=True):
    q, _, _, g, beta = inputs
    poison_like(q, q, q, g, beta)
    return cb.bwd_grads(*inputs, do, SCALE, plan, state_in, dstate_out, deterministic)


# Token-heads of one FP64 oracle backward: its autograd graph keeps ~4 FP64 states (128 KiB each) per token-head,
# ~25 GB here; [16-8000] in one piece (128,000 token-heads) ran out of memory on an 80 GB H100.
ORACLE_TOKEN_HEADS = 48_000


def oracle_grads(inputs, do, cu):
    """The FP64 oracle's gradients, computed for a few heads at a time (heads are independent) so that its autograd
    graph fits an 80 GB card."""
    T, H = inputs[0].shape[:2]
    step = max(1, ORACLE_TOKEN_HEADS // max(T, 1))
    parts = [[] for _ in inputs]
    for first in range(0, H, step):
        heads = slice(first, min(H, first + step))
        leaves = [x[:, heads].detach().double().requires_grad_() for x in inputs]
        naive_kda(*leaves, cu, scale=SCALE).backward(do[:, heads].double())
        for out, x in zip(parts, leaves):
            out.append(x.grad)
    return [torch.cat(p, 1) for p in parts]


def test_stages_match_torch_stages():
    """Diagnostics stage by stage against the torch backend's stages (FP32): the prep record (W, U, Aqk, A,
    P, Kg, s Qg, gamma), h from the forward walk and dh from the reverse walk."""
    from kda_kcp.chunk import _masks, _prep_slab
    from kda_kcp.torch_backend import _chunk_set
    from kda_kcp.walk import reverse_walk, state_walk

    gen = torch.Generator().manual_seed(SEED + 3)
    cu = [0, 100, 1100, 1101, 1800]
    T, H = cu[-1], 2
    inputs, do = make_inputs(T, H, gen)
    plan = local_plan(cu)
    mod = cb.load(DEV)
    chunks, runs = bwd_tables.chunk_tables(plan, DEV)
    nc = chunks.shape[0]
    prep = torch.full((nc * H * bwd_layout.PREP_BYTES,), 255, dtype=torch.uint8, device=DEV)
    h = torch.full(bwd_layout.hi_state_shape(nc, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    dh = torch.full(bwd_layout.scaled_state_shape(nc, H), 255, dtype=torch.uint8, device=DEV)  # NaN words and powers
    e0 = torch.empty(0, device=DEV)
    mod.bwd_prep(*inputs, chunks, prep, SCALE, status.word(DEV))
    again = torch.full_like(prep, 255)
    mod.bwd_prep(*inputs, chunks, again, SCALE, status.word(DEV))
    assert torch.equal(again, prep), "the prep's records are not bitwise repeatable"
    rec = prep.view(nc, H, bwd_layout.PREP_BYTES)

    def field(off, nbytes, dtype, shape):
        return rec[:, :, off : off + nbytes].contiguous().view(dtype).reshape(nc, H, *shape).float()

    mine = {
        "W": field(0, 16384, torch.bfloat16, (64, 128)),
        "Kg": field(16384, 16384, torch.bfloat16, (64, 128)),
        "sQg": field(32768, 16384, torch.bfloat16, (64, 128)),
        "Aqk": field(49152, 8192, torch.bfloat16, (64, 64)) + field(57344, 8192, torch.bfloat16, (64, 64)),
        "A": field(65536, 8192, torch.bfloat16, (64, 64)),  # hi only (kda_bwd.h)
        "U": records.record_u(rec),
        "P": field(114688, 16384, torch.float32, (64, 64)),
        "gamma": field(131072, 512, torch.float32, (128,)),
    }
    # the walks write V_new over U and dV_new after gamma (kda_bwd.h kRecVn, kRecDvn)
    mod.bwd_fwd_walk(prep, chunks, runs, e0, e0, e0, h, 8)
    mod.bwd_rev_walk(do, prep, chunks, runs, e0, e0, e0, dh, 8)
    torch.cuda.synchronize()
    vn, dvn = (records.walk_tiles(rec, off) for off in (records.REC_VN, records.REC_DVN))
    cs = _chunk_set(plan, range(plan.num_runs), DEV)
    qc, kc, vc, gc = (cs.gather(x, torch.float32) for x in inputs[:4])
    bc = cs.gather(inputs[4].unsqueeze(-1), torch.float32).squeeze(-1)
    incl, strict = _masks(64, DEV)
    G, pw, P, A, Kexp, W, U, Aqk, Qg, Kg, gamma = _prep_slab(qc, kc, vc, gc, bc, SCALE, incl, strict)
    ref = {"W": W, "Kg": Kg, "sQg": SCALE * Qg, "Aqk": Aqk, "A": A, "U": U, "P": P * strict, "gamma": gamma}
    lower = records.record_lower_blocks(DEV)  # Aqk, A and P: the prep leaves their strictly upper blocks unwritten
    for name in ("Aqk", "A", "P"):
        mine[name] = mine[name].where(lower, 0.0)
    bad = []
    for name in mine:
        e = rel(mine[name], ref[name])
        print(f"stage prep {name}: rel vs torch-fp32 {e:.3e}")
        if not (e <= 1e-2):
            bad.append(name)
    from kda_kcp.chunk import Prep

    pr = Prep(W, U, Aqk, Qg, Kg, gamma)
    doc = cs.gather(do, torch.float32)
    h_ref, _, _ = state_walk(pr, cs.steps, None)
    dh_ref, _, _ = reverse_walk(pr, doc, cs.steps, SCALE, None)
    Vn = U - W @ h_ref
    dVn = Aqk.transpose(-1, -2) @ doc + Kg @ dh_ref
    h, dh = records.hi_states(h), records.scaled_states(dh)
    for name, x, r in (("h", h, h_ref), ("dh", dh, dh_ref), ("V_new", vn, Vn), ("dV_new", dvn, dVn)):
        e = rel(x, r)
        print(f"stage walk {name}: rel vs torch-fp32 {e:.3e}")
        if not (e <= 1e-2):
            bad.append(name)
    assert not bad, f"stages off: {bad}"


@pytest.mark.parametrize("H,total", [(1, 12000), (4, 12000), (16, 8000), (64, 3000)])
def test_grads_match_fp64_oracle(H, total):
    gen = torch.Generator().manual_seed(SEED + H)
    cu = random_docs(total, gen)
    inputs, do = make_inputs(cu[-1], H, gen, gate="mixed" if H != 4 else "uniform")
    plan = local_plan(cu)
    ours = run_bwd(inputs, do, plan)
    torch.cuda.synchronize()
    ref = oracle_grads(inputs, do, cu)
    tb = TorchBackend().bwd_grads(*inputs, do, SCALE, plan)
    errs = {}
    for name, x, r, t in zip(NAMES, ours, ref, tb):
        assert torch.isfinite(x.float()).all(), f"{name}: unwritten or non-finite elements"
        errs[name] = rel(x, r)
        print(f"H={H} T={cu[-1]} {name}: ours vs FP64 {errs[name]:.3e}   torch-fp32 vs FP64 {rel(t, r):.3e}   "
              f"ours vs torch {rel(x, t):.3e}")
    for name in NAMES:
        assert errs[name] <= TOL[name], f"{name} rel-RMS {errs[name]:.3e} > {TOL[name]}"


def test_benchmark_slice():
    """Slices of the benchmark batch's documents (first 2048 tokens of each of the 4), H = 4."""
    gen = torch.Generator().manual_seed(SEED + 7)
    cu = [0, 2048, 4096, 6144, 8192]
    inputs, do = make_inputs(8192, 4, gen, gate="benchmark")
    plan = local_plan(cu)
    ours = run_bwd(inputs, do, plan)
    ref = oracle_grads(inputs, do, cu)
    for name, x, r in zip(NAMES, ours, ref):
        e = rel(x, r)
        print(f"benchmark slice {name} rel-RMS vs FP64 = {e:.3e}")
        assert e <= TOL[name]


@pytest.mark.parametrize("gate", ["benchmark", "edge_in", "edge_out"])
def test_grads_anchorings_match_fp64_oracle(gate):
    """The gradients against the FP64 oracle where the backward prep anchors every chunk at its first row
    (benchmark's gates; edge_in: at the limit) and where it anchors by block just past it (edge_out)."""
    gen = torch.Generator().manual_seed(SEED + 500)
    cu = [0, 1500, 1537, 3000]
    inputs, do = make_inputs(cu[-1], 4, gen, gate)
    ours = run_bwd(inputs, do, local_plan(cu))
    ref = oracle_grads(inputs, do, cu)
    for name, x, r in zip(NAMES, ours, ref):
        e = rel(x, r)
        print(f"gates {gate}: {name} rel-RMS vs FP64 = {e:.3e}")
        assert torch.isfinite(x.float()).all() and e <= TOL[name], name


def test_state_in_and_dstate_out_match_torch_backend():
    """Runs that do not start / end their document (KCP pieces): incoming states and outgoing gradients."""
    gen = torch.Generator().manual_seed(SEED + 13)
    cu = [0, 700, 2000, 2001, 4100]
    T, H = cu[-1], 4
    inputs, do = make_inputs(T, H, gen)
    kp = build_plan(cu, [[(0, 1500)], [(1500, T)]])
    plan = LocalPlan(T - 1500, kp.rank_runs[1])
    sl = [x[1500:].contiguous() for x in inputs]
    dsl = do[1500:].contiguous()
    R = plan.num_runs
    sin = 0.1 * torch.randn(R, H, 128, 128, generator=gen).to(DEV)
    dso = 0.1 * torch.randn(R, H, 128, 128, generator=gen).to(DEV)
    ours = run_bwd(sl, dsl, plan, sin, dso)
    ref = TorchBackend().bwd_grads(*sl, dsl, SCALE, plan, sin, dso)
    for name, x, r in zip(NAMES, ours, ref):
        assert torch.isfinite(x.float()).all(), name
        e = rel(x, r)
        print(f"state_in/dstate_out {name}: ours vs torch-fp32 {e:.3e}")
        assert e <= TOL[name]


def test_segmentations_agree(monkeypatch):
    """Walks split into segments of 1, 3 and 7 chunks (summaries + FP32 fold) against whole runs, with
    incoming states and outgoing gradients."""
    gen = torch.Generator().manual_seed(SEED + 11)
    cu = [0, 3000, 3001, 7000]
    T, H = cu[-1], 4
    inputs, do = make_inputs(T, H, gen)
    R = 3
    sin = 0.1 * torch.randn(R, H, 128, 128, generator=gen).to(DEV)
    dso = 0.1 * torch.randn(R, H, 128, 128, generator=gen).to(DEV)
    outs = {}
    for n in ("0", "1", "3", "7", ""):
        set_tuning(monkeypatch, bwd_seg_chunks=n or None)
        plan = local_plan(cu)
        outs[n] = run_bwd(inputs, do, plan, sin, dso)
    for n in ("1", "3", "7", ""):
        for name, a, b in zip(NAMES, outs[n], outs["0"]):
            assert torch.isfinite(a.float()).all(), (n, name)
            d = rel(a, b)
            print(f"segments of {n or 'auto'} chunk(s) vs whole runs {name}: {d:.2e}")
            assert d <= 1e-3


def _walk_case(seed, seg, monkeypatch):
    """Inputs, do, the plan, incoming states and outgoing state gradients of a ~9000-token batch at H = 4,
    with bwd_seg_chunks = seg ("": the model's choice under the default tuning, then forced, because the model
    prices one stream and two differently and a test that turns the streams off must keep the segments)."""
    gen = torch.Generator().manual_seed(seed)
    cu = random_docs(9000, gen)
    inputs, do = make_inputs(cu[-1], 4, gen)
    plan = local_plan(cu)
    if not seg:
        set_tuning(monkeypatch, bwd_seg_chunks=None, bwd_walk_streams=None)
        seg = str(bwd_tables.seg_tables(plan, 4, DEV).seg_chunks)
    set_tuning(monkeypatch, bwd_seg_chunks=seg)
    R = plan.num_runs
    sin = 0.1 * torch.randn(R, 4, 128, 128, generator=gen).to(DEV)
    dso = 0.1 * torch.randn(R, 4, 128, 128, generator=gen).to(DEV)
    return inputs, do, plan, sin, dso


@pytest.mark.parametrize("seg", ["0", "3", ""])
def test_walks_on_two_streams_bitwise(seg, monkeypatch):
    """The backward's forward and reverse walk chains on two streams (the default) against one stream
    (bwd_walk_streams=0): every gradient bitwise equal, for whole runs, 3-chunk segments (summaries
    and folds on both streams) and the model's choice, with incoming states and outgoing gradients; the
    lean backward (2 passes) too."""
    inputs, do, plan, sin, dso = _walk_case(SEED + 19, seg, monkeypatch)
    set_tuning(monkeypatch, bwd_walk_streams=0)
    one = run_bwd(inputs, do, plan, sin, dso)
    set_tuning(monkeypatch, bwd_walk_streams=1)
    two = run_bwd(inputs, do, plan, sin, dso)
    q, _, _, g, beta = inputs
    poison_like(q, q, q, g, beta)
    lean = cb.bwd_grads(*inputs, do, SCALE, plan, sin, dso, True, passes=2)
    for name, a, b, c in zip(NAMES, two, one, lean):
        assert torch.isfinite(a.float()).all(), name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name}: two streams != one stream"
        assert torch.equal(c.view(torch.uint8), b.view(torch.uint8)), f"{name}: lean (2 passes) != one stream"
    print(f"walks on two streams (segments {seg or 'auto'}): bitwise equal to one stream and to the lean path")


@pytest.mark.parametrize("seg", ["0", "3"])
def test_walk_widths_bitwise(seg, monkeypatch):
    """Walk and summary CTAs of 4 warps (64 state columns) and of 8 (128) do the same per-warp work: every
    gradient and the KCP run summaries bitwise equal under bwd_walk_warps = 4, 8 and the automatic choice,
    for whole runs and 3-chunk segments (summaries and folds), with incoming states and outgoing gradients."""
    inputs, do, plan, sin, dso = _walk_case(SEED + 23, seg, monkeypatch)
    R = plan.num_runs
    out = {}
    for w in ("4", "8", "auto"):
        set_tuning(monkeypatch, bwd_walk_warps=None if w == "auto" else w)
        out[w] = (*run_bwd(inputs, do, plan, sin, dso), *cb.bwd_summaries(*inputs, do, SCALE, plan, list(range(R))))
    for w in ("8", "auto"):
        for name, a, b in zip((*NAMES, "Mt", "F"), out[w], out["4"]):
            assert torch.isfinite(a.float()).all(), (w, name)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name}: {w} walk warps != 4"
    print(f"walk widths 4, 8, auto (segments {seg}): bitwise equal")


def test_walk_groups_bitwise(monkeypatch):
    """The pipelined backward with its runs in 2, 3 and 4 walk groups (bwd_walk_groups; each group's
    gradients on its own stream once its walks end) against the unpipelined one (bwd_pipeline=0): every
    gradient bitwise equal, whole-run walks of five documents of unlike lengths, with incoming states and
    outgoing gradients."""
    gen = torch.Generator().manual_seed(SEED + 29)
    cu = [0, 250, 850, 1950, 4250, 8750]  # 4, 10, 18, 36 and 71 chunks
    inputs, do = make_inputs(cu[-1], 4, gen)
    set_tuning(monkeypatch, bwd_seg_chunks=0)
    plan = local_plan(cu)
    sin = 0.1 * torch.randn(5, 4, 128, 128, generator=gen).to(DEV)
    dso = 0.1 * torch.randn(5, 4, 128, 128, generator=gen).to(DEV)
    set_tuning(monkeypatch, bwd_pipeline=0)
    plain = run_bwd(inputs, do, plan, sin, dso)
    set_tuning(monkeypatch, bwd_pipeline=1)
    for cap in ("2", "3", "4"):
        set_tuning(monkeypatch, bwd_walk_groups=cap)
        assert len(bwd_tables.walk_groups(plan, 4, DEV)) == int(cap)
        got = run_bwd(inputs, do, plan, sin, dso)
        for name, a, b in zip(NAMES, got, plain):
            assert torch.isfinite(a.float()).all(), (cap, name)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name}: {cap} walk groups != unpipelined"
    print("walk groups 2, 3, 4: bitwise equal to the unpipelined backward")


def test_split_walks_bitwise(monkeypatch):
    """Whole-run walks in pieces (bwd_walk_pieces 4 and 7 and the automatic choice; the walk chains on
    high-priority streams, each block's gradients on a stream of its own once both walks have passed it) against the
    unpipelined backward (bwd_pipeline=0): every gradient bitwise equal, for five documents of unlike lengths
    in 4 walk groups and for one document alone, with incoming states and outgoing gradients."""
    gen = torch.Generator().manual_seed(SEED + 37)
    set_tuning(monkeypatch, bwd_seg_chunks=0, bwd_walk_groups=None)
    for cu in ([0, 250, 850, 1950, 4250, 8750], [0, 6000]):
        inputs, do = make_inputs(cu[-1], 4, gen)
        plan = local_plan(cu)
        R = plan.num_runs
        sin = 0.1 * torch.randn(R, 4, 128, 128, generator=gen).to(DEV)
        dso = 0.1 * torch.randn(R, 4, 128, 128, generator=gen).to(DEV)
        set_tuning(monkeypatch, bwd_pipeline=0)
        plain = run_bwd(inputs, do, plan, sin, dso)
        set_tuning(monkeypatch, bwd_pipeline=1)
        for pieces in ("4", "7", ""):
            set_tuning(monkeypatch, bwd_walk_pieces=pieces or None)
            groups = bwd_tables.walk_groups(plan, 4, DEV)
            assert max(grp.pieces for grp in groups) == int(pieces or tuning.WALK_PIECES)
            got = run_bwd(inputs, do, plan, sin, dso)
            for name, a, b in zip(NAMES, got, plain):
                assert torch.isfinite(a.float()).all(), (pieces, name)
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name}: {pieces} pieces != unpipelined"
    print("split walks (4, 7 pieces, auto): bitwise equal to the unpipelined backward")


def test_segment_halves_bitwise(monkeypatch):
    """Segmented walks (3-chunk segments, summaries and folds both ways) pipelined in two halves of the chunk table,
    each half's gradients once its walks end, against the unpipelined backward (bwd_pipeline=0): every
    gradient bitwise equal, with incoming states and outgoing gradients."""
    inputs, do, plan, sin, dso = _walk_case(SEED + 31, "3", monkeypatch)
    assert len(bwd_tables.walk_groups(plan, 4, DEV)) == 2
    set_tuning(monkeypatch, bwd_pipeline=0)
    plain = run_bwd(inputs, do, plan, sin, dso)
    set_tuning(monkeypatch, bwd_pipeline=1)
    got = run_bwd(inputs, do, plan, sin, dso)
    for name, a, b in zip(NAMES, got, plain):
        assert torch.isfinite(a.float()).all(), name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name}: segment halves != unpipelined"
    print("segmented walks in two halves: bitwise equal to the unpipelined backward")


@pytest.mark.parametrize("seg", ["0", "5"])  # whole runs; 5-chunk segments composed (runs of 15 and 32 chunks)
def test_summaries_match_torch_backend(seg, monkeypatch):
    set_tuning(monkeypatch, bwd_summary_chunks=seg)
    gen = torch.Generator().manual_seed(SEED + 17)
    cu = [0, 900, 1000, 3000]
    T, H = cu[-1], 4
    inputs, do = make_inputs(T, H, gen)
    plan = local_plan(cu)
    run_ids = [0, 2]
    Mt, F = cb.bwd_summaries(*inputs, do, SCALE, plan, run_ids)
    Mt_r, F_r = TorchBackend().bwd_summaries(*inputs, do, SCALE, plan, run_ids)
    em, ef = rel(Mt, Mt_r), rel(F, F_r)
    print(f"summaries (segments of {seg}): Mt rel-RMS vs torch-fp32 {em:.3e}, F {ef:.3e}")
    assert torch.isfinite(Mt).all() and torch.isfinite(F).all()
    assert em <= 5e-3 and ef <= 5e-3


def _scaled_alike(got, ref, f, what):
    """got == ref * f[name] for powers of two f: the bf16 gradients bit for bit; dg (FP32) within FP32 rounding,
    since a few of its elements do not scale exactly (on the H200: 80-2,600 of 512,000
    elements differ, by at most 2.4e-6 of dg's RMS, under dO times 2^-20 .. 2^12; bf16 rounding hides the like
    in dbeta; with the gates clamped at -1 per token it scales bit for bit: FP32 subnormals, most likely in the
    anchored pairwise products, whose factors reach e^-75)."""
    for name, x, r in zip(NAMES, got, ref):
        a, b = x.float(), r.float() * f[name]
        if name == "dg":
            d = ((a - b).abs().max() / b.pow(2).mean().sqrt()).item()
            assert d <= 1e-5, f"{what}: dg is not dg times {f[name]} within FP32 rounding ({d:.2e} of its RMS)"
        else:
            assert torch.equal(a, b), f"{what}: {name} is not {name} times {f[name]}"


@pytest.mark.parametrize("seg", ["0", "3"])  # whole runs; 3-chunk segments (summaries and folds scale too)
def test_scale_of_v_and_do(seg, monkeypatch):
    """The backward is linear in dO (and in the outgoing state gradient) and, but for dv, in v (and the incoming
    states): scaled by a power of two they scale the gradients alike (dv unchanged under v's scale); and the
    gradients stay within the oracle bounds (against the FP64 torch backend) for dO of RMS 1e-8 (a mean loss over
    many tokens) and v of RMS 1e-6 and 1e4. A guard for any narrower operand type in the backward's products
    (fp16's normal range is 6e-5 .. 65504)."""
    set_tuning(monkeypatch, bwd_seg_chunks=seg)
    gen = torch.Generator().manual_seed(SEED + 23)
    cu = [0, 700, 701, 2000]
    inputs, do = make_inputs(cu[-1], 2, gen)
    q, k, v, g, beta = inputs
    plan = local_plan(cu)
    s0 = (0.5 * torch.randn(3, 2, 128, 128, generator=gen)).to(DEV)
    ds = (0.5 * torch.randn(3, 2, 128, 128, generator=gen)).to(DEV)
    ref = run_bwd(inputs, do, plan, s0, ds)
    for p in (-20, 12):
        f = dict.fromkeys(NAMES, 2.0**p)
        _scaled_alike(run_bwd(inputs, do * 2.0**p, plan, s0, ds * 2.0**p), ref, f, f"dO times 2^{p}")
        f["dv"] = 1.0
        _scaled_alike(run_bwd((q, k, v * 2.0**p, g, beta), do, plan, s0 * 2.0**p, ds), ref, f, f"v times 2^{p}")
    cases = ((v, s0, do.double() * 1e-8, ds * 1e-8, "dO times 1e-8"),
             (v.double() * 1e-6, s0 * 1e-6, do, ds, "v and S_in times 1e-6"),
             (v.double() * 1e4, s0 * 1e4, do, ds, "v and S_in times 1e4"))
    for vf, sf, dof, dsf, what in cases:
        vf, dof = vf.bfloat16(), dof.bfloat16()
        got = run_bwd((q, k, vf, g, beta), dof, plan, sf, dsf)
        want = TorchBackend().bwd_grads(*(x.double() for x in (q, k, vf, g, beta)), dof.double(), SCALE, plan,
                                        sf.double(), dsf.double())
        for name, x, r in zip(NAMES, got, want):
            err = rel(x, r)
            print(f"segments of {seg}: {what}: {name} rel-RMS vs the FP64 torch backend {err:.2e}")
            assert err <= TOL[name], (what, name)


def test_deterministic_bitwise_over_5_calls_and_nondet_close():
    gen = torch.Generator().manual_seed(1234)
    cu = [0, 5000, 5001, 9000]
    inputs, do = make_inputs(9000, 4, gen)
    plan = local_plan(cu)
    outs = [run_bwd(inputs, do, plan) for _ in range(5)]
    for o in outs[1:]:
        for a, b in zip(o, outs[0]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    nd = run_bwd(inputs, do, plan, deterministic=False)
    for name, a, b in zip(NAMES, nd, outs[0]):
        e = rel(a, b)
        print(f"nondet vs det {name}: {e:.2e}")
        assert e <= 1e-4


def test_sixteen_warp_gradient_kernel(monkeypatch):
    """The 16-warp gradient kernel (the default: half the accumulator registers per thread, twice the warps
    per SM) against the 8-warp one (bwd_grads_warps=8): dq, dk, dv bitwise equal (each element is
    accumulated in the same order); dg and dbeta within FP32 reassociation (their row and column partial
    sums are grouped differently: dg, an FP32 output, within 1e-5; dbeta, a bf16 output, element by element
    within one bf16 step plus the FP32 regrouping noise of cancelling terms); bitwise repeatable; within the FP64 tolerances."""
    gen = torch.Generator().manual_seed(SEED + 600)
    cu = random_docs(9000, gen)
    inputs, do = make_inputs(cu[-1], 4, gen)
    plan = local_plan(cu)
    set_tuning(monkeypatch, bwd_grads_warps=8)
    ref = run_bwd(inputs, do, plan)
    set_tuning(monkeypatch, bwd_grads_warps=16)
    got = run_bwd(inputs, do, plan)
    again = run_bwd(inputs, do, plan)
    oracle = oracle_grads(inputs, do, cu)
    for name, x, x2, r, o64 in zip(NAMES, got, again, ref, oracle):
        e8, e64 = rel(x, r), rel(x, o64)
        print(f"16 warps {name}: vs 8 warps {e8:.2e}, vs FP64 {e64:.2e}")
        assert torch.equal(x, x2), name
        assert e64 <= TOL[name], name
        if name in ("dq", "dk", "dv"):
            assert torch.equal(x, r), name
        elif name == "dbeta":
            # FP32 regrouping moves a sum by ~2^-24 of its terms' magnitudes, which is one bf16 step of the
            # result unless the terms cancel: there it is absolute, bounded here by 1e-5 of dbeta's RMS
            # (terms up to ~100x the RMS). Beyond that an element differs by at most one bf16 step.
            assert x.dtype == torch.bfloat16
            xf, rf = x.float(), r.float()
            step = torch.maximum(xf.abs(), rf.abs()) * 2.0**-7  # >= one bf16 step at that magnitude
            noise = 1e-5 * rf.pow(2).mean().sqrt()
            excess = (xf - rf).abs() - step - noise
            i = int(excess.argmax())
            print(f"dbeta worst: 16 warps {xf.flatten()[i]:.6e}, 8 warps {rf.flatten()[i]:.6e}, RMS {noise / 1e-5:.3e}")
            assert bool((excess <= 0).all()), name
        else:
            assert e8 <= 1e-5, name
