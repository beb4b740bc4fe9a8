"""scripts/profiling/sass_lines.py (static SASS instructions per source line) on a small hand-made nvdisasm -gi page."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profiling" / "sass_lines.py"
spec = importlib.util.spec_from_file_location("sass_lines", SCRIPT)
sass_lines = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_lines)

PAGE = """\
.text._Z5otherv:
	//## File "/src/k.cu", line 3
        /*0000*/                   IMAD R1, R2, R3, RZ ;
.text._Z6kernelv:
	//## File "/src/k.cu", line 10
        /*0000*/                   S2R R0, SR_TID.X ;
	//## File "/src/tile.cuh", line 7 inlined at "/src/k.cu", line 20
	//## File "/src/k.cu", line 20 inlined at "/src/k.cu", line 30
	//## File "/src/k.cu", line 30
        /*0010*/                   IADD3 R4, P0, R2, 0x100, RZ ;
        /*0020*/              @!P0 LDGSTS.E.BYPASS.128 [R5+0x800], desc[UR4][R4.64] ;
	//## File "/src/tile.cuh", line 9 inlined at "/src/k.cu", line 31
	//## File "/src/k.cu", line 31
        /*0030*/                   STL [R1], R4 ;
.text._Z5thirdv:
	//## File "/src/k.cu", line 30
        /*0000*/                   LDL R4, [R1] ;
"""


def test_charged_to_the_outermost_line_of_the_chosen_file():
    counts = sass_lines.count_lines(PAGE, "kernel", "k.cu")
    # the inlined copy (tile.cuh:7 inside k.cu:20 inside k.cu:30) is charged to the kernel's own line 30; other
    # kernels' instructions are not counted
    assert {n: dict(c) for n, c in counts.items()} == {10: {"S2R": 1}, 30: {"IADD3": 1, "LDGSTS": 1}, 31: {"STL": 1}}
    inner = sass_lines.count_lines(PAGE, "kernel", "tile.cuh")  # the helper's own lines; S2R has none there
    assert {n: dict(c) for n, c in inner.items()} == {7: {"IADD3": 1, "LDGSTS": 1}, 9: {"STL": 1}}


def test_only_the_chosen_opcodes():
    counts = sass_lines.count_lines(PAGE, "kernel", "k.cu", {"LDL", "STL"})
    assert {n: dict(c) for n, c in counts.items()} == {31: {"STL": 1}}
