"""GPU tests of the CUDA forward (kda_kcp.cuda). Each skips, with its reason, without an sm_90+ GPU.

Inputs are drawn fresh each run (seed printed), never zeros; outputs are poisoned with NaN before each call.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kda_kcp.plan import LocalPlan, build_plan
from kda_kcp.reference import naive_kda

from gpu_common import DEV, fresh_seed, local_plan, make_inputs, random_docs, rel, require_kernel_gpu, run_fwd

require_kernel_gpu("the CUDA forward tests")

from kda_kcp.cuda import CudaBackend  # noqa: E402
from kda_kcp.torch_backend import TorchBackend  # noqa: E402


@pytest.fixture(autouse=True)
def fused_forward(monkeypatch):
    """These tests cover the fused v3 forward (tests/gpu/test_fwd_staged.py covers the default, v4)."""
    monkeypatch.setenv("KDA_KCP_FWD_KERNEL", "fused")

SEED = fresh_seed("test_fwd_cuda")


@pytest.mark.parametrize("H,total", [(1, 12000), (4, 12000), (16, 8000), (64, 4000)])
def test_fwd_matches_fp64_oracle(H, total):
    gen = torch.Generator().manual_seed(SEED + H)
    cu = random_docs(total, gen)
    inputs = make_inputs(cu[-1], H, gen, gate="mixed" if H != 4 else "uniform")
    plan = local_plan(cu)
    scale = 128**-0.5
    o = run_fwd(CudaBackend(), inputs, scale, plan)
    torch.cuda.synchronize()
    assert torch.isfinite(o.float()).all(), "unwritten or non-finite output"
    ref = naive_kda(*inputs, cu, scale=scale)
    err = rel(o, ref)
    print(f"H={H} T={cu[-1]} docs={len(cu) - 1} o rel-RMS vs FP64 = {err:.3e}")
    assert err <= 4e-3


def test_fwd_benchmark_slice():
    """Slices of the benchmark batch's documents (first 2048 tokens of each of the 4), H = 4."""
    gen = torch.Generator().manual_seed(SEED + 7)
    cu = [0, 2048, 4096, 6144, 8192]
    inputs = make_inputs(8192, 4, gen)
    plan = local_plan(cu)
    o = run_fwd(CudaBackend(), inputs, 128**-0.5, plan)
    ref = naive_kda(*inputs, cu)
    err = rel(o, ref)
    print(f"benchmark slice o rel-RMS vs FP64 = {err:.3e}")
    assert err <= 4e-3


def test_segmentations_agree(monkeypatch):
    """Segments of 1 chunk, 3 chunks and whole runs (summaries + fold vs a plain walk)."""
    gen = torch.Generator().manual_seed(SEED + 11)
    cu = [0, 3000, 3001, 7000]
    inputs = make_inputs(7000, 4, gen, gate="mixed")
    plan_args = cu
    outs = {}
    for n in ("1", "3", "100000"):
        monkeypatch.setenv("KDA_KCP_SEG_CHUNKS", n)
        outs[n] = run_fwd(CudaBackend(), inputs, 128**-0.5, local_plan(plan_args))
    for n in ("1", "3"):
        d = rel(outs[n], outs["100000"])
        print(f"segments of {n} chunk(s) vs unsplit: {d:.2e}")
        assert d <= 1e-3


