"""Loading the CUDA programs listed in build.json, by GPU architecture, each checked against its build identity.

Order: a prebuilt ``.so`` in ``kda_kcp/prebuilt/<arch>/<program>.so``; otherwise a JIT build with nvcc + ninja
through ``tvm_ffi.cpp.build`` into ``$KDA_KCP_CACHE_DIR`` (default ``~/.cache/kda_kcp``), under a file lock so that
concurrent processes build once and later processes never recompile. Then ``tvm_ffi.load_module``.

Build identity: every program is compiled with ``-DKDA_BUILD_IDENTITY="..."`` and exports it as ``build_identity()``
(csrc/kda_build_identity.h): the program, the arch, the package version, a hash of the program's sources and
headers, a hash of its flags (the base flags included), a hash of extra defines, the nvcc version and the tvm_ffi
version. The JIT cache's directory is named by a hash of it. A program is used only after its identity is checked:

- a cached ``.so`` must match in every field; one that does not, or that cannot be loaded, is rebuilt under the lock;
- a prebuilt ``.so`` must match the checkout in program, arch, package version, sources and flags (it may come from
  another nvcc, and may carry extra defines: ``build_prebuilt.py --define`` builds a variant for an A/B); one that
  does not is skipped, with one warning, for the JIT cache;
- an installed package without its sources (no build.json or csrc/) checks a prebuilt's program, arch and package
  version only, and cannot build.

Every failure to build, load or check a program raises ``KernelBuildError`` naming the cause (kda_kcp.backend then
falls back to the torch backend). A failure is kept for the process: a later call does not rebuild.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

__all__ = ["manifest", "arch_of_device", "program_path", "load_program", "build_program", "check_prebuilt_identity",
           "KernelBuildError"]

_PKG = Path(__file__).resolve().parent
PREBUILT_ROOT = _PKG / "prebuilt"
# flags of every CUDA compile, before a program's own (build.json): part of the flags hash
BASE_FLAGS = ("-O3", "-std=c++17")
# identity fields a prebuilt program must share with the checkout (with sources) or with the package (without)
_PREBUILT_FIELDS = ("program", "arch", "package", "sources", "flags")
_INSTALLED_FIELDS = ("program", "arch", "package")
# an identity travels through a ninja file, /bin/sh and nvcc's -D: its values keep to these characters
_FIELD_VALUE = re.compile(r"[A-Za-z0-9_.+-]+")

_LOCK = threading.Lock()
_LOADED: dict[tuple[str, str], tuple[object, Path]] = {}  # (name, arch) -> (module, the .so it came from)
_FAILED: dict[tuple[str, str], Exception] = {}  # (name, arch) -> why it cannot be used in this process
_BY_DEVICE: dict = {}  # (name, torch.device with an index) -> the module of _LOADED for its arch
_OPENED: set[str] = set()  # paths this process has dlopened


class KernelBuildError(RuntimeError):
    """A CUDA program cannot be found, built, loaded or verified for this machine."""


def source_root() -> Path | None:
    """The directory holding build.json (the repository root in a checkout), or None (installed without sources)."""
    for cand in (_PKG / "build.json", _PKG.parent / "build.json"):
        if cand.exists():
            return cand.parent
    return None


def manifest(root: Path | None = None) -> dict:
    """build.json of ``root`` (default: ``source_root()``)."""
    root = root if root is not None else source_root()
    if root is None:
        raise KernelBuildError("build.json not found next to the kda_kcp package")
    try:
        with open(root / "build.json") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise KernelBuildError(f"cannot read {root / 'build.json'}: {exc}") from exc


def arch_of_device(device=None) -> str:
    """'sm_90a' style name of a CUDA device's architecture."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}a"


def _program(man: dict, name: str) -> dict:
    for p in man["programs"]:
        if p["name"] == name:
            return p
    raise KernelBuildError(f"no program named {name!r} in build.json")


def _check_arch(man: dict, arch: str) -> None:
    archs = man["archs"]
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


