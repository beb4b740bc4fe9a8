"""Byte queries and the reusable workspace.

What a call needs beyond its inputs and outputs:
- workspace: the exchange scratch (send rows, then every rank's rows; the larger of the forward and the
  backward exchange) plus, on the CUDA backend, the arena its kernels' scratch is carved from (records,
  per-chunk states, segment summaries; kda_kcp/function.py lays it out). Dead after the call, so one
  ``WorkspaceKcp`` serves several calls in turn, of any context whose need fits.
- saved: the incoming state of every local run ([R, H, K, V] FP32), kept from the forward for the
  backward when the batch is split across pieces (nothing at W = 1). The inputs themselves are saved
  by reference and not counted.
- comm: per forward + backward step, the bytes this rank sends plus the bytes it receives in the two
  all-gathers: 2 (W - 1) x its buffer each way (what a ring all-gather moves per rank).

``head_dim``, ``value_dim`` (default: head_dim) and ``dtype`` describe the torch backend's other shapes and
precisions (FP64 tests); the library's kernels use head dims 128 and FP32 summaries, the defaults.
"""

from __future__ import annotations

import copy

import torch

from .archs import KERNEL_CAPABILITIES
from .arena import Arena
from .exchange import summary_elements
from .handles import new_handle
from .sizing import element_bytes, workspace_bytes
from .validate import check_context, check_flag, check_positive_int

__all__ = [
    "ARENAS",
    "check_arena",
    "kda_workspace_bytes_kcp",
    "kda_saved_bytes_kcp",
    "kda_comm_bytes_kcp",
    "WorkspaceKcp",
]

ARENAS = ("replay", "lean")


def check_arena(local_arena, lean_passes) -> int | None:
    if local_arena not in ARENAS:
        raise ValueError(f"local_arena must be one of {ARENAS}, got {local_arena!r}")
    if lean_passes is None:
        return 2 if local_arena == "lean" else None
    if local_arena != "lean":
        raise ValueError(f"lean_passes applies to local_arena='lean' only, got lean_passes={lean_passes!r} with {local_arena!r}")
    if isinstance(lean_passes, bool) or not isinstance(lean_passes, int) or not 1 <= lean_passes <= 8:
        raise ValueError(f"lean_passes must be an int in 1..8 (or None for 2), got {lean_passes!r}")
    return lean_passes


def _heads(num_heads) -> int:
    check_positive_int("num_heads", num_heads)
    return num_heads


def _dims(head_dim, value_dim) -> None:
    check_positive_int("head_dim", head_dim)
    check_positive_int("value_dim", value_dim, none_ok=True)


def _device_of(ctx, device) -> torch.device:
    dev = torch.device(device) if device is not None else ctx.token_index.device
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={dev} but this machine has no CUDA device; to plan for a GPU you do not have, pass arch= "
            "(one of 'sm_90a', 'sm_100a', 'sm_103a', with sm_count= where needed) instead of device="
        )
    if dev.type == "cuda" and dev.index is None:  # the key the tables are cached under names the index
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


# SM counts of the parts a plan names by arch alone: H100 / H200 SXM (sm_90a) and B200 (sm_100a); any other part
# (H100 PCIe's 114, a B300) is named by its sm_count
PLANNING_SM_COUNTS = {"sm_90a": 132, "sm_100a": 148}


def _planned_sizes(ctx, num_heads, deterministic, passes, head_dim, value_dim, dtype, arch, sm_count) -> int:
    """kda_workspace_bytes_kcp for the CUDA kernels of ``arch`` on a GPU of ``sm_count`` SMs, computed without one:
    the sizes are pure functions of the shapes and the SM count. The tables are made on the CPU, in a copy of the
    context's local plan kept per SM count, so they never mix with the tables of a real device."""
    from dataclasses import replace

    from .cuda import CudaBackend
    from .cuda.common import planning_sm_count

    archs = sorted(KERNEL_CAPABILITIES.values())
    if arch not in archs:
        from .jit import manifest

        try:
            declared = manifest()["archs"].get(arch) if isinstance(arch, str) else None
        except Exception:  # noqa: BLE001 - no manifest to name it from: the plain message
            declared = None
        unbuildable = f" ({arch} is declared in build.json but not buildable: {declared.get('why', 'no kernels')})" \
            if declared else ""
        raise ValueError(f"arch must be one of {archs}, got {arch!r}{unbuildable}")
    if sm_count is None:
        sm_count = PLANNING_SM_COUNTS.get(arch)
        if sm_count is None:
            raise ValueError(f"sm_count is required with arch={arch!r} (the SM count of the GPU to plan for)")
    check_positive_int("sm_count", sm_count)
    key = ("planning_local", sm_count)
    if key not in ctx.local._tables:
        ctx.local._tables[key] = replace(ctx.local, _tables={})
    planned = copy.copy(ctx)
    planned.local = ctx.local._tables[key]
    with planning_sm_count(sm_count):
        return workspace_bytes(planned, num_heads, CudaBackend(deterministic), torch.device("cpu"), head_dim,
                               value_dim, dtype, passes)


