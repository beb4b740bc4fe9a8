"""The CUDA backend's workspace arithmetic, on the CPU: the CUDA wrappers run with their kernels replaced
by no-ops, so every scratch carve of a forward and a backward call happens as on the GPU (same plans,
tables, segment choices and order) without a GPU. Checks that the arena kda_workspace_bytes_kcp sizes is
exactly the peak of the carves (never more, never less), for the replay arena and the lean one (1 to 3
passes), at W = 1 and at W = 2 over gloo, for every layout, with segmented walks, and that the lean passes
hold every chunk once and the same walk and summary rows; that an arena that only counts (the sizing's) moves as
one on a buffer does, and that the sizing loads, launches and exchanges nothing. tests/gpu/test_workspace_cuda.py
runs the real kernels."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import kda_kcp
import kda_kcp.backend
import kda_kcp.function as function
import kda_kcp.sizing as sizing
import kda_kcp.steps as steps
from kda_kcp.arena import Arena, aligned, tensor_bytes
from kda_kcp.cuda import CudaBackend, backward, bwd_tables, forward
from kda_kcp.sizing import exchange_elements
from helpers import offsets, run_distributed, set_tuning


class _NoKernels:
    """Stands for a loaded kernel module: every entry point does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class _Recorded(Arena):
    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _Recorded.made.append(self)


def _fake_cuda(monkeypatch):
    backend = CudaBackend(True)
    monkeypatch.setattr(function, "select_backend", lambda device, det: backend)
    monkeypatch.setattr(kda_kcp.backend, "select_backend", lambda device, det: backend)
    monkeypatch.setattr(function, "check_inputs", lambda *a: None)
    monkeypatch.setattr(function, "Arena", _Recorded)  # calls without a workspace
    monkeypatch.setattr(kda_kcp.workspace, "Arena", _Recorded)  # WorkspaceKcp.arena: calls with one
    monkeypatch.setattr(forward, "check_tensors", lambda *a: None)
    monkeypatch.setattr(backward, "check_tensors", lambda *a: None)
    monkeypatch.setattr(forward, "load", lambda device: _NoKernels())
    monkeypatch.setattr(backward, "load", lambda device: _NoKernels())
    # segmented forward and backward walks on these small runs, and segmented KCP backward summaries
    set_tuning(monkeypatch, fwd_seg_chunks=3, bwd_seg_chunks=2, bwd_summary_chunks=2)
    return backend


def _inputs(T, H):
    q = torch.zeros(T, H, 128, dtype=torch.bfloat16)
    g = torch.zeros(T, H, 128, dtype=torch.float32)
    return q, q.clone(), q.clone(), g, torch.zeros(T, H, dtype=torch.bfloat16), q.clone()


ARENAS = (("replay", None), ("lean", 1), ("lean", 2), ("lean", 3))


def _check_exact(ctx, H, local_arena="replay", lean_passes=None):
    """One fwd + bwd with a workspace of exactly the queried size: the arena's peak is its whole size."""
    backend = function.select_backend(None, True)
    need = kda_kcp.kda_workspace_bytes_kcp(ctx, H, local_arena=local_arena, lean_passes=lean_passes)
    passes = kda_kcp.workspace.check_arena(local_arena, lean_passes)
    ex = exchange_elements(ctx, H, 128) * 4
    arena_size = sizing.local_arena_bytes(ctx, H, backend, "cpu", passes=passes)
    assert need == (aligned(ex) + arena_size if arena_size else ex)
    q, k, v, g, beta, do = _inputs(ctx.local_tokens, H)

    def workspace(n):
        return kda_kcp.WorkspaceKcp.from_buffer(torch.empty(n, dtype=torch.uint8), True, local_arena, lean_passes)

    _Recorded.made.clear()
    o, saved = function.forward_kcp(q, k, v, g, beta, ctx, None, True, workspace(need))
    grads = function.backward_kcp(do, saved, ctx, workspace(need))
    assert o.shape == q.shape and len(grads) == 5
    peaks = [a.peak for a in _Recorded.made if not a.counting]  # (not the sizing's own arenas)
    assert len(peaks) == 2 and max(peaks) == arena_size, (local_arena, lean_passes, peaks, arena_size)
    # each call's own peak, not only the larger one (the backward's is the larger in every case here)
    parts = sizing.arena_parts(ctx, H, backend, "cpu", passes=passes)
    assert tuple(peaks) == parts, (local_arena, lean_passes, peaks, parts)
    with pytest.raises(ValueError, match=f"needs {need} bytes"):
        function.forward_kcp(q, k, v, g, beta, ctx, None, True, workspace(need - 1))
    with pytest.raises(ValueError, match=f"needs {need} bytes"):
        function.backward_kcp(do, saved, ctx, workspace(need - 1))
    return need


