"""What the GPU tests share: the skip rule, the seed, random inputs as a model hands them over, plans,
NaN poisoning, the error measure and forced tuning choices (tests/helpers.py's set_tuning). Importable on any
machine (nothing here needs a GPU)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from kda_kcp.plan import LocalPlan, build_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import set_tuning  # noqa: E402,F401  (forced tuning choices, as the CPU tests force them)

KERNEL_CAPABILITIES = ((9, 0), (10, 0), (10, 3))
DEV = torch.device("cuda")


def require_kernel_gpu(what: str) -> None:
    """Skip the calling test module, with its reason, unless an sm_90a / sm_100a / sm_103a GPU is here."""
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA GPU: {what} need one", allow_module_level=True)
    if torch.cuda.get_device_capability() not in KERNEL_CAPABILITIES:
        pytest.skip(
            f"{torch.cuda.get_device_name()} is sm_{''.join(map(str, torch.cuda.get_device_capability()))}: "
            "the kernels are built for sm_90a / sm_100a / sm_103a",
            allow_module_level=True,
        )


def fresh_seed(name: str) -> int:
    """A new seed every run (KDA_TEST_SEED pins one), printed so a failure can be replayed."""
    seed = int(os.environ.get("KDA_TEST_SEED", str(int(time.time() * 1000) % 2**31)))
    print(f"[{name}] seed {seed}")
    return seed


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(T, H, gen, gate="mixed", device=DEV):
    """q, k L2-normalised BF16, v BF16, g FP32 in [-5, 0), beta BF16 in (0.05, 0.95), head dim 128.

    gate="mixed": -5 sigmoid(x) with a quarter of the channels slow (|g| < 0.02) and one token of the
    extreme gate -5; "uniform": uniform in (-5, 0); "benchmark": the benchmark's, logsigmoid(2 + 1.5 z) clipped at
    -5; "edge_in" / "edge_out": every gate in (-1, -0.99) / (-1.02, -1.01), so that every full chunk's gates sum to
    just above / just below -64, the chunk prep's limit for one anchor per chunk (kda_chunk_prep.cuh kOneAnchor).
    All but "benchmark" and the edges set one token's gates to -5."""
    q = torch.nn.functional.normalize(torch.randn(T, H, 128, generator=gen), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(T, H, 128, generator=gen), dim=-1).bfloat16()
    v = torch.randn(T, H, 128, generator=gen).bfloat16()
    if gate == "mixed":
        g = -5 * torch.sigmoid(torch.randn(T, H, 128, generator=gen) * 2 - 1)
        slow = torch.rand(1, H, 128, generator=gen) < 0.25
        g = torch.where(slow, -0.02 * torch.rand(T, H, 128, generator=gen), g)
    elif gate == "benchmark":
        g = torch.nn.functional.logsigmoid(2 + 1.5 * torch.randn(T, H, 128, generator=gen))
    elif gate in ("edge_in", "edge_out"):
        lo = -1.0 if gate == "edge_in" else -1.02
        g = lo + 0.01 * torch.rand(T, H, 128, generator=gen)
    elif gate == "uniform":
        g = -5 * torch.rand(T, H, 128, generator=gen)
    else:
        raise ValueError(f"unknown gate {gate!r}")
    g = g.clamp(-5.0, -1e-6)
    if T > 3 and gate in ("mixed", "uniform"):
        g[T // 3] = -5.0
    beta = (0.05 + 0.9 * torch.rand(T, H, generator=gen)).bfloat16()
    return [x.to(device) for x in (q, k, v, g.float(), beta)]


def local_plan(cu):
    """The single-rank plan of a packed batch (every run starts its document)."""
    T = cu[-1]
    kp = build_plan(cu, [[(0, T)]])
    return LocalPlan(T, kp.rank_runs[0])


def random_docs(total, gen, lo=1, hi=5000):
    """Offsets of documents of 1, 63, 64, 65 tokens, a zero-length one, then random lengths up to ``total``."""
    lens = [1, 63, 64, 65]
    while sum(lens) < total:
        lens.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    lens.insert(2, 0)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def poison_like(*tensors):
    """Fill the caching allocator's next blocks of these sizes with NaN, so an unwritten output shows."""
    bufs = [torch.full_like(t, float("nan")) for t in tensors]
    del bufs


def run_fwd(be, inputs, scale, plan, state_in=None):
    poison_like(inputs[0])
    return be.fwd_output(*inputs, scale, plan, state_in)


def capture(step, static):
    """Capture ``step(*static)`` in a CUDA graph after two warm-up calls on a side stream (kernels loaded,
    tables uploaded, allocator pools settled); returns (graph, the captured outputs). Copy new values
    into ``static`` and call ``graph.replay()`` to rerun it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(*static)
    return graph, outs


def replay(graph, static, new):
    """Copy ``new`` into ``static`` and replay ``graph``, synchronized."""
    for s, n in zip(static, new):
        s.copy_(n)
    graph.replay()
    torch.cuda.synchronize()
