"""kda_kcp.cuda.tuning: the default choices pinned on a table of shapes, the single override KDA_KCP_TUNING (its
parsing, its validation, each key reaching its choice) and the cache key the tables and the workspace need fold in.
Pure functions (CPU)."""

import pytest

from kda_kcp.cuda import CudaBackend, tuning
from kda_kcp.cuda import bwd_tables
from kda_kcp.plan import LocalPlan, build_plan
from helpers import set_tuning

# (run chunks, H, SMs, fwd_segment_chunks, bwd_segment_chunks, bwd_summary_chunks, fwd_run_groups, bwd_walk_groups,
#  bwd_walk_warps of one row per run, bwd_walk_pieces at that width): the default choices, pinned so that a change
# to a cost model or a rule shows here (the benchmark batch and the W = 2 ranks' runs first, then seeded shapes)
CASES = [
    ([657, 900, 1143, 1386], 1, 132, 66, 45, 66, [[3], [2], [1], [0]], [[0], [1], [3, 2]], 4, 4),
    ([657, 900, 1143, 1386], 4, 132, 139, 1386, 73, [[3], [2], [1], [0]], [[0], [1], [3, 2]], 4, 4),
    ([657, 900, 1143, 1386], 16, 114, 693, 1386, 99, [[3], [2], [1], [0]], [[0], [1], [3, 2]], 8, 1),
    ([657, 900, 1143, 1386], 64, 132, 1386, 1386, 139, [[3], [2], [1], [0]], [[0], [1], [3, 2]], 8, 1),
    ([658, 1386], 1, 132, 61, 42, 66, [[1], [0]], [[0], [1]], 4, 4),
    ([658, 1386], 4, 132, 139, 56, 66, [[1], [0]], [[0], [1]], 4, 4),
    ([658, 1386], 16, 114, 693, 1386, 77, [[1], [0]], [[0], [1]], 4, 4),
    ([658, 1386], 64, 132, 1386, 1386, 116, [[1], [0]], [[0], [1]], 8, 1),
    ([536, 1143, 365], 1, 132, 61, 37, 64, [[1], [0], [2]], [[2], [0], [1]], 4, 4),
    ([536, 1143, 365], 4, 132, 143, 1143, 64, [[1], [0], [2]], [[2], [0], [1]], 4, 4),
    ([536, 1143, 365], 16, 132, 572, 1143, 77, [[1], [0], [2]], [[2], [0], [1]], 8, 4),
    ([536, 1143, 365], 64, 132, 572, 1143, 96, [[1], [0], [2]], [[2], [0], [1]], 8, 1),
    ([657, 900, 486], 1, 132, 36, 36, 53, [[1], [0], [2]], [[2], [0], [1]], 4, 4),
    ([657, 900, 486], 4, 132, 150, 900, 60, [[1], [0], [2]], [[2], [0], [1]], 4, 4),
    ([657, 900, 486], 16, 132, 900, 900, 70, [[1], [0], [2]], [[2], [0], [1]], 8, 4),
    ([657, 900, 486], 64, 132, 900, 900, 100, [[1], [0], [2]], [[2], [0], [1]], 8, 1),
    ([657, 365, 1022], 1, 132, 61, 38, 57, [[2], [0], [1]], [[1], [0], [2]], 4, 4),
    ([657, 365, 1022], 4, 132, 146, 1022, 57, [[2], [0], [1]], [[1], [0], [2]], 4, 4),
    ([657, 365, 1022], 16, 132, 341, 1022, 73, [[2], [0], [1]], [[1], [0], [2]], 8, 4),
    ([657, 365, 1022], 64, 132, 1022, 1022, 103, [[2], [0], [1]], [[1], [0], [2]], 8, 1),
    ([329, 451, 572, 694], 1, 132, 32, 29, 50, [[3], [2], [1, 0]], [[0], [1], [3, 2]], 4, 4),
    ([329, 451, 572, 694], 4, 132, 70, 694, 50, [[3], [2], [1], [0]], [[0], [1], [3, 2]], 4, 4),
    ([329, 451, 572, 694], 16, 114, 347, 694, 58, [[3], [2], [1], [0]], [[0], [1], [3, 2]], 8, 1),
    ([329, 451, 572, 694], 64, 132, 694, 694, 116, [[3], [2], [1], [0]], [[0], [1], [3, 2]], 8, 1),
    ([1021, 1021, 1021, 1021], 1, 132, 64, 41, 57, None, [[0, 1, 2, 3]], 4, 4),
    ([1021, 1021, 1021, 1021], 4, 132, 256, 1021, 64, None, [[0, 1, 2, 3]], 4, 4),
    ([1021, 1021, 1021, 1021], 16, 114, 1021, 1021, 93, None, [[0, 1, 2, 3]], 8, 1),
    ([1021, 1021, 1021, 1021], 64, 132, 1021, 1021, 146, None, [[0, 1, 2, 3]], 8, 1),
    ([5], 1, 132, 5, 5, 5, None, [[0]], 4, 4),
    ([5], 4, 132, 5, 5, 5, None, [[0]], 4, 4),
    ([5], 16, 132, 5, 5, 5, None, [[0]], 4, 4),
    ([5], 64, 132, 5, 5, 5, None, [[0]], 8, 4),
    ([300], 1, 132, 20, 20, 30, None, [[0]], 4, 4),
    ([300], 4, 132, 20, 20, 30, None, [[0]], 4, 4),
    ([300], 16, 132, 75, 300, 30, None, [[0]], 4, 4),
    ([300], 64, 132, 300, 300, 43, None, [[0]], 8, 4),
    ([1386], 1, 132, 48, 42, 66, None, [[0]], 4, 4),
    ([1386], 4, 132, 87, 48, 66, None, [[0]], 4, 4),
    ([1386], 16, 132, 347, 1386, 73, None, [[0]], 4, 4),
    ([1386], 64, 132, 1386, 1386, 99, None, [[0]], 8, 4),
    ([10, 10, 9], 1, 132, 10, 10, 10, None, [[0, 1, 2]], 4, 4),
    ([10, 10, 9], 4, 132, 10, 10, 10, None, [[0, 1, 2]], 4, 4),
    ([10, 10, 9], 16, 132, 10, 10, 10, None, [[0, 1, 2]], 8, 4),
    ([10, 10, 9], 64, 132, 10, 10, 10, None, [[0, 1, 2]], 8, 1),
    ([100, 50, 25, 12, 6], 1, 132, 13, 10, 20, None, [[3, 4], [2], [1], [0]], 4, 4),
    ([100, 50, 25, 12, 6], 4, 132, 17, 100, 20, [[0, 1], [2, 3, 4]], [[3, 4], [2], [1], [0]], 4, 4),
    ([100, 50, 25, 12, 6], 16, 132, 34, 100, 25, [[0], [1], [2, 3], [4]], [[3, 4], [2], [1], [0]], 8, 1),
    ([100, 50, 25, 12, 6], 64, 132, 50, 100, 25, [[0], [1], [2], [3, 4]], [[3, 4], [2], [1], [0]], 8, 1),
    ([14, 930, 704], 1, 132, 47, 31, 55, [[1], [2], [0]], [[0], [1, 2]], 4, 4),
    ([14, 930, 704], 4, 132, 117, 47, 55, [[1], [2], [0]], [[0], [1, 2]], 4, 4),
    ([14, 930, 704], 16, 132, 310, 930, 62, [[1], [2], [0]], [[0], [1, 2]], 8, 4),
    ([14, 930, 704], 64, 132, 930, 930, 93, [[1], [2], [0]], [[0], [1, 2]], 8, 1),
    ([792, 158, 14], 1, 132, 36, 33, 53, [[0], [1, 2]], [[2], [1], [0]], 4, 4),
    ([792, 158, 14], 4, 132, 66, 40, 53, [[0], [1], [2]], [[2], [1], [0]], 4, 4),
    ([792, 158, 14], 16, 132, 159, 792, 53, [[0], [1], [2]], [[2], [1], [0]], 8, 4),
    ([792, 158, 14], 64, 132, 80, 792, 80, [[0], [1], [2]], [[2], [1], [0]], 8, 1),
    ([1], 1, 132, 1, 1, 1, None, [[0]], 4, 4),
    ([1], 4, 132, 1, 1, 1, None, [[0]], 4, 4),
    ([1], 16, 132, 1, 1, 1, None, [[0]], 4, 4),
    ([1], 64, 132, 1, 1, 1, None, [[0]], 8, 4),
    ([186, 19, 146], 1, 132, 17, 17, 27, None, [[1], [0, 2]], 4, 4),
    ([186, 19, 146], 4, 132, 24, 21, 27, [[0], [2], [1]], [[1], [0, 2]], 4, 4),
    ([186, 19, 146], 16, 132, 62, 186, 31, [[0], [2], [1]], [[1], [0, 2]], 8, 4),
    ([186, 19, 146], 64, 132, 186, 186, 38, [[0], [2], [1]], [[1], [0, 2]], 8, 1),
    ([8, 1053, 114, 2, 767], 1, 132, 56, 39, 62, [[1], [4], [2, 0, 3]], [[0, 3], [2], [4], [1]], 4, 4),
    ([8, 1053, 114, 2, 767], 4, 132, 66, 59, 62, [[1], [4], [2, 0, 3]], [[0, 3], [2], [4], [1]], 4, 4),
    ([8, 1053, 114, 2, 767], 16, 132, 39, 1053, 66, [[1], [4], [2], [0, 3]], [[0, 3], [2], [4], [1]], 8, 1),
    ([8, 1053, 114, 2, 767], 64, 132, 1053, 1053, 117, [[1], [4], [2], [0, 3]], [[0, 3], [2], [4], [1]], 8, 1),
    ([701, 1178, 8], 1, 132, 54, 38, 62, [[1], [0], [2]], [[2], [0], [1]], 4, 4),
    ([701, 1178, 8], 4, 132, 131, 54, 62, [[1], [0], [2]], [[2], [0], [1]], 4, 4),
    ([701, 1178, 8], 16, 132, 44, 1178, 74, [[1], [0], [2]], [[2], [0], [1]], 8, 4),
    ([701, 1178, 8], 64, 132, 79, 1178, 118, [[1], [0], [2]], [[2], [0], [1]], 8, 1),
    ([11], 1, 132, 11, 11, 11, None, [[0]], 4, 4),
    ([11], 4, 132, 11, 11, 11, None, [[0]], 4, 4),
    ([11], 16, 132, 11, 11, 11, None, [[0]], 4, 4),
    ([11], 64, 132, 11, 11, 11, None, [[0]], 8, 4),
    ([149], 1, 132, 15, 15, 25, None, [[0]], 4, 4),
    ([149], 4, 132, 17, 15, 25, None, [[0]], 4, 4),
    ([149], 16, 132, 38, 149, 25, None, [[0]], 4, 4),
    ([149], 64, 132, 149, 149, 30, None, [[0]], 8, 4),
    ([1107, 25, 1786, 11, 16], 1, 132, 47, 47, 78, [[2], [0], [1, 4, 3]], [[4, 3], [1], [0], [2]], 4, 4),
    ([1107, 25, 1786, 11, 16], 4, 132, 163, 62, 78, [[2], [0], [1, 4, 3]], [[4, 3], [1], [0], [2]], 4, 4),
    ([1107, 25, 1786, 11, 16], 16, 132, 47, 1786, 94, [[2], [0], [1, 4], [3]], [[4, 3], [1], [0], [2]], 8, 1),
    ([1107, 25, 1786, 11, 16], 64, 132, 112, 1786, 128, [[2], [0], [1], [4, 3]], [[4, 3], [1], [0], [2]], 8, 1),
    ([155], 1, 132, 16, 13, 26, None, [[0]], 4, 4),
    ([155], 4, 132, 18, 16, 26, None, [[0]], 4, 4),
    ([155], 16, 132, 39, 155, 26, None, [[0]], 4, 4),
    ([155], 64, 132, 155, 155, 31, None, [[0]], 8, 4),
]


