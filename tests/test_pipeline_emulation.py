"""The pipeline pieces of the v2 kernels (csrc/kda_pipeline.cuh: mbarriers, bulk copies and stores, named barriers,
setmaxnreg; csrc/kda_tile_ring.cuh: the tile ring) on the CPU: tests/probes/pipeline_probe.cu built by g++ against
their emulation (tests/emulation/kda_pipeline.cuh), which lands a bulk copy only when its mbarrier is next used and
reads a bulk store's source only at its wait. The probe streams tiles through the ring into bulk stores and must get
every value right; with one wait left out (the consumers' wait for a tile, the wait before a staging tile is written
again) it must get values wrong, so the emulation catches those mistakes. With nvcc, the probe also compiles for
every arch build.json builds (tests/gpu/test_pipeline_cuda.py runs it on the GPU)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kda_kcp import jit
from test_kernel_emulation import EMU, ROOT, _emulated

PROBE = Path(__file__).resolve().parent / "probes" / "pipeline_probe.cu"

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the CPU emulation")


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_emu")
    inc = out / "inc"
    inc.mkdir()
    for f in ("cuda_runtime.h", "cuda_bf16.h", "cuda_fp16.h", "kda_common.cuh", "kda_pipeline.cuh"):
        shutil.copy(EMU / f, inc / f)
    shutil.copy(ROOT / "csrc" / "kda_tile_ring.cuh", inc / "kda_tile_ring.cuh")  # unchanged, on the emulated pieces
    unit = out / "pipeline_probe.cpp"
    unit.write_text(_emulated(PROBE.read_text()))
    exe = out / "pipeline_probe"
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", f"-I{inc}", str(unit), "-o", str(exe)], check=True)
    return exe


def _run(exe, mode, grid, tiles):
    out = subprocess.run([str(exe), str(mode), str(grid), str(tiles)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.fullmatch(r"mode (\d+): (\d+) of (\d+) values wrong\n", out.stdout)
    assert m and int(m[1]) == mode and int(m[3]) == tiles * 4096, out.stdout
    return int(m[2])


@pytest.mark.parametrize("grid,tiles", [(1, 3), (2, 12), (3, 29)])
def test_ring_streams_every_tile(probe, grid, tiles):
    """Fewer tiles than slots, several rounds of the ring, and CTAs with unequal counts of tiles: every value right."""
    assert _run(probe, 0, grid, tiles) == 0


def test_a_consumer_that_skips_its_wait_reads_garbage(probe):
    # tile 1 of each CTA is read before its copies land: at least that tile's values are wrong
    assert _run(probe, 1, 2, 12) >= 2 * 4096


def test_a_staging_tile_written_before_its_store_has_read_it(probe):
    # every store then reads the CTA's last tile's staging: the other 10 tiles come out wrong (but for the rare value
    # where 2 x + t of the last tile equals this tile's)
    assert _run(probe, 2, 2, 12) >= 0.99 * 10 * 4096


@pytest.mark.parametrize("grid,tiles", [(1, 3), (2, 12), (3, 29)])
def test_ring_filled_by_cp_async_pieces(probe, grid, tiles):
    """The slots filled by 16-byte cp.async pieces, each producer lane arriving on the slot's barrier once its pieces
    land (the reverse walk's producer): every value right."""
    assert _run(probe, 3, grid, tiles) == 0


def test_cp_async_pieces_land_only_with_their_phase(probe):
    # the pieces handed to the barrier land when its phase completes: read before the wait, tile 1 is stale
    assert _run(probe, 4, 2, 12) >= 2 * 4096


def probe_nvcc_command(arch, out, *extra):
    """nvcc (found as kda_kcp's JIT finds it) building the probe for ``arch`` into ``out``, or None without nvcc."""
    nvcc = jit._find_nvcc()
    if nvcc is None:
        return None
    return [nvcc, "-std=c++17", "-O2", jit.gencode_flag(arch), f"-I{ROOT / 'csrc'}", *extra, str(PROBE), "-o", str(out)]


@pytest.mark.parametrize("arch", sorted(a for a, v in jit.manifest()["archs"].items() if v["buildable"]))
def test_probe_compiles_for_every_arch(tmp_path, arch):
    cmd = probe_nvcc_command(arch, tmp_path / "probe.o", "-Xptxas", "-v", "-c")
    if cmd is None:
        pytest.skip("no nvcc")
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    # setmaxnreg needs the kernel's register count fixed by its launch bound: 65,536 / 384 threads -> 168
    regs = re.findall(r"Used (\d+) registers", out.stderr)
    assert regs and all(int(r) == 168 for r in regs), out.stderr[-3000:]