def kda_workspace_bytes_kcp(
    ctx, num_heads, deterministic=True, local_arena="replay", lean_passes=None, *, head_dim=128, value_dim=None,
    dtype=torch.float32, device=None, arch=None, sm_count=None,
) -> int:
    """Bytes of workspace one call (forward or backward) of this context needs, on ``device`` (default:
    the device of the cu_seqlens the context was built from): the exchange scratch, and on the CUDA
    backend every scratch buffer of its kernels, so that a call with the workspace allocates only its
    outputs. ``local_arena="replay"`` holds the backward's per-chunk buffers for every chunk at once;
    ``"lean"`` runs the backward in ``lean_passes`` passes (1..8, default 2) over whole segments of the
    walks, on buffers for the largest pass, with results bitwise equal to replay.

    ``arch`` (with ``sm_count``; default 132 for sm_90a, 148 for sm_100a) instead of ``device``: the bytes for the
    CUDA kernels of that architecture, computed on any machine (a CPU-only login node too)."""
    check_context(ctx)
    _dims(head_dim, value_dim)
    passes = check_arena(local_arena, lean_passes)
    H = _heads(num_heads)
    if arch is not None or sm_count is not None:
        if device is not None:
            raise ValueError("pass device= (a GPU of this machine) or arch= (a GPU to plan for), not both")
        if arch is None:
            raise ValueError("sm_count goes with arch= (the GPU architecture to plan for)")
        return _planned_sizes(ctx, H, deterministic, passes, head_dim, value_dim, dtype, arch, sm_count)
    from .backend import select_backend

    dev = _device_of(ctx, device)
    return workspace_bytes(ctx, H, select_backend(dev, deterministic), dev, head_dim, value_dim, dtype, passes)


def kda_saved_bytes_kcp(ctx, num_heads, deterministic=True, *, head_dim=128, value_dim=None, dtype=torch.float32) -> int:
    """Bytes the forward keeps for the backward beyond references to the inputs."""
    check_context(ctx)
    _dims(head_dim, value_dim)
    per_run = _heads(num_heads) * head_dim * (value_dim or head_dim) * element_bytes(dtype)
    return ctx.local.num_runs * per_run if ctx.plan.needs_exchange else 0


def kda_comm_bytes_kcp(ctx, num_heads, deterministic=True, *, head_dim=128, value_dim=None, dtype=torch.float32) -> int:
    """Bytes this rank sends plus receives in one forward + backward step."""
    check_context(ctx)
    _dims(head_dim, value_dim)
    W = ctx.world_size
    per = summary_elements(_heads(num_heads), head_dim, value_dim or head_dim) * element_bytes(dtype)
    if W == 1 or not ctx.plan.needs_exchange:
        return 0
    return 2 * (W - 1) * per * (ctx.plan.fwd_slots + ctx.plan.bwd_slots)


