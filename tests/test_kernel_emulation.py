"""The CUDA kernels (csrc/kda_bwd.cu, csrc/kda_fwd.cu, csrc/kda_affine_merge.cuh, unchanged) run on the
CPU: compiled with g++ against an emulation of the CUDA pieces they use (tests/emulation/: one OS thread
per CUDA thread, ldmatrix, mma.m16n8k16 and cp.async with their PTX semantics), so that indexing, tiling
and synchronization mistakes fail CI instead of a device call. The emulated mma sums in FP64, so results
are compared with the torch backend or the FP64 oracle within tolerances, not bitwise with a GPU.

Checked: the backward's prep records, h and dh of the walks, their V_new and dV_new, and the four
segment summaries against the torch walks; the gradient kernel at 16 warps (the default) and 8 warps
against the torch backward; and the whole CUDA path (kda_kcp.cuda's wrappers: plans, tables, segmented
walks, folds, the workspace arena, the lean backward) with the emulated kernels standing for the loaded
programs, against the FP64 oracle, at W = 1 and at W = 2 over gloo (every layout), with and without initial and
final states. About ten minutes on two cores."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import kda_kcp
from kda_kcp.reference import naive_merge
import kda_kcp.backend
import kda_kcp.function as function
import kda_kcp.sizing as sizing
from kda_kcp.arena import Arena
from kda_kcp.chunk import Prep, _masks, _prep_slab
from kda_kcp.cuda import CudaBackend, forward
from kda_kcp.cuda import backward as cb
from kda_kcp.cuda import bwd_layout, bwd_streams, bwd_tables
from kda_kcp.plan import LocalPlan, build_plan
from kda_kcp.reference import naive_kda
from kda_kcp.torch_backend import TorchBackend, _chunk_set
from kda_kcp.walk import reverse_walk, state_walk
import records
from helpers import gather_global, run_distributed, set_tuning

ROOT = Path(__file__).resolve().parents[1]
EMU = Path(__file__).resolve().parent / "emulation"
SCALE = 128 ** -0.5
NAMES = ("dq", "dk", "dv", "dg", "dbeta")
TOL = {"dq": 6e-3, "dk": 6e-3, "dv": 6e-3, "dg": 1e-2, "dbeta": 1e-2}  # docs/design.md §10's gradient bounds

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the CPU emulation")]


def _emulated(src: str) -> str:
    """Kernel source with its dynamic shared memory and launches mapped onto the emulation."""
    s = src.replace("extern __shared__ __align__(128) char smem[];", "char* smem = g_smem;")
    return re.sub(r"([\w:]+(?:<[\w, ]+>)?)<<<(.*?)>>>\((\w+)\);", r"emu_launch(\1, \2, \3);", s)


def _build(out: Path, defines: tuple[str, ...] = ()) -> Path:
    """csrc/kda_bwd.cu, csrc/kda_fwd.cu and the affine merge, unchanged but for _emulated, in one library."""
    inc = out / "inc"
    inc.mkdir()
    for f in ("cuda_runtime.h", "cuda_bf16.h", "cuda_fp16.h", "kda_common.cuh", "kda_pipeline.cuh"):
        shutil.copy(EMU / f, inc / f)
    # their "kda_common.cuh" and "kda_pipeline.cuh" are then the emulated ones
    for f in ("kda_state_tile.cuh", "kda_chunk_prep.cuh", "kda_tile_copy.cuh", "kda_tile_ring.cuh"):
        shutil.copy(ROOT / "csrc" / f, inc / f)
    (inc / "kda_affine_merge.cuh").write_text(_emulated((ROOT / "csrc" / "kda_affine_merge.cuh").read_text()))
    units = []
    for name in ("kda_bwd", "kda_fwd"):
        units.append(out / f"{name}_emu.cpp")
        units[-1].write_text(_emulated((ROOT / "csrc" / f"{name}.cu").read_text()))
    lib = out / "libkda_emu.so"
    subprocess.run(["g++", "-std=c++20", "-O2", "-pthread", "-fPIC", "-shared", f"-I{inc}", f"-I{ROOT / 'csrc'}",
                    # an experiment's compile-time variant, as scripts/build_prebuilt.py --define builds it
                    *os.environ.get("KDA_EMU_DEFINES", "").split(),
                    *defines,
                    "-x", "c++", *map(str, units), str(EMU / "driver.cpp"), "-o", str(lib)], check=True)
    return lib


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return ctypes.CDLL(str(_build(tmp_path_factory.mktemp("kda_emu"))))


@pytest.fixture(scope="module")
def emu_mma(tmp_path_factory):
    """The same kernels built as for an arch without wgmma (sm_100a / sm_103a): the walks' products on mma.sync."""
    return ctypes.CDLL(str(_build(tmp_path_factory.mktemp("kda_emu_mma"), ("-DKDA_HAS_WGMMA=0",))))


@pytest.fixture(scope="module")
def emu_eager(tmp_path_factory):
    """The same kernels with every cp.async landing at its issue as well as at its wait."""
    return ctypes.CDLL(str(_build(tmp_path_factory.mktemp("kda_emu_eager"), ("-DKDA_EMU_CP_ASYNC_EAGER",))))


def _p(t):
    return ctypes.c_void_p(t.data_ptr() if t is not None and t.numel() else 0)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _case(cu, H, seed, steep_docs=()):
    """A packed batch of the documents ``cu`` with the benchmark's gates (whose chunks the prep anchors at their
    first row: kda_chunk_prep.cuh kOneAnchor), but in the documents ``steep_docs``: gates uniform in (-5, 0), whose
    chunks it anchors by 16-row block."""
    T = cu[-1]
    plan = LocalPlan(T, build_plan(cu, [[(0, T)]]).rank_runs[0])
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, H, 128, generator=gen), dim=-1).bfloat16()
    k = F.normalize(torch.randn(T, H, 128, generator=gen), dim=-1).bfloat16()
    v = torch.randn(T, H, 128, generator=gen).bfloat16()
    g = F.logsigmoid(2 + 1.5 * torch.randn(T, H, 128, generator=gen)).clamp(-5, -1e-6)  # the benchmark's gates
    # a quarter of the channels decay slowly (gamma ~ 0.5 per chunk), so states carry across chunks and
    # segments: with fast gates alone a wrong decay or a wrong state hand-over would go unseen
    slow = torch.rand(1, H, 128, generator=gen) < 0.25
    g = torch.where(slow, -0.02 * torch.rand(T, H, 128, generator=gen) - 1e-6, g)
    for d in steep_docs:
        g[cu[d]:cu[d + 1]] = -5 * torch.rand(cu[d + 1] - cu[d], H, 128, generator=gen).clamp_min(1e-6)
    beta = (0.05 + 0.9 * torch.rand(T, H, generator=gen)).bfloat16()
    do = torch.randn(T, H, 128, generator=gen).bfloat16()
    R = plan.num_runs
    sin = 0.1 * torch.randn(R, H, 128, 128, generator=gen)
    dso = 0.1 * torch.randn(R, H, 128, 128, generator=gen)
    return plan, (q, k, v, g, beta), do, sin, dso


