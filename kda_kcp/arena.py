"""The scratch of one call, carved from a caller's workspace instead of allocated.

An ``Arena`` hands out tensors from a byte buffer in order (each start aligned to 256 bytes); ``mark`` and
``release`` free everything carved after a mark, so a stage's scratch is reused by the next stage. Without
a buffer it falls back to ``torch.empty`` (a call without a workspace). The byte counts of the CUDA
backend (``kda_kcp.cuda.forward``, ``kda_kcp.cuda.backward``) use ``aligned`` on the same sequence of
carves, which is what makes ``kda_workspace_bytes_kcp`` exact.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ALIGN", "aligned", "tensor_bytes", "Arena"]

ALIGN = 256


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def tensor_bytes(shape, dtype: torch.dtype) -> int:
    """Aligned bytes one carve of ``shape`` and ``dtype`` takes."""
    return aligned(math.prod(shape) * dtype.itemsize)


class Arena:
    def __init__(self, buffer: torch.Tensor | None, device, what: str = "the CUDA backend's scratch"):
        self.buffer = buffer
        self.device = torch.device(device)
        self.what = what
        self.offset = 0
        self.peak = 0

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
        used = math.prod(shape) * dtype.itemsize
        t = self.buffer[self.offset:self.offset + used].view(dtype).view(shape)
        self.offset = end
        self.peak = max(self.peak, end)
        return t

    def mark(self) -> int:
        return self.offset

    def release(self, mark: int) -> None:
        """Everything carved after ``mark`` is dead."""
        self.offset = mark
