"""How the CUDA backward's walks and gradients share the GPU: the two walks on two streams (``both_walks``), and the
pipelined walk groups, piece by piece, with each block's gradients on streams of their own
(``pipelined_walks_and_grads``). Every kernel sees the same rows and chunks whatever the overlap, so the results are
bitwise those of one stream; on the CPU (the emulated kernels) the same launches run in order.
"""

from __future__ import annotations

import torch

from . import tuning
from .common import CallStreams, side_streams

__all__ = ["both_walks", "launch_order", "launch_waits", "pipelined_walks_and_grads", "run_in_order"]


def both_walks(rev_chain, fwd_chain, device) -> None:
    """Run the reverse chain (dh, dV_new) on the current stream and the forward chain (h, V_new) on a side
    stream, joined before returning. They are independent: the reverse recursion of dS never reads S, the
    reverse walk reads the records' W, Kg, Qg, Aqk, gamma and writes dV_new and dh, the forward walk reads
    W, Kg, U, gamma and writes V_new (over U) and h. Each kernel's result is the same whatever the overlap,
    so the backward stays bitwise repeatable. A CTA of each does not fit on one SM (shared memory): the
    overlap is between the segmented chains' summaries and folds (``tuning.bwd_walk_streams``).
    The walks themselves go through ``pipelined_walks_and_grads`` when there are walk groups; run together, the
    two walks are bound by DRAM bandwidth even when a CTA of each fits on one SM (docs/kernels.md §4)."""
    if torch.device(device).type != "cuda" or not tuning.bwd_walk_streams():  # (the CPU emulation of the kernels)
        rev_chain()
        fwd_chain()
        return
    streams = CallStreams(device)
    main = streams.main
    side = side_streams("bwd_side", main.device, 1)[0]
    streams.join(side, main)  # the records, states and buffers made so far
    rev_chain()
    with streams.on(side):
        fwd_chain()
    streams.join(main, side)  # buffers used on the side stream are freed (or reused) on main only after this


_ORDERS: dict = {}  # id(groups) -> (groups, their launch order): the walk groups are kept per plan, so is the order


def launch_order(groups) -> list:
    """The pipelined backward's launches in the order the host enqueues them: (group, what, piece), what in "fwd",
    "rev", "grads" (piece p of "grads": block p's gradients). Each launch at the time it is expected to start (forward
    walk steps from the walks' start): piece p of a chain at p / k of its group's walk, a block's gradients when both
    its pieces end (``WalkGroup.ready``); walks first on ties, the longer groups' walks first among them. The host
    enqueues a launch in ~10-20 us and the first gradients wait for nothing else, so they should not wait behind the
    later pieces of every chain (each piece's dependencies, its chain's earlier pieces, start earlier and come
    first). A block's gradients come after both walk pieces that pass it (``launch_waits``). Kept per groups list
    (the entry holds it, so its id names no other list while kept); each caller gets its own list."""
    kept = _ORDERS.get(id(groups))
    if kept is not None:
        return list(kept[1])
    launches = []  # (expected start, walks before gradients, ties: longer groups' walks first, group, what, piece)
    for gi, grp in enumerate(groups):
        k = grp.pieces
        for p in range(k):
            launches.append((grp.longest * p / k, 0, -gi, gi, "fwd", p))
            launches.append((tuning.REV_STEP_RATIO * grp.longest * p / k, 0, -gi, gi, "rev", p))
            launches.append((grp.ready[p], 1, gi, gi, "grads", p))  # (block p)
    order = tuple((gi, what, p) for *_, gi, what, p in sorted(launches))
    if len(_ORDERS) >= 64:
        _ORDERS.clear()
    _ORDERS[id(groups)] = (groups, order)
    return list(order)


def launch_waits(groups, gi: int, p: int) -> tuple:
    """The walk launches (group, what, piece) block p's gradients of group gi wait for: the forward piece p and
    the reverse piece that passes block p (the reverse chain runs its blocks last to first)."""
    return (gi, "fwd", p), (gi, "rev", groups[gi].rev_blocks.index(p))


def pipelined_walks_and_grads(groups, launch_walk, launch_grads, device) -> None:
    """Every group's walks, each group's reverse and forward chain on two side streams of its own at high priority,
    piece by piece (``WalkGroup``), and the gradients of each block of each group on a side stream of their own at
    normal priority, each once the forward and the reverse piece of that block end (``launch_waits``); everything
    enqueued in ``launch_order``; joined at the end. High priority: a walk piece launched while gradient CTAs wait
    for SMs takes the next SM free instead of queueing behind whole gradient launches (a chain's pieces are
    serial). On the CPU (the emulated kernels) the launches run one after the other in that order, so a gradient
    launch runs before every walk piece it does not wait for: a dependency the events miss changes its result there."""
    order = launch_order(groups)
    if torch.device(device).type != "cuda" or not tuning.bwd_walk_streams():
        run_in_order(groups, order, launch_walk, launch_grads)
        return
    streams = CallStreams(device)
    main = streams.main
    walk_pool = side_streams("bwd_walks", main.device, 2 * len(groups), priority=-1)
    grads_pool = side_streams("bwd_grads", main.device, sum(grp.pieces for grp in groups))
    for s in walk_pool + grads_pool:
        streams.join(s, main)  # the records and buffers carved so far
    done = {}  # (group, what, piece) -> the event recorded after that walk piece
    grads_streams = iter(grads_pool)
    for gi, what, p in order:
        grp = groups[gi]
        if what == "grads":
            s = next(grads_streams)
            for w in launch_waits(groups, gi, p):
                done[w].wait(s)
            with streams.on(s):
                launch_grads(grp.blocks[p])
            continue
        stream = walk_pool[2 * gi + (0 if what == "rev" else 1)]
        with streams.on(stream):
            launch_walk(grp, what, p)
            ev = torch.cuda.Event()
            ev.record(stream)
            done[gi, what, p] = ev
    for s in walk_pool + grads_pool:
        streams.join(main, s)  # buffers used on the side streams are freed (or reused) on main only after this


def run_in_order(groups, order, launch_walk, launch_grads) -> None:
    """The launches of ``order`` one after the other on the current stream (the CPU's emulated kernels, one stream,
    and the tests' other valid orders: each chain's pieces in turn, each block's gradients after ``launch_waits``)."""
    for gi, what, p in order:
        if what == "grads":
            launch_grads(groups[gi].blocks[p])
        else:
            launch_walk(groups[gi], what, p)
