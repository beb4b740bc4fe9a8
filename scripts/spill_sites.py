"""Where does ptxas spill? Local-memory loads (LDL) and stores (STL) of one kernel, per source line.

ptxas -v gives only a kernel's spill bytes. In the gradient kernel (128 registers, one 16-warp CTA per SM) the
same byte count can sit in a cold epilogue or inside the state products' loop, and sessions 7, 12 and 13 lost
time to spills that moved into phase A. This compiles a source tree for one arch with -lineinfo and counts the
SASS spill instructions of the chosen kernel per file:line (static counts, not executions). Needs nvdisasm
(not in this machine's CUDA: `pip install nvidia-cuda-nvdisasm` and put its bin/ on PATH, or pass --nvdisasm).

    python3 scripts/spill_sites.py                         # csrc/, grads_kernel<16>, sm_90a
    python3 scripts/spill_sites.py --src /tmp/branch/csrc --kernel grads_kernelILi8
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", default=str(ROOT / "csrc"), help="source folder holding the .cu file")
    p.add_argument("--file", default="kda_bwd.cu", help="translation unit inside --src")
    p.add_argument("--kernel", default="grads_kernelILi16", help="substring of the kernel's mangled name")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--nvcc", default=os.environ.get("NVCC", "/usr/local/cuda/bin/nvcc"))
    p.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    args = p.parse_args()

    import tvm_ffi.libinfo  # the bindings' headers, as scripts/build_prebuilt.py compiles them

    src = Path(args.src)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run([args.nvcc, "-std=c++17", "-O3", "-lineinfo", f"-arch={args.arch}", f"-I{src}",
                        f"-I{tvm_ffi.libinfo.find_include_path()}", "-cubin", "-o", str(cubin), str(src / args.file)],
                       check=True)
        sass = subprocess.run([args.nvdisasm, "--print-line-info", str(cubin)], check=True, capture_output=True,
                              text=True).stdout

    section = re.compile(r"\.section\s+\.text\.(\S+?),")
    where = re.compile(r'## File "([^"]+)", line (\d+)')
    counts: dict[str, collections.Counter] = {"LDL": collections.Counter(), "STL": collections.Counter()}
    inside, site, found = False, "?", False
    for line in sass.splitlines():
        m = section.search(line)
        if m:
            inside = args.kernel in m.group(1)
            found |= inside
            continue
        if not inside:
            continue
        m = where.search(line)
        if m:
            site = f"{Path(m.group(1)).name}:{m.group(2)}"
            continue
        for op in counts:
            if re.search(rf"\b{op}(\.\w+)*\b", line):
                counts[op][site] += 1
    if not found:
        raise SystemExit(f"no kernel matching {args.kernel!r} in {args.file}")
    sites = sorted(set(counts["LDL"]) | set(counts["STL"]),
                   key=lambda s: (s.split(":")[0], int(s.split(":")[1]) if s.split(":")[1].isdigit() else 0))
    print(f"{args.kernel} ({args.arch}, {src / args.file}): {sum(counts['LDL'].values())} spill loads, "
          f"{sum(counts['STL'].values())} spill stores (SASS instructions)")
    for s in sites:
        print(f"  {s:32s} LDL {counts['LDL'][s]:3d}  STL {counts['STL'][s]:3d}")


if __name__ == "__main__":
    main()
