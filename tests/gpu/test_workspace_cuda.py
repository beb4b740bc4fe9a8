"""Workspaces and CUDA graphs on the CUDA path at W = 1 (tests/gpu/test_kcp_nccl.py covers W = 2).

A WorkspaceKcp of exactly kda_workspace_bytes_kcp runs fwd + bwd with results bitwise equal to calls
without one, allocates nothing but the outputs, never blocks the host and fills its arena exactly; a byte
less raises before any kernel runs; one workspace serves several packs in turn; fwd + bwd captured in a
CUDA graph replays bitwise equal to eager calls on new input values."""

from __future__ import annotations

import pytest
import torch

from gpu_common import DEV, capture, fresh_seed, make_inputs, replay, require_kernel_gpu

require_kernel_gpu("the CUDA workspace tests")

import kda_kcp  # noqa: E402

SEED = fresh_seed("workspace cuda")
PACKS = {
    "short": ([0, 1000, 1001, 4000, 9000], 4),
    # one long document at H = 16: the forward and backward walks are segmented (summaries, folds)
    "long": ([0, 60000], 16),
}


def _data(cu, H, seed):
    gen = torch.Generator().manual_seed(seed)
    inputs = make_inputs(cu[-1], H, gen)
    do = torch.randn(cu[-1], H, 128, generator=gen).bfloat16().to(DEV)
    return inputs, do


def _allocations() -> int:
    return torch.cuda.memory_stats(DEV)["allocation.all.allocated"]


def _step(inputs, do, ctx, workspace=None):
    o, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx, workspace=workspace)
    return (o, *kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx, workspace=workspace))


@pytest.mark.parametrize("pack", list(PACKS))
def test_exact_workspace_is_bitwise_allocation_free_and_non_blocking(pack):
    cu, H = PACKS[pack]
    inputs, do = _data(cu, H, SEED)
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=DEV))
    ws = kda_kcp.WorkspaceKcp(ctx, H)
    assert ws.nbytes == kda_kcp.kda_workspace_bytes_kcp(ctx, H) > 0
    arenas, carve = [], ws.arena  # the two calls' arenas (W = 1: the workspace is all arena)
    ws.arena = lambda *args: arenas.append(carve(*args)) or arenas[-1]
    ref = _step(inputs, do, ctx)  # also loads the kernels and uploads the plan's tables
    torch.cuda.synchronize()
    a0 = _allocations()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx, workspace=ws)
        a1 = _allocations()
        grads = kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx, workspace=ws)
        a2 = _allocations()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print(f"[{pack}] workspace {ws.nbytes / 2**20:.1f} MiB; allocations: forward {a1 - a0}, backward {a2 - a1}")
    assert a1 - a0 == 1, "the forward allocated more than o"
    assert a2 - a1 == 5, "the backward allocated more than dq, dk, dv, dg, dbeta"
    assert len(arenas) == 2 and max(a.peak for a in arenas) == ws.nbytes, "the carves' peak is not the sizing's"
    for name, x, r in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), (o, *grads), ref):
        assert torch.equal(x, r), f"{name} with the workspace differs from the call without one"


def test_one_byte_short_raises_before_any_kernel():
    cu, H = PACKS["short"]
    inputs, do = _data(cu, H, SEED + 1)
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=DEV))
    need = kda_kcp.kda_workspace_bytes_kcp(ctx, H)
    short = kda_kcp.WorkspaceKcp.from_buffer(torch.empty(need - 1, dtype=torch.uint8, device=DEV))
    torch.cuda.synchronize()
    a0 = _allocations()
    with pytest.raises(ValueError, match=f"needs {need} bytes"):
        kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx, workspace=short)
    assert _allocations() == a0, "the failed call allocated (an output or scratch) before raising"
    _, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx)
    with pytest.raises(ValueError, match=f"needs {need} bytes"):
        kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx, workspace=short)


def test_one_workspace_serves_several_packs():
    ctxs, data = [], []
    for i, (cu, H) in enumerate(PACKS.values()):
        ctxs.append((kda_kcp.build_context_kcp(torch.tensor(cu, device=DEV)), H))
        data.append(_data(cu, H, SEED + 10 + i))
    need = max(kda_kcp.kda_workspace_bytes_kcp(c, H) for c, H in ctxs)
    ws = kda_kcp.WorkspaceKcp.from_buffer(torch.empty(need, dtype=torch.uint8, device=DEV))
    for _ in range(2):  # in turn, twice
        for (ctx, H), (inputs, do) in zip(ctxs, data):
            got = _step(inputs, do, ctx, ws)
            ref = _step(inputs, do, ctx)
            for x, r in zip(got, ref):
                assert torch.equal(x, r)