def _require_nvcc() -> str:
    nvcc = _find_nvcc()
    if nvcc is None:
        raise KernelBuildError(
            "no nvcc found to build the kda_kcp CUDA kernels (no usable prebuilt .so for this GPU). "
            "Install the CUDA compiler with `pip install kda-kcp[jit]`, or set CUDA_HOME."
        )
    return nvcc


@functools.lru_cache(maxsize=None)
def _nvcc_version(nvcc: str) -> str:
    """nvcc's version ("13.0.88"), asked once per process and compiler."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"`{nvcc} --version` failed: {exc}") from exc
    m = re.search(r"\bV(\d+(?:\.\d+)+)\b", out)
    return m.group(1) if m else _digest(out)


def _digest(text: str, n: int = 16) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def _package_version() -> str:
    from . import __version__

    return __version__


def _source_fields(prog: dict, arch: str, root: Path) -> dict[str, str]:
    """The identity fields the sources determine: program, arch, package, sources, flags (OSError: a missing file)."""
    h = hashlib.sha256()
    for rel in sorted(set(prog["sources"]) | set(prog.get("headers", []))):
        data = (root / rel).read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return {
        "program": prog["name"],
        "arch": arch,
        "package": _package_version(),
        "sources": h.hexdigest()[:24],
        "flags": _digest(json.dumps([*BASE_FLAGS, *prog.get("flags", [])])),
    }


def _identity(prog: dict, arch: str, root: Path, nvcc: str, defines=()) -> dict[str, str]:
    """Every field of the identity of ``prog`` built for ``arch`` by ``nvcc`` (with extra ``defines``)."""
    import tvm_ffi

    try:
        fields = _source_fields(prog, arch, root)
    except OSError as exc:
        raise KernelBuildError(f"cannot read the sources of {prog['name']}: {exc}") from exc
    fields["defines"] = _digest(json.dumps(list(defines))) if defines else "none"
    fields["nvcc"] = _nvcc_version(nvcc)
    fields["tvm_ffi"] = str(getattr(tvm_ffi, "__version__", "unknown"))
    return fields


def _format(fields: dict[str, str]) -> str:
    for key, value in fields.items():
        if not _FIELD_VALUE.fullmatch(value):
            raise KernelBuildError(f"build identity field {key}={value!r} has characters outside [A-Za-z0-9_.+-]")
    return ";".join(f"{key}={value}" for key, value in fields.items())


def _parse(identity: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in identity.split(";") if "=" in item)


def _compiler_errors(log: str, most: int = 8) -> str:
    """The error lines of a failed build's log (else its end): the warning stays readable."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"\berror\b", ln, re.IGNORECASE)]
    return "\n".join(errors[:most] if errors else lines[-most:])


def _build(prog: dict, arch: str, root: Path, nvcc: str, out_dir: Path, defines, identity: str) -> Path:
    """Compile ``prog`` into ``out_dir/<name>.so``, written atomically."""
    import tvm_ffi.cpp

    name = prog["name"]
    # tvm_ffi writes the flags into a ninja file whose commands run through /bin/sh: the quotes reach the compiler
    identity_flag = shlex.quote(f'-DKDA_BUILD_IDENTITY="{identity}"')
    define_flags = [f"-D{d}" for d in defines]
    flags = [*BASE_FLAGS, *prog.get("flags", []), *define_flags, identity_flag]
    old_home = os.environ.get("CUDA_HOME")
    old_arch = os.environ.get("TVM_FFI_CUDA_ARCH_LIST")
    home = Path(nvcc).parent.parent
    os.environ["CUDA_HOME"] = str(home)
    ldflags = [f"-L{home / d}" for d in ("lib64", "lib", "targets/x86_64-linux/lib") if (home / d).is_dir()]
    os.environ["TVM_FFI_CUDA_ARCH_LIST"] = _arch_list_value(arch)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{name}-build-") as tmp:
            try:
                lib = tvm_ffi.cpp.build(
                    name,
                    sources=[str(root / s) for s in prog["sources"]],
                    extra_cflags=[*define_flags, identity_flag],  # C++ sources, if a program has any
                    extra_cuda_cflags=flags,
                    extra_include_paths=[str(root / "csrc")],
                    extra_ldflags=ldflags,
                    build_directory=tmp,
                )
            except Exception as exc:  # ninja's RuntimeError with the compiler's output, or a missing tool
                raise KernelBuildError(f"compiling {name} for {arch} failed:\n{_compiler_errors(str(exc))}") from exc
            final = out_dir / f"{name}.so"
            tmp_final = out_dir / f".{name}.so.{os.getpid()}.tmp"
            shutil.copyfile(lib, tmp_final)
            os.replace(tmp_final, final)
    except OSError as exc:
        raise KernelBuildError(f"cannot build {name} into {out_dir}: {exc}") from exc
    finally:
        for var, old in (("CUDA_HOME", old_home), ("TVM_FFI_CUDA_ARCH_LIST", old_arch)):
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old
    return final


