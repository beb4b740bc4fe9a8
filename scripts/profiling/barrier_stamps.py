#!/usr/bin/env python
"""Which warps each CTA-wide barrier of the gradient kernel waits for: a stamped copy of the tree whose
grads_kernel<16> records, in every warp, the SM clock (clock64) on arriving at each __syncthreads, in the CTAs of
head 0 whose first token / 64 is 5 mod 128, and prints them; the summary gives per barrier (in execution order, with its
source line) the phase it closes (the last warp's arrival after the previous barrier's last), the mean time a warp
waits there, and how far each warpgroup's last warp arrives before the slowest.

    python3 scripts/profiling/barrier_stamps.py make /tmp/stamped     # the copy, built for sm_90a (nvcc, no GPU)
    python3 scripts/profiling/barrier_stamps.py run /tmp/stamped --heads 16
    python3 scripts/profiling/barrier_stamps.py run /tmp/stamped --heads 4 --docs 64x2112

`run` steps the copy's kda_kcp (profile_step.py, one forward + backward) and summarises its one-anchor CTAs. The
stamps cost the kernel a few per cent and some stack; they place phases, they do not time the kernel
(docs/kernels.md, Where the time goes).
"""

import argparse
import collections
import os
import re
import shutil
import statistics as st
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNEL = "grads_kernel(const Args a) {"

STAMP_DEFS = r'''
#include <cstdio>
// barrier_stamps.py: per-warp arrival stamps at grads_kernel<16>'s barriers
__device__ long long g_bar_t[2048 * 16 * 64];
__device__ int g_bar_line[2048 * 64];
#define KDA_ARRIVE(L)                                                                                          \
  do {                                                                                                         \
    if (stamp_cta && (threadIdx.x & 31) == 0 && stamp_n < 64) {                                                \
      long long t_;                                                                                            \
      asm volatile("mov.u64 %0, %%clock64;" : "=l"(t_));                                                       \
      g_bar_t[(stamp_slot * 16 + (threadIdx.x >> 5)) * 64 + stamp_n] = t_;                                     \
      if (threadIdx.x == 0) g_bar_line[stamp_slot * 64 + stamp_n] = (L);                                       \
    }                                                                                                          \
    ++stamp_n;                                                                                                 \
  } while (0)
'''

STAMP_SELECT = '''  // tok, the batch's token (c counts from the launch's first chunk)
  const bool stamp_cta = NW == 16 && h == 0 && (tok / 64) % 128 == 5;
  const int stamp_slot = static_cast<int>((tok / (64 * 128)) % 2048);
  int stamp_n = 0;
  KDA_ARRIVE();
'''

STAMP_PRINT = '''  KDA_ARRIVE();
  __syncthreads();
  if (stamp_cta && lane == 0) {
    const long long* t = g_bar_t + (stamp_slot * 16 + warp) * 64;
    const long long t0 = g_bar_t[stamp_slot * 16 * 64];
    for (int i = 0; i < stamp_n && i < 64; ++i)
      printf("BARRIER tok=%lld w=%d i=%d line=%d one=%d t=%lld\\n", static_cast<long long>(tok), warp, i,
             g_bar_line[stamp_slot * 64 + i], int(one_anchor), t[i] - t0);
  }
}
'''


def stamp_source(src: str) -> str:
    """kda_bwd.cu with the stamps: KDA_ARRIVE(line) before every __syncthreads of grads_kernel's body, line being the
    barrier's line in the unstamped source."""
    start = src.index(KERNEL)
    end = src.index("\n}\n", start)  # the kernel's closing brace (its body's braces are indented)
    first = src[:start].count("\n") + 1  # the source line of the kernel's first line
    out, selected = [], False
    for n, line in enumerate(src[start:end].split("\n")):
        if "__syncthreads" in line:
            assert selected, "a barrier before the chunk row"
            out.append(line[:len(line) - len(line.lstrip())] + f"KDA_ARRIVE({first + n});")
        out.append(line)
        if not selected and re.match(r"  const int nrows = ", line):
            out.append(STAMP_SELECT.rstrip("\n").replace("KDA_ARRIVE()", f"KDA_ARRIVE({first + n})"))
            selected = True
    assert selected, "grads_kernel's chunk row not found"
    body = "\n".join(out)
    last = src[:end].count("\n") + 2  # the kernel's closing line
    src = src[:start] + body + "\n" + STAMP_PRINT.replace("KDA_ARRIVE()", f"KDA_ARRIVE({last})") + src[end + 3:]
    return src.replace('#include "kda_bwd.h"\n', '#include "kda_bwd.h"\n' + STAMP_DEFS, 1)


