"""The scratch of one call, carved from a caller's workspace instead of allocated.

An ``Arena`` hands out tensors from a byte buffer in order (each start aligned to 256 bytes); ``mark`` and
``release`` free everything carved after a mark, so a stage's scratch is reused by the next stage. Without
a buffer it falls back to ``torch.empty`` (a call without a workspace). The byte counts of the CUDA
backend (``kda_kcp.cuda.forward``, ``kda_kcp.cuda.backward``) use ``aligned`` on the same sequence of
carves, which is what makes ``kda_workspace_bytes_kcp`` exact.

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


class Arena:
    def __init__(self, buffer: torch.Tensor | None, device, what: str = "the CUDA backend's scratch",
                 views: dict | None = None):
        """``views``: a dict the typed views of ``buffer`` are kept in (a workspace passes its own, so they
        outlive the call); one of this arena's own otherwise."""
        self.buffer = buffer
        self.device = torch.device(device)
        self.what = what
        self.offset = 0
        self.peak = 0
        self._views = {} if views is None else views

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
            return torch.empty(shape, dtype=dtype, device=self.device)
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
