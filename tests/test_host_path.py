"""The host's side of one CUDA-path call, on the CPU (kernel programs replaced by recorders): where the forward
launches its first kernel, what its caches keep and when they miss, and the streams and events of the backward's
launches (a fake of torch.cuda's streams records them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import kda_kcp
import kda_kcp.backend
import kda_kcp.function as function
from kda_kcp import steps
from kda_kcp.cuda import CudaBackend, backward, bwd_streams, common, forward
from helpers import offsets, set_tuning

LOG: list = []  # the recorder programs' launches, and markers


class _Recorder:
    """Stands for a loaded kernel program: every entry point appends (name, its tensors' (pointer, shape, dtype) and
    its other arguments) to LOG, and launches nothing."""

    def __getattr__(self, name):
        def launch(*args):
            LOG.append((name, tuple((a.data_ptr(), tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                                    for a in args)))

        return launch


def _recorded_cuda(monkeypatch, **knobs):
    backend = CudaBackend(True)
    monkeypatch.setattr(function, "select_backend", lambda device, det: backend)
    monkeypatch.setattr(kda_kcp.backend, "select_backend", lambda device, det: backend)
    monkeypatch.setattr(forward, "check_tensors", lambda *a: None)
    monkeypatch.setattr(backward, "check_tensors", lambda *a: None)
    monkeypatch.setattr(forward, "load", lambda device: _Recorder())
    monkeypatch.setattr(backward, "load", lambda device: _Recorder())
    set_tuning(monkeypatch, **knobs)
    LOG.clear()
    return backend


def _inputs(T, H, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, H, 128, generator=gen).bfloat16() for _ in range(3))
    g = -torch.rand(T, H, 128, generator=gen)
    beta = torch.rand(T, H, generator=gen).bfloat16()
    return q, k, v, g, beta


def _canonical(log, ws):
    """``log`` with each tensor's pointer as its offset into the workspace, or else as the order in which it first
    appears (the outputs a call allocates land elsewhere in each call)."""
    base, end, seen = ws.buffer.data_ptr(), ws.buffer.data_ptr() + ws.nbytes, {}

    def name(ptr):
        return ("ws", ptr - base) if base <= ptr < end else ("tensor", seen.setdefault(ptr, len(seen)))

    return [(n, tuple((name(a[0]),) + a[1:] if isinstance(a, tuple) else a for a in args)) for n, args in log]


def _workspace(ctx, H):
    return kda_kcp.WorkspaceKcp.from_buffer(torch.empty(kda_kcp.kda_workspace_bytes_kcp(ctx, H), dtype=torch.uint8))


@pytest.mark.parametrize("seg", [3, 0])  # segmented walks (the records at once), whole runs in run groups
def test_forward_launches_its_prep_before_the_nodes(monkeypatch, seg):
    """At W = 1 the differentiable call makes its records (fwd_prep) before its first node, KdaKcpInputs, is built,
    with grad mode off (as inside a node's forward); the launches, their order and their arguments are those of the
    call with the records made in ``finish``, with or without initial states (with them, the first run group's
    records stay in ``output``, after the initial states' rows)."""
    _recorded_cuda(monkeypatch, fwd_seg_chunks=seg)
    monkeypatch.setattr(forward, "sm_count", lambda device: 1)  # so that these small runs form run groups
    ctx = kda_kcp.build_context_kcp(torch.tensor(offsets([1000, 1, 0, 333, 130])))
    H = 2
    ws = _workspace(ctx, H)
    x = _inputs(ctx.num_tokens, H)
    assert (forward.run_group_tables(ctx.local, H, "cpu") is None) == (seg != 0)
    for node in (function.KdaKcpInputs, function.KdaKcpOutput):
        def marked(fctx, *args, _name=f"{node.__name__}.forward", _forward=node.forward):
            LOG.append((_name, ()))
            return _forward(fctx, *args)

        monkeypatch.setattr(node, "forward", staticmethod(marked))
    start_forward = function.start_forward

    def start_marked(*args):
        LOG.append(("start_forward", (torch.is_grad_enabled(),)))
        return start_forward(*args)

    monkeypatch.setattr(function, "start_forward", start_marked)
    x = [t.requires_grad_() for t in x]
    kda_kcp.chunk_kda_kcp(*x, ctx, workspace=ws)
    x = [t.detach() for t in x]
    names = [name for name, _ in LOG]
    assert LOG[0] == ("start_forward", (False,))
    assert (names.index("fwd_prep") < names.index("KdaKcpInputs.forward") < names.index("KdaKcpOutput.forward")
            < names.index("fwd_walk_output"))
    assert torch.is_grad_enabled()
    h0 = torch.randn(ctx.num_docs, H, 128, 128)
    backend = function.select_backend(None, True)
    for initial_state in (None, h0):
        logs = []
        for records_now in (False, True):
            LOG.clear()
            _, _, dt, xbuf, arena = function._prepare(*x, ctx, None, True, ws, None, initial_state, False)
            call = steps.ForwardCall(backend, *x, ctx, 128**-0.5, True, dt, xbuf, arena, ws,
                                     initial_state=initial_state, records_now=records_now)
            made = len(LOG)
            call.finish()
            logs.append(_canonical(LOG, ws))
            assert (made > 0) == (records_now and (seg != 0 or initial_state is None))
        assert logs[0] == logs[1]


def test_checkpoint_recomputation_at_one_rank_launches_no_kernel(monkeypatch):
    """A non-reentrant checkpoint of the call alone: its recomputation stops before KdaKcpOutput (torch's early
    stop) and launches nothing, so the forward's kernels run once (in the forward), as when the records were made
    in the output node."""
    _recorded_cuda(monkeypatch, fwd_seg_chunks=3)
    ctx = kda_kcp.build_context_kcp(torch.tensor(offsets([300, 200])))
    H = 2
    ws = _workspace(ctx, H)
    leaves = [t.requires_grad_() for t in _inputs(ctx.num_tokens, H)]
    o = checkpoint(lambda *xs: kda_kcp.chunk_kda_kcp(*xs, ctx, workspace=ws), *leaves, use_reentrant=False)
    forward_launches = list(LOG)
    assert [name for name, _ in forward_launches].count("fwd_prep") == 1
    LOG.clear()
    backward_prep = backward.PreparedBackward.__init__

    def marked(self, *args, **kwargs):
        LOG.append(("PreparedBackward", ()))
        return backward_prep(self, *args, **kwargs)

    monkeypatch.setattr(backward.PreparedBackward, "__init__", marked)
    o.backward(torch.ones_like(o))
    assert LOG[0] == ("PreparedBackward", ())  # nothing launched before the backward's own prep
    assert not any(name.startswith("fwd_") for name, _ in LOG)


def test_workspace_layout_cache_follows_its_key(monkeypatch):
    """The call's (need, exchange elements, arena start) is cached per context and key: another head count, another
    lean pass count or another tuning choice finds its own entry, equal to a fresh computation."""
    backend = _recorded_cuda(monkeypatch, fwd_seg_chunks=3, bwd_seg_chunks=2)
    ctx = kda_kcp.build_context_kcp(torch.tensor(offsets([700, 1, 300])))
    dev, f32 = torch.device("cpu"), torch.float32
    seen = set()
    for knobs in ({"bwd_seg_chunks": 2}, {"bwd_seg_chunks": 0}):
        set_tuning(monkeypatch, **knobs)
        for H in (1, 3):
            for passes in (None, 2):
                layout = function._workspace_layout(ctx, H, backend, dev, 128, 128, f32, passes)
                numel = function.exchange_elements(ctx, H, 128, 128)
                fresh = (function.workspace_bytes(ctx, H, backend, dev, 128, 128, f32, passes), numel,
                         function.aligned(numel * 4))
                assert layout == fresh
                assert function._workspace_layout(ctx, H, backend, dev, 128, 128, f32, passes) is layout
                seen.add(layout[0])
    assert len(seen) == 8


def test_call_tables_follow_the_tuning_knobs(monkeypatch):
    """The forward's whole-plan tables, looked up as one entry, are those forward_tables and run_group_tables give for
    the tuning choices in force: another segment length finds its own entry."""
    _recorded_cuda(monkeypatch)
    monkeypatch.setattr(forward, "sm_count", lambda device: 1)  # so that these small runs form run groups
    ctx = kda_kcp.build_context_kcp(torch.tensor(offsets([1000, 1, 0, 333, 130])))
    dev = torch.device("cpu")
    seen = []
    for seg in (3, 0, 3):
        set_tuning(monkeypatch, fwd_seg_chunks=seg)
        tabs, groups = forward.call_tables(ctx.local, 2, dev, True)
        assert tabs is forward.forward_tables(ctx.local, 2, dev)
        assert groups is forward.run_group_tables(ctx.local, 2, dev)
        assert (groups is None) == (seg != 0)
        assert forward.call_tables(ctx.local, 2, dev, False) == (tabs, None)
        seen.append(tabs)
    assert seen[0] is seen[2] and seen[0] is not seen[1] and seen[0].seg_chunks != seen[1].seg_chunks


def test_workspace_keeps_its_carves():
    """A workspace's arena hands the same carve back to the next call of the same shape (the same bytes, without
    a new view); another offset, shape or dtype, another range of the buffer or another buffer is a new carve,
    and the kept carves are bounded."""
    ws = kda_kcp.WorkspaceKcp.from_buffer(torch.zeros(1 << 16, dtype=torch.uint8))

    def carves(arena):
        return [arena.empty((4, 8), torch.float32), arena.empty((0,), torch.float32),
                arena.empty((16,), torch.bfloat16)]

    first, again = carves(ws.arena(256, 8192, "cpu")), carves(ws.arena(256, 8192, "cpu"))
    assert all(a is b for a, b in zip(first, again))
    arena = ws.arena(256, 8192, "cpu")
    other = [arena.empty((16,), torch.bfloat16), arena.empty((4, 8), torch.float32), arena.empty((4, 8), torch.int32)]
    assert all(x is not y for x in other for y in first)
    assert other[0].data_ptr() == first[0].data_ptr() and other[0].dtype == torch.bfloat16
    assert all(x is not y for x, y in zip(carves(ws.arena(512, 8192, "cpu")), first))
    ws.buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    assert all(x is not y for x, y in zip(carves(ws.arena(256, 8192, "cpu")), first))
    arena = ws.arena(0, 1 << 16, "cpu")
    for n in range(2000):  # one carve per shape: the cache is cleared past its bound
        arena.release(0)
        arena.empty((n + 1,), torch.uint8)
    assert len(arena._views) <= 1100


# ---- the streams and events of the launches: torch.cuda's streams faked, every operation recorded ----
class _Stream:
    def __init__(self, name, index=0):
        self.name, self.device_index = name, index
        self.device = torch.device("cuda", index)

    def wait_event(self, event):  # (torch.cuda.Stream's own, for a caller that uses them)
        event.wait(self)

    def wait_stream(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        self.wait_event(event)


class _FakeCuda:
    """torch.cuda's current stream, set_stream, stream(), Event and current_device, recording into ``log``: launches
    (with the stream current at the launch), event records and waits (events by creation number)."""

    def __init__(self, monkeypatch, current_device=0):
        self.log, self.events = [], 0
        self.main = _Stream("main")
        self.current = self.main
        fake = self

        class Event:
            def __init__(self):
                fake.events += 1
                self.id = fake.events

            def record(self, stream):
                fake.log.append(("record", self.id, stream.name))

            def wait(self, stream):
                fake.log.append(("wait", self.id, stream.name))

        class StreamContext:  # torch.cuda.stream(s): s current inside, the previous one back after
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                self.prev, fake.current = fake.current, self.stream

            def __exit__(self, *exc):
                fake.current = self.prev

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.current)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current_device)
        monkeypatch.setattr(torch.cuda, "set_stream", lambda s: setattr(fake, "current", s))
        monkeypatch.setattr(torch.cuda, "stream", StreamContext)
        pools = {}

        def side_streams(name, device, n, priority=0):
            pool = pools.setdefault(name, [])
            while len(pool) < n:
                pool.append(_Stream(f"{name}{len(pool)}"))
            return pool[:n]

        monkeypatch.setattr(bwd_streams, "side_streams", side_streams)

    def launch(self, what):
        self.log.append(("launch", what, self.current.name))


def _groups(pieces):
    """Walk groups as ``launch_order`` reads them: group gi's runs 10 (gi + 1) chunks long, in k pieces; block j
    ready when both pieces that pass it end (the reverse chain runs its blocks last to first)."""
    rev = bwd_streams.tuning.REV_STEP_RATIO
    return [SimpleNamespace(pieces=k, longest=L, rev_blocks=list(range(k))[::-1], blocks=[(gi, j) for j in range(k)],
                            ready=[max(L * (j + 1) / k, rev * L * (k - j) / k) for j in range(k)])
            for gi, (k, L) in enumerate((k, 10 * (gi + 1)) for gi, k in enumerate(pieces))]


def _expected_pipeline(groups):
    """The operations of the pipelined backward as its docstring gives them: every side stream waits for main
    (an event each), each walk piece launches on its chain's stream with an event recorded after it, each
    block's gradients on their own stream after waiting for its two pieces' events, then main waits for every
    side stream. Events by creation number."""
    walks = [f"bwd_walks{i}" for i in range(2 * len(groups))]
    grads = [f"bwd_grads{i}" for i in range(sum(grp.pieces for grp in groups))]
    log, events, done = [], 0, {}
    for s in walks + grads:
        events += 1
        log += [("record", events, "main"), ("wait", events, s)]
    streams = iter(grads)
    for gi, what, p in bwd_streams.launch_order(groups):
        if what == "grads":
            s = next(streams)
            log += [("wait", done[w], s) for w in bwd_streams.launch_waits(groups, gi, p)]
            log.append(("launch", ("grads", groups[gi].blocks[p]), s))
            continue
        s = walks[2 * gi + (0 if what == "rev" else 1)]
        events += 1
        done[gi, what, p] = events
        log += [("launch", (what, gi, p), s), ("record", events, s)]
    for s in walks + grads:
        events += 1
        log += [("record", events, s), ("wait", events, "main")]
    return log


@pytest.mark.parametrize("current_device", [0, 1])  # the streams' device current, or another one
@pytest.mark.parametrize("pieces", [(1,), (4, 1), (2, 3, 4)])
def test_pipelined_backward_streams_and_events(monkeypatch, current_device, pieces):
    cuda = _FakeCuda(monkeypatch, current_device)
    set_tuning(monkeypatch, bwd_walk_streams=1)
    groups = _groups(pieces)
    bwd_streams.pipelined_walks_and_grads(
        groups, lambda grp, what, p: cuda.launch((what, groups.index(grp), p)),
        lambda blocks: cuda.launch(("grads", blocks)), torch.device("cuda", 0))
    assert cuda.log == _expected_pipeline(groups)
    assert cuda.current is cuda.main


@pytest.mark.parametrize("current_device", [0, 1])
def test_both_walks_streams_and_events(monkeypatch, current_device):
    """The reverse chain on main, the forward chain on the side stream after it waited for main, then main waits
    for the side stream."""
    cuda = _FakeCuda(monkeypatch, current_device)
    set_tuning(monkeypatch, bwd_walk_streams=1)
    bwd_streams.both_walks(lambda: cuda.launch("rev"), lambda: cuda.launch("fwd"), torch.device("cuda", 0))
    assert cuda.log == [("record", 1, "main"), ("wait", 1, "bwd_side0"), ("launch", "rev", "main"),
                        ("launch", "fwd", "bwd_side0"), ("record", 2, "bwd_side0"), ("wait", 2, "main")]
    assert cuda.current is cuda.main


def test_call_streams_restore_main_when_a_launch_raises(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    streams = common.CallStreams(torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="launch failed"):
        with streams.on(_Stream("side")):
            assert cuda.current.name == "side"
            raise RuntimeError("launch failed")
    assert cuda.current is cuda.main
