"""What the CUDA backend's wrappers share: the head dim, tensor checks, the SM count, even splits, side streams."""

from __future__ import annotations

import contextlib
import contextvars

import torch

__all__ = ["_D", "_c", "check_tensors", "check_grid_bounds", "sm_count", "planning_sm_count", "even_split",
           "side_streams", "CallStreams"]

_D = 128  # the kernels' head dim (K = V)
MAX_GRID_Y = 65535  # CUDA's bound on gridDim.y and gridDim.z (csrc/kda_common.cuh kMaxGridY)
MAX_GRID_X = 2**31 - 1  # ... on gridDim.x


_SMS: dict = {}
# the SM count of the GPU a byte query plans for without one (kda_workspace_bytes_kcp(..., arch=...)); unset, a
# table made off the GPU assumes an H200's 132, so the CPU tests choose as on the benchmark's machine
_PLANNING_SMS: contextvars.ContextVar = contextvars.ContextVar("kda_kcp_planning_sms", default=132)


@contextlib.contextmanager
def planning_sm_count(sms: int):
    """Tables made off the GPU inside this block choose segments and pieces for a GPU of ``sms`` SMs."""
    token = _PLANNING_SMS.set(sms)
    try:
        yield
    finally:
        _PLANNING_SMS.reset(token)


def sm_count(device) -> int:
    """SMs of ``device``; off the GPU, the planned GPU's (``planning_sm_count``, else an H200's 132).
    Kept per device with an index (a property query per call otherwise)."""
    device = torch.device(device)
    if device.type != "cuda":
        return _PLANNING_SMS.get()
    if device.index is None:
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def _c(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def check_tensors(where: str, q, k, v, g, beta, do=None) -> None:
    """BF16 q, k, v, beta (and do), FP32 g, all on a CUDA device, [T, H, 128] (beta [T, H])."""
    named = [("q", q, torch.bfloat16), ("k", k, torch.bfloat16), ("v", v, torch.bfloat16),
             ("g", g, torch.float32), ("beta", beta, torch.bfloat16)]
    if do is not None:
        named.append(("do", do, torch.bfloat16))
    for name, t, dt in named:
        if t.dtype != dt:
            raise TypeError(f"{where}: {name} must be {dt}, got {t.dtype}")
        if not t.is_cuda:
            raise ValueError(f"{where}: {name} must be on a CUDA device")
    if q.dim() != 3 or q.shape[-1] != _D or v.shape[-1] != _D:
        raise ValueError(f"{where}: head dim must be {_D}, got q {tuple(q.shape)}, v {tuple(v.shape)}")
    T, H, _ = q.shape
    for name, t, *_ in named[1:]:
        want = (T, H) if name == "beta" else (T, H, _D)
        if tuple(t.shape) != want:
            raise ValueError(f"{where}: {name} must be {list(want)}, got {list(t.shape)}")


def check_grid_bounds(heads: int, num_chunks: int) -> None:
    """The bounds of the kernels' grids that a call's shapes can reach, checked before any kernel runs: the walks and
    merges put the heads on gridDim.y or z (at most 65,535), the preps one CTA per chunk-head on gridDim.x (at most
    2^31 - 1). Chunk, segment and run counts have no bound of their own (the gradient kernel folds its chunks into
    gridDim.z, the forward's walks launch 65,535 segments at a time)."""
    if heads > MAX_GRID_Y:
        raise ValueError(f"the CUDA backend runs at most {MAX_GRID_Y:,} heads (a CUDA grid dimension), got H = {heads:,}")
    if num_chunks * heads > MAX_GRID_X:
        raise ValueError(f"the CUDA backend runs at most 2^31 - 1 chunk-heads per call (a CUDA grid dimension), got "
                         f"{num_chunks:,} chunks x {heads:,} heads; split the batch")


def even_split(nchunks: int, nseg: int) -> list[int]:
    """``nchunks`` chunks in ``nseg`` consecutive segments of whole chunks, the first ``nchunks % nseg`` one longer."""
    base, extra = divmod(nchunks, nseg)
    return [base + (1 if i < extra else 0) for i in range(nseg)]


_STREAMS: dict = {}


def side_streams(name: str, device, n: int, priority: int = 0) -> list:
    """``n`` CUDA streams of the pool ``name`` on ``device`` (made once, kept): the side streams a stage forks its
    launches onto. Pools of different names never share a stream."""
    device = torch.device(device)
    pool = _STREAMS.setdefault((name, device, priority), [])
    while len(pool) < n:
        pool.append(torch.cuda.Stream(device=device, priority=priority))
    return pool[:n]


class CallStreams:
    """The current stream of one call's device (``main``), resolved once, and the switches of its launches to side
    streams: ``with streams.on(side): launch(...)`` is ``with torch.cuda.stream(side): launch(...)`` for a stream of
    that device, whose entry and exit each look the current device up again through ``torch.cuda.is_available``
    (an NVML query and environment reads) and build a Stream object. Here an entry sets ``side`` current and the
    exit sets ``main`` back, the same two ``torch.cuda.set_stream`` calls; the kernel programs launch on torch's
    current stream (tvm_ffi asks torch for it at each call), so every launch lands where it did. When the current
    device is another (the stream context then moves the device too, and back), ``torch.cuda.stream`` is used as
    it is. One ``on`` at a time."""

    __slots__ = ("main", "_direct", "_target", "_context")

    def __init__(self, device):
        self.main = torch.cuda.current_stream(device)
        self._direct = torch.cuda.current_device() == self.main.device_index
        self._target = self._context = None

    def on(self, stream) -> "CallStreams":
        self._target = stream
        return self

    def __enter__(self) -> None:
        if self._direct:
            torch.cuda.set_stream(self._target)
        else:
            self._context = torch.cuda.stream(self._target)
            self._context.__enter__()

    def __exit__(self, *exc) -> None:
        if self._direct:
            torch.cuda.set_stream(self.main)
        else:
            self._context.__exit__(*exc)

    @staticmethod
    def join(waiter, stream) -> None:
        """``waiter.wait_stream(stream)``: an event recorded on ``stream`` now, that ``waiter`` waits for (the same
        calls, without three Python frames)."""
        event = torch.cuda.Event()
        event.record(stream)
        event.wait(waiter)
