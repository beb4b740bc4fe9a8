"""CPU emulation (torch, FP32) of the CUDA forward's tiling: the (chunk, head) records, the V-tiled
walks over the segment tables that ``kda_kcp.cuda.forward`` hands the kernels, the [M | E] summary tiles,
the FP32 fold along the merge chains and the whole-run composition. Checked against the torch backend.

It runs without a GPU (seconds): it tests the host logic and the algebra of the tiling, not the kernels'
fragments or their fp16 rounding (tests/gpu/test_fwd_cuda.py does that on the device).
"""

from __future__ import annotations

import math

import pytest
import torch

from kda_kcp.cuda.forward import CHUNK, forward_tables
from kda_kcp.cuda.tuning import fwd_model_time, fwd_segment_chunks
from kda_kcp.partition import partition_kcp
from kda_kcp.plan import LocalPlan, build_plan
from kda_kcp.torch_backend import TorchBackend

from gpu_common import local_plan, rel, set_tuning

D = 128


def make_inputs(T, H, gen, dk=D):
    q = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=gen), dim=-1)
    v = torch.randn(T, H, dk, generator=gen)
    g = (-5 * torch.sigmoid(torch.randn(T, H, dk, generator=gen) * 2 - 1)).clamp(-5.0, -1e-6)
    slow = torch.rand(1, H, dk, generator=gen) < 0.25
    g = torch.where(slow, -0.02 * torch.rand(T, H, dk, generator=gen), g)
    beta = 0.05 + 0.9 * torch.rand(T, H, generator=gen)
    return q, k, v, g, beta


def records(q, k, v, g, beta, scale, chunks):
    """What the prep kernel writes per (chunk, head), in FP32: dict of [N, H, ...] tensors."""
    C = CHUNK
    N = chunks.shape[0]
    T, H, K = q.shape
    idx = torch.full((N, C), T, dtype=torch.long)
    for c, (t0, n) in enumerate(chunks.tolist()):
        idx[c, :n] = torch.arange(t0, t0 + n)

    def gather(x):
        pad = torch.cat([x, x.new_zeros(1, *x.shape[1:])], 0)
        return pad[idx].movedim(1, 2)  # [N, H, C, ...]

    qc, kc, vc, gc = gather(q), gather(k), gather(v), gather(g)
    bc = gather(beta.unsqueeze(-1)).squeeze(-1)
    G = gc.cumsum(2)
    lower = torch.tril(torch.ones(C, C, dtype=torch.bool))
    diff = G.unsqueeze(3) - G.unsqueeze(2)  # [N, H, C(i), C(j), K]: G_i - G_j
    E = torch.where(lower[..., None], diff, torch.full_like(diff, -float("inf"))).exp()
    kk = torch.einsum("nhid,nhjd,nhijd->nhij", kc, kc, E)
    qk = torch.einsum("nhid,nhjd,nhijd->nhij", qc, kc, E)
    strict = torch.tril(torch.ones(C, C), -1)
    L = bc.unsqueeze(-1) * kk * strict
    A = torch.linalg.inv(torch.eye(C) + L)
    Ab = A * bc.unsqueeze(-2)
    Aqk = scale * qk * lower
    W = Ab @ (kc * G.exp())
    Qg = scale * qc * G.exp()
    Kg = kc * (G[:, :, -1:, :] - G).exp()
    gam = G[:, :, -1, :].exp()
    return dict(W=W, Qg=Qg, Kg=Kg, Aqk=Aqk, Ab=Ab, gam=gam, V=vc, chunks=chunks)


def walk_tile(rec, seg, h, cols, S, with_u, out=None, H=None):
    """One CTA: the chunks of a segment for state columns `cols` (S [K, len(cols)]), FP32.

    Row (tok_start, ntok, first chunk, idx, kind, chunks); each chunk's tokens come from the chunk table."""
    c0, nchunks = seg[2], seg[5]
    for ch in range(nchunks):
        c = c0 + ch
        U = rec["Ab"][c, h] @ rec["V"][c, h][:, cols] if with_u else torch.zeros(CHUNK, len(cols))
        Vn = U - rec["W"][c, h] @ S
        if out is not None:
            O = rec["Qg"][c, h] @ S + rec["Aqk"][c, h] @ Vn
            tok, n = rec["chunks"][c].tolist()
            out[tok:tok + n, h][:, cols] = O[:n]
        S = rec["gam"][c, h][:, None] * S + rec["Kg"][c, h].T @ Vn
    return S