def _check_uploaded(ctx, H, passes=None):
    """After upload_tables (what WorkspaceKcp does), a forward and a backward build no table: on a GPU a table
    built in a call is a blocking host-to-device copy (tests/gpu/test_workspace_cuda.py checks that there)."""
    backend = function.select_backend(None, True)
    backend.upload_tables(ctx, H, "cpu", passes)
    before = set(ctx.local._tables)
    q, k, v, g, beta, do = _inputs(ctx.local_tokens, H)
    arena = "replay" if passes is None else "lean"
    ws = kda_kcp.WorkspaceKcp.from_buffer(
        torch.empty(kda_kcp.kda_workspace_bytes_kcp(ctx, H, local_arena=arena, lean_passes=passes), dtype=torch.uint8),
        True, arena, passes)
    o, saved = function.forward_kcp(q, k, v, g, beta, ctx, None, True, ws)
    function.backward_kcp(do, saved, ctx, ws)
    built = [key for key in set(ctx.local._tables) - before  # (host-only values: the chunk count, the need)
             if isinstance(key, tuple) and key[0] != "workspace_bytes"]
    assert not built, built


def _check_all_arenas(ctx, H):
    sizes = {arena: _check_exact(ctx, H, *arena) for arena in ARENAS}
    # one pass holds every chunk; the replay arena also holds the split walks' hand-off states (the lean passes
    # walk whole runs)
    groups = bwd_tables.walk_groups(ctx.local, H, "cpu") if ctx.local.num_tokens else None
    handoff = sum(2 * tensor_bytes((grp.rows, H, 128, 128), torch.float32) for grp in groups or () if grp.pieces > 1)
    assert sizes[("lean", 1)] + handoff == sizes[("replay", None)]
    assert sizes[("lean", 3)] <= sizes[("lean", 2)] <= sizes[("replay", None)]
    _check_passes(ctx.local, H)


def _check_passes(plan, H):
    """Every chunk in exactly one pass; each pass's rows name the same chunks as the whole tables."""
    if plan.num_tokens == 0:
        return
    st = bwd_tables.seg_tables(plan, H, "cpu")
    chunks, _ = bwd_tables.chunk_tables(plan, "cpu")
    whole = {name: sorted(tuple(chunks[r[0]:r[0] + r[1]].flatten().tolist()) + tuple(r[1:])
                          for r in st.host[name]) for name in ("fwalk", "rwalk", "fsum", "rsum")}
    for passes in (1, 2, 3, 8):
        lean = bwd_tables.lean_passes(plan, H, "cpu", passes)
        seen = sorted(t for p in lean for t in p.chunks[:, 0].tolist())
        assert seen == sorted(chunks[:, 0].tolist())
        for name in whole:
            got = sorted(tuple(p.chunks[r[0]:r[0] + r[1]].flatten().tolist()) + tuple(r[1:])
                         for p in lean for r in getattr(p, name).tolist())
            assert got == whole[name], (passes, name)


@pytest.mark.parametrize("lengths,H", [([1000, 1, 0, 333], 4), ([2000], 2), ([64, 65, 63], 3)])
def test_cuda_arena_is_exact_at_one_rank(monkeypatch, lengths, H):
    _fake_cuda(monkeypatch)
    _check_all_arenas(kda_kcp.build_context_kcp(offsets(lengths)), H)


@pytest.mark.parametrize("seg", [3, 0])  # segmented walks, whole runs (run groups in both directions)
@pytest.mark.parametrize("passes", [None, 2])
def test_upload_tables_leaves_nothing_to_build(monkeypatch, seg, passes):
    _fake_cuda(monkeypatch)
    set_tuning(monkeypatch, fwd_seg_chunks=seg, bwd_seg_chunks=seg)
    monkeypatch.setattr(forward, "sm_count", lambda device: 1)  # so that these small runs form run groups
    ctx = kda_kcp.build_context_kcp(offsets([1000, 1, 0, 333, 130]))
    if seg == 0:
        assert forward.run_group_tables(ctx.local, 2, "cpu") is not None
    _check_uploaded(ctx, 2, passes)


