"""scripts/profiling/stall_regions.py (the ncu_src stage's per-phase summary) on a small hand-made SASS page."""

import csv
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profiling" / "stall_regions.py"
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
          "stall_barrier", "stall_wait"]


def test_phases_split_at_barriers(tmp_path):
    rows = [  # phase 1: a load and its barrier (60 samples); phase 2: two mma and a store (40 samples)
        ["0x0", "      LDG.E.128 R4, desc[UR4][R2.64]", "50", "64", "45", "0", "5"],
        ["0x10", "      BAR.SYNC.DEFER_BLOCKING 0x0", "10", "64", "0", "10", "0"],
        ["0x20", "      HMMA.16816.F32.BF16 R8, R4, R6, R8", "20", "128", "0", "0", "20"],
        ["0x30", "  @P0 HMMA.16816.F32.BF16 R12, R4, R6, R12", "10", "128", "0", "0", "10"],
        ["0x40", "      STG.E desc[UR4][R2.64], R8", "10", "32", "0", "0", "0"],
    ]
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "other_kernel(Args)"])
        w.writerow(HEADER)
        w.writerow(["0x0", "      NOP", "1", "1", "0", "0", "0"])
        w.writerow(["Kernel Name", "void grads_kernel<16>(Args)"])
        w.writerow(HEADER)
        w.writerows(rows)
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), "--kernel", "grads_kernel", "--ctas", "32"],
                         check=True, capture_output=True, text=True).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("| ") and "SASS" not in ln]
    assert "100 stall samples, 2 phases" in out
    assert lines[0].startswith("| 0-1 | 60.0 % | long_sb 75 %, barrier 17 %, wait 8 % |"), lines[0]
    assert "ldg 2" in lines[0]
    assert lines[1].startswith("| 2-4 | 40.0 % | wait 75 % |"), lines[1]
    assert "hmma 8" in lines[1] and "stg 1" in lines[1]  # the predicated HMMA counts too