@pytest.mark.parametrize("pack", list(PACKS))
def test_cuda_graph_replay_matches_eager(pack):
    """fwd + bwd captured once in a CUDA graph (with a workspace: nothing allocated, nothing synchronized),
    replayed with new input values: bitwise equal to eager calls on those values."""
    cu, H = PACKS[pack]
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=DEV))
    ws = kda_kcp.WorkspaceKcp(ctx, H)
    inputs, do = _data(cu, H, SEED + 20)
    static = [x.clone() for x in (*inputs, do)]
    graph, outs = capture(lambda *xs: _step(xs[:5], xs[5], ctx, ws), static)
    for trial in range(2):
        new_inputs, new_do = _data(cu, H, SEED + 21 + trial)
        replay(graph, static, [*new_inputs, new_do])
        eager = _step(new_inputs, new_do, ctx)
        for name, x, r in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), outs, eager):
            assert torch.equal(x, r), f"trial {trial}: {name} of the replayed graph differs from eager"


@pytest.mark.parametrize("passes", [1, 2, 3])
@pytest.mark.parametrize("pack", list(PACKS))
def test_lean_arena_is_smaller_and_bitwise_equal_to_replay(pack, passes):
    """local_arena="lean": the backward in passes over whole segments, on per-pass buffers."""
    cu, H = PACKS[pack]
    inputs, do = _data(cu, H, SEED + 30)
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=DEV))
    replay = kda_kcp.WorkspaceKcp(ctx, H)
    lean = kda_kcp.WorkspaceKcp(ctx, H, local_arena="lean", lean_passes=passes)
    print(f"[{pack}] workspace replay {replay.nbytes / 2**20:.1f} MiB, lean {passes} passes {lean.nbytes / 2**20:.1f} MiB")
    assert lean.nbytes <= replay.nbytes
    ref = _step(inputs, do, ctx, replay)
    torch.cuda.synchronize()
    a0 = _allocations()
    got = _step(inputs, do, ctx, lean)
    assert _allocations() - a0 == 6, "the lean step allocated more than o and the five gradients"
    for name, x, r in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, ref):
        assert torch.equal(x, r), f"{name}: lean ({passes} passes) differs from replay"


def test_first_call_after_making_the_workspace_copies_nothing():
    """Building the context and the workspace put every index table on the GPU: even the first call
    (kernels already loaded by the backend choice) never blocks the host."""
    cu, H = [0, 2500, 2501, 7000], 4
    inputs, do = _data(cu, H, SEED + 40)
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=DEV))
    ws = kda_kcp.WorkspaceKcp(ctx, H)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(inputs, do, ctx, ws)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_one_workspace_on_two_streams_is_ordered():
    """Two calls in flight on different streams share one WorkspaceKcp: the second waits for the first's use of
    its bytes (an event, no host synchronization), so both results are bitwise the calls' without a workspace.
    The first stream starts each call late (a GPU sleep), so that without the wait the two would overlap."""
    cu, H = PACKS["long"]
    inputs, do = _data(cu, H, SEED)
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=DEV))
    ref = _step(inputs, do, ctx)
    ws = kda_kcp.WorkspaceKcp(ctx, H)
    streams = (torch.cuda.Stream(DEV), torch.cuda.Stream(DEV))
    main = torch.cuda.current_stream(DEV)
    for s in streams:
        s.wait_stream(main)
    got = []
    for _ in range(4):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                if i == 0:
                    torch.cuda._sleep(2_000_000)  # ~1 ms: the other stream's call starts meanwhile
                got.append(_step(inputs, do, ctx, workspace=ws))
    for s in streams:
        main.wait_stream(s)
    torch.cuda.synchronize(DEV)
    for out in got:
        for a, b in zip(out, ref):
            assert torch.equal(a, b)


def test_planned_bytes_equal_the_device_s():
    """kda_workspace_bytes_kcp(arch=, sm_count=) on any machine equals the bytes asked of this GPU."""
    props = torch.cuda.get_device_properties(DEV)
    arch = f"sm_{props.major}{props.minor}a"
    for cu, H in PACKS.values():
        ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=DEV))
        for arena, passes in (("replay", None), ("lean", 2)):
            on_gpu = kda_kcp.kda_workspace_bytes_kcp(ctx, H, local_arena=arena, lean_passes=passes)
            planned = kda_kcp.kda_workspace_bytes_kcp(ctx, H, local_arena=arena, lean_passes=passes, arch=arch,
                                                      sm_count=props.multi_processor_count)
            assert planned == on_gpu > 0