def _prep(emu, plan, inputs):
    q, k, v, g, beta = inputs
    H = q.shape[1]
    chunks, runs = bwd_tables.chunk_tables(plan, "cpu")
    nc = chunks.shape[0]
    prep = torch.full((nc * H * bwd_layout.PREP_BYTES,), 255, dtype=torch.uint8)
    assert emu.e_prep(*map(_p, (q, k, v, g, beta, chunks)), nc, H, ctypes.c_float(SCALE), _p(prep), None) == 0
    return chunks, runs, prep


_PROBE = r"""
#include <cuda_runtime.h>
#include "kda_common.cuh"
using namespace kda;
struct ProbeArgs { const float* src; float* out; };
// thread 0 copies src[0:4] and src[4:8] into shared memory as two cp.async groups and reads the first word of
// each before any wait, after wait_group 1 and after wait_all
__global__ void probe_kernel(const ProbeArgs a) {
  extern __shared__ __align__(128) char smem[];
  float* s = reinterpret_cast<float*>(smem);
  if (threadIdx.x == 0) {
    for (int i = 0; i < 8; ++i) s[i] = -1.f;
    cp_async16(s, a.src, true);
    cp_async_commit();
    cp_async16(s + 4, a.src + 4, true);
    cp_async_commit();
    a.out[0] = s[0]; a.out[1] = s[4];
    cp_async_wait1();
    a.out[2] = s[0]; a.out[3] = s[4];
    cp_async_wait_all();
    a.out[4] = s[0]; a.out[5] = s[4];
  }
}
extern "C" int e_probe(const float* src, float* out) {
  ProbeArgs a{src, out};
  probe_kernel<<<dim3(1), 32, 64, nullptr>>>(a);
  return 0;
}
"""


def test_emulated_cp_async_lands_at_its_wait(tmp_path):
    """The emulation's cp.async (tests/emulation/kda_common.cuh) keeps PTX's ordering, so a kernel that reads a
    tile before waiting for it reads stale shared memory here as on the GPU: nothing lands before a wait,
    wait_group 1 lands all but the newest group, wait_all lands the rest."""
    inc = tmp_path / "inc"
    inc.mkdir()
    for f in ("cuda_runtime.h", "cuda_bf16.h", "cuda_fp16.h", "kda_common.cuh"):
        shutil.copy(EMU / f, inc / f)
    src = tmp_path / "probe.cpp"
    src.write_text(_emulated(_PROBE))
    lib = tmp_path / "libprobe.so"
    subprocess.run(["g++", "-std=c++20", "-O2", "-pthread", "-fPIC", "-shared", f"-I{inc}", "-x", "c++", str(src),
                    "-o", str(lib)], check=True)
    probe = ctypes.CDLL(str(lib))
    data = torch.arange(1, 9, dtype=torch.float32)
    out = torch.zeros(6)
    assert probe.e_probe(_p(data), _p(out)) == 0
    assert out.tolist() == [-1.0, -1.0, 1.0, -1.0, 1.0, 5.0]


def test_records_walks_and_summaries(emu):
    """Records vs the torch prep; h, dh (with incoming states), the walks' V_new and dV_new, and the
    summaries M, E, M^T, F vs the torch walks, from walk CTAs of 8 and of 4 warps (bitwise equal)."""
    plan, inputs, do, sin, dso = _case([0, 70, 230], 2, 5)
    H, R = 2, plan.num_runs
    chunks, runs, prep = _prep(emu, plan, inputs)
    nc = chunks.shape[0]
    cs = _chunk_set(plan, range(R), "cpu")
    qc, kc, vc, gc = (cs.gather(x, torch.float32) for x in inputs[:4])
    bc = cs.gather(inputs[4].unsqueeze(-1), torch.float32).squeeze(-1)
    incl, strict = _masks(64, "cpu")
    G, pw, P, A, Kexp, W, U, Aqk, Qg, Kg, gamma = _prep_slab(qc, kc, vc, gc, bc, SCALE, incl, strict)
    rec = prep.view(nc, H, bwd_layout.PREP_BYTES)

    def field(off, nbytes, dtype, shape):
        return rec[:, :, off:off + nbytes].contiguous().view(dtype).reshape(nc, H, *shape).float()

    mine = {"W": field(0, 16384, torch.bfloat16, (64, 128)), "Kg": field(16384, 16384, torch.bfloat16, (64, 128)),
            "U": records.record_u(rec), "gamma": field(131072, 512, torch.float32, (128,)),
            # A hi (the record holds no lo: kda_bwd.h); the upper blocks are not written (still the 0xFF poison)
            "A": field(65536, 8192, torch.bfloat16, (64, 64)).where(records.record_lower_blocks(), 0.0)}
    ref = {"W": W, "Kg": Kg, "U": U, "gamma": gamma, "A": A}
    for name in mine:
        e = _rel(mine[name], ref[name])
        print(f"emulated prep {name}: vs torch {e:.2e}")
        assert e <= 1e-2, name
    pr = Prep(W, U, Aqk, Qg, Kg, gamma)
    doc = cs.gather(do, torch.float32)
    h_ref, _, _ = state_walk(pr, cs.steps, sin)
    dh_ref, _, _ = reverse_walk(pr, doc, cs.steps, SCALE, dso)
    _, e_ref, m_ref = state_walk(pr, cs.steps, None, summary=True)  # each run's map from a zero start
    _, f_ref, mt_ref = reverse_walk(pr, doc, cs.steps, SCALE, None, summary=True)
    vn_ref = U - W @ h_ref
    dvn_ref = Aqk.transpose(-1, -2) @ doc + Kg @ dh_ref
    outs = {}
    for warps in (8, 4):  # the two CTA widths of the walks: the same per-warp work, so the same bits
        outs[warps] = _walk_outputs(emu, plan, inputs, do, sin, dso, warps)
        for name, r in (("h", h_ref), ("dh", dh_ref), ("M", m_ref), ("E", e_ref), ("Mt", mt_ref), ("F", f_ref),
                        ("V_new", vn_ref), ("dV_new", dvn_ref)):
            x = outs[warps][name]
            err = _rel(x, r)
            print(f"emulated {warps}-warp walk {name}: vs torch {err:.2e}")
            assert torch.isfinite(x).all() and err <= 1e-2, (warps, name)
    for name in outs[8]:
        assert torch.equal(outs[8][name], outs[4][name]), f"{name}: 8-warp and 4-warp walks differ"


