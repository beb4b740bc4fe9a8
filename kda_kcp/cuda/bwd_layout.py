"""The byte layouts of the CUDA backward's scratch (csrc/kda_bwd.h): the prep record of each (chunk, head), h and dh.

The decoders of these layouts are the tests' (tests/records.py); the backward carves by the sizes here.
"""

from __future__ import annotations

from .common import _D

__all__ = ["PREP_BYTES", "DH_BYTES", "hi_state_shape", "scaled_state_shape"]

PREP_BYTES = 164352  # one prep record per (chunk, head), with the walks' V_new and dV_new; kda_bwd.h kPrepBytes
DH_BYTES = 32896  # dh per chunk-head: the state gradient's fp16 words, then their powers of two; kda_bwd.h kDhStateBytes


def hi_state_shape(n: int, H: int) -> tuple:
    """Shape of h: bf16 [n, H, 128, 128], the state entering each chunk as bf16 hi only in the walks' fragment
    order (kda_bwd.h kHiStateBytes; tests/records.py ``hi_states``): the gradient kernel's products read S as hi
    only, and its dgamma takes S hi times dS."""
    return (n, H, _D, _D)


def scaled_state_shape(n: int, H: int) -> tuple:
    """Shape of dh: uint8 [n, H, DH_BYTES], per chunk-head the state gradient as fp16 at a power of two per walk warp
    in the walks' fragment order, then the powers (kda_bwd.h kDhStateBytes; tests/records.py ``scaled_states``)."""
    return (n, H, DH_BYTES)