@pytest.fixture
def defaults(monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}runs-H{c[1]}-{c[2]}sms")
def test_default_choices_are_pinned(defaults, case):
    runs, H, sms, fseg, bseg, bsum, fgroups, bgroups, warps, pieces = case
    lengths = dict(enumerate(runs))
    assert tuning.fwd_segment_chunks(runs, H, sms) == fseg
    assert tuning.bwd_segment_chunks(runs, H, sms) == bseg
    assert tuning.bwd_summary_chunks(runs, H, sms) == bsum
    assert tuning.fwd_run_groups(lengths, H, sms) == fgroups
    assert tuning.bwd_walk_groups(lengths) == bgroups
    assert tuning.bwd_walk_warps(len(runs), H, sms) == warps
    assert tuning.bwd_walk_pieces(len(runs), H, warps, sms) == pieces


def test_default_flags(defaults):
    assert (tuning.fwd_warps(), tuning.fwd_early_mode(), tuning.fwd_early(),
            tuning.fwd_pipeline()) == (4, 0, False, True)
    assert (tuning.bwd_grads_warps(), tuning.bwd_walk_streams(), tuning.bwd_pipeline(),
            tuning.bwd_max_walk_groups()) == (16, True, True, 4)
    assert tuning.overrides() == {} and tuning.cache_key() == () and CudaBackend().table_knobs() == ()
    assert tuning.fwd_group_walk_priority(4, 16, 132) == -1  # 4 runs x 16 heads x 2 CTAs = 128 <= 132: one per SM
    assert tuning.fwd_group_walk_priority(4, 64, 132) == 0