def _walk_outputs(lib, plan, inputs, do, sin, dso, warps):
    """h, dh, the summaries M, E, M^T, F and the walks' V_new, dV_new of the backward's walks (CTAs of ``warps``
    warps) on fresh records of ``lib``."""
    H, R = inputs[0].shape[1], plan.num_runs
    chunks, runs, prep = _prep(lib, plan, inputs)
    nc = chunks.shape[0]
    rec = prep.view(nc, H, bwd_layout.PREP_BYTES)
    # the summaries first: the forward walk writes V_new over U (the library's order too)
    m, e, mt, f = (torch.full((R, H, 128, 128), float("nan")) for _ in range(4))
    assert lib.e_fwd_summary(_p(prep), _p(chunks), nc, _p(runs), R, H, _p(m), _p(e), warps) == 0
    assert lib.e_rev_summary(_p(do), _p(prep), _p(chunks), nc, _p(runs), R, H, _p(mt), _p(f), warps) == 0
    h = torch.full(bwd_layout.hi_state_shape(nc, H), float("nan"), dtype=torch.bfloat16)
    dh = torch.full(bwd_layout.scaled_state_shape(nc, H), 255, dtype=torch.uint8)  # NaN words and powers
    assert lib.e_fwd_walk(_p(prep), _p(chunks), nc, _p(runs), R, H, _p(sin), None, None, _p(h), warps) == 0
    assert lib.e_rev_walk(_p(do), _p(prep), _p(chunks), nc, _p(runs), R, H, _p(dso), None, None, _p(dh), warps) == 0
    vn, dvn = (records.walk_tiles(rec, off) for off in (records.REC_VN, records.REC_DVN))
    return {"h": records.hi_states(h), "dh": records.scaled_states(dh), "M": m, "E": e, "Mt": mt, "F": f, "V_new": vn,
            "dV_new": dvn}


def test_walks_on_mma_sync_equal_wgmma(emu, emu_mma):
    """The backward's walks and summaries built without wgmma (the sm_100a / sm_103a kernels, whose mma.sync path no
    GPU here runs) give the bits of the wgmma build (the sm_90a kernels): the same products in the same order, the
    emulated tensor cores summing each k16 step in FP64 alike. (On the H200 the two forms also agree bit for bit.)"""
    plan, inputs, do, sin, dso = _case([0, 70, 230], 2, 5)
    for warps in (8, 4):
        a = _walk_outputs(emu, plan, inputs, do, sin, dso, warps)
        b = _walk_outputs(emu_mma, plan, inputs, do, sin, dso, warps)
        for name in a:
            assert torch.isfinite(a[name]).all(), (warps, name)
            assert torch.equal(a[name], b[name]), f"{warps}-warp {name}: mma.sync and wgmma walks differ"


def _walked(lib, plan, inputs, do):
    """``lib``'s records and walks for the gradient kernel: (chunks, records, h, dh)."""
    H, R = inputs[0].shape[1], plan.num_runs
    chunks, runs, prep = _prep(lib, plan, inputs)
    nc = chunks.shape[0]
    h = torch.full(bwd_layout.hi_state_shape(nc, H), float("nan"), dtype=torch.bfloat16)
    dh = torch.full(bwd_layout.scaled_state_shape(nc, H), 255, dtype=torch.uint8)  # NaN words and powers
    assert lib.e_fwd_walk(_p(prep), _p(chunks), nc, _p(runs), R, H, None, None, None, _p(h), 8) == 0
    assert lib.e_rev_walk(_p(do), _p(prep), _p(chunks), nc, _p(runs), R, H, None, None, None, _p(dh), 8) == 0
    return chunks, prep, h, dh


def _grads(lib, inputs, do, walked, warps):
    """The gradient kernel's five outputs (NaN-filled before) from the records and walks ``walked``."""
    chunks, prep, h, dh = walked
    grads = [torch.full_like(x, float("nan")) for x in inputs]
    assert lib.e_grads(*map(_p, (*inputs, do, chunks)), chunks.shape[0], inputs[0].shape[1], _p(prep), _p(h), _p(dh),
                       *map(_p, grads), ctypes.c_float(SCALE), warps) == 0
    return grads


def test_gradient_kernel(emu):
    """dq, dk, dv, dg, dbeta of the gradient kernel (16 and 8 warps) from emulated records and walks against
    the torch backward (FP32), and 16 vs 8 warps: dq, dk, dv bitwise (the same accumulation order), dg and
    dbeta within FP32 regrouping."""
    plan, inputs, do, _, _ = _case([0, 37, 150], 2, 6)
    walked = _walked(emu, plan, inputs, do)
    ref = TorchBackend().bwd_grads(*inputs, do, SCALE, plan, None, None)
    got = {}
    for w in (16, 8):
        got[w] = grads = _grads(emu, inputs, do, walked, w)
        for name, x, r in zip(NAMES, grads, ref):
            err = _rel(x, r)
            print(f"emulated {w}-warp gradient kernel {name}: vs torch {err:.2e}")
            assert torch.isfinite(x.float()).all() and err <= TOL[name], (w, name)
    for name, a, b in zip(NAMES, got[16], got[8]):
        if name in ("dq", "dk", "dv"):
            assert torch.equal(a, b), name
        else:
            assert _rel(a, b) <= 1e-5, name


def test_gradient_kernel_on_mma_sync_equals_wgmma(emu, emu_mma):
    """The gradient kernel built without wgmma (sm_100a / sm_103a: every product on mma.sync) gives the bits of the
    wgmma build (sm_90a: phase A, B2, B3 and, on one-anchor chunks at 16 warps, the pairwise rows and columns on
    wgmma, both operands from shared memory), at 16 and 8 warps, on chunks anchored once and by 16-row block (a
    steep document): the same products in the same order per element, the wgmma products over a lower-triangular
    A's zero blocks adding exact zeros."""
    plan, inputs, do, _, _ = _case([0, 37, 150, 230], 2, 9, steep_docs=(1,))
    walked = _walked(emu, plan, inputs, do), _walked(emu_mma, plan, inputs, do)
    for warps in (16, 8):
        a = _grads(emu, inputs, do, walked[0], warps)
        b = _grads(emu_mma, inputs, do, walked[1], warps)
        for name, x, y in zip(NAMES, a, b):
            assert torch.isfinite(x.float()).all(), (warps, name)
            assert torch.equal(x, y), f"{warps}-warp {name}: mma.sync and wgmma gradient kernels differ"


