"""The GPU architectures the library builds kernels for, by compute capability."""

from __future__ import annotations

__all__ = ["KERNEL_CAPABILITIES"]

# compute capabilities the library builds kernels for: sm_90a, sm_100a, sm_103a
KERNEL_CAPABILITIES = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}