def emulate_summaries(rec, segs, nslots, H, tile=64):
    """The summary walk: every (segment, head, tile of the 256 columns [M | E])."""
    M = torch.zeros(nslots, H, D, D)
    E = torch.zeros(nslots, H, D, D)
    for seg in segs.tolist():
        for h in range(H):
            for vb in range(0, 2 * D, tile):
                cols = list(range(vb % D, vb % D + tile))
                isE = vb >= D
                S0 = torch.zeros(D, tile) if isE else torch.eye(D)[:, cols]
                S = walk_tile(rec, seg, h, cols, S0, with_u=isE)
                (E if isE else M)[seg[3], h][:, cols] = S
    return M, E


def emulate_fwd_output(q, k, v, g, beta, scale, plan, state_in=None, sms=132, tile=64):
    T, H, _ = q.shape
    tabs = forward_tables(plan, H, "cpu", sms=sms)
    rec = records(q, k, v, g, beta, scale, tabs.chunks)
    sin = torch.zeros(tabs.num_sin, H, D, D)
    if tabs.num_summary:
        M, E = emulate_summaries(rec, tabs.summary, tabs.num_summary, H, tile)
        for first, cnt, init, out0 in tabs.chains.tolist():  # the merge_fold chains
            S = state_in[init].clone() if state_in is not None else torch.zeros(H, D, D)
            for j in range(cnt):
                S = M[first + j] @ S + E[first + j]
                sin[out0 + j] = S
    o = torch.full((T, H, D), float("nan"))
    for seg in tabs.out.tolist():
        idx, kind = seg[3], seg[4]
        for h in range(H):
            for vb in range(0, D, tile):
                cols = list(range(vb, vb + tile))
                if kind == 1:
                    S0 = sin[idx, h][:, cols].clone()
                elif state_in is not None:
                    S0 = state_in[idx, h][:, cols].clone()
                else:
                    S0 = torch.zeros(D, tile)
                walk_tile(rec, seg, h, cols, S0, with_u=True, out=o)
    return o, tabs


def emulate_fwd_summaries(q, k, v, g, beta, scale, plan, run_ids, sms=132):
    H = q.shape[1]
    tabs = forward_tables(plan, H, "cpu", run_ids=run_ids, sms=sms)
    rec = records(q, k, v, g, beta, scale, tabs.chunks)
    M, E = emulate_summaries(rec, tabs.summary, tabs.num_summary, H)
    Mo = torch.zeros(len(run_ids), H, D, D)
    Eo = torch.zeros(len(run_ids), H, D, D)
    for first, cnt, _, out in tabs.chains.tolist():  # the merge_compose chains
        Mc, Ec = torch.eye(D).expand(H, D, D).clone(), torch.zeros(H, D, D)
        for j in range(cnt):
            Mc, Ec = M[first + j] @ Mc, M[first + j] @ Ec + E[first + j]
        Mo[out], Eo[out] = Mc, Ec
    return Mo, Eo, tabs


@pytest.mark.parametrize("seg_chunks,sms", [("", 132), ("", 1), ("1", 132), ("3", 132)])
def test_emulated_output_matches_torch_backend(monkeypatch, seg_chunks, sms):
    set_tuning(monkeypatch, fwd_seg_chunks=seg_chunks or None)
    gen = torch.Generator().manual_seed(5)
    cu = [0, 1, 64, 64, 450, 700]  # a 1-token run, a full chunk, a zero-length document, ragged ends
    H = 2
    q, k, v, g, beta = make_inputs(cu[-1], H, gen)
    plan = local_plan(cu)
    state_in = 0.1 * torch.randn(plan.num_runs, H, D, D, generator=gen)
    for st in (None, state_in):
        o, tabs = emulate_fwd_output(q, k, v, g, beta, 128**-0.5, plan, st, sms=sms)
        ref = TorchBackend().fwd_output(q, k, v, g, beta, 128**-0.5, plan, st)
        assert torch.isfinite(o).all(), "a row of o was not written by any tile"
        err = rel(o, ref)
        print(f"seg_chunks={seg_chunks or 'model'} (L={tabs.seg_chunks}) sms={sms} state_in={st is not None}: "
              f"{tabs.out.shape[0]} output segments, {tabs.num_summary} summaries, rel {err:.2e}")
        assert err < 2e-5