def _random_maps(n, H, gen, decay=0.97):
    """n random affine maps (M [n, H, 128, 128], E [n, H, 128, 128]) fp32 with the shape of chunk summaries:
    Diag(gamma) minus a low-rank-ish part, norm ~1, so a chain neither blows up nor dies out."""
    D = 128
    M = decay * torch.eye(D).expand(n, H, D, D) + 0.02 * torch.randn(n, H, D, D, generator=gen)
    E = torch.randn(n, H, D, D, generator=gen)
    return M.float().contiguous(), E.float().contiguous()


def test_affine_merge_against_fp64(emu):
    """The merge kernel (3xTF32 products) against the same fold and composition in FP64: chains of 0, 1, 3 and 12
    steps, with and without an initial state. 3xTF32 keeps ~21 bits per product (one plain TF32 product keeps 11,
    ~5e-4 relative). The emulated mma sums its products in FP64 and rounds once, more precisely than tensor cores
    (which truncate as they add): this bound checks the algorithm; tests/gpu/test_fwd_cuda.py has the hardware's."""
    gen = torch.Generator().manual_seed(5)
    H = 2
    M, E = _random_maps(16, H, gen)
    init = torch.randn(3, H, 128, 128, generator=gen)
    chains = torch.tensor([[0, 12, 0, 0], [12, 3, -1, 12], [15, 1, 2, 15], [15, 0, 1, 16]], dtype=torch.int32)
    out = torch.full((16, H, 128, 128), float("nan"))
    assert emu.e_merge(_p(M), _p(E), _p(chains), 4, H, _p(init), _p(out), None, 0) == 0
    comp_m = torch.full((4, H, 128, 128), float("nan"))
    comp_e = torch.full((4, H, 128, 128), float("nan"))
    cchains = chains.clone()
    cchains[:, 3] = torch.arange(4)
    assert emu.e_merge(_p(M), _p(E), _p(cchains), 4, H, None, _p(comp_m), _p(comp_e), 1) == 0
    states, maps = naive_merge(M, E, chains, init)
    worst = max(_rel(out[i], x) for i, x in states.items())
    worst = max(worst, *(max(_rel(comp_m[c], P), _rel(comp_e[c], F)) for c, (P, F) in enumerate(maps)))
    print(f"affine merge (3xTF32) vs FP64: {worst:.2e}")
    assert worst <= 2e-6


class _Programs:
    """Stands for the loaded kda_fwd and kda_bwd programs: each entry point maps its tensors onto the
    emulated launchers the way csrc/*_binding.cu maps them onto kda::*Args (checks aside)."""

    def __init__(self, lib):
        self.lib = lib

    def _ok(self, rc, what):
        assert rc == 0, f"emulated {what} returned {rc}"

    # ---- kda_bwd ----
    def bwd_prep(self, q, k, v, g, beta, chunks, prep, scale, status):
        self._ok(self.lib.e_prep(*map(_p, (q, k, v, g, beta, chunks)), chunks.shape[0], q.shape[1],
                                 ctypes.c_float(scale), _p(prep), _p(status)), "bwd_prep")

    def bwd_fwd_walk(self, prep, chunks, runs, state_in, fold, state_out, h, warps):
        self._ok(self.lib.e_fwd_walk(_p(prep), _p(chunks), chunks.shape[0], _p(runs), runs.shape[0], h.shape[1],
                                     _p(state_in), _p(fold), _p(state_out), _p(h), warps), "bwd_fwd_walk")

    def bwd_rev_walk(self, dout, prep, chunks, runs, dstate_out, fold, dstate_in, dh, warps):
        self._ok(self.lib.e_rev_walk(_p(dout), _p(prep), _p(chunks), chunks.shape[0], _p(runs), runs.shape[0],
                                     dh.shape[1], _p(dstate_out), _p(fold), _p(dstate_in), _p(dh), warps),
                 "bwd_rev_walk")

    def bwd_fwd_summary(self, prep, chunks, segs, m, e, warps):
        self._ok(self.lib.e_fwd_summary(_p(prep), _p(chunks), chunks.shape[0], _p(segs), segs.shape[0], m.shape[1],
                                        _p(m), _p(e), warps), "bwd_fwd_summary")

    def bwd_rev_summary(self, dout, prep, chunks, runs, mt, f, warps):
        self._ok(self.lib.e_rev_summary(_p(dout), _p(prep), _p(chunks), chunks.shape[0], _p(runs), runs.shape[0],
                                        mt.shape[1], _p(mt), _p(f), warps), "bwd_rev_summary")

    def bwd_grads(self, q, k, v, g, beta, do, chunks, prep, h, dh, dq, dk, dv, dg, dbeta, scale, warps):
        self._ok(self.lib.e_grads(*map(_p, (q, k, v, g, beta, do, chunks)), chunks.shape[0], q.shape[1], _p(prep),
                                  _p(h), _p(dh), *map(_p, (dq, dk, dv, dg, dbeta)), ctypes.c_float(scale), warps),
                 "bwd_grads")

    # ---- both programs ----
    def merge_fold(self, m, e, chains, init, out):
        self._ok(self.lib.e_merge(_p(m), _p(e), _p(chains), chains.shape[0], m.shape[1], _p(init), _p(out), None, 0),
                 "merge_fold")

    def status_fill(self, word, report, *outputs):
        ptrs = (ctypes.c_void_p * 5)(*(_p(t).value for t in outputs))
        n = (ctypes.c_int64 * 5)(*(t.numel() for t in outputs))
        nbytes = (ctypes.c_int * 5)(*(t.element_size() for t in outputs))
        self._ok(self.lib.e_status_fill(_p(word), _p(report), ptrs, n, nbytes), "status_fill")

    def merge_compose(self, m, e, chains, m_out, e_out):
        self._ok(self.lib.e_merge(_p(m), _p(e), _p(chains), chains.shape[0], m.shape[1], None, _p(m_out), _p(e_out),
                                  1), "merge_compose")

    # ---- kda_fwd ----
    def fwd_prep(self, q, k, g, beta, chunks, ws, scale, status):
        self._ok(self.lib.e_fwd_prep(*map(_p, (q, k, g, beta, chunks)), chunks.shape[0], q.shape[1],
                                     ctypes.c_float(scale), _p(ws), _p(status)), "fwd_prep")

    def fwd_walk_output(self, v, ws, chunks, segs, state_in, sin, o, warps):
        self._ok(self.lib.e_fwd_walk_output(_p(v), _p(ws), _p(chunks), _p(segs), segs.shape[0], v.shape[1],
                                            _p(state_in), _p(sin), _p(o), warps), "fwd_walk_output")

    def fwd_walk_summary(self, v, ws, chunks, segs, m, e, warps):
        self._ok(self.lib.e_fwd_walk_summary(_p(v), _p(ws), _p(chunks), _p(segs), segs.shape[0], v.shape[1],
                                             _p(m), _p(e), warps), "fwd_walk_summary")

    def fwd_record_bytes(self):
        return self.lib.e_fwd_record_bytes()


