"""scripts/profiling/barrier_stamps.py on the CPU: the stamped gradient kernel's source (every barrier of
grads_kernel stamped with its own source line, nothing else changed) and the summary of a hand-made output."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "profiling" / "barrier_stamps.py"
spec = importlib.util.spec_from_file_location("barrier_stamps", SCRIPT)
barrier_stamps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(barrier_stamps)

SRC = (ROOT / "csrc" / "kda_bwd.cu").read_text()


def _kernel_barrier_lines(src):
    start = src.index(barrier_stamps.KERNEL)
    end = src.index("\n}\n", start)
    first = src[:start].count("\n") + 1
    return [first + n for n, line in enumerate(src[start:end].split("\n")) if "__syncthreads" in line]


def test_every_barrier_of_the_gradient_kernel_is_stamped_with_its_line():
    out = barrier_stamps.stamp_source(SRC)
    lines = _kernel_barrier_lines(SRC)
    assert len(lines) >= 10
    stamped = [int(x) for x in re.findall(r"KDA_ARRIVE\((\d+)\);\n[^\n]*__syncthreads", out)]
    # the barriers of the kernel in order, then the one the stamps add before their print
    assert stamped[:-1] == lines
    assert out.count("KDA_ARRIVE(") == len(lines) + 3  # + the macro, the start stamp, the end stamp
    for line in lines:
        assert "__syncthreads" in SRC.split("\n")[line - 1]


def test_the_stamps_change_nothing_else():
    out = barrier_stamps.stamp_source(SRC)
    out = out.replace(barrier_stamps.STAMP_DEFS, "", 1)
    kept = [line for line in out.split("\n") if not re.fullmatch(r"\s*KDA_ARRIVE\(\d+\);", line)]
    text = "\n".join(kept)
    select = barrier_stamps.STAMP_SELECT.replace("  KDA_ARRIVE();\n", "")
    assert text.count(select) == 1
    text = text.replace(select, "", 1)
    tail = barrier_stamps.STAMP_PRINT.split("\n", 1)[1]  # its first line (the end stamp) is gone with the others
    assert text.count(tail) == 1
    text = text.replace(tail, "}\n", 1)
    assert text == SRC


def _out(ctas):
    """BARRIER lines of CTAs given as {tok: [[t of warp w at stamp i] for w in 0..15]}."""
    lines = []
    for tok, warps in ctas.items():
        for w, ts in enumerate(warps):
            for i, t in enumerate(ts):
                lines.append(f"BARRIER tok={tok} w={w} i={i} line={100 + i} one=1 t={t}")
    lines.append("BARRIER tok=999 w=0 i=0 line=100 one=0 t=0")  # a per-block CTA: left out
    return lines


def test_the_summary_places_phases_and_waits(capsys):
    # 2 CTAs, 3 stamps: the start; barrier 1 where warpgroup 2's warps arrive last (at 1000, the rest at 600);
    # barrier 2 where every warp arrives at 1500 (CTA 0) or 1700 (CTA 1)
    def cta(end):
        return [[0, 1000 if w // 4 == 2 else 600, end] for w in range(16)]

    barrier_stamps.summarise(_out({64: cta(1500), 128: cta(1700)}))
    text = capsys.readouterr().out
    assert text.startswith("2 one-anchor CTAs")
    rows = [line for line in text.split("\n") if line.strip().startswith("line")]
    assert len(rows) == 2
    # barrier 1: phase 1000 cycles, mean wait 12 warps x 400 / 16 = 300, warpgroups 0, 1, 3 ahead by 400
    assert re.search(r"line +101 +1000 .* wait +300 +ahead +400 +400 +0 +400", rows[0]), rows[0]
    # barrier 2: phase median(500, 700) = 600, no wait
    assert re.search(r"line +102 +600 .* wait +0 +ahead +0 +0 +0 +0", rows[1]), rows[1]
    assert "total 1600 cycles" in text
