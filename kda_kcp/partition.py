"""How one packed batch is split over the ranks of a group (host only, pure functions).

A *piece* is a contiguous run of global tokens ``(start, end)`` held by one rank. ``partition_kcp``
returns, for every rank, its pieces in local order. Parts are "equal" in the sense of docs/design.md
§3: sizes differ by at most one token, and no divisibility is required.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .validate import check_positive_int

__all__ = ["LAYOUTS", "partition_kcp", "check_cu_seqlens", "equal_split"]

LAYOUTS = ("contiguous", "zigzag", "zigzag_per_document")

Piece = tuple[int, int]


def check_cu_seqlens(cu_seqlens, name: str = "cu_seqlens") -> list[int]:
    """Validate document offsets and return them as Python ints.

    Accepts a 1-D integer tensor (any device) or a sequence of ints: N + 1 >= 2 entries, cu[0] == 0,
    non-decreasing. Zero-length documents are allowed.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"{name} must be a 1-D tensor of N + 1 offsets, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers (int32 or int64), got {cu_seqlens.dtype}")
        if cu_seqlens.is_meta:
            raise ValueError(f"{name} is a meta tensor: its offsets must be values (a CPU or CUDA tensor, or a list)")
        values = [int(x) for x in cu_seqlens.detach().cpu().tolist()]
    elif isinstance(cu_seqlens, (list, tuple)):
        values = []
        for x in cu_seqlens:
            if isinstance(x, bool) or not isinstance(x, int):
                raise TypeError(f"{name} must hold integers, got {type(x).__name__} {x!r}")
            values.append(int(x))
    else:
        raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {type(cu_seqlens).__name__}")
    if len(values) < 2:
        raise ValueError(f"{name} must hold N + 1 >= 2 offsets (at least one document), got {len(values)}")
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing, but {name}[{i}] = {values[i]} < {name}[{i - 1}] = {values[i - 1]}"
            )
    return values


def equal_split(start: int, end: int, parts: int) -> list[Piece]:
    """Split [start, end) into ``parts`` contiguous ranges whose sizes differ by at most one."""
    n = end - start
    return [(start + (i * n) // parts, start + ((i + 1) * n) // parts) for i in range(parts)]


def coalesce_ranges(pieces: Sequence[Piece]) -> list[Piece]:
    """Drop empty pieces and join neighbours that are contiguous (end of one = start of the next)."""
    out: list[Piece] = []
    for s, e in pieces:
        if e <= s:
            continue
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def partition_kcp(cu_seqlens, world_size: int, layout: str = "contiguous") -> list[list[Piece]]:
    """Pieces of every rank, in local order: ``parts[r] = [(global_start, global_end), ...]``.

    - ``contiguous``: rank r holds part r of W equal parts of the T global tokens;
    - ``zigzag``: rank r holds parts r and 2W-1-r of 2W equal parts (front part first);
    - ``zigzag_per_document``: the zigzag split inside every document (for each document in order,
      its front part then its back part).

    Empty pieces are dropped and pieces that touch in both local and global order are joined (so
    W = 1 gives one piece per layout that does not cut documents).
    """
    cu = check_cu_seqlens(cu_seqlens)
    check_positive_int("world_size", world_size)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    W = world_size
    T = cu[-1]
    if layout == "contiguous":
        return [coalesce_ranges([p]) for p in equal_split(0, T, W)]
    if layout == "zigzag":
        halves = equal_split(0, T, 2 * W)
        return [coalesce_ranges([halves[r], halves[2 * W - 1 - r]]) for r in range(W)]
    parts: list[list[Piece]] = [[] for _ in range(W)]
    for s, e in zip(cu[:-1], cu[1:]):
        halves = equal_split(s, e, 2 * W)
        for r in range(W):
            parts[r].extend([halves[r], halves[2 * W - 1 - r]])
    return [coalesce_ranges(p) for p in parts]
