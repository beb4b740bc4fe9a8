#!/usr/bin/env python3
"""Is the code that will be merged the code that was measured? Compare the PTX of two builds of the kernels.

A build measured on the GPU is often made from an experiment branch with a compile-time switch; what lands on
main is the same idea as plain code. A source change with the same meaning can compile to different code and run
slower (one ran 6 % slower), so the merged tree's PTX is diffed against the measured one before the measurement is
quoted for it. Each side is a git revision (`git archive`) or a directory, with its own -D defines:

    python3 scripts/ptx_diff.py main my-experiment --defines-b MY_SWITCH=2
    python3 scripts/ptx_diff.py HEAD . --arch sm_90a sm_100a --files csrc/kda_fwd.cu

Needs nvcc (no GPU). Comments, .loc / .file lines and the per-build hashes of anonymous namespaces are dropped
before the comparison. Exit status 0 when every (file, arch) pair is identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOISE = re.compile(r"^\s*(//|\.loc\b|\.file\b)")
ANON = re.compile(r"_GLOBAL__N__[0-9a-f]+_")


def tree(spec: str, into: Path) -> Path:
    """The source tree of `spec`: a directory as is, else a git revision unpacked under `into`."""
    p = Path(spec)
    if p.is_dir():
        return p.resolve()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", spec, "csrc"], check=True, capture_output=True)
    subprocess.run(["tar", "x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def ptx(src_root: Path, cu: str, arch: str, defines: list[str], include: str, out: Path) -> list[str]:
    num = arch.removeprefix("sm_")
    cmd = ["nvcc", "-O3", "-std=c++17", f"-gencode=arch=compute_{num},code={arch}", "-Icsrc", f"-I{include}",
           *(f"-D{d}" for d in defines), "-ptx", cu, "-o", str(out)]
    if shutil.which("setarch"):  # cicc's output otherwise varies from run to run with address randomization
        cmd = ["setarch", "x86_64", "-R", *cmd]
    subprocess.run(cmd, cwd=src_root, check=True)
    return [ANON.sub("_GLOBAL__N__", line) for line in out.read_text().splitlines() if not NOISE.match(line)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="git revision or directory (the merged side)")
    ap.add_argument("b", help="git revision or directory (the measured side)")
    ap.add_argument("--defines-a", nargs="*", default=[], metavar="NAME=VALUE")
    ap.add_argument("--defines-b", nargs="*", default=[], metavar="NAME=VALUE")
    ap.add_argument("--arch", nargs="+", default=["sm_90a"])
    ap.add_argument("--files", nargs="+", default=["csrc/kda_fwd.cu", "csrc/kda_bwd.cu"])
    ap.add_argument("--context", type=int, default=3, help="lines of context in the diffs shown")
    args = ap.parse_args()
    import tvm_ffi.libinfo  # the bindings' headers, which the kernel files include

    include = tvm_ffi.libinfo.find_include_path()
    same = True
    with tempfile.TemporaryDirectory(prefix="ptx_diff_") as tmp:
        t = Path(tmp)
        ra, rb = tree(args.a, t / "a"), tree(args.b, t / "b")
        for cu in args.files:
            for arch in args.arch:
                stem = f"{Path(cu).stem}.{arch}"
                pa = ptx(ra, cu, arch, args.defines_a, include, t / f"{stem}.a.ptx")
                pb = ptx(rb, cu, arch, args.defines_b, include, t / f"{stem}.b.ptx")
                diff = list(difflib.unified_diff(pa, pb, "a", "b", n=args.context, lineterm=""))
                changed = sum(1 for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---"))
                print(f"{cu} {arch}: {'identical' if not diff else f'{changed} lines differ'}")
                if diff:
                    same = False
                    print("\n".join(diff[:60]) + ("\n..." if len(diff) > 60 else ""))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