def build_program(name: str, arch: str, out_dir: Path, defines=(), root: Path | None = None) -> Path:
    """Compile program ``name`` for ``arch`` into ``out_dir/<name>.so`` (no GPU needed). Returns the path.
    ``defines``: extra ``NAME=VALUE`` macros (builds for A/Bs of compile-time variants, never the JIT's).
    ``root``: the directory of build.json (default: ``source_root()``)."""
    root = root if root is not None else source_root()
    man = manifest(root)
    _check_arch(man, arch)
    prog = _program(man, name)
    nvcc = _require_nvcc()
    identity = _format(_identity(prog, arch, root, nvcc, defines))
    return _build(prog, arch, root, nvcc, Path(out_dir), defines, identity)


def cache_dir() -> Path:
    return Path(os.environ.get("KDA_KCP_CACHE_DIR") or Path.home() / ".cache" / "kda_kcp")


def _cache_entry(prog: dict, arch: str, root: Path, nvcc: str, cache_root: Path) -> tuple[Path, dict[str, str]]:
    """The cache directory of ``prog`` for ``arch`` (named by its identity's hash) and the identity's fields."""
    fields = _identity(prog, arch, root, nvcc)
    return cache_root / f"{prog['name']}-{arch}-{_digest(_format(fields), 20)}", fields


def _open(path: Path):
    import tvm_ffi

    try:
        if str(path) not in _OPENED:
            _OPENED.add(str(path))
            return tvm_ffi.load_module(str(path))
        # dlopen answers a path this process has opened with the library it mapped then, even when the file
        # was rebuilt since: open the new file through a copy of its own name
        with tempfile.TemporaryDirectory(prefix="kda_kcp-") as tmp:
            copy = Path(tmp) / path.name
            shutil.copyfile(path, copy)
            return tvm_ffi.load_module(str(copy))
    except Exception as exc:  # tvm_ffi's RuntimeError for a file dlopen rejects (truncated, not a shared object)
        raise KernelBuildError(f"cannot load {path}: {exc}") from exc


def _check_identity(module, path: Path, expected: dict[str, str], fields) -> None:
    try:
        built = str(module.build_identity())
    except AttributeError:
        raise KernelBuildError(f"{path} exports no build_identity(): it was not built by kda_kcp") from None
    except Exception as exc:
        raise KernelBuildError(f"{path}: build_identity() failed: {exc}") from exc
    got = _parse(built)
    differ = [f for f in fields if got.get(f) != expected[f]]
    if differ:
        raise KernelBuildError(
            f"{path} is another build: "
            + ", ".join(f"{f} {got.get(f, '(none)')} where {expected[f]} is expected" for f in differ)
        )


def _verified(path: Path, fields: dict[str, str]):
    module = _open(path)
    _check_identity(module, path, fields, fields)
    return module


def _prebuilt_expectation(name: str, arch: str, root: Path | None):
    """(expected fields, the fields compared, the program of build.json or None when there are no sources)."""
    if root is not None:
        man = manifest(root)
        _check_arch(man, arch)
        prog = _program(man, name)
        try:
            return _source_fields(prog, arch, root), _PREBUILT_FIELDS, prog
        except OSError:
            pass  # build.json without the sources it lists: as installed
    return {"program": name, "arch": arch, "package": _package_version()}, _INSTALLED_FIELDS, None


