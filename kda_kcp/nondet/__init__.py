"""Non-deterministic KDA KCP: may reduce with atomics and split reductions where that is faster; results stay
within FP32 rounding of kda_kcp.det. Entries take ``deterministic=False`` only."""

from ..entries import ENTRY_NAMES, make_entries

DETERMINISTIC = False
globals().update(make_entries(__name__, DETERMINISTIC))

__all__ = ["DETERMINISTIC", *ENTRY_NAMES]
