"""Loading the CUDA programs listed in build.json, by GPU architecture.

Order: a prebuilt ``.so`` shipped in ``kda_kcp/prebuilt/<arch>/<program>.so``; otherwise a JIT build with
nvcc + ninja through ``tvm_ffi.cpp.build`` into ``$KDA_KCP_CACHE_DIR`` (default ``~/.cache/kda_kcp``),
keyed by the sources' hash, the flags and the arch, under a file lock so that concurrent processes build
once and later processes never recompile. Then ``tvm_ffi.load_module``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

__all__ = ["manifest", "arch_of_device", "program_path", "load_program", "KernelBuildError"]

_PKG = Path(__file__).resolve().parent
_LOCK = threading.Lock()
_LOADED: dict[tuple[str, str], object] = {}
_BY_DEVICE: dict = {}  # (name, torch.device with an index) -> the module of _LOADED for its arch


class KernelBuildError(RuntimeError):
    """A CUDA program cannot be found or built for this machine."""


def _first_existing(*cands: Path) -> Path | None:
    for c in cands:
        if c.exists():
            return c
    return None


def _manifest_path() -> Path:
    p = _first_existing(_PKG / "build.json", _PKG.parent / "build.json")
    if p is None:
        raise KernelBuildError("build.json not found next to the kda_kcp package")
    return p


def manifest() -> dict:
    with open(_manifest_path()) as f:
        return json.load(f)


def _source_root() -> Path:
    # sources are paths relative to the directory holding build.json (the repository root in a checkout)
    return _manifest_path().parent


def arch_of_device(device=None) -> str:
    """'sm_90a' style name of a CUDA device's architecture."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}a"


def _program(name: str) -> dict:
    for p in manifest()["programs"]:
        if p["name"] == name:
            return p
    raise KernelBuildError(f"no program named {name!r} in build.json")


def _check_arch(arch: str) -> None:
    archs = manifest()["archs"]
    if arch not in archs:
        known = sorted(a for a, v in archs.items() if v.get("buildable", False))
        raise KernelBuildError(
            f"kda_kcp has no CUDA build for {arch}; kernels are built for {known}. "
            "Use the torch backend (KDA_KCP_BACKEND=torch) on this GPU."
        )
    if not archs[arch].get("buildable", False):
        raise KernelBuildError(
            f"{arch} is declared in build.json but cannot be built yet: {archs[arch].get('why', 'unbuildable')}"
        )


def gencode_flag(arch: str) -> str:
    num = arch[len("sm_") :]
    return f"-gencode=arch=compute_{num},code={arch}"


def _arch_list_value(arch: str) -> str:
    # tvm_ffi.cpp.build reads TVM_FFI_CUDA_ARCH_LIST as "major.minor[a]" entries
    num = arch[len("sm_") :]
    suffix = "a" if num.endswith("a") else ""
    digits = num.rstrip("a")
    return f"{digits[:-1]}.{digits[-1]}{suffix}"


def _build_key(prog: dict, arch: str) -> str:
    root = _source_root()
    h = hashlib.sha256()
    files = sorted(set(prog["sources"]) | set(prog.get("headers", [])))
    for rel in files:
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    h.update(json.dumps(prog.get("flags", []), sort_keys=True).encode())
    h.update(arch.encode())
    try:
        import tvm_ffi

        h.update(getattr(tvm_ffi, "__version__", "?").encode())
    except ImportError:
        pass
    return h.hexdigest()[:20]


def _find_nvcc() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return "/usr/local/cuda/bin/nvcc"
    found = shutil.which("nvcc")
    if found:
        return str(Path(found).resolve())
    try:  # the nvidia-cuda-nvcc wheel (the `jit` extra)
        import nvidia.cuda_nvcc as m  # type: ignore

        p = Path(m.__path__[0]) / "bin" / "nvcc"
        if p.exists():
            return str(p)
    except ImportError:
        pass
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("KDA_KCP_CACHE_DIR") or Path.home() / ".cache" / "kda_kcp")


def build_program(name: str, arch: str, out_dir: Path, defines=()) -> Path:
    """Compile program ``name`` for ``arch`` into ``out_dir/<name>.so`` (no GPU needed). Returns the path.
    ``defines``: extra ``NAME=VALUE`` macros (builds for A/Bs of compile-time variants, never the JIT's)."""
    _check_arch(arch)
    prog = _program(name)
    nvcc = _find_nvcc()
    if nvcc is None:
        raise KernelBuildError(
            "no nvcc found to build the kda_kcp CUDA kernels (no prebuilt .so for this GPU). "
            "Install the CUDA compiler with `pip install kda-kcp[jit]`, or set CUDA_HOME."
        )
    import tvm_ffi.cpp

    root = _source_root()
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", "-std=c++17", *prog.get("flags", []), *(f"-D{d}" for d in defines)]
    old_home = os.environ.get("CUDA_HOME")
    old_arch = os.environ.get("TVM_FFI_CUDA_ARCH_LIST")
    home = Path(nvcc).parent.parent
    os.environ["CUDA_HOME"] = str(home)
    ldflags = [f"-L{home / d}" for d in ("lib64", "lib", "targets/x86_64-linux/lib") if (home / d).is_dir()]
    os.environ["TVM_FFI_CUDA_ARCH_LIST"] = _arch_list_value(arch)
    try:
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{name}-build-") as tmp:
            lib = tvm_ffi.cpp.build(
                name,
                sources=[str(root / s) for s in prog["sources"]],
                extra_cuda_cflags=flags,
                extra_include_paths=[str(root / "csrc")],
                extra_ldflags=ldflags,
                build_directory=tmp,
            )
            final = out_dir / f"{name}.so"
            tmp_final = out_dir / f".{name}.so.tmp"
            shutil.copyfile(lib, tmp_final)
            os.replace(tmp_final, final)
    finally:
        for var, old in (("CUDA_HOME", old_home), ("TVM_FFI_CUDA_ARCH_LIST", old_arch)):
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old
    return final


def program_path(name: str, arch: str) -> Path:
    """Path of a loadable .so for (name, arch): prebuilt, cached, or freshly JIT-built under a lock."""
    _check_arch(arch)
    prebuilt = _PKG / "prebuilt" / arch / f"{name}.so"
    if prebuilt.exists() and os.environ.get("KDA_KCP_FORCE_JIT", "") != "1":
        return prebuilt
    prog = _program(name)
    key = _build_key(prog, arch)
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    target_dir = root / f"{name}-{arch}-{key}"
    so = target_dir / f"{name}.so"
    if so.exists():
        return so
    with open(root / f"{name}-{arch}-{key}.lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        try:
            if not so.exists():  # another process may have built it while we waited
                build_program(name, arch, target_dir)
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)
    return so


def load_program(name: str, device=None):
    """The tvm_ffi module of program ``name`` for the arch of ``device`` (cached per process). Every call of
    the CUDA backend asks; a device with an index is answered from ``_BY_DEVICE`` without the capability
    query and the lock (a few us of host time before the call's first launch)."""
    fast = (name, device) if getattr(device, "index", None) is not None else None
    mod = _BY_DEVICE.get(fast) if fast is not None else None
    if mod is not None:
        return mod
    arch = arch_of_device(device)
    with _LOCK:
        key = (name, arch)
        if key not in _LOADED:
            import tvm_ffi

            _LOADED[key] = tvm_ffi.load_module(str(program_path(name, arch)))
        if fast is not None:
            _BY_DEVICE[fast] = _LOADED[key]
        return _LOADED[key]
