"""The pipeline pieces of the v2 kernels (csrc/kda_pipeline.cuh, csrc/kda_tile_ring.cuh) on the GPU:
tests/probes/pipeline_probe.cu built by nvcc for this GPU's arch and run as tests/test_pipeline_emulation.py runs its
emulated build, streaming tiles through the ring into bulk stores (every value must be right), and under
compute-sanitizer's racecheck, synccheck and memcheck where the sanitizer is installed. Skips, with its reason, without an
sm_90a / sm_100a / sm_103a GPU or without nvcc."""

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


def _wrong(cmd, tiles):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(r"mode 0: (\d+) of (\d+) values wrong", out.stdout)
    assert m and int(m[2]) == tiles * 4096, out.stdout
    return int(m[1])


@pytest.mark.parametrize("grid,tiles", [(1, 3), (7, 100), (132, 2112)])
def test_ring_streams_every_tile(probe, grid, tiles):
    assert _wrong([str(probe), "0", str(grid), str(tiles)], tiles) == 0


@pytest.mark.parametrize("tool", ["racecheck", "synccheck", "memcheck"])
def test_probe_under_compute_sanitizer(probe, tool):
    beside_nvcc = Path(jit._find_nvcc() or "/nonexistent").parent / "compute-sanitizer"  # the toolkit ships both
    san = shutil.which("compute-sanitizer") or (str(beside_nvcc) if beside_nvcc.exists() else None)
    if san is None:
        pytest.skip("no compute-sanitizer")
    assert _wrong([san, "--tool", tool, "--error-exitcode", "1", str(probe), "0", "4", "40"], 40) == 0
