"""The scratch of one call, carved from a caller's workspace instead of allocated.

An ``Arena`` hands out tensors from a byte buffer in order (each start aligned to 256 bytes); ``mark`` and
``release`` free everything carved after a mark, so a stage's scratch is reused by the next stage. Without
a buffer it falls back to ``torch.empty`` (a call without a workspace). ``Arena.count_only`` makes one that
only counts: its carves are placeholders on the meta device (shape and dtype, no memory) and it keeps the
offset and the peak as a buffer would. ``kda_workspace_bytes_kcp`` is the peak of a call's own carve sequence
run on such an arena (``kda_kcp.sizing.arena_parts``), so the size and the carves cannot disagree.

A carve is one ``torch.as_strided`` of a typed view of the buffer (the views are kept per dtype, and a
workspace keeps them across calls): on the H200 machine's host a slice and two views took ~9 us per carve,
paid before the first kernel of a call can start.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ALIGN", "aligned", "tensor_bytes", "contiguous_strides", "Arena"]

ALIGN = 256


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def tensor_bytes(shape, dtype: torch.dtype) -> int:
    """Aligned bytes one carve of ``shape`` and ``dtype`` takes."""
    return aligned(math.prod(shape) * dtype.itemsize)


def contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


_META = torch.device("meta")


class Arena:
    def __init__(self, buffer: torch.Tensor | None, device, what: str = "the CUDA backend's scratch",
                 views: dict | None = None):
        """``device``: the device the call runs on (its tables and kernels). ``views``: a dict the typed views of
        ``buffer`` are kept in (a workspace passes its own, so they outlive the call); one of this arena's own
        otherwise."""
        self.buffer = buffer
        self.device = torch.device(device)
        self.what = what
        self.offset = 0
        self.peak = 0
        self.counting = False
        self._views = {} if views is None else views

    @classmethod
    def count_only(cls, device) -> "Arena":
        """An arena that only counts, for a call on ``device``: each carve advances the offset and the peak as on
        a buffer and returns a meta tensor; whoever carves from it launches nothing (the call is being sized)."""
        arena = cls(None, device)
        arena.counting = True
        return arena

    def _typed(self, dtype: torch.dtype):
        """(the buffer's whole ``dtype`` elements viewed as ``dtype``, that view's storage offset in elements).
        Every carve ends on an ALIGN boundary inside the buffer, so it lies inside the view."""
        if dtype not in self._views:
            b = self.buffer
            v = b[: b.numel() - b.numel() % dtype.itemsize].view(dtype)
            self._views[dtype] = (v, v.storage_offset())
        return self._views[dtype]

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(int(s) for s in shape)
        if self.buffer is None:
            if not self.counting:
                return torch.empty(shape, dtype=dtype, device=self.device)
            self.offset += tensor_bytes(shape, dtype)
            self.peak = max(self.peak, self.offset)
            return torch.empty(shape, dtype=dtype, device=_META)
        n = tensor_bytes(shape, dtype)
        end = self.offset + n
        if end > self.buffer.numel():
            raise ValueError(
                f"workspace too small for {self.what}: needs at least {end} bytes of arena, has "
                f"{self.buffer.numel()}; size it with kda_workspace_bytes_kcp(ctx, num_heads, ...) for this context"
            )
        view, base = self._typed(dtype)  # the carve starts ALIGN-aligned: its offset is whole elements
        t = torch.as_strided(view, shape, contiguous_strides(shape), base + self.offset // dtype.itemsize)
        self.offset = end
        self.peak = max(self.peak, end)
        return t

    def mark(self) -> int:
        return self.offset

    def release(self, mark: int) -> None:
        """Everything carved after ``mark`` is dead."""
        self.offset = mark
