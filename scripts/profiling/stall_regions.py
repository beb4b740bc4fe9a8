#!/usr/bin/env python3
"""Where a kernel's time goes, phase by phase, from Nsight Compute's per-instruction source page.

Input: the CSV that `ncu -i REPORT --page source --csv --print-source sass` writes (the `ncu_src` stage of
scripts/gpu_session.sh leaves it in $OUT/ncu_sass.csv). Our kernels separate their phases with
`__syncthreads()`, so the SASS between two BAR.SYNC instructions is one phase; for each phase this prints
its share of the kernel's warp-stall samples, the main stall reasons inside it, and the warp instructions it
executes per CTA, all of them and by kind (HMMA, LDSM, LDS, STS, MUFU, LDG / LDGSTS, STG, LDL / STL spills).

    python3 scripts/profiling/stall_regions.py ncu_sass.csv --kernel grads_kernel [--ctas 65376] [--min-share 0.5]

`--ctas` (the grid size) turns executed warp instructions into per-CTA counts; without it they are totals.
"""

from __future__ import annotations

import argparse
import csv
import sys

REASONS = ("short_sb", "wait", "long_sb", "barrier", "math", "mio", "selected", "not_selected", "lg", "no_inst",
           "dispatch", "branch_resolving", "drain")
OPS = (("hmma", "HMMA"), ("ldsm", "LDSM"), ("lds", "LDS"), ("sts", "STS"), ("mufu", "MUFU"), ("ldg", "LDG"),
       ("stg", "STG"), ("ldl", "LDL"), ("stl", "STL"))


def kernel_rows(path: str, name: str):
    """(header, rows) of the first kernel whose name contains `name`."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    for i, r in enumerate(rows):
        if r and r[0] == "Kernel Name" and name in r[1]:
            header, body = rows[i + 1], []
            for r2 in rows[i + 2:]:
                if not r2 or r2[0] == "Kernel Name":
                    break
                body.append(r2)
            return r[1], header, body
    sys.exit(f"stall_regions: no kernel matching {name!r} in {path}")


def opcode(sass: str) -> str:
    words = sass.split()
    return words[1] if words and words[0].startswith("@") else (words[0] if words else "")


def num(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--kernel", required=True, help="a substring of the kernel's name")
    p.add_argument("--ctas", type=float, default=1.0, help="grid size, for per-CTA instruction counts")
    p.add_argument("--min-share", type=float, default=0.5, help="hide phases under this share of samples (%%)")
    a = p.parse_args()
    name, header, body = kernel_rows(a.csv, a.kernel)
    col = {h: i for i, h in enumerate(header)}
    samples = col["Warp Stall Sampling (All Samples)"]
    executed = col["Instructions Executed"]
    reason_cols = {r: col[f"stall_{r}"] for r in REASONS if f"stall_{r}" in col}
    total = sum(num(r[samples]) for r in body) or 1.0

    phases, cur = [], None
    for line, r in enumerate(body):
        if cur is None:
            cur = {"first": line, "samples": 0.0, "all": 0.0, **{k: 0.0 for k in reason_cols},
                   **{k: 0.0 for k, _ in OPS}}
        cur["samples"] += num(r[samples])
        cur["all"] += num(r[executed])
        for k, c in reason_cols.items():
            cur[k] += num(r[c])
        op = opcode(r[1])
        for k, prefix in OPS:
            if op.startswith(prefix):
                cur[k] += num(r[executed])
        if "BAR.SYNC" in r[1]:
            cur["last"] = line
            phases.append(cur)
            cur = None
    if cur is not None:
        cur["last"] = len(body) - 1
        phases.append(cur)

    executed_all = sum(ph["all"] for ph in phases)
    print(f"{name}: {len(body)} SASS lines, {total:.0f} stall samples, {len(phases)} phases (between barriers), "
          f"{executed_all / a.ctas:.0f} warp instructions per CTA")
    print("| SASS lines | share | main stalls (share of the phase) | instructions per CTA | of which |")
    print("|---|---|---|---|---|")
    for ph in phases:
        share = 100.0 * ph["samples"] / total
        if share < a.min_share:
            continue
        top = sorted(((ph[k] / max(ph["samples"], 1.0), k) for k in reason_cols), reverse=True)[:3]
        stalls = ", ".join(f"{k} {100 * v:.0f} %" for v, k in top if v > 0.04)
        ops = " ".join(f"{k} {ph[k] / a.ctas:.0f}" for k, _ in OPS if ph[k])
        print(f"| {ph['first']}-{ph['last']} | {share:.1f} % | {stalls} | {ph['all'] / a.ctas:.0f} | {ops} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
