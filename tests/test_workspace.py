"""Byte queries: exact arithmetic on the host (the W > 1 checks against real collectives are in test_kcp)."""

import pytest
import torch

import kda_kcp
from kda_kcp.partition import partition_kcp
from helpers import offsets

BENCH = offsets([42024, 57573, 73122, 88673])


def test_single_rank_needs_no_exchange_and_saves_nothing():
    ctx = kda_kcp.build_context_kcp(BENCH)
    for H in (4, 16, 64):
        assert kda_kcp.kda_workspace_bytes_kcp(ctx, H) == 0
        assert kda_kcp.kda_saved_bytes_kcp(ctx, H) == 0
        assert kda_kcp.kda_comm_bytes_kcp(ctx, H) == 0


class _FakeGroupContext(kda_kcp.KcpContext):
    """A rank's context for W ranks, built without a process group (host arithmetic only)."""

    def __init__(self, cu, world, rank, layout):
        super().__init__(cu, layout, None, world, rank, torch.device("cpu"))


@pytest.mark.parametrize("layout", kda_kcp.LAYOUTS)
def test_byte_arithmetic_at_two_ranks(layout):
    ctx = _FakeGroupContext(BENCH, 2, 0, layout)
    H, K = 16, 128
    per = H * K * (K + K) * 4  # one summary: K x K map + K x V offset per head, FP32
    fwd, bwd = ctx.plan.fwd_slots, ctx.plan.bwd_slots
    assert kda_kcp.kda_comm_bytes_kcp(ctx, H) == 2 * (2 - 1) * per * (fwd + bwd)
    assert kda_kcp.kda_workspace_bytes_kcp(ctx, H) == (1 + 2) * max(fwd, bwd) * per
    assert kda_kcp.kda_saved_bytes_kcp(ctx, H) == ctx.local.num_runs * H * K * K * 4
    parts = partition_kcp(BENCH, 2, layout)
    assert ctx.pieces == parts[0]


def test_arena_arguments():
    ctx = kda_kcp.build_context_kcp(BENCH)
    assert kda_kcp.kda_workspace_bytes_kcp(ctx, 4, local_arena="lean") == 0
    for passes in (1, 8):
        kda_kcp.kda_workspace_bytes_kcp(ctx, 4, local_arena="lean", lean_passes=passes)
    for passes in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="lean_passes must be an int in 1..8"):
            kda_kcp.kda_workspace_bytes_kcp(ctx, 4, local_arena="lean", lean_passes=passes)
    with pytest.raises(ValueError, match="local_arena must be one of"):
        kda_kcp.kda_workspace_bytes_kcp(ctx, 4, local_arena="tiny")
    with pytest.raises(ValueError, match="lean_passes applies to local_arena='lean'"):
        kda_kcp.kda_workspace_bytes_kcp(ctx, 4, lean_passes=2)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="num_heads must be a positive int"):
            kda_kcp.kda_saved_bytes_kcp(ctx, bad)


def test_byte_queries_check_their_arguments():
    """A context that is not a KcpContext, or head dims that are not positive ints, raise naming the argument (not
    an AttributeError from inside, nor a byte count of a shape no call can have)."""
    ctx = _FakeGroupContext(BENCH, 2, 0, "contiguous")
    queries = (kda_kcp.kda_workspace_bytes_kcp, kda_kcp.kda_saved_bytes_kcp, kda_kcp.kda_comm_bytes_kcp,
               kda_kcp.WorkspaceKcp)
    for query in queries:
        for bad in (None, BENCH):
            with pytest.raises(TypeError, match="ctx must be a KcpContext"):
                query(bad, 4)
        for dims in (dict(head_dim=0), dict(head_dim=-1), dict(head_dim=2.5), dict(value_dim=0), dict(head_dim=True)):
            with pytest.raises(ValueError, match=f"{next(iter(dims))} must be a positive int"):
                query(ctx, 4, **dims)
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        kda_kcp.WorkspaceKcp.from_buffer(torch.empty(16, dtype=torch.uint8), deterministic=None)


