"""A backward runs on its forward's context: another context raises ValueError, a wrong type TypeError, through
the facade and through both mode packages."""

import pytest
import torch

import kda_kcp
from kda_kcp import det, nondet
from kda_kcp.context import KcpContext
from helpers import make_inputs, offsets

CU = offsets([64, 65])  # T = 129
ENTRIES = {
    "facade det": lambda do, saved, ctx: kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx),
    "facade nondet": lambda do, saved, ctx: kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx, deterministic=False),
    "det": det.chunk_kda_bwd_kcp,
    "nondet": nondet.chunk_kda_bwd_kcp,
}
FORWARDS = {"facade det": (kda_kcp, True), "facade nondet": (kda_kcp, False), "det": (det, True),
            "nondet": (nondet, False)}


def _forward(entry, cu=CU, ctx=None):
    ctx = ctx or kda_kcp.build_context_kcp(cu)
    inputs, do = make_inputs(cu, seed=4)
    package, mode = FORWARDS[entry]
    _, saved = package.chunk_kda_fwd_kcp(*[ctx.shard(x) for x in inputs], ctx, deterministic=mode)
    return ctx.shard(do), saved, ctx


@pytest.mark.parametrize("entry", ENTRIES)
def test_another_context_raises(entry):
    do, saved, ctx = _forward(entry)
    other = {
        "another T": offsets([64, 36]),  # T = 100: rows 100.. would get no gradient
        "other offsets": offsets([60, 69]),  # the same T and documents, other boundaries
        "other documents": offsets([129]),
    }
    for name, cu in other.items():
        with pytest.raises(ValueError, match="ctx is not the forward's context") as info:
            ENTRIES[entry](do, saved, kda_kcp.build_context_kcp(cu))
        assert ("same sizes, different offsets" in str(info.value)) == (name == "other offsets"), str(info.value)
    with pytest.raises(ValueError, match="ctx is not the forward's context"):
        ENTRIES[entry](do, saved, kda_kcp.build_context_kcp(CU, layout="zigzag"))


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_context_of_another_rank_raises(entry):
    """Two ranks' views of one split (built by hand: no document crosses a piece, so no collective runs)."""
    cu = offsets([64, 64])
    ranks = [KcpContext(cu, "contiguous", None, 2, r, "cpu") for r in range(2)]
    do, saved, _ = _forward(entry, cu, ranks[0])
    assert ranks[1].local_tokens == ranks[0].local_tokens and not ranks[0].plan.needs_exchange
    with pytest.raises(ValueError, match="the forward ran on rank 0 of 2.*ctx is rank 1 of 2"):
        ENTRIES[entry](do, saved, ranks[1])


@pytest.mark.parametrize("entry", ENTRIES)
def test_wrong_types_raise_type_error(entry):
    do, saved, ctx = _forward(entry)
    with pytest.raises(TypeError, match="ctx must be a KcpContext"):
        ENTRIES[entry](do, saved, None)
    with pytest.raises(TypeError, match="saved must be the KdaSaved that chunk_kda_fwd_kcp returned, got tuple"):
        ENTRIES[entry](do, tuple(saved.tensors()), ctx)
    with pytest.raises(TypeError, match="saved must be the KdaSaved"):
        ENTRIES[entry](do, None, ctx)


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_equal_context_is_the_same_context(entry):
    """A context rebuilt from the same cu_seqlens (as a training step may do) is accepted, with the same bits."""
    do, saved, ctx = _forward(entry)
    same = ENTRIES[entry](do, saved, ctx)
    rebuilt = ENTRIES[entry](do, saved, kda_kcp.build_context_kcp(torch.tensor(CU)))
    for a, b in zip(same, rebuilt):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "initial_state"])
def test_an_input_written_in_place_since_the_forward_raises(name):
    """The forward keeps the caller's tensors by reference: one written in place before the backward raises,
    naming it (the gradients would be those of other values), as autograd's saved-tensor check does for
    chunk_kda_kcp; the same write to a clone is no concern of the backward's."""
    ctx = kda_kcp.build_context_kcp(CU)
    inputs, do = make_inputs(CU, seed=4)
    h0 = torch.randn(ctx.num_docs, 2, 16, 8, dtype=inputs[0].dtype)
    tensors = dict(zip(("q", "k", "v", "g", "beta"), inputs), initial_state=h0)
    _, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx, initial_state=h0)
    tensors[name].clone().mul_(0.5)
    want = kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx)
    tensors[name].mul_(1.0)  # the same values, but written: the backward cannot tell
    with pytest.raises(ValueError, match=f"^{name} changed in place since the forward"):
        kda_kcp.chunk_kda_bwd_kcp(do, saved, ctx)
    assert all(torch.isfinite(x).all() for x in want)