@pytest.mark.parametrize("seg_chunks", ["", "2"])
def test_emulated_output_on_a_kcp_piece(monkeypatch, seg_chunks):
    """Runs that start inside their document (rank 1 of 2 and 3) open with a partial chunk."""
    set_tuning(monkeypatch, fwd_seg_chunks=seg_chunks or None)
    gen = torch.Generator().manual_seed(8)
    cu = [0, 130, 700, 1337]
    H = 2
    for W, layout in ((2, "contiguous"), (3, "zigzag_per_document")):
        parts = partition_kcp(cu, W, layout)
        kp = build_plan(cu, parts)
        plan = LocalPlan(sum(e - s for s, e in parts[1]), kp.rank_runs[1])
        assert any(len(r.chunk_lengths()) and r.chunk_lengths()[0] < CHUNK and not r.starts_doc for r in plan.runs)
        q, k, v, g, beta = make_inputs(plan.num_tokens, H, gen)
        state_in = 0.1 * torch.randn(plan.num_runs, H, D, D, generator=gen)
        o, tabs = emulate_fwd_output(q, k, v, g, beta, 128**-0.5, plan, state_in, sms=4)
        ref = TorchBackend().fwd_output(q, k, v, g, beta, 128**-0.5, plan, state_in)
        assert torch.isfinite(o).all(), "a row of o was not written by any tile"
        err = rel(o, ref)
        print(f"W={W} {layout} rank 1, seg_chunks={seg_chunks or 'model'}: {tabs.out.shape[0]} output segments, rel {err:.2e}")
        assert err < 2e-5


def test_emulated_summaries_match_torch_backend(monkeypatch):
    set_tuning(monkeypatch, fwd_seg_chunks=2)
    gen = torch.Generator().manual_seed(6)
    cu = [0, 300, 300, 520]
    H = 1
    q, k, v, g, beta = make_inputs(cu[-1], H, gen)
    plan = local_plan(cu)
    runs = tuple(range(plan.num_runs))
    M, E, tabs = emulate_fwd_summaries(q, k, v, g, beta, 128**-0.5, plan, runs)
    Mt, Et = TorchBackend().fwd_summaries(q, k, v, g, beta, 128**-0.5, plan, runs)
    em, ee = rel(M, Mt), rel(E, Et)
    print(f"summaries ({tabs.num_summary} segments): M {em:.2e}, E {ee:.2e}")
    assert em < 2e-5 and ee < 2e-5


def test_segment_choice_is_pure_and_covers_runs():
    doc_chunks = [math.ceil(n / CHUNK) for n in (42024, 57573, 73122, 88673)]
    for H in (4, 16, 64):
        L = fwd_segment_chunks(doc_chunks, H, 132)
        assert L == fwd_segment_chunks(doc_chunks, H, 132)
        t1 = fwd_model_time(doc_chunks, H, 132, max(doc_chunks))
        tL = fwd_model_time(doc_chunks, H, 132, L)
        print(f"H={H}: segment {L} chunks, model {tL:.0f} steps (unsegmented {t1:.0f})")
        assert tL <= t1
    cu = [0, 5000, 5000, 9000, 9001]
    plan = local_plan(cu)
    tabs = forward_tables(plan, 4, "cpu", sms=8)
    covered = sorted((r[0], r[1]) for r in tabs.out.tolist())
    tok = 0
    for t0, n in covered:
        assert t0 == tok
        tok += n
    assert tok == cu[-1]
    # every output segment's first chunk record holds its first token; its chunks hold its tokens
    for r in tabs.out.tolist():
        assert tabs.chunks[r[2], 0].item() == r[0]
        assert tabs.chunks[r[2]:r[2] + r[5], 1].sum().item() == r[1]


# ---- the record's byte layout (kda_fwd.h), for checking the prep kernel and feeding the walk ----
R_W, R_QG, R_KG, R_AQK, R_GAM, R_AB, R_END = 0, 16384, 32768, 49152, 54272, 54784, 59904
TRI_BLOCKS = [(I, J) for I in range(4) for J in range(I + 1)]  # block index I (I + 1) / 2 + J


def _swh_index():
    """-W, Qg and Kg: two [64][64] halves (keys < 64 first) of sw64 rows, the layouts wgmma reads (kda_common.cuh swh)."""
    r = torch.arange(64).view(64, 1)
    c = torch.arange(128).view(1, 128)
    return ((c >> 6) * 4096 + r * 64 + ((((c & 63) >> 3) ^ (r & 7)) << 3) + (c & 7)).reshape(-1)


def _tri_index():
    """[10 * 256] offsets of the lower blocks' elements, in TRI_BLOCKS order, rows and cols of 16."""
    r = torch.arange(16).view(16, 1)
    c = torch.arange(16).view(1, 16)
    within = (r * 16 + ((((c >> 3) ^ ((r >> 2) & 1))) << 3) + (c & 7)).reshape(-1)
    return torch.cat([b * 256 + within for b in range(len(TRI_BLOCKS))])


