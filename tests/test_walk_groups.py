"""The pipelined backward's walk groups (kda_kcp.cuda.tuning.group_runs, bwd_tables.walk_groups): whole-run walks
grouped by walk length so that each group's gradient kernel starts when its own walks end, segmented walks in two
halves of the chunk table; the cap. Pure functions of the plan (CPU); the emulation tests check that every grouping
gives the unpipelined gradients."""

from kda_kcp.cuda import bwd_tables
from kda_kcp.cuda import tuning
from kda_kcp.plan import LocalPlan, build_plan
from helpers import set_tuning

BENCH_DOCS = (42024, 57573, 73122, 88673)  # benchmarks/bench_kda_kcp.py's batch: 657, 900, 1143, 1386 chunks


def local_plan(cu):
    T = cu[-1]
    return LocalPlan(T, build_plan(cu, [[(0, T)]]).rank_runs[0])


def test_group_runs_rule():
    lengths = {0: 657, 1: 900, 2: 1143, 3: 1386}
    assert tuning.group_runs(lengths, 4) == [[0], [1], [3, 2]]  # 1143 >= 0.75 * 1386; 900 and 657 are not
    assert tuning.group_runs(lengths, 3) == [[0], [1], [3, 2]]
    assert tuning.group_runs(lengths, 2) == [[1, 0], [3, 2]]  # at most 2 groups
    assert tuning.group_runs({5: 10, 6: 10, 7: 9}, 4) == [[5, 6, 7]]  # alike: one group (no pipeline)
    assert tuning.group_runs({0: 100, 1: 50, 2: 25, 3: 12, 4: 6}, 4) == [[3, 4], [2], [1], [0]]  # the cap