def _use_emulated_programs(lib, setattr_, setenv):
    """The CUDA backend on CPU tensors with the emulated kernels as its programs; segmented walks on these
    small runs (segments of 2 chunks both ways)."""
    backend = CudaBackend(True)
    programs = _Programs(lib)
    setattr_(function, "select_backend", lambda device, det: backend)
    setattr_(kda_kcp.backend, "select_backend", lambda device, det: backend)
    setattr_(function, "check_inputs", lambda *a: None)  # CPU tensors stand for CUDA ones
    setattr_(forward, "check_tensors", lambda *a: None)
    setattr_(cb, "check_tensors", lambda *a: None)
    setattr_(forward, "load", lambda device: programs)
    setattr_(cb, "load", lambda device: programs)
    set_tuning(setenv, fwd_seg_chunks=2, bwd_seg_chunks=2)


def _oracle(cu, inputs, do):
    leaves = [x.detach().double().requires_grad_() for x in inputs]
    o64 = naive_kda(*leaves, cu, scale=SCALE)
    return [o64.detach(), *torch.autograd.grad(o64, leaves, do.double())]


def _check_vs_oracle(got, ref, where):
    for name, x, r in zip(("o", *NAMES), got, ref):
        err = _rel(x, r)
        print(f"emulated CUDA path {where} {name}: vs FP64 {err:.2e}")
        assert torch.isfinite(x.float()).all() and err <= (4e-3 if name == "o" else TOL[name]), (where, name)


@pytest.mark.parametrize("steep_docs", [(), (0,)])  # every chunk on one anchor; the first document's by block
def test_cuda_path_on_the_emulated_kernels(emu, monkeypatch, steep_docs):
    """One W = 1 forward + backward through kda_kcp.cuda (segmented forward and backward walks, folds, a
    workspace of exactly the queried size, whose arena peaks at what the sizing counted for each call) against
    the FP64 oracle, and the lean backward (2 passes) bitwise equal to the replay one; prepared records serve one
    gradient call (the forward walk writes V_new over U), a second one raises. With steep gates in the first
    document, the preps anchor its chunks by 16-row block and the second document's at their first row, in one
    launch."""
    _use_emulated_programs(emu, monkeypatch.setattr, monkeypatch.setenv)
    cu = [0, 70, 300]
    H = 1
    plan, inputs, do, _, _ = _case(cu, H, 7, steep_docs)
    prepared = cb.PreparedBackward(*inputs, do, SCALE, plan)
    prepared.grads()
    with pytest.raises(RuntimeError, match="once per prepared backward"):
        prepared.grads()
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu))
    arenas = []  # the workspace calls' arenas: each call's peak is what the sizing counted for it
    monkeypatch.setattr(kda_kcp.workspace, "Arena", lambda *a, **kw: arenas.append(Arena(*a, **kw)) or arenas[-1])
    ws = kda_kcp.WorkspaceKcp.from_buffer(
        torch.empty(kda_kcp.kda_workspace_bytes_kcp(ctx, H), dtype=torch.uint8), True, "replay", None)
    o, saved = function.forward_kcp(*inputs, ctx, None, True, ws)
    grads = function.backward_kcp(do, saved, ctx, ws)
    _check_vs_oracle((o, *grads), _oracle(cu, inputs, do), "W=1")
    backend = function.select_backend(None, True)
    assert [a.peak for a in arenas] == list(sizing.arena_parts(ctx, H, backend, "cpu")) != [0, 0]
    lean = kda_kcp.WorkspaceKcp.from_buffer(
        torch.empty(kda_kcp.kda_workspace_bytes_kcp(ctx, H, local_arena="lean", lean_passes=2), dtype=torch.uint8),
        True, "lean", 2)
    lean_grads = function.backward_kcp(do, saved, ctx, lean)
    for name, x, r in zip(NAMES, lean_grads, grads):
        assert torch.equal(x, r), f"{name}: the lean backward differs from the replay one"
    assert arenas[-1].peak == sizing.arena_parts(ctx, H, backend, "cpu", passes=2)[1]


def test_cp_async_requests_go_into_dead_tiles(emu, emu_eager, monkeypatch):
    """Every cp.async request of the kernels targets shared memory that no thread reads again before the
    request's wait: with each copy landing at its issue (the earliest the GPU may land it) a W = 1 forward +
    backward (segmented walks, folds, records, gradients) is bitwise the one with copies landing at their waits
    (the latest). A request moved ahead of a tile's last read (a prefetch into a live tile) fails here."""
    cu = [0, 70, 300]
    plan, inputs, do, _, _ = _case(cu, 1, 13)
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu))
    res = []
    for lib in (emu, emu_eager):
        with monkeypatch.context() as m:
            _use_emulated_programs(lib, m.setattr, m.setenv)
            o, saved = function.forward_kcp(*inputs, ctx, None, True, None)
            res.append((o, *function.backward_kcp(do, saved, ctx, None)))
    for name, x, y in zip(("o", *NAMES), *res):
        assert torch.isfinite(x.float()).all() and torch.equal(x, y), f"{name}: copies landing at issue change it"


def test_forward_operand_scale(emu, monkeypatch):
    """The forward walk's fp16 operands, scaled per warp by a power of two that follows the largest |v| and |S_in|
    seen (csrc/kda_fwd.cu), on the emulated kernels (2-chunk segments: summaries, fold, incoming states): v and
    the initial states times 2^-20 give o times 2^-20 bit for bit; v and states times 1e-6, and v jumping by 2^12
    inside a run, stay within o's bound against the FP64 torch backend."""
    _use_emulated_programs(emu, monkeypatch.setattr, monkeypatch.setenv)
    cu = [0, 70, 200]
    plan, inputs, _, sin, _ = _case(cu, 1, 11)
    q, k, v, g, beta = inputs
    be = CudaBackend(True)
    o = be.fwd_output(q, k, v, g, beta, SCALE, plan, sin)
    o2 = be.fwd_output(q, k, v * 2.0**-20, g, beta, SCALE, plan, sin * 2.0**-20)
    assert torch.equal(o2.float() * 2.0**20, o.float())
    jump = torch.ones(cu[-1], 1, 1)
    jump[100:] = 4096.0  # v jumps inside a chunk: the walk's scale steps down there (U again at the new scale)
    for vf, sf, what in (((v.double() * 1e-6).bfloat16(), sin * 1e-6, "v and states times 1e-6"),
                         ((v.double() * jump).bfloat16(), sin, "v jumping 2^12 up")):
        o3 = be.fwd_output(q, k, vf, g, beta, SCALE, plan, sf)
        ref = TorchBackend().fwd_output(*(x.double() for x in (q, k, vf, g, beta)), SCALE, plan, sf.double())
        err = _rel(o3, ref)
        print(f"emulated forward, {what}: o vs FP64 {err:.2e}")
        assert err <= 4e-3


