"""examples/train_lm.py on the CPU: two runs with one seed give bitwise-identical, finite, falling losses and write
loss.json; a W = 2 run under torchrun (gloo, context parallel) follows the W = 1 run; the packing and the targets."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_lm.py"
STEPS = 6
SMALL = ["--steps", str(STEPS), "--hidden", "32", "--layers", "2", "--heads", "2", "--head-dim", "16",
         "--tokens-per-batch", "256", "--max-doc-len", "128", "--warmup", "2", "--lr", "1e-2", "--log-every", "3",
         "--threads", "1", "--seed", "3", "--device", "cpu"]


def load_example():
    spec = importlib.util.spec_from_file_location("train_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(out: Path, *launcher) -> list[float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, *launcher, str(SCRIPT), *SMALL, "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"step {STEPS:5d}  loss" in done.stdout, done.stdout  # progress was shown
    record = json.loads((out / "loss.json").read_text())
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "loss.png").stat().st_size > 0
    else:
        assert "matplotlib is not installed" in done.stdout and not (out / "loss.png").exists()
    assert record["args"]["steps"] == STEPS and len(record["losses"]) == STEPS
    return record["losses"], record


@pytest.fixture(scope="module")
def single_rank_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("train_lm")
    return run(base / "a"), run(base / "b")


def test_two_runs_are_bitwise_identical_and_learn(single_rank_runs):
    (first, record), (second, _) = single_rank_runs
    assert first == second  # floats from JSON round-trip exactly: bitwise equal losses
    assert all(math.isfinite(x) for x in first)
    assert sum(first[-3:]) / 3 < sum(first[:3]) / 3 - 0.2, first
    assert record["world_size"] == 1 and record["args"]["deterministic"] is True


def test_two_ranks_over_gloo_follow_one_rank(single_rank_runs, tmp_path):
    (one, _), _ = single_rank_runs
    two, record = run(tmp_path, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    assert record["world_size"] == 2
    for a, b in zip(one, two):
        assert abs(a - b) < 1e-4 * abs(a), (one, two)


def test_packed_batches_and_targets(tmp_path):
    lm = load_example()
    for i, size in enumerate([1, 0, 50, 300, 7]):
        (tmp_path / f"m{i}.py").write_bytes(bytes((i * 31 + j) % 256 for j in range(size)))
    files = lm.corpus_files(tmp_path)
    assert [f.name for f in files] == [f"m{i}.py" for i in range(5)]
    contents = [f.read_bytes() for f in files]
    batches = lm.PackedBatches(files, tokens=120, max_doc_len=64, seed=0)
    again = lm.PackedBatches(files, tokens=120, max_doc_len=64, seed=0)
    for _ in range(6):
        tokens, cu = next(batches)
        assert torch.equal(tokens, next(again)[0])  # the same seed gives every rank the same batches
        assert len(tokens) == 120 and cu[0] == 0 and cu[-1] == 120
        for s, e in zip(cu[:-1], cu[1:]):
            doc = bytes(tokens[s:e].tolist())
            assert 1 <= len(doc) <= 64
            assert any(doc in c for c in contents if len(c) >= 2)  # a window of one file (empty ones skipped)
        targets = lm.next_byte_targets(tokens, cu)
        ends = set(e - 1 for e in cu[1:])
        for t in range(120):
            assert targets[t] == (lm.IGNORE if t in ends else tokens[t + 1]), t
