"""Shared test helpers: random packed batches, error measures, bad values, bitwise comparison, torch.compile, forced
tuning choices, and spawning gloo process groups (the GPU tests import it too)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kda_kcp
from kda_kcp.reference import naive_kda


INPUT_NAMES = ("q", "k", "v", "g", "beta")


def with_value(inputs, name, value, at):
    """Copies of (q, k, v, g, beta) with one value of ``name`` at ``at`` = (token, head, channel) set to ``value``
    (a number, or "nan", "inf", "-inf"); beta takes (token, head)."""
    out = [x.clone() for x in inputs]
    x = out[INPUT_NAMES.index(name)]
    fill = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}.get(value, value)
    t, h, c = at
    if x.dim() == 3:
        x[t, h, c] = fill
    else:
        x[t, h] = fill
    return out


# What first_call_compiled runs after its setup: the compiled call of fn first, then the eager one, on fresh leaves
_COMPILED_THEN_EAGER = """
results = []
for f in (torch.compile(fn, fullgraph=True, backend="aot_eager"), fn):
    leaves = [x.clone().requires_grad_() for x in inputs]
    o = f(*leaves)
    o.backward(do)
    results.append([o.detach()] + [x.grad for x in leaves])
print(all(torch.equal(a, b) for a, b in zip(*results)))
"""


def first_call_compiled(setup: str, *args: str) -> None:
    """In a fresh interpreter (``args`` its sys.argv[1:]), ``setup`` defines fn, its input tensors ``inputs`` and
    the output gradient ``do``; a torch.compile(fullgraph=True) call of fn is the process's first kda_kcp call, and its
    o and gradients must be bitwise those of the eager call after it."""
    out = subprocess.run([sys.executable, "-c", setup + _COMPILED_THEN_EAGER, *args], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == ["True"]


def assert_bitwise(got, want):
    """Two lists of tensors equal bit for bit (dtype and shape too)."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b), f"output {i} differs: max |diff| {(a.float() - b.float()).abs().max().item()}"


def fresh_compile(fn, backend):
    """torch.compile(fn, fullgraph=True) from a clean dynamo state (its graph-break counters cleared)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch.compile(fn, fullgraph=True, backend=backend)


def set_tuning(target, **knobs) -> None:
    """Force tuning choices (``KDA_KCP_TUNING``, kda_kcp.cuda.tuning) through ``target``: a pytest MonkeyPatch, or a
    function (name, value) that sets an environment variable. The keys given join those already forced; a value of
    None drops its key."""
    from kda_kcp.cuda import tuning

    forced = tuning.overrides()
    for key, value in knobs.items():
        if value is None:
            forced.pop(key, None)
        else:
            forced[key] = value
    setenv = getattr(target, "setenv", target)
    setenv(tuning.ENV, ",".join(f"{key}={value}" for key, value in sorted(forced.items())))


def offsets(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def make_inputs(cu, H=2, K=16, V=8, dtype=torch.float64, seed=0, gate_low=-5.0, device="cpu"):
    """Random inputs as a model hands them over (never zeros): q, k L2-normalised, g in (gate_low, 0),
    beta in (0, 1); plus a random output gradient."""
    gen = torch.Generator().manual_seed(seed)
    T = cu[-1]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = torch.nn.functional.normalize(rnd(T, H, K), dim=-1)
    k = torch.nn.functional.normalize(rnd(T, H, K), dim=-1)
    v = rnd(T, H, V)
    g = gate_low * torch.rand(T, H, K, generator=gen, dtype=torch.float64)
    beta = torch.rand(T, H, generator=gen, dtype=torch.float64)
    do = rnd(T, H, V)
    cast = lambda x, dt: x.to(device=device, dtype=dt).contiguous()  # noqa: E731
    gdt = torch.float64 if dtype == torch.float64 else torch.float32
    return [cast(q, dtype), cast(k, dtype), cast(v, dtype), cast(g, gdt), cast(beta, dtype)], cast(do, dtype)


def rel_rms(x, ref) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    den = ref.norm()
    if den == 0:
        return float((x - ref).norm())
    return float((x - ref).norm() / den)


def oracle(cu, inputs, do):
    """FP64 o and the five gradients of <o, do>."""
    leaves = [x.detach().double().requires_grad_() for x in inputs]
    o = naive_kda(*leaves, cu)
    o.backward(do.double())
    return [o.detach()] + [x.grad for x in leaves]


def step(inputs, do, ctx, **kw):
    """o and the five gradients of <o, do> through chunk_kda_kcp (autograd)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o = kda_kcp.chunk_kda_kcp(*leaves, ctx, **kw)
    o.backward(do)
    return [o.detach()] + [x.grad for x in leaves]


def gather_global(ctx, local):
    """Global [T, ...] tensor from every rank's local rows (all ranks get it)."""
    full = ctx.unshard(local)
    if ctx.world_size > 1:
        dist.all_reduce(full)
    return full


def _entry(rank, world, init_file, fn, args):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        fn(rank, world, *args)
        dist.barrier()  # every rank done with the group before any tears it down (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()
    # passed: leave without the interpreter's teardown, where gloo's threads can abort an exit (kda_kcp/demo.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world, *args):
    """Run fn(rank, world, *args) on ``world`` spawned processes joined by a gloo group.

    An exception (a failed assertion) in any rank fails the caller."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, os.path.join(tmp, "init"), fn, args), nprocs=world, join=True)
