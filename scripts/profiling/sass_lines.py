"""Where do a kernel's instructions sit? Static SASS instructions of one kernel per source line, with their top opcodes.

A latency-bound walk issues in order, so instructions ahead of its products lengthen every step; a kernel run once
per chunk-head pays for every instruction at its start, where its loads are exposed. Counting the SASS of a kernel
by source line (static counts, not executions) shows where address arithmetic and spills sit (docs/kernels.md,
"Conventions"). Each instruction is charged to the outermost line of --in that it is inlined into (default: the
translation unit itself, i.e. the kernel's own lines; `--in kda_chunk_prep.cuh` splits the prep's shared code).
Needs nvdisasm (`pip install nvidia-cuda-nvdisasm` and put its bin/ on PATH, or pass --nvdisasm).

    python3 scripts/profiling/sass_lines.py --kernel grads_kernelILi16                  # csrc/kda_bwd.cu, sm_90a
    python3 scripts/profiling/sass_lines.py --file kda_fwd.cu --kernel walk_kernelILb1ELi4 --top 20
    python3 scripts/profiling/sass_lines.py --kernel prep_kernel --in kda_chunk_prep.cuh
    python3 scripts/profiling/sass_lines.py --ops LDL STL                               # the spill sites only
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

ROOT = Path(__file__).resolve().parents[2]
_SECTION = re.compile(r"^\.text\.(\S+?):")
_WHERE = re.compile(r'//## File "([^"]+)", line (\d+)')
_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def disassemble(src: Path, file: str, arch: str, nvcc: str, nvdisasm: str) -> str:
    """SASS of one translation unit with line and inline information (nvdisasm -gi)."""
    import tvm_ffi.libinfo  # the bindings' headers, as scripts/build_prebuilt.py compiles them

    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run([nvcc, "-std=c++17", "-O3", "-lineinfo", f"-arch={arch}", f"-I{src}",
                        f"-I{tvm_ffi.libinfo.find_include_path()}", "-cubin", "-o", str(cubin), str(src / file)],
                       check=True)
        return subprocess.run([nvdisasm, "-gi", "-c", str(cubin)], check=True, capture_output=True, text=True).stdout


def count_lines(sass: str, kernel: str, within: str, ops: set | None = None):
    """{line of `within`: Counter of opcodes} for the first kernel whose mangled name contains `kernel`. An
    instruction's location chain (innermost first, then each 'inlined at') is charged to its last entry in
    `within`; instructions with no such entry are left out. `ops`: count only these opcodes."""
    counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    inside = found = False
    chain: list[tuple[str, int]] = []
    fresh = False  # the next location comment starts a new chain
    site = None
    for line in sass.splitlines():
        m = _SECTION.match(line)
        if m:
            if found and inside:
                break
            inside = kernel in m.group(1)
            found |= inside
            continue
        if not inside:
            continue
        m = _WHERE.search(line)
        if m:
            if not fresh:
                chain, fresh = [], True
            chain.append((Path(m.group(1)).name, int(m.group(2))))
            continue
        m = _OPCODE.match(line)
        if not m:
            continue
        if fresh:
            hits = [n for f, n in chain if f == within]
            site, fresh = (hits[-1] if hits else None), False
        if site is not None and (ops is None or m.group(1) in ops):
            counts[site][m.group(1)] += 1
    if not found:
        raise SystemExit(f"no kernel matching {kernel!r}")
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", default=str(ROOT / "csrc"), help="source folder holding the .cu file")
    p.add_argument("--file", default="kda_bwd.cu", help="translation unit inside --src")
    p.add_argument("--kernel", default="grads_kernelILi16", help="substring of the kernel's mangled name")
    p.add_argument("--in", dest="within", default=None, help="file whose lines are charged (default: --file)")
    p.add_argument("--ops", nargs="*", default=None, help="count only these opcodes (e.g. LDL STL: the spills)")
    p.add_argument("--top", type=int, default=30, help="lines to print, most instructions first (0: all, by line)")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--nvcc", default=os.environ.get("NVCC", "/usr/local/cuda/bin/nvcc"))
    p.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    args = p.parse_args()

    src = Path(args.src)
    within = args.within or args.file
    counts = count_lines(disassemble(src, args.file, args.arch, args.nvcc, args.nvdisasm), args.kernel, within,
                         set(args.ops) if args.ops else None)
    text = (src / within).read_text().splitlines() if (src / within).exists() else []
    total = sum(sum(c.values()) for c in counts.values())
    what = " ".join(args.ops) if args.ops else "SASS"
    print(f"{args.kernel} ({args.arch}, {src / args.file}): {total} {what} instructions charged to {within} lines")
    rows = sorted(counts.items(), key=lambda kv: -sum(kv[1].values()))[:args.top] if args.top else sorted(counts.items())
    for n, c in rows:
        code = text[n - 1].strip()[:80] if 0 < n <= len(text) else ""
        top = " ".join(f"{op} {k}" for op, k in c.most_common(4))
        print(f"{sum(c.values()):6d}  {within}:{n:<5d} {top:40s} | {code}")


if __name__ == "__main__":
    main()