def test_workspace_object():
    ctx = kda_kcp.build_context_kcp(BENCH)
    ws = kda_kcp.WorkspaceKcp(ctx, 16)
    assert ws.nbytes == 0 and ws.buffer.numel() == 0 and ws.device == torch.device("cpu")
    with pytest.raises(TypeError, match="uint8"):
        kda_kcp.WorkspaceKcp.from_buffer(torch.empty(8, dtype=torch.float32))
    big = torch.empty(4096, dtype=torch.uint8)
    base = (-big.data_ptr()) % 16  # the first 16-byte boundary inside it
    assert kda_kcp.WorkspaceKcp.from_buffer(big[base + 16:]).nbytes == 4096 - base - 16
    with pytest.raises(ValueError, match="16-byte boundary"):
        kda_kcp.WorkspaceKcp.from_buffer(big[base + 3:])
    with pytest.raises(ValueError, match="contiguous"):
        kda_kcp.WorkspaceKcp.from_buffer(big[::2])


def test_sizing_for_a_gpu_this_machine_does_not_have(monkeypatch):
    """A job is planned on a CPU-only node: arch= sizes the CUDA kernels' workspace with no GPU; device="cuda"
    without one says what to pass instead (not torch's AssertionError)."""
    from kda_kcp.cuda import CudaBackend
    from kda_kcp.cuda.common import planning_sm_count
    from kda_kcp.sizing import workspace_bytes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ctx = kda_kcp.build_context_kcp(BENCH)
    for dev in (torch.device("cuda"), "cuda:0"):
        with pytest.raises(ValueError, match="no CUDA device.*arch="):
            kda_kcp.kda_workspace_bytes_kcp(ctx, 16, device=dev)
        with pytest.raises(ValueError, match="no CUDA device"):
            kda_kcp.WorkspaceKcp(ctx, 16, device=dev)
    cpu = torch.device("cpu")
    for arena, passes in (("replay", None), ("lean", 2), ("lean", 3)):
        planned = kda_kcp.kda_workspace_bytes_kcp(ctx, 16, local_arena=arena, lean_passes=passes, arch="sm_90a")
        direct = workspace_bytes(ctx, 16, CudaBackend(True), cpu, lean_passes=passes if arena == "lean" else None)
        assert planned == direct > 0
    # the SM count steers the segment choice, and so the bytes: 114 SMs (an H100 PCIe) is planned as such, and
    # tables planned for one SM count are never reused for another
    with planning_sm_count(114):  # a fresh context: its tables are made here, for 114 SMs
        pcie = workspace_bytes(kda_kcp.build_context_kcp(BENCH), 16, CudaBackend(True), cpu)
    assert kda_kcp.kda_workspace_bytes_kcp(ctx, 16, arch="sm_90a", sm_count=114) == pcie
    assert pcie != kda_kcp.kda_workspace_bytes_kcp(ctx, 16, arch="sm_90a")
    assert kda_kcp.kda_workspace_bytes_kcp(ctx, 16, arch="sm_103a", sm_count=148) == \
        kda_kcp.kda_workspace_bytes_kcp(ctx, 16, arch="sm_100a")
    for kw, match in (({"arch": "sm_80"}, "arch must be one of"), ({"arch": "sm_107a"}, "declared in build.json but not"),
                      ({"arch": "sm_103a"}, "sm_count is required"),
                      ({"sm_count": 132}, "sm_count goes with arch"), ({"arch": "sm_90a", "sm_count": 0}, "positive"),
                      ({"arch": "sm_90a", "device": "cpu"}, "not both")):
        with pytest.raises(ValueError, match=match):
            kda_kcp.kda_workspace_bytes_kcp(ctx, 16, **kw)


def test_cuda_sizing_names_its_head_dim():
    """The CUDA kernels run head dim 128 only: a byte query for them with another says so (the torch backend's take
    any)."""
    ctx = kda_kcp.build_context_kcp(BENCH)
    for kw in ({"head_dim": 64}, {"value_dim": 64}):
        with pytest.raises(ValueError, match="head dim 128 only"):
            kda_kcp.kda_workspace_bytes_kcp(ctx, 4, arch="sm_90a", **kw)
    assert kda_kcp.kda_workspace_bytes_kcp(ctx, 4, head_dim=64) == 0  # (this machine's torch backend, W = 1)
