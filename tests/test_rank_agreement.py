"""Ranks that disagree, or one rank whose checks fail, over gloo at W = 2 and 3: every rank raises the same
ValueError within seconds, and none hangs.

The cases run on a gloo group whose timeout is a few seconds: a rank left waiting in a collective fails
its case with gloo's timeout error instead of stalling the run. In every case the last rank is the odd one.
"""

import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import kda_kcp
from helpers import make_inputs, offsets, rel_rms, run_distributed, step
from kda_kcp.context import KcpContext

TIMEOUT = timedelta(seconds=10)
CU = offsets([70, 50, 40])  # every document crosses a piece at W = 2 and 3: both directions exchange
H, K, V = 2, 16, 8
SIZES = dict(head_dim=K, value_dim=V, dtype=torch.float64)


def _local(ctx, seed=0, **kw):
    inputs, do = make_inputs(CU, **{"H": H, "K": K, "V": V, "seed": seed, **kw})
    return [ctx.shard(x) for x in inputs], ctx.shard(do)


def _cases(rank, world, group):
    """(name, call, pattern): ``call`` runs this rank's side of the case; the last rank's differs."""
    odd = rank == world - 1
    ctx = kda_kcp.build_context_kcp(CU, group, "contiguous")
    local, do = _local(ctx)
    fwd = lambda *xs, **kw: kda_kcp.chunk_kda_kcp(*xs, ctx, **kw)  # noqa: E731
    ws = kda_kcp.WorkspaceKcp(ctx, H, **SIZES)
    lean = kda_kcp.WorkspaceKcp(ctx, H, local_arena="lean", **SIZES)
    nan_q = local[0].clone()
    nan_q[0, 0, 0] = float("nan")
    _, saved = kda_kcp.chunk_kda_fwd_kcp(*local, ctx)
    _, checked = kda_kcp.chunk_kda_fwd_kcp(*local, ctx, validate=True)
    nan_do = do.clone()
    nan_do[0, 0, 0] = float("nan")
    other_ctx = kda_kcp.build_context_kcp(offsets([60, 60, 40]), group, "contiguous")  # same T, other documents
    # a context of another rank (built by hand: build_context_kcp gives each rank its own)
    foreign = KcpContext(CU, "contiguous", group, world, rank - 1 if odd else rank, "cpu")
    others = "rank 0 has {0}, .*rank %d has {1}" % (world - 1)
    failed = r"a rank failed its checks, so every rank raises: rank %d \((.+?)\): " % (world - 1)
    return [
        ("H", lambda: fwd(*_local(ctx, H=3 if odd else H)[0]), r"forward calls disagree: H: " + others.format(2, 3)),
        ("V", lambda: fwd(*_local(ctx, V=4 if odd else V)[0]), r"disagree: V: " + others.format(8, 4)),
        ("dtype", lambda: fwd(*_local(ctx, dtype=torch.float32 if odd else torch.float64)[0]),
         r"disagree: q dtype: " + others.format("torch.float64", "torch.float32") + "; k dtype: "),
        ("scale", lambda: fwd(*local, scale=0.5 if odd else None), r"disagree: scale: " + others.format(0.25, 0.5)),
        ("deterministic", lambda: fwd(*local, deterministic=not odd),
         r"disagree: deterministic: " + others.format(True, False)),
        ("workspace vs none", lambda: fwd(*local, workspace=ws if odd else None),
         r"disagree: workspace: " + others.format("none", "replay")),
        ("replay vs lean", lambda: fwd(*local, workspace=lean if odd else ws),
         r"disagree: workspace: " + others.format("replay", r"lean \(2 passes\)")),
        ("bad shape", lambda: fwd(local[0], local[1], local[2][:-1] if odd else local[2], *local[3:]),
         failed.replace("(.+?)", "a forward") + "ValueError: v must be"),
        ("NaN with validate=True", lambda: fwd(nan_q if odd else local[0], *local[1:], validate=True),
         failed.replace("(.+?)", "a forward") + "ValueError: .*q holds non-finite values"),
        ("g out of the domain, by default", lambda: fwd(*local[:3], local[3] - 6.0 if odd else local[3], local[4]),
         failed.replace("(.+?)", "a forward") + r"ValueError: .*g below -5"),
        ("invalid cu_seqlens", lambda: kda_kcp.build_context_kcp([0, 10, 5] if odd else [0, 10, 15], group),
         failed.replace("(.+?)", "build_context_kcp") + "ValueError: cu_seqlens must be non-decreasing"),
        ("layout", lambda: kda_kcp.build_context_kcp(CU, group, "zigzag" if odd else "contiguous"),
         r"ranks disagree on the context: layout: " + others.format("'contiguous'", "'zigzag'")),
        ("do dtype", lambda: kda_kcp.chunk_kda_bwd_kcp(do.float() if odd else do, saved, ctx),
         r"backward calls disagree: do dtype: " + others.format("torch.float64", "torch.float32")),
        ("backward on another context", lambda: kda_kcp.chunk_kda_bwd_kcp(do, saved, other_ctx if odd else ctx),
         failed.replace("(.+?)", "a backward") + "ValueError: ctx is not the forward's context"),
        ("NaN do after a forward with validate=True",
         lambda: kda_kcp.chunk_kda_bwd_kcp(nan_do if odd else do, checked, ctx),
         failed.replace("(.+?)", "a backward") + "ValueError: .*do holds non-finite values"),
        ("saved of another type", lambda: kda_kcp.chunk_kda_bwd_kcp(do, list(saved.tensors()) if odd else saved, ctx),
         failed.replace("(.+?)", "a backward") + "TypeError: saved must be the KdaSaved"),
        ("a context of another rank", lambda: kda_kcp.chunk_kda_kcp(*_local(foreign)[0], foreign),
         r"forward calls disagree: group ranks \[%d, %d\] all run the context of rank %d"
         % (world - 2, world - 1, world - 2)),
        ("deterministic not a bool", lambda: fwd(*local, deterministic=1 if odd else True),
         failed.replace("(.+?)", "a forward") + "TypeError: deterministic must be True or False, got 1"),
        ("a package entry in the other mode", lambda: kda_kcp.det.chunk_kda_kcp(*local, ctx, deterministic=not odd),
         failed.replace("(.+?)", "a forward") + "ValueError: kda_kcp.det runs deterministic=True only"),
        ("backward in the other mode", lambda: kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx, deterministic=not odd),
         failed.replace("(.+?)", "a backward") + "ValueError: saved comes from a deterministic=True forward"),
        ("chunk_kda: a shard of another length",
         lambda: kda_kcp.chunk_kda(*(x.unsqueeze(0)[:, : -1 if odd else None] for x in local), cp_context=ctx),
         failed.replace("(.+?)", "a forward") + "ValueError: chunk_kda: cp_context gives rank %d" % (world - 1)),
        ("chunk_kda: an unsupported option",
         lambda: kda_kcp.chunk_kda(*(x.unsqueeze(0) for x in local), cp_context=ctx, use_graph=odd),
         failed.replace("(.+?)", "a forward") + "ValueError: chunk_kda: use_graph=True is not supported"),
        ("an input written in place before the autograd backward", lambda: _written_before_backward(ctx, local, do, odd),
         failed.replace("(.+?)", "a backward") + "RuntimeError: one of the variables needed for gradient computation "
         "has been modified by an inplace operation"),
        ("forward beside a backward", lambda: kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx) if odd else fwd(*local),
         r"the ranks are in different calls: rank 0 in a forward, .*rank %d in a backward" % (world - 1)),
    ]