def _two_ranks(rank, world):
    mp = pytest.MonkeyPatch()
    try:
        _fake_cuda(mp)
        for early in (0, 1):  # the KCP forward's early output pass off, on (its carves live through the exchange)
            set_tuning(mp, fwd_early=early)
            for lengths in ([1000, 1, 0, 333], [2001], [5, 700, 61, 300, 3]):
                for layout in kda_kcp.LAYOUTS:
                    ctx = kda_kcp.build_context_kcp(offsets(lengths), dist.group.WORLD, layout)
                    if early == 1 and layout == "contiguous" and lengths[0] == 1000:
                        assert forward.early_runs(ctx.local), "expected runs walked before the exchange"
                    _check_all_arenas(ctx, 2)
                    _check_uploaded(kda_kcp.build_context_kcp(offsets(lengths), dist.group.WORLD, layout), 2)
    finally:
        mp.undo()


def test_cuda_arena_is_exact_at_two_ranks():
    run_distributed(_two_ranks, 2)


def test_call_need_is_cached_per_knob(monkeypatch):
    """A call checks its workspace against the need cached in the context (function._workspace_layout): equal to
    workspace_bytes, and a knob that changes the tables (the backward's segment length) changes the key, so the
    check follows it instead of a stale size."""
    backend = _fake_cuda(monkeypatch)
    ctx = kda_kcp.build_context_kcp(offsets([1000, 1, 0, 333]))
    needs = {}
    for seg in (2, 0):
        set_tuning(monkeypatch, bwd_seg_chunks=seg)
        fresh = sizing.workspace_bytes(ctx, 4, backend, "cpu")
        needs[seg] = function._workspace_layout(ctx, 4, backend, "cpu", 128, 128, torch.float32, None)[0]
        assert needs[seg] == fresh == function._workspace_layout(ctx, 4, backend, "cpu", 128, 128, torch.float32, None)[0]
    assert needs[2] != needs[0]
    q, k, v, g, beta, _ = _inputs(ctx.local_tokens, 4)
    small = kda_kcp.WorkspaceKcp.from_buffer(torch.empty(min(needs.values()), dtype=torch.uint8))
    set_tuning(monkeypatch, bwd_seg_chunks=2 if needs[2] > needs[0] else 0)
    with pytest.raises(ValueError, match="workspace too small"):
        function.forward_kcp(q, k, v, g, beta, ctx, None, True, small)


def test_call_need_follows_the_pipeline_flag(monkeypatch):
    """The backward's segment choice credits the pipelined gradients only while the backward is pipelined, so
    bwd_pipeline changes the tables (here, runs of 536, 1,143 and 365 chunks at H = 4: whole runs or 55-chunk segments)
    and is part of the cached need's key."""
    backend = _fake_cuda(monkeypatch)
    set_tuning(monkeypatch, bwd_seg_chunks=None)
    ctx = kda_kcp.build_context_kcp(offsets([536 * 64, 1143 * 64, 365 * 64]))
    needs = {}
    for flag in (1, 0):
        set_tuning(monkeypatch, bwd_pipeline=flag)
        fresh = sizing.workspace_bytes(ctx, 4, backend, "cpu")
        needs[flag] = function._workspace_layout(ctx, 4, backend, "cpu", 128, 128, torch.float32, None)[0]
        assert needs[flag] == fresh
    assert needs[1] != needs[0]


