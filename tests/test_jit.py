"""kda_kcp.jit: every program carries its build identity and is checked before use; every failure to build, load
or check a program falls back to the torch backend with one warning (BackendUnavailable under KDA_KCP_BACKEND=cuda).

No GPU and no real kernels: a tiny C++ program (compiled by g++ through the same tvm_ffi.cpp.build path, about a
second) stands in for kda_fwd and kda_bwd in a source root of its own, with the real csrc/kda_build_identity.h. nvcc
is a script that only answers --version (its version is part of the identity); one test compiles a .cu with the real
nvcc where there is one. The GPU's capability is faked so that select_backend takes the CUDA path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import kda_kcp
import kda_kcp.status
from kda_kcp import backend, jit
from kda_kcp.backend import BackendUnavailable

REPO = Path(__file__).resolve().parents[1]
ARCH = "sm_90a"
DEVICE = torch.device("cuda", 0)
REAL_CUDA_HOME = os.environ.get("CUDA_HOME") or "/usr/local/cuda"

TINY = """#include <tvm/ffi/function.h>

#include "kda_build_identity.h"
{export}

#ifndef KDA_TINY_OFFSET
#define KDA_TINY_OFFSET 0
#endif

int64_t answer() {{ return {answer} + KDA_TINY_OFFSET; }}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(answer, answer);
"""


def make_root(where: Path, answer: int = 42, identity: bool = True, text: str | None = None, ext: str = "cc") -> Path:
    """A source root with build.json naming the CUDA backend's programs (kda_fwd, kda_bwd, kda_act), all built from
    one tiny program."""
    (where / "csrc").mkdir(parents=True)
    shutil.copyfile(REPO / "csrc" / "kda_build_identity.h", where / "csrc" / "kda_build_identity.h")
    if text is None:
        text = TINY.format(export="KDA_EXPORT_BUILD_IDENTITY();" if identity else "", answer=answer)
    (where / "csrc" / f"tiny.{ext}").write_text(text)
    prog = {"package": "common", "sources": [f"csrc/tiny.{ext}"], "headers": ["csrc/kda_build_identity.h"],
            "flags": ["-lineinfo"]}
    man = {"archs": {ARCH: {"buildable": True}},
           "programs": [{"name": name, **prog} for name in ("kda_fwd", "kda_bwd", "kda_act")]}
    (where / "build.json").write_text(json.dumps(man))
    return where


def fake_nvcc(where: Path, version: str) -> Path:
    """A CUDA home whose nvcc only answers --version."""
    (where / "bin").mkdir(parents=True)
    nvcc = where / "bin" / "nvcc"
    nvcc.write_text(f'#!/bin/sh\necho "Cuda compilation tools, release 13.0, V{version}"\n')
    nvcc.chmod(0o755)
    return where


@pytest.fixture
def env(tmp_path, monkeypatch):
    """jit and backend in a fresh state, loading from a tiny source root, a prebuilt root and a cache in tmp_path."""
    root = make_root(tmp_path / "src")
    monkeypatch.setattr(jit, "source_root", lambda: root)
    monkeypatch.setattr(jit, "PREBUILT_ROOT", tmp_path / "prebuilt")
    monkeypatch.setenv("KDA_KCP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDA_HOME", str(fake_nvcc(tmp_path / "cuda", "13.0.88")))
    for var in ("KDA_KCP_FORCE_JIT", "KDA_KCP_BACKEND", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    for name in ("_LOADED", "_FAILED", "_BY_DEVICE"):
        monkeypatch.setattr(jit, name, {})
    monkeypatch.setattr(backend, "_selected", {})
    monkeypatch.setattr(backend, "_cuda_backends", {})
    monkeypatch.setattr(backend, "_warned_fallback", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU of capability 9.0")
    # the backend's load also makes the device's status word (kda_kcp.status): a CUDA tensor there is none of here
    monkeypatch.setattr(kda_kcp.status, "word", lambda device: None)
    return root


def new_process():
    """What a later process would find: nothing loaded, nothing failed."""
    for d in (jit._LOADED, jit._FAILED, jit._BY_DEVICE):
        d.clear()


def cache_so(root: Path, name: str = "kda_fwd") -> Path:
    prog = jit._program(jit.manifest(root), name)
    entry, _ = jit._cache_entry(prog, ARCH, root, jit._require_nvcc(), jit.cache_dir())
    return entry / f"{name}.so"


def kda_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("kda_kcp")]


@pytest.fixture
def unwritable_dir(tmp_path):
    d = tmp_path / "read-only"
    d.mkdir()
    d.chmod(0o555)
    # root ignores the mode; sysfs refuses new files and directories to every user
    yield Path("/sys/kernel") if os.access(d, os.W_OK) else d
    d.chmod(0o755)


def test_program_carries_its_identity_and_is_built_once(env):
    mod = jit.load_program("kda_fwd")
    assert mod.answer() == 42
    path = jit.program_path("kda_fwd", ARCH)
    identity = str(mod.build_identity())
    got = jit._parse(identity)
    prog = jit._program(jit.manifest(env), "kda_fwd")
    assert got["program"] == "kda_fwd" and got["arch"] == ARCH and got["nvcc"] == "13.0.88"
    assert got["package"] == kda_kcp.__version__ and got["defines"] == "none"
    assert got["sources"] == jit._source_fields(prog, ARCH, env)["sources"]
    assert path.parent.parent == jit.cache_dir() and path.parent.name == f"kda_fwd-{ARCH}-{jit._digest(identity, 20)}"
    mtime = path.stat().st_mtime_ns
    new_process()
    assert jit.load_program("kda_fwd").answer() == 42
    assert jit.program_path("kda_fwd", ARCH) == path and path.stat().st_mtime_ns == mtime  # not rebuilt


def test_cache_key_covers_sources_flags_and_nvcc_version(env, tmp_path, monkeypatch):
    prog = jit._program(jit.manifest(env), "kda_fwd")
    nvcc = jit._require_nvcc()
    cache = jit.cache_dir()

    def key(p=prog, n=nvcc):
        return jit._cache_entry(p, ARCH, env, n, cache)[0].name

    base = key()
    assert key() == base
    keys = {base}
    keys.add(key(n=str(fake_nvcc(tmp_path / "cuda2", "13.0.89") / "bin" / "nvcc")))
    keys.add(key(p={**prog, "flags": ["-lineinfo", "-DKDA_X=1"]}))
    base_flags = jit.BASE_FLAGS
    monkeypatch.setattr(jit, "BASE_FLAGS", ("-O2", "-std=c++17"))
    keys.add(key())
    monkeypatch.setattr(jit, "BASE_FLAGS", base_flags)
    (env / "csrc" / "tiny.cc").write_text(TINY.format(export="KDA_EXPORT_BUILD_IDENTITY();", answer=43))
    keys.add(key())
    assert len(keys) == 5, keys


def test_corrupt_cached_program_is_rebuilt(env):
    so = cache_so(env)
    so.parent.mkdir(parents=True)
    so.write_bytes(b"\x7fELF\x02\x01\x01")  # a build cut short: dlopen says "file too short"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert jit.load_program("kda_fwd").answer() == 42
    assert kda_warnings(record) == []
    assert jit.program_path("kda_fwd", ARCH) == so and so.stat().st_size > 1000


@pytest.mark.parametrize("foreign", ["other sources", "no identity"])
def test_foreign_cached_program_is_rebuilt(env, tmp_path, foreign):
    other = make_root(tmp_path / "other", answer=7, identity=foreign != "no identity")
    built = jit.build_program("kda_fwd", ARCH, tmp_path / "other-build", root=other)
    so = cache_so(env)
    so.parent.mkdir(parents=True)
    shutil.copyfile(built, so)
    with pytest.raises(jit.KernelBuildError, match="sources" if foreign == "other sources" else "build_identity"):
        jit._verified(so, jit._identity(jit._program(jit.manifest(env), "kda_fwd"), ARCH, env, jit._require_nvcc()))
    # the foreign file is open in this process now: the rebuilt one at the same path must still be the one used
    mod = jit.load_program("kda_fwd")
    assert mod.answer() == 42 and jit.program_path("kda_fwd", ARCH) == so


def test_stale_prebuilt_is_skipped_for_the_jit_cache(env, tmp_path):
    other = make_root(tmp_path / "other", answer=7)
    jit.build_program("kda_fwd", ARCH, jit.PREBUILT_ROOT / ARCH, root=other)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        mod = jit.load_program("kda_fwd")
    assert mod.answer() == 42
    msgs = kda_warnings(record)
    assert len(msgs) == 1 and "sources" in msgs[0] and "build_prebuilt.py" in msgs[0], msgs
    assert jit.program_path("kda_fwd", ARCH).parent.parent == jit.cache_dir()


def test_prebuilt_of_these_sources_is_used(env, tmp_path, monkeypatch):
    """Built by another nvcc and with an A/B define (build_prebuilt.py --define): used as it is, nothing is built."""
    monkeypatch.setenv("CUDA_HOME", str(fake_nvcc(tmp_path / "cuda-other", "12.8.93")))
    so = jit.build_program("kda_fwd", ARCH, jit.PREBUILT_ROOT / ARCH, defines=("KDA_TINY_OFFSET=1000",))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert jit.load_program("kda_fwd").answer() == 1042
    assert kda_warnings(record) == []
    assert jit.program_path("kda_fwd", ARCH) == so and not jit.cache_dir().exists()


def test_installed_without_sources_checks_program_arch_and_version(env, monkeypatch):
    jit.build_program("kda_fwd", ARCH, jit.PREBUILT_ROOT / ARCH)
    monkeypatch.setattr(jit, "source_root", lambda: None)
    assert jit.load_program("kda_fwd").answer() == 42
    new_process()
    monkeypatch.setattr(jit, "_package_version", lambda: "9.9.9")
    stale = f"package {re.escape(kda_kcp.__version__)} where 9.9.9 is expected.*without its CUDA sources"
    with pytest.raises(jit.KernelBuildError, match=stale):
        jit.load_program("kda_fwd")
    with pytest.raises(jit.KernelBuildError, match="no prebuilt .*kda_bwd.so"):
        jit.load_program("kda_bwd")


def _compile_error(env, monkeypatch, tmp_path, unwritable):
    (env / "csrc" / "tiny.cc").write_text("this is not C++;\n")
    return "compiling kda_fwd for sm_90a failed"


def _read_only_cache(env, monkeypatch, tmp_path, unwritable):
    monkeypatch.setenv("KDA_KCP_CACHE_DIR", str(unwritable / "kda_kcp"))
    return "cannot build kda_fwd into the cache"


def _no_nvcc(env, monkeypatch, tmp_path, unwritable):
    monkeypatch.setattr(jit, "_find_nvcc", lambda: None)
    return "no nvcc found"


def _no_identity_export(env, monkeypatch, tmp_path, unwritable):
    (env / "csrc" / "tiny.cc").write_text(TINY.format(export="", answer=42))
    return "exports no build_identity()"


def _corrupt_prebuilt_without_sources(env, monkeypatch, tmp_path, unwritable):
    monkeypatch.setattr(jit, "source_root", lambda: None)
    (jit.PREBUILT_ROOT / ARCH).mkdir(parents=True)
    (jit.PREBUILT_ROOT / ARCH / "kda_fwd.so").write_bytes(b"")
    return "cannot load"


@pytest.mark.parametrize("failure", [_compile_error, _read_only_cache, _no_nvcc, _no_identity_export,
                                     _corrupt_prebuilt_without_sources],
                         ids=["compile error", "read-only cache", "no nvcc", "no identity after a rebuild",
                              "corrupt prebuilt"])
def test_failure_falls_back_to_torch_with_one_warning(env, monkeypatch, tmp_path, unwritable_dir, failure):
    cause = failure(env, monkeypatch, tmp_path, unwritable_dir)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = backend.select_backend(DEVICE, True)
        second = backend.select_backend(DEVICE, False)
    assert first is backend.TORCH and second is backend.TORCH
    msgs = kda_warnings(record)
    assert len(msgs) == 1 and cause in msgs[0] and "KDA_KCP_BACKEND=torch" in msgs[0], msgs
    monkeypatch.setenv("KDA_KCP_BACKEND", "cuda")
    with pytest.raises(BackendUnavailable, match=cause):
        backend.select_backend(DEVICE, True)


def test_backend_loads_after_rebuilding_a_corrupt_program(env):
    so = cache_so(env, "kda_bwd")
    so.parent.mkdir(parents=True)
    so.write_bytes(b"not a shared object")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        chosen = backend.select_backend(DEVICE, True)
    assert chosen.name == "cuda" and kda_warnings(record) == []
    assert jit.load_program("kda_bwd", DEVICE).answer() == 42


def test_nvcc_program_carries_its_identity(env, tmp_path, monkeypatch):
    """The identity survives nvcc's -D handling (a .cu program, the real compiler)."""
    if not (Path(REAL_CUDA_HOME) / "bin" / "nvcc").exists():
        pytest.skip(f"no nvcc under {REAL_CUDA_HOME}")
    monkeypatch.setenv("CUDA_HOME", REAL_CUDA_HOME)
    root = make_root(tmp_path / "cu", text=TINY.format(export="KDA_EXPORT_BUILD_IDENTITY();", answer=42), ext="cu")
    monkeypatch.setattr(jit, "source_root", lambda: root)
    mod = jit.load_program("kda_fwd")
    assert mod.answer() == 42
    got = jit._parse(str(mod.build_identity()))
    assert got["program"] == "kda_fwd" and got["nvcc"] == jit._nvcc_version(jit._require_nvcc())
