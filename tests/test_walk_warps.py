"""The backward walks' CTA width (kda_kcp.cuda.tuning.walk_warps and SegTables): 4 warps where a launch fits
on the GPU at 4, else 8; the override. Pure functions of the shapes (CPU)."""

from kda_kcp.cuda import bwd_tables
from kda_kcp.cuda import tuning
from kda_kcp.plan import LocalPlan, build_plan
from helpers import set_tuning


def local_plan(cu):
    T = cu[-1]
    return LocalPlan(T, build_plan(cu, [[(0, T)]]).rank_runs[0])


def test_walk_warps_rule(monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    assert tuning.walk_warps(132, 132) == 4  # fits: one 4-warp CTA per SM
    assert tuning.walk_warps(133, 132) == 8
    assert tuning.walk_warps(0, 132) == 4
    for v, want in ((4, 4), (8, 8), (None, 8)):
        set_tuning(monkeypatch, bwd_walk_warps=v)
        assert tuning.walk_warps(1000, 132) == want


def test_segment_tables_choose_the_width(monkeypatch):
    """The benchmark batch at H = 16 (whole runs: 4 rows x 16 heads x 3 SMs at 4 warps = 192 > 132) takes 8; a
    single short document at H = 1 takes 4; the KCP exchange's summaries of 2 runs at H = 4 (32 SMs) take 4."""
    monkeypatch.delenv(tuning.ENV, raising=False)
    cu = [0, 42024, 99597, 172719, 261392]
    st = bwd_tables.SegTables(local_plan(cu), 16, "cpu")
    assert st.num_sum_f == 0 and st.walk_warps == 8
    small = bwd_tables.SegTables(local_plan([0, 1000]), 1, "cpu")
    assert small.walk_warps == 4
    assert tuning.bwd_rev_summary_warps(2, 4, 132) == 4