def _written_before_backward(ctx, local, do, odd):
    """chunk_kda_kcp with autograd; the odd rank writes an input in place before the backward, which autograd's
    saved-tensor check catches on that rank alone."""
    leaves = [x.clone().requires_grad_() for x in local]
    o = kda_kcp.chunk_kda_kcp(*leaves, ctx)
    if odd:
        with torch.no_grad():
            leaves[2].mul_(1.0)
    o.backward(do)


def _every_rank_raises_the_same(rank, world):
    group = dist.new_group(backend="gloo", timeout=TIMEOUT)
    for name, call, pattern in _cases(rank, world, group):
        start = time.monotonic()
        try:
            call()
        except ValueError as exc:
            msg = str(exc)
        else:
            msg = None
        elapsed = time.monotonic() - start
        messages = [None] * world
        dist.all_gather_object(messages, msg, group=group)
        assert msg is not None, f"{name}: rank {rank} did not raise"
        assert all(m == msg for m in messages), (name, messages)
        assert re.search(pattern, msg), (name, pattern, msg)
        assert elapsed < TIMEOUT.total_seconds(), (name, elapsed)
    _nccl_companion(group)
    # the group still works after the errors: an agreeing step gives every rank the W = 1 result
    ctx = kda_kcp.build_context_kcp(CU, group, "zigzag")
    inputs, do = make_inputs(CU, H=H, K=K, V=V, seed=3)
    ref = step(inputs, do, kda_kcp.build_context_kcp(CU))
    got = step([ctx.shard(x) for x in inputs], ctx.shard(do), ctx)
    for x, r in zip(got, ref):
        assert rel_rms(x, ctx.shard(r)) < 1e-12


def _nccl_companion(group):
    """An NCCL group agrees on a gloo companion, made by its first context and reused by the next (here a gloo
    group that reports NCCL stands in, while only contexts are built; tests/gpu/test_rank_agreement_nccl.py
    runs NCCL)."""
    real = dist.get_backend
    dist.get_backend = lambda g=None: "nccl" if g is group else real(g)
    try:
        first = kda_kcp.build_context_kcp(CU, group)
        assert first.host_group is not group and real(first.host_group) == "gloo"
        assert kda_kcp.build_context_kcp(CU, group, "zigzag").host_group is first.host_group
        with pytest.raises(ValueError, match="ranks disagree on the context: layout"):
            kda_kcp.build_context_kcp(CU, group, "zigzag" if dist.get_rank() else "contiguous")
    finally:
        dist.get_backend = real


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_raises_the_same_error(world):
    run_distributed(_every_rank_raises_the_same, world)