def make(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    for f in files:
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dst / f)
    p = dst / "csrc" / "kda_bwd.cu"
    p.write_text(stamp_source(p.read_text()))
    subprocess.run([sys.executable, "scripts/build_prebuilt.py", "--arch", "sm_90a", "--program", "kda_bwd"], cwd=dst,
                   check=True)
    print(f"stamped copy in {dst}; its other programs build on first use (or copy them into kda_kcp/prebuilt/sm_90a)")


def summarise(lines) -> None:
    ctas = collections.defaultdict(lambda: collections.defaultdict(dict))
    where = {}
    pat = re.compile(r"BARRIER tok=(\d+) w=(\d+) i=(\d+) line=(\d+) one=(\d+) t=(-?\d+)")
    for line in lines:
        m = pat.search(line)
        if m and m.group(5) == "1":
            tok, w, i, ln, _, t = map(int, m.groups())
            ctas[tok][i][w] = t
            where[i] = ln
    rows = []
    for stamps in ctas.values():
        n = len(stamps)
        if n < 2 or any(len(stamps[i]) != 16 for i in range(n)):
            continue
        r, prev = [], max(stamps[0].values())
        for i in range(1, n):
            arr = [stamps[i][w] for w in range(16)]
            last = max(arr)
            ahead = [last - max(arr[4 * g:4 * g + 4]) for g in range(4)]
            r.append((last - prev, st.mean(last - a for a in arr), ahead))
            prev = last
        rows.append(r)
    if not rows:
        sys.exit("no complete one-anchor CTA in the output")
    n = min(len(r) for r in rows)
    total = st.median(sum(p[0] for p in r[:n]) for r in rows)
    print(f"{len(rows)} one-anchor CTAs; median cycles per barrier (execution order): the phase it closes, the mean "
          "wait of a warp there, each warpgroup's last warp ahead of the slowest")
    for i in range(n):
        ph = st.median(r[i][0] for r in rows)
        wait = st.median(r[i][1] for r in rows)
        lead = [st.median(r[i][2][g] for r in rows) for g in range(4)]
        print(f"  line {where.get(i + 1, 0):5d}  {ph:7.0f} ({100 * ph / total:4.1f} %)  wait {wait:6.0f}  "
              f"ahead {' '.join(f'{x:6.0f}' for x in lead)}")
    waits = st.median(sum(p[1] for p in r[:n]) for r in rows)
    print(f"  total {total:.0f} cycles; a warp waits {waits:.0f} of them at barriers ({100 * waits / total:.0f} %)")


def run(copy: Path, extra) -> None:
    env = dict(os.environ, PYTHONPATH=f"{copy}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", KDA_KCP_BACKEND="cuda")
    out = subprocess.run([sys.executable, "scripts/profile_step.py", *extra], cwd=copy, env=env, capture_output=True,
                         text=True)
    if out.returncode != 0:
        sys.exit(out.stderr[-2000:])
    summarise(out.stdout.splitlines())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("make", "run", "summarise"))
    p.add_argument("path", help="the stamped copy (make, run) or a saved output (summarise)")
    a, extra = p.parse_known_args()
    path = Path(a.path)
    if a.mode == "make":
        make(path)
    elif a.mode == "run":
        run(path, extra)
    else:
        summarise(path.read_text().splitlines())


if __name__ == "__main__":
    main()