def test_backward_u_scale(emu, monkeypatch):
    """The backward record's U in fp16 at one power of two per chunk-head (kda_bwd.h kRecU): v times 2^-40 or
    2^40 gives the same fp16 words under a scale 2^-40 / 2^40 apart; the gradients of v times 2^-30 are the
    originals scaled bit for bit (dq, dk, dg, dbeta times 2^-30, dv equal); and a document of |v| ~ 1e4 beside
    one of |v| ~ 1e-4 keeps every chunk-head's U within fp16's precision of the FP32 torch prep."""
    _use_emulated_programs(emu, monkeypatch.setattr, monkeypatch.setenv)
    cu = [0, 70, 200]
    plan, inputs, do, _, _ = _case(cu, 2, 17)
    q, k, v, g, beta = inputs
    H = q.shape[1]

    def record(vv):
        chunks, _, prep = _prep(emu, plan, (q, k, vv, g, beta))
        rec = prep.view(chunks.shape[0], H, bwd_layout.PREP_BYTES)
        words = rec[:, :, records.REC_U : records.REC_U + 32768].reshape(*rec.shape[:2], 64, 2, 256)[..., :128]
        scale = rec[:, :, records.REC_U + records.U_SCALE_OFF : records.REC_U + records.U_SCALE_OFF + 4].contiguous().view(torch.float32)
        return words.clone(), scale.clone(), records.record_u(rec)

    w0, s0, _ = record(v)
    for f in (2.0**-40, 2.0**40):
        w1, s1, _ = record(v * f)
        assert torch.equal(w1, w0) and torch.equal(s1, s0 * f), f
    assert torch.equal(torch.frexp(s0).mantissa, torch.full_like(s0, 0.5)), "the scale is not a power of two"

    def grads(vv):
        return cb.PreparedBackward(q, k, vv, g, beta, do, SCALE, plan).grads()

    ref, tiny = grads(v), grads(v * 2.0**-30)
    for name, x, r in zip(NAMES, tiny, ref):
        want = r if name == "dv" else (r.double() * 2.0**-30).to(r.dtype)
        assert torch.equal(x, want), f"{name}: v times 2^-30 changes its bits beyond the scale"

    mixed = v.clone()
    mixed[: cu[1]] *= 1e4
    mixed[cu[1] :] *= 1e-4
    _, _, u = record(mixed)
    cs = _chunk_set(plan, range(plan.num_runs), "cpu")
    qc, kc, vc, gc = (cs.gather(x, torch.float32) for x in (q, k, mixed, g))
    bc = cs.gather(beta.unsqueeze(-1), torch.float32).squeeze(-1)
    incl, strict = _masks(64, "cpu")
    U = _prep_slab(qc, kc, vc, gc, bc, SCALE, incl, strict)[6]
    for c in range(U.shape[0]):
        for h in range(H):
            err = _rel(u[c, h], U[c, h])
            assert err <= 2e-3, (c, h, err)  # fp16 rounding (2^-12) over the prep's bf16 hi + lo A


@pytest.mark.parametrize("max_groups", ["2", "4"])
def test_pipelined_backward_is_bitwise_the_plain_one(emu, monkeypatch, max_groups):
    """Whole-run walks (no segments) of runs of 2, 4 and 1 chunks. In at most 2 groups the run of 4 is the late
    group, runs 0 and 2 the early one (two chunk ranges, so the gradient kernel runs on views of the chunk rows,
    records, h and dh); in up to 4 each run is a group of its own. The pipelined backward gives the unpipelined
    one's gradients bit for bit, from given states."""
    _use_emulated_programs(emu, monkeypatch.setattr, monkeypatch.setenv)
    set_tuning(monkeypatch, bwd_seg_chunks=0, bwd_walk_groups=max_groups)
    cu = [0, 70, 300, 330]
    plan, inputs, do, sin, dso = _case(cu, 1, 11)
    groups = bwd_tables.walk_groups(plan, 1, "cpu")
    want = [[(0, 2), (6, 7)], [(2, 6)]] if max_groups == "2" else [[(6, 7)], [(0, 2)], [(2, 6)]]
    assert [grp.ranges for grp in groups] == want
    _pipelined_equals_plain(plan, inputs, do, sin, dso, monkeypatch)


@pytest.mark.parametrize("pieces", ["2", "3"])
def test_split_walks_are_bitwise_the_plain_backward(emu, monkeypatch, pieces):
    """Whole-run walks launched in pieces (bwd_walk_pieces; each piece starts from the FP32 state its run's
    previous piece leaves in the hand-off buffer) with each block's gradients once both walks have passed it: runs of
    2, 4 and 1 chunks (blocks of zero chunks where a run is shorter than the pieces: a row that only hands its state
    on), in one group and in three, and a single run; every gradient the unpipelined backward's bit for bit, from
    given states."""
    _use_emulated_programs(emu, monkeypatch.setattr, monkeypatch.setenv)
    set_tuning(monkeypatch, bwd_seg_chunks=0, bwd_walk_pieces=pieces)
    for cu, cap, seed in (([0, 70, 300, 330], "2", 13), ([0, 70, 300, 330], "4", 14), ([0, 250], "4", 15)):
        set_tuning(monkeypatch, bwd_walk_groups=cap)
        plan, inputs, do, sin, dso = _case(cu, 1, seed)
        groups = bwd_tables.walk_groups(plan, 1, "cpu")
        longest = max(grp.fwalk[:, 1].max().item() for grp in groups)
        assert max(grp.pieces for grp in groups) == min(int(pieces), longest)
        for grp in groups:  # the blocks cover the group's chunks once
            covered = sorted(c for j in range(grp.pieces) for a, b in grp.blocks[j] for c in range(a, b))
            assert covered == sorted(c for a, b in grp.ranges for c in range(a, b))
        _pipelined_equals_plain(plan, inputs, do, sin, dso, monkeypatch)


def _random_valid_order(groups, rng):
    """The pipelined backward's launches in a random order that keeps only what its streams and events enforce:
    each chain's pieces in turn, each block's gradients after the two walk pieces it waits for."""
    todo, done, order = bwd_streams.launch_order(groups), set(), []

    def ready(launch):
        gi, what, p = launch
        if what == "grads":
            return all(w in done for w in bwd_streams.launch_waits(groups, gi, p))
        return p == 0 or (gi, what, p - 1) in done

    while todo:
        ready_now = [x for x in todo if ready(x)]
        pick = ready_now[rng.randrange(len(ready_now))]
        todo.remove(pick)
        done.add(pick)
        order.append(pick)
    return order