def _tri_gather(X):
    """[.., 64, 64] -> [.., 10 * 256] lower blocks in TRI_BLOCKS order (row-major inside a block)."""
    return torch.cat([X[..., 16 * I:16 * I + 16, 16 * J:16 * J + 16].reshape(*X.shape[:-2], 256)
                      for I, J in TRI_BLOCKS], -1)


def _tri_scatter(flat):
    X = flat.new_zeros(*flat.shape[:-1], 64, 64)
    for b, (I, J) in enumerate(TRI_BLOCKS):
        blk = flat[..., b * 256:(b + 1) * 256]
        X[..., 16 * I:16 * I + 16, 16 * J:16 * J + 16] = blk.reshape(*flat.shape[:-1], 16, 16)
    return X


def encode_records(rec) -> torch.Tensor:
    """FP32 records (``records``) -> uint8 [N * H * 59904] in the kernel's layout (fp16 rounding, as the prep
    kernel does)."""
    N, H = rec["W"].shape[:2]
    out = torch.zeros(N, H, R_END, dtype=torch.uint8)
    sw, tri = _swh_index(), _tri_index()
    for name, off, sign in (("W", R_W, -1.0), ("Qg", R_QG, 1.0), ("Kg", R_KG, 1.0)):
        buf = torch.zeros(N, H, 64 * 128, dtype=torch.float16)
        buf[..., sw] = (sign * rec[name]).reshape(N, H, -1).half()
        out[..., off:off + 16384] = buf.view(torch.uint8)
    for name, off in (("Aqk", R_AQK), ("Ab", R_AB)):
        buf = torch.zeros(N, H, 2560, dtype=torch.float16)
        buf[..., tri] = _tri_gather(rec[name]).half()
        out[..., off:off + 5120] = buf.view(torch.uint8)
    out[..., R_GAM:R_GAM + 512] = rec["gam"].float().contiguous().view(torch.uint8)
    return out.reshape(-1)


def decode_records(raw: torch.Tensor, N: int, H: int) -> dict:
    raw = raw.reshape(N, H, R_END).cpu()
    sw, tri = _swh_index(), _tri_index()
    dec = {}
    for name, off, sign in (("W", R_W, -1.0), ("Qg", R_QG, 1.0), ("Kg", R_KG, 1.0)):
        buf = raw[..., off:off + 16384].contiguous().view(torch.float16)
        dec[name] = sign * buf[..., sw].float().reshape(N, H, 64, 128)
    for name, off in (("Aqk", R_AQK), ("Ab", R_AB)):
        dec[name] = _tri_scatter(raw[..., off:off + 5120].contiguous().view(torch.float16)[..., tri].float())
    dec["gam"] = raw[..., R_GAM:R_GAM + 512].contiguous().view(torch.float32).reshape(N, H, 128)
    return dec


def test_record_layout_roundtrip():
    """encode -> decode gives the records back (to fp16 rounding), and the index maps are
    bijections inside their tiles (every byte of a record written once)."""
    sw, tri = _swh_index(), _tri_index()
    assert sorted(sw.tolist()) == list(range(64 * 128))
    assert sorted(tri.tolist()) == list(range(2560))
    gen = torch.Generator().manual_seed(7)
    cu = [0, 100, 230]
    q, k, v, g, beta = make_inputs(cu[-1], 2, gen)
    tabs = forward_tables(local_plan(cu), 2, "cpu")
    rec = records(q, k, v, g, beta, 128**-0.5, tabs.chunks)
    N = tabs.num_chunks
    dec = decode_records(encode_records(rec), N, 2)
    for name in ("W", "Qg", "Kg", "Aqk", "Ab", "gam"):
        err = rel(dec[name], rec[name])
        print(f"record {name}: encode/decode rel {err:.1e}")
        assert err < (1e-5 if name == "gam" else 5e-4)  # fp16: 2^-11 relative per element
    # the emulated walk on decoded records still matches the torch backend
    rec2 = dict(dec, V=rec["V"], chunks=tabs.chunks)
    o = torch.full((cu[-1], 2, D), float("nan"))
    for seg in tabs.out.tolist():
        for h in range(2):
            for vb in range(0, D, 64):
                cols = list(range(vb, vb + 64))
                walk_tile(rec2, seg, h, cols, torch.zeros(D, 64), with_u=True, out=o)
    ref = TorchBackend().fwd_output(q, k, v, g, beta, 128**-0.5, local_plan(cu))
    err = rel(o, ref)
    print(f"walk on decoded (fp16-rounded) records vs torch backend: {err:.2e}")
    assert err < 1e-2