class WorkspaceKcp:
    """A byte buffer sized by ``kda_workspace_bytes_kcp``; pass it as ``workspace=`` to reuse it. Making
    one for a context also puts the CUDA backend's index tables for ``num_heads`` on the device, so the
    calls that use it copy nothing from the host.

    It holds scratch only (nothing a later backward needs), so consecutive calls, forward or backward,
    of any context whose need fits may share it.
    """

    def __init__(
        self, ctx, num_heads, device=None, deterministic=True, local_arena="replay", lean_passes=None,
        *, head_dim=128, value_dim=None, dtype=torch.float32,
    ):
        self.device = _device_of(check_context(ctx), device)
        self.lean_passes = check_arena(local_arena, lean_passes)  # None: the replay arena
        self.nbytes = kda_workspace_bytes_kcp(
            ctx, num_heads, deterministic, local_arena, lean_passes, head_dim=head_dim, value_dim=value_dim,
            dtype=dtype, device=self.device,
        )
        self.deterministic = deterministic
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self._graph_handle = new_handle(self)  # names this workspace in torch.compile graphs (kda_kcp.library)
        from .backend import select_backend

        # the CUDA backend's head-dependent index tables, on the device now
        select_backend(self.device, deterministic).upload_tables(ctx, _heads(num_heads), self.device, self.lean_passes)

    @classmethod
    def from_buffer(cls, buffer: torch.Tensor, deterministic=True, local_arena="replay", lean_passes=None) -> "WorkspaceKcp":
        """Wrap caller-owned bytes (a 1-D uint8 tensor) as a workspace for calls of ``local_arena`` (and
        ``lean_passes``), which its size must fit (kda_workspace_bytes_kcp with the same arguments)."""
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise TypeError("workspace buffer must be a 1-D torch.uint8 tensor")
        if buffer.numel() and buffer.stride(0) != 1:
            raise ValueError(f"workspace buffer must be contiguous, got stride {buffer.stride(0)}")
        # the kernels read the carves with 16-byte accesses, and the carves start on ALIGN-byte offsets from here
        if buffer.numel() and buffer.data_ptr() % 16:
            raise ValueError(
                f"workspace buffer must start on a 16-byte boundary, got an address {buffer.data_ptr() % 16} bytes past "
                "one (slice a larger buffer at a multiple of 16 bytes)"
            )
        check_flag("deterministic", deterministic)
        ws = cls.__new__(cls)
        ws.nbytes, ws.deterministic, ws.device, ws.buffer = buffer.numel(), deterministic, buffer.device, buffer
        ws.lean_passes = check_arena(local_arena, lean_passes)
        ws._graph_handle = new_handle(ws)
        return ws

    def begin_use(self) -> None:
        """A call on the current CUDA stream is about to carve this workspace: when the previous call that used it
        ran on another stream, the current stream waits for that use to end (a CUDA event, no host
        synchronization), as the caching allocator orders a block's reuse across streams. Calls on one stream
        are ordered by the stream itself. Off the GPU, and while a CUDA graph is being captured (replays run in
        the order the caller gives them), there is nothing to do."""
        device = self.buffer.device
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        last = self.__dict__.get("_last_use")
        # the streams compared by their handles: torch.cuda.current_stream builds a Stream object (a few us of host
        # time before the call's first kernel), needed only to wait
        if last is not None and last[0] != torch._C._cuda_getCurrentRawStream(device.index):
            torch.cuda.current_stream(device).wait_event(last[1])

    def end_use(self) -> None:
        """The call that began on the current stream has enqueued its last use of the workspace."""
        if self.buffer.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        last = self.__dict__.get("_last_use")
        event = last[1] if last is not None else torch.cuda.Event()
        stream = torch.cuda.current_stream(self.buffer.device)
        event.record(stream)
        self._last_use = (stream.cuda_stream, event)  # (the stream's handle, as begin_use reads it)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, what: str) -> torch.Tensor:
        """The first ``numel`` elements of the buffer as ``dtype``; raises if the buffer is too small."""
        need = numel * dtype.itemsize
        if need > self.nbytes:
            raise ValueError(
                f"workspace too small for {what}: needs {need} bytes, has {self.nbytes}; size it with "
                "kda_workspace_bytes_kcp(ctx, num_heads, ...) for this context"
            )
        if self.buffer.device != device:
            raise ValueError(f"workspace is on {self.buffer.device} but the inputs are on {device}")
        return self.buffer[:need].view(dtype)

    def arena(self, start: int, end: int, device) -> Arena:
        """An empty ``Arena`` over bytes [start, end) of the buffer. The slice, its typed views and the carves are
        kept per (start, end) (for the last 64 of them), so a call makes no view of the buffer after the first
        call of its shape."""
        owner, cache = self.__dict__.get("_arenas", (None, None))
        if owner is not self.buffer:  # made for another buffer (or none yet)
            cache = {}
            self._arenas = (self.buffer, cache)
        if (start, end) not in cache:
            if len(cache) >= 64:
                cache.clear()
            cache[(start, end)] = (self.buffer[start:end], {})
        base, views = cache[(start, end)]
        return Arena(base, device, views=views)

    def __repr__(self) -> str:
        return f"WorkspaceKcp(nbytes={self.nbytes}, device={self.device})"