def test_override_is_parsed_into_one_sorted_key(monkeypatch):
    monkeypatch.setenv(tuning.ENV, " fwd_warps=8 ,bwd_seg_chunks = 8,, ")
    assert tuning.overrides() == {"bwd_seg_chunks": 8, "fwd_warps": 8}
    assert tuning.cache_key() == (("bwd_seg_chunks", 8), ("fwd_warps", 8)) == CudaBackend().table_knobs()
    monkeypatch.setenv(tuning.ENV, "")
    assert tuning.cache_key() == ()


@pytest.mark.parametrize("text,message", [
    ("fwd_wraps=8", "unknown key 'fwd_wraps'; the keys are fwd_seg_chunks, fwd_warps"),
    ("fwd_warps=3", "fwd_warps must be 2, 4 or 8, got '3'"),
    ("fwd_warps", "fwd_warps must be 2, 4 or 8, got 'fwd_warps'"),
    ("bwd_walk_groups=5", "bwd_walk_groups must be 2, 3 or 4"),
    ("bwd_walk_pieces=0", "bwd_walk_pieces must be an integer in 1..16, got '0'"),
    ("bwd_seg_chunks=-2", "bwd_seg_chunks must be an integer >= 0, got '-2'"),
    ("bwd_seg_chunks=auto", "bwd_seg_chunks must be an integer >= 0"),
    ("bwd_walk_warps=16", "bwd_walk_warps must be 4 or 8"),
    ("fwd_early=1,fwd_early=2", "fwd_early is given twice"),
])
def test_bad_override_names_what_is_allowed(monkeypatch, text, message):
    monkeypatch.setenv(tuning.ENV, text)
    with pytest.raises(ValueError, match="KDA_KCP_TUNING: " + message.replace("(", r"\(").replace(".", r"\.")):
        tuning.cache_key()
    with pytest.raises(ValueError, match="KDA_KCP_TUNING"):  # every reader raises, not only the cache key
        tuning.fwd_warps()


