#!/usr/bin/env python
"""Load every built program (no GPU needed) and check that it exports each entry point the Python
wrappers call (``ENTRY_POINTS`` of kda_kcp/cuda/forward.py, backward.py and activations.py), that the record
sizes and item lengths the wrappers assume match the kernels', and that its build identity (``build_identity()``)
is one the loader accepts as prebuilt: this program, this arch, the checkout's sources and flags. A renamed
binding or a stale build then fails CI instead of a user's first call.

    python scripts/check_entry_points.py DIR        # DIR/<arch>/<program>.so, as build_prebuilt.py --out DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kda_kcp import jit  # noqa: E402
from kda_kcp.cuda import activations, backward, forward  # noqa: E402

WRAPPERS = {"kda_fwd": forward, "kda_bwd": backward, "kda_act": activations}


def main() -> int:
    import tvm_ffi

    root = Path(sys.argv[1] if len(sys.argv) > 1 else "kda_kcp/prebuilt")
    sos = sorted(root.glob("*/*.so"))
    if not sos:
        print(f"no built programs under {root}")
        return 1
    bad = 0
    for so in sos:
        wrapper = WRAPPERS.get(so.stem)
        if wrapper is None:
            print(f"{so}: no Python wrapper names this program")
            bad += 1
            continue
        mod = tvm_ffi.load_module(str(so))
        missing = []
        for name in wrapper.ENTRY_POINTS:
            try:
                getattr(mod, name)
            except AttributeError:
                missing.append(name)
        if so.stem == "kda_fwd" and not missing and mod.fwd_record_bytes() != forward.RECORD_BYTES:
            missing.append(f"fwd_record_bytes() = {mod.fwd_record_bytes()} != RECORD_BYTES {forward.RECORD_BYTES}")
        if so.stem == "kda_act" and not missing and mod.act_rows_per_item() != activations.ROWS_PER_ITEM:
            missing.append(f"act_rows_per_item() = {mod.act_rows_per_item()} != ROWS_PER_ITEM "
                           f"{activations.ROWS_PER_ITEM}")
        try:
            jit.check_prebuilt_identity(mod, so, so.stem, so.parent.name)
        except jit.KernelBuildError as exc:
            missing.append(f"a build identity the loader accepts ({exc})")
        found = f"all {len(wrapper.ENTRY_POINTS)} entry points and its build identity"
        print(f"{so}: {'missing ' + ', '.join(missing) if missing else found}")
        bad += bool(missing)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