def test_arena_carves_are_views_of_the_buffer():
    """Each carve is a contiguous view of its own aligned bytes of the workspace, whatever the dtype; the typed
    views a workspace keeps are reused by the next call's arena; a buffer whose size does not divide into a dtype
    is carved at the same offsets."""
    ws = kda_kcp.WorkspaceKcp.from_buffer(torch.zeros(8192, dtype=torch.uint8))
    for a in (ws.arena(256, 8192, "cpu"), ws.arena(256, 8192, "cpu")):
        x = a.empty((2, 3, 5), torch.float32)
        y = a.empty((7,), torch.bfloat16)
        z = a.empty((0, 4), torch.float32)
        w = a.empty((3, 2), torch.int32)
        assert x.is_contiguous() and y.is_contiguous() and w.is_contiguous() and z.shape == (0, 4)
        assert a.peak == 256 * 3 and a.offset == 256 * 3
        for t, start in ((x, 256), (y, 512), (w, 768)):
            assert t.untyped_storage().data_ptr() == ws.buffer.untyped_storage().data_ptr()
            assert t.storage_offset() * t.element_size() == start
        x.fill_(1.5), y.fill_(-2.0), w.fill_(7)
        assert torch.equal(ws.buffer[256:256 + 120].view(torch.float32), torch.full((30,), 1.5))
        assert torch.equal(ws.buffer[512:512 + 14].view(torch.bfloat16), torch.full((7,), -2.0, dtype=torch.bfloat16))
        assert torch.equal(ws.buffer[768:768 + 24].view(torch.int32), torch.full((6,), 7, dtype=torch.int32))
        assert ws.buffer[256 + 120:512].eq(0).all() and ws.buffer[512 + 14:768].eq(0).all()
        ws.buffer.zero_()
    assert len(ws._arenas[1]) == 1  # one (start, end): its views were made once
    odd = Arena(torch.zeros(1000, dtype=torch.uint8)[:998], "cpu")  # 998 bytes: no float32 view of the whole
    t = odd.empty((3,), torch.float32)
    assert t.storage_offset() == 0 and odd.empty((2,), torch.float32).storage_offset() * 4 == 256


def test_count_only_arena_counts_as_a_buffer_does():
    """Arena.count_only: a carve sequence (marks and releases included) moves its offset and peak exactly as on a
    buffer; its carves are meta tensors of the carve's shape and dtype, and nothing bounds it."""
    real = Arena(torch.zeros(1 << 16, dtype=torch.uint8), "cpu")
    count = Arena.count_only("cpu")
    assert count.counting and not real.counting and count.device == torch.device("cpu")
    steps = [((3, 5), torch.float32), "mark", ((7,), torch.bfloat16), ((0, 4), torch.float32), ((2, 3000), torch.uint8),
             "release", ((64, 4), torch.float64), ((1,), torch.int32)]
    base = {}
    for step in steps:
        for arena in (real, count):
            if step == "mark":
                base[arena] = arena.mark()
            elif step == "release":
                arena.release(base[arena])
            else:
                t = arena.empty(*step)
                assert tuple(t.shape) == step[0] and t.dtype == step[1]
                assert t.device.type == ("meta" if arena is count else "cpu")
        assert count.offset == real.offset and count.peak == real.peak, step
    assert real.peak == 256 + 256 + 6144 and real.offset == 256 + 2048 + 256  # the peak was before the release
    huge = count.empty((1 << 20, 1 << 20), torch.float32)  # 4 TiB, counted, never allocated
    assert huge.is_meta and count.peak == count.offset > 1 << 42


def test_sizing_launches_loads_and_exchanges_nothing(monkeypatch):
    """arena_parts runs the calls' own steps on an arena that only counts: no program is loaded, no status word is
    made, nothing is exchanged or merged (a context without a process group, at W = 2), and the sizes equal those
    of a workspace call's carves (test_cuda_arena_is_exact_*)."""
    from test_workspace import _FakeGroupContext

    def refuse(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"the sizing called {what}")
        return fail

    for owner, name in ((forward, "load"), (backward, "load"), (kda_kcp.status, "word"), (kda_kcp.status, "fill"),
                        (steps, "gather_summaries"), (steps, "affine_merge")):
        monkeypatch.setattr(owner, name, refuse(f"{owner.__name__}.{name}"))
    set_tuning(monkeypatch, fwd_early=1, bwd_summary_chunks=2)  # an early output pass too; segmented KCP summaries
    backend = CudaBackend(True)
    cu = offsets([1000, 1, 0, 333, 5000])
    for ctx in (kda_kcp.build_context_kcp(cu), _FakeGroupContext(cu, 2, 0, "zigzag"),
                _FakeGroupContext(cu, 2, 1, "contiguous")):
        assert ctx.world_size == 1 or ctx.plan.needs_exchange
        for passes in (None, 2):
            fwd, bwd = sizing.arena_parts(ctx, 4, backend, "cpu", passes=passes)
            assert fwd > 0 and bwd > 0