def test_bitwise_repeat_and_two_processes(tmp_path):
    gen = torch.Generator().manual_seed(1234)
    cu = [0, 5000, 5001, 9000]
    inputs = make_inputs(9000, 4, gen)
    plan = local_plan(cu)
    be = CudaBackend()
    outs = [run_fwd(be, inputs, 128**-0.5, plan) for _ in range(3)]
    for o in outs[1:]:
        assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16))
    digest = hashlib.sha256(outs[0].cpu().view(torch.int16).numpy().tobytes()).hexdigest()
    script = textwrap.dedent(
        f"""
        import hashlib, torch, sys
        sys.path.insert(0, {os.getcwd()!r})
        from tests.gpu.gpu_common import make_inputs, local_plan
        from kda_kcp.cuda import CudaBackend
        gen = torch.Generator().manual_seed(1234)
        inputs = make_inputs(9000, 4, gen)
        o = CudaBackend().fwd_output(*inputs, 128 ** -0.5, local_plan([0, 5000, 5001, 9000]))
        print(hashlib.sha256(o.cpu().view(torch.int16).numpy().tobytes()).hexdigest())
        """
    )
    env = dict(os.environ, KDA_TEST_SEED="1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == digest


def _fold(M, E, sources, H):
    S = torch.zeros(H, 128, 128, dtype=torch.float64, device=DEV)
    for m, e in sources:
        S = m.double() @ S + e.double()
    return S.float()


@pytest.mark.parametrize("gate", ["uniform", "mixed"])
@pytest.mark.parametrize("W", [2, 3])
def test_kcp_pieces_on_one_gpu(W, gate):
    """Split the batch into W contiguous pieces, publish summaries, fold, re-run: o matches unsplit.

    Pieces move the chunk grid (chunks restart at every piece), so the two runs round differently; the
    'mixed' gates (a quarter of the channels decaying by < 2 % per token) make that rounding visible."""
    gen = torch.Generator().manual_seed(SEED + 100 + W)
    cu = [0, 1500, 1501, 6000, 6100]
    T = cu[-1]
    H = 4
    inputs = make_inputs(T, H, gen, gate=gate)
    scale = 128**-0.5
    be, tb = CudaBackend(), TorchBackend()
    ref = run_fwd(be, inputs, scale, local_plan(cu))
    bounds = [round(T * i / W) for i in range(W + 1)]
    parts = [[(bounds[i], bounds[i + 1])] for i in range(W)]
    kp = build_plan(cu, parts)
    for name, backend in (("cuda", be), ("torch", tb)):
        published = []
        for w in range(W):
            s, e = bounds[w], bounds[w + 1]
            loc = [x[s:e].contiguous() for x in inputs]
            plan = LocalPlan(e - s, kp.rank_runs[w])
            M, E = backend.fwd_summaries(*loc, scale, plan, kp.fwd_publish[w])
            published.append((M, E))
        outs = []
        for w in range(W):
            s, e = bounds[w], bounds[w + 1]
            loc = [x[s:e].contiguous() for x in inputs]
            plan = LocalPlan(e - s, kp.rank_runs[w])
            states = []
            for srcs in kp.fwd_sources[w]:
                states.append(_fold(None, None, [(published[r][0][i], published[r][1][i]) for r, i in srcs], H))
            state_in = torch.stack(states) if states else None
            if name == "cuda":
                outs.append(run_fwd(backend, loc, scale, plan, state_in))
            else:
                outs.append(backend.fwd_output(*loc, scale, plan, state_in))
        o = torch.cat(outs)
        d = rel(o, ref)
        print(f"W={W} gates={gate} {name} pieces vs unsplit cuda: {d:.2e}")
        assert d <= 1e-3 if name == "cuda" else d <= 4e-3


def test_summaries_match_torch_backend():
    gen = torch.Generator().manual_seed(SEED + 200)
    cu = [0, 700, 701, 4000]
    inputs = make_inputs(4000, 4, gen, gate="mixed")
    plan = local_plan(cu)
    runs = (0, 1, 2)
    M, E = CudaBackend().fwd_summaries(*inputs, 128**-0.5, plan, runs)
    Mt, Et = TorchBackend().fwd_summaries(*inputs, 128**-0.5, plan, runs)
    em, ee = rel(M, Mt.float()), rel(E, Et.float())
    print(f"summaries vs torch backend: M {em:.2e}  E {ee:.2e}")
    assert torch.isfinite(M).all() and torch.isfinite(E).all()
    assert em <= 4e-3 and ee <= 4e-3


def test_state_in_matches_torch_backend():
    gen = torch.Generator().manual_seed(SEED + 300)
    cu = [0, 2000, 2100, 5000]
    H = 4
    inputs = make_inputs(5000, H, gen)
    plan = local_plan(cu)
    state_in = 0.1 * torch.randn(plan.num_runs, H, 128, 128, device=DEV)
    o = run_fwd(CudaBackend(), inputs, 128**-0.5, plan, state_in)
    ot = TorchBackend().fwd_output(*inputs, 128**-0.5, plan, state_in)
    d = rel(o, ot)
    print(f"with state_in vs torch backend: {d:.2e}")
    assert d <= 4e-3


def test_jit_second_process_does_not_rebuild(tmp_path):
    env = dict(os.environ, KDA_KCP_FORCE_JIT="1", KDA_KCP_CACHE_DIR=str(tmp_path))
    code = (
        "import time, torch; t=time.time(); from kda_kcp.jit import load_program, program_path, arch_of_device; "
        "load_program('kda_fwd'); p = program_path('kda_fwd', arch_of_device()); "
        "import os; print(p, os.path.getmtime(p), round(time.time()-t, 1))"
    )
    r1 = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r2.returncode == 0, r2.stderr[-3000:]
    p1, m1, t1 = r1.stdout.split()[-3:]
    p2, m2, t2 = r2.stdout.split()[-3:]
    print(f"jit: first process {t1} s, second {t2} s")
    assert p1 == p2 and m1 == m2
