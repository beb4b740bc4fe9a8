"""Which backend runs a call: the CUDA kernels on sm_90a / sm_100a / sm_103a, else the torch backend.

``KDA_KCP_BACKEND=torch|cuda`` forces one. On a GPU without kernels the torch backend runs, with one
warning per process; so does a GPU whose kernels cannot be built, loaded or verified (kda_kcp.jit's
KernelBuildError names the cause), where KDA_KCP_BACKEND=cuda raises BackendUnavailable instead. The choice is made
once per (device, mode, KDA_KCP_BACKEND) and kept for the process.
"""

from __future__ import annotations

import os
import warnings
from typing import Protocol, runtime_checkable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .archs import KERNEL_CAPABILITIES
from .torch_backend import TorchBackend

__all__ = ["Backend", "TORCH", "select_backend", "KERNEL_CAPABILITIES", "BackendUnavailable"]


@runtime_checkable
class Backend(Protocol):
    """What the shared core (kda_kcp.function, workspace, states, validate, fla, demo) asks of a backend: TorchBackend
    (kda_kcp.torch_backend) and CudaBackend (kda_kcp.cuda) implement it, and the core never asks which one it has.
    Tensors are [T, H, *] local tokens; ``plan`` is the context's LocalPlan; ``arena`` a kda_kcp.arena.Arena or None.
    """

    name: str  # for messages, logging and cache keys only
    uses_arena: bool  # whether its scratch is carved from the workspace's arena (else it uses the exchange part only)

    def describe(self, device) -> str:
        """One line for the user: what runs tensors on ``device``, and why."""

    def check_supported(self, q, k, v, g, beta) -> None:
        """Raise for dtypes and head dims this backend does not take (after the shared shape checks)."""

    def check_head_dims(self, head_dim: int, value_dim: int) -> None:
        """Raise for head dims this backend does not take (a byte query's)."""

    def check_call(self, q, k, v, g, beta, plan) -> None:
        """This backend's checks of one call, before the ranks agree (kda_kcp.agreement)."""

    def summary_dtype(self, *xs: torch.Tensor) -> torch.dtype:
        """The dtype of the summaries, states and exchange of a call on ``xs``."""

    def input_dtypes(self, q, k, v, g, beta) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """(q/k/v, g, beta) dtypes this backend computes inputs of these dtypes in (kda_kcp.fla converts to them)."""

    def grad_output(self, do: torch.Tensor) -> torch.Tensor:
        """The output gradient in the dtype this backend's backward reads."""

    def fused_activations(self, q, k, g, beta, A_log, dt_bias, heads_v: int, lower_bound, beta_scale: float):
        """kda_kcp.chunk_kda's in-call activations in this backend's own fused pass, or None where it has none for
        these tensors (kda_kcp.fla then runs its torch ops). q, k ``[B, T, H, K]`` (None: no norm) come back
        normalised with ``heads_v`` heads; g ``[B, T, HV, K]`` (None: no gate) as the log decay; beta ``[B, T, HV]``
        (None: no sigmoid) as ``beta_scale * sigmoid(beta)``; in this backend's input dtypes, differentiable."""

    def table_knobs(self) -> tuple:
        """What the backend's tables depend on besides the shapes (a key of caches computed from them)."""

    def upload_tables(self, ctx, num_heads: int, device, passes=None) -> None:
        """Put every index table a call of ``ctx`` at ``num_heads`` reads on ``device`` now."""

    def fwd_prepare(self, q, k, v, g, beta, scale, plan, arena=None, output_next=False, lead=False):
        """One forward call's records: ``.summaries(run_ids, arena)``, ``.output(state_in)``, ``.reserve_early()``.
        ``output_next``: ``output`` is the next step (no summaries, no exchange first); ``lead``: and the caller
        launches nothing before it, so the records ``output`` would make first may be made now."""

    def bwd_prepare(self, q, k, v, g, beta, do, scale, plan, arena=None, passes=None):
        """One backward call's records: ``.summaries(run_ids, arena)``, ``.grads(state_in, dstate_out)``."""

    def fwd_output(self, q, k, v, g, beta, scale, plan, state_in=None, arena=None):
        """o of every run from its incoming state."""

    def fwd_summaries(self, q, k, v, g, beta, scale, plan, run_ids, arena=None):
        """(M, E) of the listed runs from a zero state."""

    def bwd_summaries(self, q, k, v, g, beta, do, scale, plan, run_ids, arena=None):
        """(M^T, F) of the listed runs from a zero state gradient."""

    def bwd_grads(self, q, k, v, g, beta, do, scale, plan, state_in=None, dstate_out=None, arena=None, passes=None):
        """(dq, dk, dv, dg, dbeta) of every run from its incoming state and outgoing state gradient."""


TORCH = TorchBackend()  # one for every device and mode: it keeps no state of either
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
    if torch.compiler.is_compiling():
        _selected_outside_the_trace(device, deterministic, forced)
    return _cached_selection(device, deterministic, forced)


def _cached_selection(device: torch.device, deterministic: bool, forced: str):
    key = (device, deterministic, forced)
    backend = _selected.get(key)
    if backend is None:
        # The first selection may come from a fake kernel that torch.compile runs while it traces (kda_kcp.library),
        # under the fake tensor mode: what it makes and keeps (the CUDA backend's status word and pinned host slots)
        # must be real tensors, so it runs with every dispatch mode off.
        with _disable_current_modes():
            backend = _selected[key] = _select(device, deterministic, forced)
    return backend


@torch.compiler.assume_constant_result
def _selected_outside_the_trace(device: torch.device, deterministic: bool, forced: str) -> bool:
    """The selection made for real when torch.compile traces a call that asks for a backend (chunk_kda's own
    selection, in a process whose first call is compiled): dynamo runs a function marked so eagerly and keeps its
    result as a constant, so the programs load outside the graph and the traced lookup then finds them."""
    _cached_selection(device, deterministic, forced)
    return True


def _select(device: torch.device, deterministic: bool, forced: str):
    global _warned_fallback
    if forced == "torch":
        return TORCH
    if device.type != "cuda":
        if forced == "cuda":
            raise BackendUnavailable(f"KDA_KCP_BACKEND=cuda, but the tensors are on {device}, not a CUDA device")
        return TORCH
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
        return TORCH
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
        return TORCH