def check_prebuilt_identity(module, path: Path, name: str, arch: str, root: Path | None = None) -> None:
    """Raise KernelBuildError unless ``module`` (loaded from ``path``) is a build of program ``name`` for ``arch`` that
    the loader accepts as prebuilt: from the current sources and flags (``root``: default ``source_root()``)."""
    expected, fields, _ = _prebuilt_expectation(name, arch, root if root is not None else source_root())
    _check_identity(module, Path(path), expected, fields)


def _stat_key(path: Path):
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _cached_program(prog: dict, arch: str, root: Path, cache_root: Path):
    """(module, path) of ``prog`` from the JIT cache, built (or rebuilt) there under a file lock when needed."""
    name = prog["name"]
    nvcc = _require_nvcc()
    entry, fields = _cache_entry(prog, arch, root, nvcc, cache_root)
    so = entry / f"{name}.so"
    refused, refused_stat = None, None
    if so.exists():
        try:
            return _verified(so, fields), so
        except KernelBuildError as exc:
            refused, refused_stat = exc, _stat_key(so)
    try:
        entry.mkdir(parents=True, exist_ok=True)
        lockf = open(cache_root / f"{entry.name}.lock", "w")
    except OSError as exc:
        raise KernelBuildError(
            f"cannot build {name} into the cache {cache_root}: {exc}"
            + (f" (to replace {refused})" if refused else "")
            + "; set KDA_KCP_CACHE_DIR to a writable directory"
        ) from exc
    with lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        now = _stat_key(so)
        if now is not None and now != refused_stat:  # built by another process while this one waited
            try:
                return _verified(so, fields), so
            except KernelBuildError:
                pass
        _build(prog, arch, root, nvcc, entry, (), _format(fields))
        try:
            return _verified(so, fields), so
        except KernelBuildError as exc:
            raise KernelBuildError(f"{exc} (right after building it)") from exc


def _load(name: str, arch: str, root: Path | None, prebuilt_root: Path, cache_root: Path):
    """(module, path) of program ``name`` for ``arch``: a prebuilt one that passes its check, else the JIT cache's."""
    expected, fields, prog = _prebuilt_expectation(name, arch, root)
    prebuilt = prebuilt_root / arch / f"{name}.so"
    skipped = None
    if prebuilt.exists() and os.environ.get("KDA_KCP_FORCE_JIT", "") != "1":
        try:
            module = _open(prebuilt)
            _check_identity(module, prebuilt, expected, fields)
            return module, prebuilt
        except KernelBuildError as exc:
            skipped = exc
    if prog is None:
        raise KernelBuildError(
            f"{skipped or f'no prebuilt {prebuilt}'}; kda_kcp is installed without its CUDA sources, so it cannot "
            f"build {name} for {arch}: install it from a checkout (pip install -e .)"
        )
    try:
        module, path = _cached_program(prog, arch, root, cache_root)
    except KernelBuildError as exc:
        if skipped is None:
            raise
        raise KernelBuildError(f"{exc} (and the prebuilt program was refused: {skipped})") from exc
    if skipped is not None:
        warnings.warn(
            f"kda_kcp: {skipped}; using a JIT build instead ({path}). "
            f"Rebuild the prebuilt programs: python scripts/build_prebuilt.py --arch {arch}",
            RuntimeWarning,
            stacklevel=2,
        )
    return module, path


def _loaded(name: str, arch: str):
    """(module, path) of (name, arch), loaded once per process (callers hold _LOCK)."""
    key = (name, arch)
    if key in _FAILED:
        raise KernelBuildError(str(_FAILED[key]))
    if key not in _LOADED:
        try:
            _LOADED[key] = _load(name, arch, source_root(), PREBUILT_ROOT, cache_dir())
        except KernelBuildError as exc:
            _FAILED[key] = exc
            raise
    return _LOADED[key]


def program_path(name: str, arch: str) -> Path:
    """Path of the checked .so that ``load_program`` uses for (name, arch): prebuilt, cached, or freshly JIT-built."""
    with _LOCK:
        return _loaded(name, arch)[1]


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
        mod = _loaded(name, arch)[0]
        if fast is not None:
            _BY_DEVICE[fast] = mod
        return mod
