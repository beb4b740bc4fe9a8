"""The forward's segment choice (kda_kcp.cuda.tuning.fwd_segment_chunks), a pure function of the runs' lengths,
the head count and the SM count, against the lengths measured best on the H200."""

from kda_kcp.cuda import tuning

BENCH = [657, 900, 1143, 1386]  # the benchmark batch's documents in chunks (W = 1)


def test_whole_runs_where_they_fill_the_gpu(monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    # W = 1, H = 16 and 64: whole runs (segments of 232-700 chunks measured 10-30 % slower at H = 16)
    assert tuning.fwd_segment_chunks(BENCH, 16, 132) == 1386
    assert tuning.fwd_segment_chunks(BENCH, 64, 132) == 1386
    # W = 2, H = 64, contiguous rank 1: its 256 whole-run CTAs are all resident at once; 99-chunk segments (the choice
    # under the list-scheduling bound alone) measured 21.5 ms against 18.5 ms for whole runs
    assert tuning.fwd_segment_chunks([658, 1386], 64, 132) == 1386


def test_segments_where_the_gpu_would_idle(monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    # W = 2, H = 16, contiguous rank 1: 347-chunk segments measured best of auto (42) / 173 / 347 / whole runs
    assert 173 < tuning.fwd_segment_chunks([658, 1386], 16, 132) < 700
    # W = 1, H = 4: segmented (463-chunk segments measured 30 % slower than 28-88; 139 and 42 equal)
    assert tuning.fwd_segment_chunks(BENCH, 4, 132) < 463


def test_the_w2_choices_measured_on_the_h200(monkeypatch):
    """Every rank's choice at W = 2 (fwd, H = 4 / 16 / 64), measured against the plain list-scheduling
    bound's choices: fwd as fast or faster in all 9 cells, contiguous H = 64 18.5 against 22.0 ms."""
    monkeypatch.delenv(tuning.ENV, raising=False)
    ranks = {"contiguous": ([657, 900, 486], [658, 1386]), "zigzag": ([657, 365, 1022], [536, 1143, 365]),
             "zigzag_per_document rank 1": ([329, 451, 572, 694],)}
    want = {"contiguous": ([150, 900, 900], [139, 347, 1386]), "zigzag": ([146, 341, 1022], [143, 572, 572]),
            "zigzag_per_document rank 1": ([70, 694, 694],)}
    for layout, runs in ranks.items():
        got = tuple([tuning.fwd_segment_chunks(r, h, 132) for h in (4, 16, 64)] for r in runs)
        assert got == want[layout], layout
