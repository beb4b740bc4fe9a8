"""The benchmark's cell logic (benchmarks/bench_kda_kcp.py) with stubbed arms: an arm that runs out of memory is
reported as OOM, and `--fla-ckpt-after-bwd-oom skip` leaves FLA's ckpt cell of that layout and H unrun (and says
so) while the default runs it and every other cell."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_mod():
    spec = importlib.util.spec_from_file_location("bench_kda_kcp", ROOT / "benchmarks" / "bench_kda_kcp.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_kda_kcp"] = mod
    spec.loader.exec_module(mod)
    return mod


def _bench(mod, policy, oom_at):
    """A Bench without __init__'s devices and FLA: arms det, nd, control, fla; `fla` runs out of memory in the
    cells listed in oom_at (op, H); every visit is recorded."""
    b = mod.Bench.__new__(mod.Bench)
    b.args = SimpleNamespace(arms=["det", "nd", "control", "fla"], groups=2, iters=3, fla_ckpt_after_bwd_oom=policy)
    b.W, b.rank, b.cuda, b.fla_reason, b.bwd_oom = 1, 0, False, None, set()
    b.visits = []

    def visit(arm, op, lay, H, x, do, iters):
        b.visits.append((arm, op, H))
        if arm == "fla" and (op, H) in oom_at:
            raise torch.cuda.OutOfMemoryError("stub")
        return [1.0] * iters, None, None

    b.visit = visit
    b.byte_queries = lambda lay, H: {}
    b.free = lambda: None
    return b


def _cells(mod, b):
    lay = SimpleNamespace(name="contiguous", fla_cp_reason=None)
    return {(op, H): b.run_cell(lay, H, op, None, None) for H in (4, 64) for op in ("fwd", "bwd", "ckpt")}


@pytest.mark.parametrize("policy", ["run", "skip"])
def test_fla_ckpt_after_bwd_oom(bench_mod, policy):
    b = _bench(bench_mod, policy, oom_at={("bwd", 64), ("ckpt", 64)})
    rows = _cells(bench_mod, b)
    assert rows[("bwd", 64)]["arms"]["fla"]["status"] == "OOM"
    assert bench_mod.arm_cell(rows[("bwd", 64)], "fla") == "unsupported (OOM)"
    ckpt = rows[("ckpt", 64)]["arms"]["fla"]
    tried = ("fla", "ckpt", 64) in b.visits
    if policy == "skip":
        assert not tried and ckpt["status"] == bench_mod.NOT_RUN_AFTER_OOM and ckpt["ms"] is None
        assert bench_mod.arm_cell(rows[("ckpt", 64)], "fla") == bench_mod.NOT_RUN_AFTER_OOM
    else:
        assert tried and ckpt["status"] == "OOM"
    # every other cell ran every arm, and ours ran in the skipped cell too
    for (op, H), row in rows.items():
        for a, v in row["arms"].items():
            if a == "fla" and H == 64 and op in ("bwd", "ckpt"):
                continue
            assert v["status"] == "ok" and v["ms"] == 1.0, (op, H, a)
    assert rows[("ckpt", 64)]["speedup"]["det/fla"] is None


def test_w2_spawn_retries_a_taken_rendezvous_port(bench_mod, monkeypatch):
    """W > 1: a rendezvous port taken between free_port() and rank 0's bind (EADDRINUSE at init_process_group, before
    any work) is retried with a fresh port; any other failure of a rank propagates at once."""
    import torch.multiprocessing as mp

    calls = []

    def spawn(fn, args, nprocs, join):
        calls.append(args[1])
        if len(calls) == 1:
            raise mp.ProcessRaisedException("DistNetworkError: ... code: -98, name: EADDRINUSE ...", 0, 1)

    monkeypatch.setattr(mp, "spawn", spawn)
    bench_mod.main(["--world", "2", "--device", "cpu", "--heads", "1"])
    assert len(calls) == 2 and all(isinstance(p, int) for p in calls)

    def failing(fn, args, nprocs, join):
        raise mp.ProcessRaisedException("RuntimeError: something else", 1, 2)

    monkeypatch.setattr(mp, "spawn", failing)
    with pytest.raises(mp.ProcessRaisedException, match="something else"):
        bench_mod.main(["--world", "2", "--device", "cpu", "--heads", "1"])
