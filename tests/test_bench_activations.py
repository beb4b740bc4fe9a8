"""benchmarks/bench_activations.py on the CPU (its --device cpu smoke: the torch ops instead of the kernels): the bytes
per token-head it divides by are docs/kernels.md §8's, and the comparison of checkouts (one process per visit) reads
its children's results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_activations  # noqa: E402


def _run(tmp_path, *argv):
    out = tmp_path / "out.json"
    assert bench_activations.main(["--device", "cpu", "--tokens", "128", "--heads", "2", "--iters", "1", "--warmup",
                                   "0", "--json", str(out), *argv]) == 0
    return json.loads(out.read_text())


def test_bytes_per_token_head_are_the_documented_ones(tmp_path):
    """T = 128 (whole items), H = HV, bf16 raw inputs, every activation on: 1,804 B forward, 2,590 B backward."""
    rows = {r["op"]: r for r in _run(tmp_path)["rows"]}
    assert round(rows["fwd"]["bytes_per_token_head"]) == 1804
    assert round(rows["bwd"]["bytes_per_token_head"]) == 2590
    assert all(r["ms"] > 0 and len(r["times_ms"]) == 1 for r in rows.values())


def test_checkouts_compared_one_process_per_visit(tmp_path):
    """Two checkouts (here this tree twice), one visit each: a row per checkout, head count and op."""
    other = str(ROOT / "benchmarks" / "..")
    res = _run(tmp_path, "--checkout", str(ROOT), "--checkout", other, "--visits", "1", "--ops", "fwd")
    assert sorted((r["checkout"], r["op"]) for r in res["rows"]) == sorted([(other, "fwd"), (str(ROOT), "fwd")])
    assert {m["kda_kcp"] for m in res["meta"].values()} == {str(ROOT / "kda_kcp")}
