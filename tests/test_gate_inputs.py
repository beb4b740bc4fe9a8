"""The GPU tests' gate modes put the chunk prep's chunks on the anchoring they are meant to test: the limit for one
anchor per chunk is read from csrc/kda_chunk_prep.cuh (kOneAnchor), so the inputs follow it if it changes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from gpu_common import make_inputs  # noqa: E402


def one_anchor_limit() -> float:
    m = re.search(r"constexpr float kOneAnchor = ([0-9.]+)f;", (ROOT / "csrc" / "kda_chunk_prep.cuh").read_text())
    assert m, "kOneAnchor not found in csrc/kda_chunk_prep.cuh"
    return float(m.group(1))


def chunk_sums(g: torch.Tensor) -> torch.Tensor:
    """Per-column sums of the gates over each full 64-row chunk of one document: [chunks, H, 128]."""
    n = g.shape[0] // 64 * 64
    return g[:n].double().reshape(-1, 64, *g.shape[1:]).sum(1)


def one_anchor(g: torch.Tensor) -> torch.Tensor:
    """Per (chunk, head): whether the prep anchors the chunk at its first row (every column's sum >= -limit)."""
    return (chunk_sums(g) >= -one_anchor_limit()).all(-1)


def test_gate_modes_hit_their_anchoring():
    gen = torch.Generator().manual_seed(0)
    gates = {mode: make_inputs(4096, 4, gen, mode, device="cpu")[3] for mode in
             ("benchmark", "edge_in", "edge_out", "mixed", "uniform")}
    assert one_anchor(gates["benchmark"]).all(), "the benchmark's gates should take the one-anchor path"
    assert one_anchor(gates["edge_in"]).all(), "edge_in should sit just inside the one-anchor limit"
    assert (chunk_sums(gates["edge_in"]) < -0.98 * one_anchor_limit()).all(), "edge_in should be near the limit"
    assert not one_anchor(gates["edge_out"]).any(), "edge_out should sit just past the limit"
    assert (chunk_sums(gates["edge_out"]) > -1.03 * one_anchor_limit()).all(), "edge_out should be near the limit"
    for mode in ("mixed", "uniform"):  # the steep modes: per-block anchors
        assert not one_anchor(gates[mode]).any(), f"{mode} gates should anchor by block"
    for mode, g in gates.items():
        assert (g < 0).all() and (g >= -5).all(), mode
