"""The scratch of one call, carved from a caller's workspace instead of allocated.

An ``Arena`` hands out tensors from a byte buffer in order (each start aligned to 256 bytes); ``mark`` and
``release`` free everything carved after a mark, so a stage's scratch is reused by the next stage. Without
a buffer it falls back to ``torch.empty`` (a call without a workspace). ``Arena.count_only`` makes one that
only counts: its carves are placeholders on the meta device (shape and dtype, no memory) and it keeps the
offset and the peak as a buffer would. ``kda_workspace_bytes_kcp`` is the peak of a call's own carve sequence
run on such an arena (``kda_kcp.sizing.arena_parts``), so the size and the carves cannot disagree.

A carve is one ``torch.as_strided`` of a typed view of the buffer (the views are kept per dtype, and a
workspace keeps them across calls): on the H200 machine's host a slice and two views took ~9 us per carve,
paid before the first kernel of a call can start. A workspace keeps the carves too, per (offset, shape, dtype): a
call of a shape seen before gets the same tensors back (they view the same bytes; a carve is scratch, written
before it is read in every call) for a dictionary lookup.
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
_MOST_CARVES = 1024  # carves kept per workspace range (a new shape's carves replace them all past this)
_NOTHING: dict = {}  # (device, dtype) -> a 0-element tensor: what a carve of shape (0,) is without a buffer


class Arena:
    def __init__(self, buffer: torch.Tensor | None, device, what: str = "the CUDA backend's scratch",
                 views: dict | None = None):
        """``device``: the device the call runs on (its tables and kernels). ``views``: a dict the typed views of
        ``buffer`` and its carves are kept in (a workspace passes its own, so they outlive the call); one of this
        arena's own otherwise."""
        self.buffer = buffer
        self.device = device if type(device) is torch.device else torch.device(device)
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
        if self.buffer is None:
            shape = tuple(int(s) for s in shape)
            if not self.counting:
                if shape == (0,):  # an absent optional argument of a launch: nothing to allocate (no bytes, a null
                    # pointer, as torch.empty gives it), one kept tensor instead of a ~3 us allocator call per call
                    nothing = _NOTHING.get((self.device, dtype))
                    if nothing is None:
                        nothing = _NOTHING[(self.device, dtype)] = torch.empty(shape, dtype=dtype, device=self.device)
                    return nothing
                return torch.empty(shape, dtype=dtype, device=self.device)
            self.offset += tensor_bytes(shape, dtype)
            self.peak = max(self.peak, self.offset)
            return torch.empty(shape, dtype=dtype, device=_META)
        # the carves are kept for shapes given as tuples of ints (hashable, and equal only to the same shape)
        key = (self.offset, shape, dtype) if type(shape) is tuple and all(type(s) is int for s in shape) else None
        kept = self._views.get(key) if key is not None else None
        if kept is not None:
            t, end = kept
        else:
            shape = tuple(int(s) for s in shape)
            end = self.offset + tensor_bytes(shape, dtype)
            if end > self.buffer.numel():
                raise ValueError(
                    f"workspace too small for {self.what}: needs at least {end} bytes of arena, has "
                    f"{self.buffer.numel()}; size it with kda_workspace_bytes_kcp(ctx, num_heads, ...) for this "
                    "context"
                )
            view, base = self._typed(dtype)  # the carve starts ALIGN-aligned: its offset is whole elements
            t = torch.as_strided(view, shape, contiguous_strides(shape), base + self.offset // dtype.itemsize)
            if key is not None:
                if len(self._views) > _MOST_CARVES:
                    self._views.clear()
                self._views[key] = (t, end)
        self.offset = end
        if end > self.peak:
            self.peak = end
        return t

    def rows(self, t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``t[start:stop]``, kept with the carves (the entry holds ``t``, so its id names no other tensor while
        kept): a launch that takes row ranges of a carve or of a cached table makes each view once per workspace
        and shape, not once per call."""
        key = ("rows", id(t), start, stop)
        kept = self._views.get(key)
        if kept is not None:
            return kept[1]
        view = t[start:stop]
        if len(self._views) > _MOST_CARVES:
            self._views.clear()
        self._views[key] = (t, view)
        return view

    def mark(self) -> int:
        return self.offset

    def release(self, mark: int) -> None:
        """Everything carved after ``mark`` is dead."""
        self.offset = mark