@pytest.mark.parametrize("tuned", ["auto", "pieces=3,groups=2", "pieces=2,groups=4"])
def test_pipelined_backward_in_any_valid_order(emu, monkeypatch, tuned):
    """On the GPU the pipelined backward's walk pieces and gradient blocks run on many streams, ordered only by each
    stream's order and the events a gradient launch waits for (bwd_streams.launch_waits). Here they run one at a
    time in random orders that keep just those (a block's gradients before every walk piece it does not wait for,
    other groups' walks anywhere): every gradient must be the unpipelined backward's bit for bit. A dependency the
    events miss (a gradient block reading a walk's output of another block, a hand-off read early) fails here.
    Runs of 2, 4 and 1 chunks, and a batch in the model's own groups and pieces (``auto``), from given states."""
    import random

    _use_emulated_programs(emu, monkeypatch.setattr, monkeypatch.setenv)
    if tuned == "auto":
        set_tuning(monkeypatch, fwd_seg_chunks=None, bwd_seg_chunks=None)
        cu = [0, 70, 300, 700]
    else:
        knobs = dict(kv.split("=") for kv in tuned.split(","))
        set_tuning(monkeypatch, bwd_seg_chunks=0, bwd_walk_pieces=knobs["pieces"], bwd_walk_groups=knobs["groups"])
        cu = [0, 70, 300, 330]
    plan, inputs, do, sin, dso = _case(cu, 1, 17)
    groups = bwd_tables.walk_groups(plan, 1, "cpu")
    assert groups is not None and (len(groups) > 1 or groups[0].pieces > 1)
    set_tuning(monkeypatch, bwd_pipeline=0)
    plain = cb.PreparedBackward(*inputs, do, SCALE, plan).grads(sin, dso)
    set_tuning(monkeypatch, bwd_pipeline=1)
    rng = random.Random(tuned)
    for trial in range(3):
        order = _random_valid_order(groups, rng)
        monkeypatch.setattr(bwd_streams, "launch_order", lambda groups, order=order: order)
        got = cb.PreparedBackward(*inputs, do, SCALE, plan).grads(sin, dso)
        for name, a, b in zip(NAMES, got, plain):
            assert torch.equal(a, b), f"{name}: launch order {order} differs from the unpipelined backward"


def _pipelined_equals_plain(plan, inputs, do, sin, dso, monkeypatch):
    """The backward with bwd_pipeline = 1 and = 0: every gradient bit for bit, none all zero."""
    got = {}
    for flag in ("0", "1"):
        set_tuning(monkeypatch, bwd_pipeline=flag)
        got[flag] = cb.PreparedBackward(*inputs, do, SCALE, plan).grads(sin, dso)
    for name, a, b in zip(NAMES, got["1"], got["0"]):
        assert torch.equal(a, b), f"{name}: the pipelined backward differs"
        assert a.float().abs().sum() > 0, name


def test_pipelined_segmented_backward_is_bitwise_the_plain_one(emu, monkeypatch):
    """Segmented walks (2-chunk segments: summaries and folds both ways) of runs of 2, 4 and 1 chunks, pipelined in
    two halves of the chunk table ([0, 4) and [4, 7)), give the unpipelined gradients bit for bit, from given
    states."""
    _use_emulated_programs(emu, monkeypatch.setattr, monkeypatch.setenv)
    set_tuning(monkeypatch, bwd_seg_chunks=2)
    cu = [0, 70, 300, 330]
    plan, inputs, do, sin, dso = _case(cu, 1, 12)
    assert [grp.ranges for grp in bwd_tables.walk_groups(plan, 1, "cpu")] == [[(0, 4)], [(4, 7)]]
    _pipelined_equals_plain(plan, inputs, do, sin, dso, monkeypatch)


def test_pipelined_forward_is_bitwise_the_plain_one(emu, monkeypatch):
    """Whole-run output walks of runs of 2, 4 and 1 chunks in run groups (one SM, so a group closes at 4
    chunk-heads): the run of 4 first, then runs 0 and 2 (two chunk ranges, so the prep runs on views of the chunk
    rows and the records). The forward prepped and walked group by group gives the unpipelined o bit for bit, from
    given incoming states."""
    _use_emulated_programs(emu, monkeypatch.setattr, monkeypatch.setenv)
    set_tuning(monkeypatch, fwd_seg_chunks=0)  # whole runs
    monkeypatch.setattr(forward, "sm_count", lambda device: 1)
    cu = [0, 70, 300, 330]
    plan, inputs, _, sin, _ = _case(cu, 1, 13)
    groups = forward.run_group_tables(plan, 1, "cpu")
    assert [grp.ranges for grp in groups] == [[(2, 6)], [(0, 2), (6, 7)]]
    got = {}
    for flag in ("0", "1"):
        set_tuning(monkeypatch, fwd_pipeline=flag)
        prepared = forward.PreparedForward(*inputs, SCALE, plan, output_next=True)
        assert (prepared.groups is None) == (flag == "0")
        got[flag] = prepared.output(sin)
    assert torch.equal(got["1"], got["0"]), "the pipelined forward differs"
    assert got["1"].float().abs().sum() > 0
    # the KCP summaries read every record first: the groups' preps are made at once, then a plain output walk
    set_tuning(monkeypatch, fwd_pipeline=1)
    assert forward.PreparedForward(*inputs, SCALE, plan).groups is None  # a KCP call's records: all made at once
    prepared = forward.PreparedForward(*inputs, SCALE, plan, output_next=True)
    prepared.summaries((0,))
    assert prepared.groups is None
    assert torch.equal(prepared.output(sin), got["0"])


def test_segmented_kcp_summaries(emu, monkeypatch):
    """The backward's KCP summaries of runs of 2, 5 and 1 chunks cut into 1- and 2-chunk segments, composed in the
    reverse walk's order, against the whole-run summaries and the torch backend's (FP64 reference of the same
    algebra)."""
    _use_emulated_programs(emu, monkeypatch.setattr, monkeypatch.setenv)
    cu = [0, 70, 330, 340]
    plan, inputs, do, _, _ = _case(cu, 2, 14)
    ref = TorchBackend().bwd_summaries(*(x.double() for x in inputs), do.double(), SCALE, plan, [1, 0, 2])
    got = {}
    for seg in ("0", "1", "2"):
        set_tuning(monkeypatch, bwd_summary_chunks=seg)
        tabs = bwd_tables.summary_tables(plan, (1, 0, 2), "cpu", own_chunks=False, heads=2)
        assert (tabs.chains is None) == (seg == "0")
        got[seg] = cb.PreparedBackward(*inputs, do, SCALE, plan).summaries([1, 0, 2])
    for seg, (mt, f) in got.items():
        em, ef = _rel(mt, ref[0]), _rel(f, ref[1])
        dm, df = _rel(mt, got["0"][0]), _rel(f, got["0"][1])
        print(f"KCP summaries, segments of {seg}: Mt {em:.2e}, F {ef:.2e} vs FP64; vs whole runs {dm:.2e}, {df:.2e}")
        assert em <= 5e-3 and ef <= 5e-3 and dm <= 2e-3 and df <= 2e-3


