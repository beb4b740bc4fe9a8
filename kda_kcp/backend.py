"""Which backend runs a call: the CUDA kernels on sm_90a / sm_100a / sm_103a, else the torch backend.

``KDA_KCP_BACKEND=torch|cuda`` forces one. On a GPU without kernels the torch backend runs, with one
warning per process; so does a GPU whose kernels cannot be built, loaded or verified (kda_kcp.jit's
KernelBuildError names the cause), where KDA_KCP_BACKEND=cuda raises BackendUnavailable instead. The choice is made
once per (device, mode, KDA_KCP_BACKEND) and kept for the process.
"""

from __future__ import annotations

import os
import warnings

import torch

from .torch_backend import TorchBackend

__all__ = ["select_backend", "KERNEL_CAPABILITIES", "BackendUnavailable"]

# compute capabilities the library builds kernels for: sm_90a, sm_100a, sm_103a
KERNEL_CAPABILITIES = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}

_TORCH = TorchBackend()
_cuda_backends: dict[bool, object] = {}
_warned_fallback = False


class BackendUnavailable(RuntimeError):
    """KDA_KCP_BACKEND=cuda was asked for but the CUDA backend cannot run here."""


def _cuda_backend(device: torch.device, deterministic: bool):
    """The CUDA backend with its programs loaded for ``device`` (prebuilt or JIT-built on first use)."""
    if deterministic not in _cuda_backends:
        from .cuda import CudaBackend  # imported lazily: loading kernels needs tvm_ffi and a GPU

        _cuda_backends[deterministic] = CudaBackend(deterministic=deterministic)
    backend = _cuda_backends[deterministic]
    backend.load(device)
    return backend


_selected: dict = {}  # (device, deterministic, KDA_KCP_BACKEND) -> backend


def select_backend(device: torch.device, deterministic: bool):
    """The backend object for tensors on ``device``. Every call asks (the facade, then the backward on autograd's
    thread), so the answer is cached per (device, mode, KDA_KCP_BACKEND): the capability query and the load check
    cost 15-45 us of host time per call on the H200 machine, before the first kernel can start."""
    forced = os.environ.get("KDA_KCP_BACKEND", "").strip().lower()
    if forced not in ("", "torch", "cuda"):
        raise ValueError(f"KDA_KCP_BACKEND must be 'torch' or 'cuda', got {forced!r}")
    key = (device, deterministic, forced)
    backend = _selected.get(key)
    if backend is None:
        backend = _selected[key] = _select(device, deterministic, forced)
    return backend


def _select(device: torch.device, deterministic: bool, forced: str):
    global _warned_fallback
    if forced == "torch":
        return _TORCH
    if device.type != "cuda":
        if forced == "cuda":
            raise BackendUnavailable(f"KDA_KCP_BACKEND=cuda, but the tensors are on {device}, not a CUDA device")
        return _TORCH
    cap = torch.cuda.get_device_capability(device)
    if cap not in KERNEL_CAPABILITIES:
        if forced == "cuda":
            raise BackendUnavailable(
                f"KDA_KCP_BACKEND=cuda, but {torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}; "
                f"kernels exist for {sorted(KERNEL_CAPABILITIES.values())}"
            )
        if not _warned_fallback:
            _warned_fallback = True
            warnings.warn(
                f"kda_kcp has no kernels for sm_{cap[0]}{cap[1]} ({torch.cuda.get_device_name(device)}); "
                "running the torch backend, which is correct but slow",
                RuntimeWarning,
                stacklevel=4,
            )
        return _TORCH
    from .jit import KernelBuildError

    try:
        return _cuda_backend(device, deterministic)
    except (ImportError, KernelBuildError) as exc:
        if forced == "cuda":
            raise BackendUnavailable(f"KDA_KCP_BACKEND=cuda, but the CUDA backend cannot load: {exc}") from exc
        if not _warned_fallback:
            _warned_fallback = True
            warnings.warn(
                f"kda_kcp cannot use its CUDA kernels: {exc}\nRunning the torch backend, which is correct but slow. "
                "Fix the cause above (the kernels are then built or loaded on the next run), or set "
                "KDA_KCP_BACKEND=torch to choose the torch backend.",
                RuntimeWarning,
                stacklevel=4,
            )
        return _TORCH