def test_walk_groups_of_the_benchmark_batch(monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    cu = [0]
    for n in BENCH_DOCS:
        cu.append(cu[-1] + n)
    plan = local_plan(cu)
    for cap, want in ((None, [[(0, 657)], [(657, 1557)], [(1557, 4086)]]),
                      (2, [[(0, 1557)], [(1557, 4086)]])):
        set_tuning(monkeypatch, bwd_walk_groups=cap)
        groups = bwd_tables.walk_groups(plan, 16, "cpu")
        assert [grp.ranges for grp in groups] == want
        assert sum(grp.fwalk.shape[0] for grp in groups) == bwd_tables.seg_tables(plan, 16, "cpu").fwalk.shape[0]


def test_segmented_walks_in_halves(monkeypatch):
    """The benchmark batch's walks in 45-chunk segments at H = 4 (a forced length):
    two groups of whole segments, the first half of the chunk table and the second, every segment in exactly one,
    both walk tables split alike."""
    monkeypatch.setenv(tuning.ENV, "bwd_seg_chunks=45")
    cu = [0]
    for n in BENCH_DOCS:
        cu.append(cu[-1] + n)
    plan = local_plan(cu)
    st = bwd_tables.seg_tables(plan, 4, "cpu")
    assert st.num_sum_f > 0 and st.num_sum_r > 0  # segmented
    groups = bwd_tables.walk_groups(plan, 4, "cpu")
    assert len(groups) == 2
    (a0, a1), = groups[0].ranges
    (b0, b1), = groups[1].ranges
    assert a0 == 0 and a1 == b0 and b1 == 4086 and abs(a1 - 2043) <= st.seg_chunks
    for name in ("fwalk", "rwalk"):
        rows = sorted(tuple(r) for grp in groups for r in getattr(grp, name).tolist())
        assert rows == sorted(tuple(r) for r in getattr(st, name).tolist())
    for grp in groups:  # a segment's forward and reverse walk rows go together
        assert sorted(r[:2] for r in grp.fwalk.tolist()) == sorted(r[:2] for r in grp.rwalk.tolist())


def test_segment_choice_credits_the_pipelined_gradients(monkeypatch):
    """bwd_segment_chunks counts the gradient time that whole-run walks hide (bwd_hidden_gradients) and the two
    walk chains as running at once. The choices below are the measured best ones on the H200."""
    monkeypatch.delenv(tuning.ENV, raising=False)
    # W = 1: whole runs at every H (H = 4: 8.44 ms against 9.14 / 9.05 ms for 45 / 90-chunk segments)
    bench = [657, 900, 1143, 1386]
    assert [tuning.bwd_segment_chunks(bench, H, 132) for H in (4, 16, 64)] == [1386, 1386, 1386]
    # W = 2, H = 16, the rank whose runs were segmented: contiguous rank 1, zigzag rank 1 (whole runs were 1.7 and
    # 2.1 ms faster than the 66- and 77-chunk segments chosen without the credit)
    assert tuning.bwd_segment_chunks([658, 1386], 16, 132) == 1386
    assert tuning.bwd_segment_chunks([536, 1143, 365], 16, 132) == 1143
    assert tuning.bwd_hidden_gradients([10, 10, 9], 16, 132) == 0.0  # one group: nothing runs beside the walks
    hidden = tuning.bwd_hidden_gradients([658, 1386], 16, 132)
    assert hidden == min(1386 - 658, tuning.GRAD_STEP_COST * 16 * 658 / 132)
    # an empty run has no walk, hence no group: it neither adds time nor widens the first group's window
    assert tuning.bwd_hidden_gradients([0, 300, 658, 1386, 0], 16, 132) == tuning.bwd_hidden_gradients([300, 658, 1386], 16, 132)
    # no pipeline, nothing hidden: with the chains at once still whole runs (measured 1.7 and 2.1 ms
    # faster than the 66- and 77-chunk segments the estimate chose when it counted the chains one after the other)
    set_tuning(monkeypatch, bwd_pipeline=0)
    assert tuning.bwd_segment_chunks([658, 1386], 16, 132) == 1386
    assert tuning.bwd_segment_chunks([536, 1143, 365], 16, 132) == 1143
    # the chains one after the other on one stream: the serial estimate, no gradients hidden
    set_tuning(monkeypatch, bwd_walk_streams=0)
    assert tuning.bwd_segment_chunks([658, 1386], 16, 132) == 66
    assert tuning.bwd_segment_chunks([536, 1143, 365], 16, 132) == 77
    assert tuning.bwd_segment_chunks(bench, 4, 132) == 45


def test_kcp_summary_segments_compose_in_reverse(monkeypatch):
    """The KCP exchange's backward summaries cut into segments (bwd_summary_chunks): every chunk of a listed run in
    exactly one segment, the run's last segment's summary in its chain's first slot (the reverse walk's order), one
    chain per listed run; whole runs (bwd_summary_chunks=0) keep one row per run and no chains."""
    plan = local_plan([0, 700, 1000, 1960])  # runs of 11, 5 and 15 chunks
    monkeypatch.setenv(tuning.ENV, "bwd_summary_chunks=4")
    tabs = bwd_tables.summary_tables(plan, (2, 0), "cpu", own_chunks=False, heads=2)
    rows, chains = tabs.rows.tolist(), tabs.chains.tolist()
    # run 2: chunks 16..30 in 4 segments (4, 4, 4, 3), last first; run 0: chunks 0..10 in 3 (4, 4, 3)
    assert chains == [[0, 4, -1, 0], [4, 3, -1, 1]]
    assert rows == [[28, 3, 0, 0], [24, 4, 1, 0], [20, 4, 2, 0], [16, 4, 3, 0],
                    [8, 3, 4, 0], [4, 4, 5, 0], [0, 4, 6, 0]]
    own = bwd_tables.summary_tables(plan, (2, 0), "cpu", own_chunks=True, heads=2)  # the lean path's own chunk table
    assert own.chunks.shape[0] == 26 and own.rows[:, 0].tolist() == [12, 8, 4, 0, 23, 19, 15]
    monkeypatch.setenv(tuning.ENV, "bwd_summary_chunks=0")
    whole = bwd_tables.summary_tables(plan, (2, 0), "cpu", own_chunks=False, heads=2)
    assert whole.chains is None and whole.rows.tolist() == [[16, 15, 0, 0], [0, 11, 1, 0]]


def test_kcp_summary_segment_choice(monkeypatch):
    """A long published run is cut where its whole-run walk would leave SMs idle (H = 16: 64 of 132); 8 chunks at
    least."""
    monkeypatch.delenv(tuning.ENV, raising=False)
    assert tuning.bwd_summary_chunks([658], 16, 132) < 658
    assert all(tuning.bwd_summary_chunks([n], h, 132) >= min(8, n) for n in (5, 300, 1386) for h in (1, 4, 64))
    assert tuning.bwd_summary_chunks([5], 4, 132) == 5


def test_walk_pieces_rule_and_tables(monkeypatch):
    """bwd_walk_pieces: 4 pieces while the walks' CTAs all fit on the GPU (the benchmark batch at H = 4 and 16,
    measured faster there), 1 at H = 64; the override forces a count. The pieces of a group: block j
    of every run, the chain's first piece from the run's own state (src 0, idx = run), the others from the hand-off
    slot of their row (src 1, idx = row); the reverse chain from the last block down; every chunk in one block."""
    monkeypatch.delenv(tuning.ENV, raising=False)
    cu = [0]
    for n in BENCH_DOCS:
        cu.append(cu[-1] + n)
    plan = local_plan(cu)
    for H, want in ((4, 4), (16, 4), (64, 1)):
        st = bwd_tables.seg_tables(plan, H, "cpu")
        assert tuning.bwd_walk_pieces(st.fwalk.shape[0], H, st.walk_warps, 132) == want, H
    assert bwd_tables.walk_groups(plan, 64, "cpu") is not None  # unlike lengths: groups, each of one piece
    assert all(grp.pieces == 1 for grp in bwd_tables.walk_groups(plan, 64, "cpu"))
    monkeypatch.setenv(tuning.ENV, "bwd_walk_pieces=3")
    plan = local_plan([0, 768, 1728])  # runs of 12 and 15 chunks: alike, one group
    (grp,) = bwd_tables.walk_groups(plan, 2, "cpu")
    assert grp.pieces == 3 and grp.rows == 2
    rows = [p.tolist() for p in grp.fwd_pieces]
    firsts = {r[2]: r[0] for r in rows[0]}  # run -> its first chunk row
    assert sorted(firsts) == [0, 1] and all(r[3] == 0 for r in rows[0])
    for j in (1, 2):
        assert [r[2:] for r in rows[j]] == [[0, 1], [1, 1]]  # from the hand-off slot of their row
    assert grp.rev_blocks == [2, 1, 0]
    rev = [p.tolist() for p in grp.rev_pieces]
    assert [r[:2] for r in rev[0]] == [r[:2] for r in rows[2]] and all(r[3] == 0 for r in rev[0])
    assert sorted(c for j in range(3) for a, b in grp.blocks[j] for c in range(a, b)) == list(range(27))
    assert min(range(3), key=grp.ready.__getitem__) == 1  # the middle block: both walks pass it first
