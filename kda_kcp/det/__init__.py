"""Deterministic KDA KCP: bitwise repeatable results (no floating-point atomics, fixed reduction orders,
tile choices that are pure functions of the shapes). Entries take ``deterministic=True`` only."""

from ..entries import ENTRY_NAMES, make_entries

DETERMINISTIC = True
globals().update(make_entries(__name__, DETERMINISTIC))

__all__ = ["DETERMINISTIC", *ENTRY_NAMES]
