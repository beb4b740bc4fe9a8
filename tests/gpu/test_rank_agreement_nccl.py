"""The ranks' agreement over NCCL at W = 2 with the CUDA kernels: the header travels on the NCCL group's gloo
companion (made once per group, reused by every context of it), and a disagreement or one rank's failed check
raises the same ValueError on every rank; the NCCL group stays usable. (That a steady-state call never blocks
the host and that a captured graph replays, with the header in the call, is checked by test_kcp_nccl.py.)
"""

from __future__ import annotations

import datetime
import json
import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpu_common import make_inputs, require_kernel_gpu

require_kernel_gpu("the NCCL agreement tests")
if torch.cuda.device_count() < 2:
    pytest.skip("the NCCL agreement tests need 2 GPUs", allow_module_level=True)

import kda_kcp  # noqa: E402

CU = [0, 3001, 5501, 6278]


def _cases(rank, world, ctx, dev):
    odd = rank == world - 1
    gen = torch.Generator().manual_seed(11)
    local = [ctx.shard(x) for x in make_inputs(CU[-1], 2, gen, device=dev)]
    wide = [ctx.shard(x) for x in make_inputs(CU[-1], 4, gen, device=dev)]
    nan_q = local[0].clone()
    nan_q[0, 0, 0] = float("nan")
    call = lambda *xs, **kw: kda_kcp.chunk_kda_kcp(*xs, ctx, **kw)  # noqa: E731
    return [
        ("H", lambda: call(*(wide if odd else local)), r"forward calls disagree: H: rank 0 has 2, rank 1 has 4"),
        ("scale", lambda: call(*local, scale=0.5 if odd else None), r"disagree: scale: rank 0 has 0\.0883"),
        ("NaN with validate=True", lambda: call(nan_q if odd else local[0], *local[1:], validate=True),
         r"rank 1 \(a forward\): ValueError: q holds non-finite values"),
        ("q in FP32", lambda: call(local[0].float() if odd else local[0], *local[1:]),
         r"rank 1 \(a forward\): TypeError: q must be torch.bfloat16 on the CUDA backend"),
        ("invalid cu_seqlens", lambda: kda_kcp.build_context_kcp(
            torch.tensor([0, 10, 5] if odd else [0, 10, 15], device=dev), ctx.group),
         r"rank 1 \(build_context_kcp\): ValueError: cu_seqlens must be non-decreasing"),
    ]


def _worker(rank, world, init_file, report_dir):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=dev,
                            timeout=datetime.timedelta(seconds=120))
    failures = []
    try:
        group = dist.group.WORLD
        ctx = kda_kcp.build_context_kcp(torch.tensor(CU, device=dev), group, "zigzag")
        again = kda_kcp.build_context_kcp(torch.tensor(CU, device=dev), group, "contiguous")
        if ctx.host_group is group or dist.get_backend(ctx.host_group) != "gloo":
            failures.append(f"the host group is {dist.get_backend(ctx.host_group)}, not a gloo companion")
        if again.host_group is not ctx.host_group:
            failures.append("a second context of the group made another gloo companion")
        for name, call, pattern in _cases(rank, world, ctx, dev):
            try:
                call()
                msg = None
            except ValueError as exc:
                msg = str(exc)
            messages = [None] * world
            dist.all_gather_object(messages, msg, group=ctx.host_group)
            if msg is None or not re.search(pattern, msg) or any(m != msg for m in messages):
                failures.append(f"{name}: {messages}")
        # the NCCL group still works after the errors
        x = torch.ones(1, device=dev)
        dist.all_reduce(x, group=group)
        if x.item() != world:
            failures.append(f"all_reduce after the errors gave {x.item()}")
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 (reported)
        failures.append(f"raised {type(exc).__name__}: {exc}")
    finally:
        with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
            json.dump(failures, f)
        dist.destroy_process_group()


def test_every_rank_raises_the_same_error_over_nccl():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        failures = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(2)]
    bad = [f"rank {r}: {m}" for r, fs in enumerate(failures) for m in fs]
    assert not bad, "\n".join(bad)