def _emulated_kcp(rank, world, lib_path):
    """One rank of a W = 2 KCP step over gloo through kda_kcp.cuda with the emulated kernels (the KCP
    summaries, their composition and both exchanges included), every layout, against the FP64 oracle."""
    _use_emulated_programs(ctypes.CDLL(lib_path), setattr, os.environ.__setitem__)
    cu = [0, 70, 300]  # the second document crosses the rank boundary in every layout
    _, inputs, do, _, _ = _case(cu, 1, 8)
    ref = _oracle(cu, inputs, do)
    for early in ("0", "1"):  # the forward's output pass after the exchange, or partly before it
        # and the backward's KCP summaries: one walk per whole run, or 1-chunk segments composed
        set_tuning(os.environ.__setitem__, fwd_early=early, bwd_summary_chunks="0" if early == "0" else "1")
        for layout in kda_kcp.LAYOUTS:
            ctx = kda_kcp.build_context_kcp(torch.tensor(cu), dist.group.WORLD, layout)
            local = [ctx.shard(x) for x in inputs]
            o, saved = function.forward_kcp(*local, ctx, None, True, None)
            grads = function.backward_kcp(ctx.shard(do), saved, ctx, None)
            got = [gather_global(ctx, x.float()) for x in (o, *grads)]
            _check_vs_oracle(got, ref, f"W={world} {layout} early={early} summary segments={early == '1'}")


def test_kcp_on_the_emulated_kernels(emu):
    """W = 2 over gloo on the CPU: kda_kcp.cuda's KCP path (forward summaries composed, backward summaries,
    the two exchanges, states handed across ranks) with the emulated kernels, all three layouts."""
    run_distributed(_emulated_kcp, 2, emu._name)


def _states_oracle(cu, inputs, do, h0, dht):
    """FP64 o, final states and the gradients of <o, do> + <ht, dht> to q, k, v, g, beta and h0."""
    leaves = [x.detach().double().requires_grad_() for x in (*inputs, h0)]
    o64, ht64 = naive_kda(*leaves[:5], cu, scale=SCALE, initial_state=leaves[5], output_final_state=True)
    return [o64.detach(), ht64.detach(), *torch.autograd.grad((o64, ht64), leaves, (do.double(), dht.double()))]


def _check_states_vs_oracle(got, ref, where):
    """o and the gradients as _check_vs_oracle; the final states within o's bound, the initial state's gradient
    within dq's (both are FP32 state products of the same walks)."""
    o, ht, *grads, dh0 = got
    ref_o, ref_ht, *ref_grads, ref_dh0 = ref
    _check_vs_oracle((o, *grads), (ref_o, *ref_grads), where)
    for name, x, r, tol in (("ht", ht, ref_ht, 4e-3), ("dh0", dh0, ref_dh0, TOL["dq"])):
        err = _rel(x, r)
        print(f"emulated CUDA path {where} {name}: vs FP64 {err:.2e}")
        assert x.dtype == torch.float32 and torch.isfinite(x).all() and err <= tol, (where, name, err)


def _state_case(cu, seed):
    _, inputs, do, _, _ = _case(cu, 1, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    N = len(cu) - 1
    return inputs, do, torch.randn(N, 1, 128, 128, generator=gen), torch.randn(N, 1, 128, 128, generator=gen)


def test_states_on_the_emulated_kernels(emu, monkeypatch):
    """W = 1 with initial and final states through kda_kcp.cuda (segmented walks, the forward and backward summaries
    of the runs that end and start a document, an empty document) with a workspace of the queried size, against the
    FP64 oracle; the lean backward gives the same bits, dh0 included."""
    _use_emulated_programs(emu, monkeypatch.setattr, monkeypatch.setenv)
    cu = [0, 70, 70, 300]
    inputs, do, h0, dht = _state_case(cu, 21)
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu))
    ws = kda_kcp.WorkspaceKcp.from_buffer(
        torch.empty(kda_kcp.kda_workspace_bytes_kcp(ctx, 1), dtype=torch.uint8), True, "replay", None)
    before = h0.clone()
    o, ht, saved = function.forward_kcp(*inputs, ctx, None, True, ws, None, h0, True)
    grads = function.backward_kcp(do, saved, ctx, ws, dht)
    assert torch.equal(h0, before)
    _check_states_vs_oracle((o, ht, *grads), _states_oracle(cu, inputs, do, h0, dht), "W=1 states")
    lean = kda_kcp.WorkspaceKcp.from_buffer(
        torch.empty(kda_kcp.kda_workspace_bytes_kcp(ctx, 1, local_arena="lean", lean_passes=2), dtype=torch.uint8),
        True, "lean", 2)
    for x, r in zip(function.backward_kcp(do, saved, ctx, lean, dht), grads):
        assert torch.equal(x, r), "the lean backward differs from the replay one"


def _emulated_kcp_states(rank, world, lib_path):
    """One rank of a W = 2 KCP step with states through kda_kcp.cuda with the emulated kernels, every layout (with
    the early output pass asked for: the runs that start a document then start from their initial states
    instead), against the FP64 oracle: o and the input gradients gathered, ht and dh0 summed over the ranks."""
    _use_emulated_programs(ctypes.CDLL(lib_path), setattr, os.environ.__setitem__)
    set_tuning(os.environ.__setitem__, fwd_early=1)
    cu = [0, 70, 300]
    inputs, do, h0, dht = _state_case(cu, 22)
    ref = _states_oracle(cu, inputs, do, h0, dht)
    for layout in kda_kcp.LAYOUTS:
        ctx = kda_kcp.build_context_kcp(torch.tensor(cu), dist.group.WORLD, layout)
        local = [ctx.shard(x) for x in inputs]
        o, ht, saved = function.forward_kcp(*local, ctx, None, True, None, None, h0, True)
        *grads, dh0 = function.backward_kcp(ctx.shard(do), saved, ctx, None, dht)
        dist.all_reduce(ht)
        dist.all_reduce(dh0)
        got = [gather_global(ctx, o.float()), ht, *[gather_global(ctx, x.float()) for x in grads], dh0]
        _check_states_vs_oracle(got, ref, f"W={world} {layout} states")


def test_kcp_states_on_the_emulated_kernels(emu):
    run_distributed(_emulated_kcp_states, 2, emu._name)