def test_each_key_forces_its_choice(monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    bench = [657, 900, 1143, 1386]
    forced = {
        "fwd_seg_chunks": (5, lambda: tuning.fwd_segment_chunks(bench, 16, 132), 5),
        "fwd_warps": (8, tuning.fwd_warps, 8),
        "fwd_early": (2, lambda: (tuning.fwd_early_mode(), tuning.fwd_early()), (2, True)),
        "fwd_pipeline": (0, lambda: tuning.fwd_run_groups(dict(enumerate(bench)), 1, 1), None),
        "bwd_seg_chunks": (9, lambda: tuning.bwd_segment_chunks(bench, 16, 132), 9),
        "bwd_summary_chunks": (7, lambda: tuning.bwd_summary_chunks(bench, 16, 132), 7),
        "bwd_walk_warps": (8, lambda: tuning.bwd_walk_warps(1, 1, 132), 8),
        "bwd_grads_warps": (8, tuning.bwd_grads_warps, 8),
        "bwd_walk_streams": (0, tuning.bwd_walk_streams, False),
        "bwd_pipeline": (0, tuning.bwd_pipeline, False),
        "bwd_walk_groups": (2, lambda: tuning.bwd_walk_groups(dict(enumerate(bench))), [[1, 0], [3, 2]]),
        "bwd_walk_pieces": (3, lambda: tuning.bwd_walk_pieces(4, 64, 8, 132), 3),
    }
    assert sorted(forced) == sorted(tuning.KNOBS)
    for key, (value, choice, want) in forced.items():
        default = choice()
        set_tuning(monkeypatch, **{key: value})
        assert choice() == want != default, key
        set_tuning(monkeypatch, **{key: None})
        assert choice() == default, key
    # 0 keeps whole runs
    set_tuning(monkeypatch, fwd_seg_chunks=0, bwd_seg_chunks=0, bwd_summary_chunks=0)
    assert tuning.fwd_segment_chunks([0, *bench], 4, 132) == 1386
    assert tuning.bwd_segment_chunks(bench, 4, 132) == tuning.bwd_summary_chunks(bench, 4, 132) == 1386


def test_tables_key_on_the_override(monkeypatch):
    """A forced backward segment length changes the segment tables a plan caches (their key folds in the override)."""
    monkeypatch.delenv(tuning.ENV, raising=False)
    T = 64 * 40
    plan = LocalPlan(T, build_plan([0, T], [[(0, T)]]).rank_runs[0])
    chosen = tuning.bwd_segment_chunks([40], 4, 132)
    assert bwd_tables.seg_tables(plan, 4, "cpu").seg_chunks == chosen != 10
    set_tuning(monkeypatch, bwd_seg_chunks=10)
    assert bwd_tables.seg_tables(plan, 4, "cpu").seg_chunks == 10
    monkeypatch.delenv(tuning.ENV)
    assert bwd_tables.seg_tables(plan, 4, "cpu").seg_chunks == chosen
