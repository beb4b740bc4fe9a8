"""The pipeline pieces of the v2 kernels (csrc/kda_pipeline.cuh, csrc/kda_tile_ring.cuh) on the GPU:
tests/probes/pipeline_probe.cu built by nvcc for this GPU's arch and run as tests/test_pipeline_emulation.py runs its
emulated build, streaming tiles through the ring (filled by bulk copies or by cp.async pieces) into bulk stores (every
value must be right), and under compute-sanitizer's racecheck, synccheck and memcheck where the sanitizer is
installed. Skips, with its reason, without an sm_90a / sm_100a / sm_103a GPU or without nvcc."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kda_kcp import jit

from gpu_common import require_kernel_gpu
from test_pipeline_emulation import probe_nvcc_command

require_kernel_gpu("the pipeline probe's tests")


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    exe = tmp_path_factory.mktemp("pipeline_cuda") / "pipeline_probe"
    cmd = probe_nvcc_command(jit.arch_of_device(), exe)
    if cmd is None:
        pytest.skip("no nvcc to build the probe")
    subprocess.run(cmd, check=True)
    return exe


def _wrong(cmd, mode, tiles):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(rf"mode {mode}: (\d+) of (\d+) values wrong", out.stdout)
    assert m and int(m[2]) == tiles * 4096, out.stdout
    return int(m[1])


# mode 0: slots filled by bulk copies; mode 3: by cp.async pieces, each producer lane arriving on the slot's barrier
@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("grid,tiles", [(1, 3), (7, 100), (132, 2112)])
def test_ring_streams_every_tile(probe, mode, grid, tiles):
    assert _wrong([str(probe), str(mode), str(grid), str(tiles)], mode, tiles) == 0


@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("tool", ["racecheck", "synccheck", "memcheck"])
def test_probe_under_compute_sanitizer(probe, mode, tool):
    beside_nvcc = Path(jit._find_nvcc() or "/nonexistent").parent / "compute-sanitizer"  # the toolkit ships both
    san = shutil.which("compute-sanitizer") or (str(beside_nvcc) if beside_nvcc.exists() else None)
    if san is None:
        pytest.skip("no compute-sanitizer")
    assert _wrong([san, "--tool", tool, "--error-exitcode", "1", str(probe), str(mode), "4", "40"], mode, 40) == 0
