"""Input checks, run before any kernel: every bad input gets a clear exception naming the argument."""

from __future__ import annotations

import math
import numbers
import os

import torch

from .exchange import collective_device

__all__ = ["check_inputs", "check_grad_output", "check_scale", "check_flag", "check_positive_int", "check_context",
           "values_requested", "check_values", "check_initial_state", "check_state_for", "check_final_state_grad"]

def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_positive_int(name: str, value, none_ok: bool = False) -> None:
    """``value`` is an int >= 1 (not a bool), or None when ``none_ok``."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if none_ok else ''}, got {value!r}")


# kda_kcp.context.KcpContext, bound by kda_kcp.context as it loads (importing the package loads it before any call).
# This module cannot import it (context imports partition, which imports this module); a function-level import costs
# ~1 us on every call's way to its first kernel, and binding it at the first check would mutate this module inside a
# torch.compile trace when that check is the process's first, which dynamo refuses under torch.utils.checkpoint.
class _Unbound:  # nothing is one: every check fails until kda_kcp.context binds its class
    pass


KcpContextClass: type = _Unbound


def check_context(ctx):
    """``ctx`` is a KcpContext; returns it."""
    if not isinstance(ctx, KcpContextClass):
        raise TypeError(f"ctx must be a KcpContext from build_context_kcp, got {type(ctx).__name__}")
    return ctx


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):  # numpy's float32 too, as FLA takes it
        raise TypeError(f"scale must be a real number (e.g. a Python float) or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    return float(scale)


def values_requested(validate) -> bool:
    if validate is None:
        return os.environ.get("KDA_KCP_VALIDATE", "0").strip() not in ("", "0", "false", "False")
    return check_flag("validate", validate)


def _tensor(name: str, x, dims: int, what: str, **shape) -> torch.Tensor:
    """``what`` is formatted with ``shape`` on the error path only (every call runs these checks)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {what.format(**shape)}, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must be {what.format(**shape)}, got shape {tuple(x.shape)}")
    return x


def check_inputs(q, k, v, g, beta, ctx, backend) -> None:
    """Types, shapes, devices and contiguity of one call's inputs against its context, then ``backend``'s own
    rules (dtypes, head dims: ``Backend.check_supported``)."""
    check_context(ctx)
    _tensor("q", q, 3, "of shape [T, H, K]")
    T, H, K = q.shape
    _tensor("k", k, 3, "of shape [T, H, K] = [{T}, {H}, {K}]", T=T, H=H, K=K)
    _tensor("v", v, 3, "of shape [T, H, V] with T = {T}, H = {H}", T=T, H=H)
    _tensor("g", g, 3, "of shape [T, H, K] = [{T}, {H}, {K}]", T=T, H=H, K=K)
    _tensor("beta", beta, 2, "of shape [T, H] = [{T}, {H}]", T=T, H=H)
    if tuple(k.shape) != (T, H, K):
        raise ValueError(f"k must have the shape of q, {[T, H, K]}, got {list(k.shape)}")
    if tuple(g.shape) != (T, H, K):
        raise ValueError(f"g must have the shape of q, {[T, H, K]}, got {list(g.shape)}")
    if v.shape[0] != T or v.shape[1] != H:
        raise ValueError(f"v must be [T, H, V] with T = {T}, H = {H}, got {list(v.shape)}")
    if tuple(beta.shape) != (T, H):
        raise ValueError(f"beta must be [T, H] = {[T, H]}, got {list(beta.shape)}")
    if T != ctx.local_tokens:
        if ctx.world_size == 1:
            raise ValueError(
                f"q has T = {T} tokens but the context was built from cu_seqlens ending at {ctx.num_tokens}; "
                "cu_seqlens[-1] must equal T"
            )
        raise ValueError(
            f"q has T = {T} tokens but rank {ctx.rank} holds {ctx.local_tokens} of the context's {ctx.num_tokens} "
            "tokens; pass ctx.shard(x) of the global [T, ...] tensors"
        )
    if H < 1 or K < 1 or v.shape[2] < 1:
        raise ValueError(f"H, K and V must be positive, got q {list(q.shape)}, v {list(v.shape)}")
    device = q.device
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}; all inputs must share one device")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous() first); got strides {x.stride()}")
    if ctx.world_size > 1 and collective_device(ctx.group).type != device.type:
        raise ValueError(
            f"the context's group communicates on {collective_device(ctx.group).type} but the inputs are on "
            f"{device}; use NCCL with CUDA tensors and gloo with CPU tensors"
        )
    backend.check_supported(q, k, v, g, beta)


def check_values(g, beta, q, k, v) -> None:
    """Value checks (validate=True or KDA_KCP_VALIDATE=1) before any kernel, on either backend: the domain of
    kda_kcp.status (every value finite, g in [-5, 0], beta in [0, 2]), in its words, with one host synchronization.
    Without them the torch backend checks the same before computing and the CUDA backend reports through the status
    word."""
    from .status import domain_error

    msg = domain_error(q, k, v, g, beta)
    if msg is not None:
        raise ValueError(msg)


def check_gradient_values(do, dht) -> None:
    """The backward's value check when its forward ran with validate=True (or KDA_KCP_VALIDATE=1): do and dht finite,
    with one host synchronization. A NaN or Inf there would otherwise reach every gradient and, through the KCP
    exchange, the other ranks' gradients too."""
    named = [(name, x) for name, x in (("do", do), ("dht", dht)) if x is not None and x.numel()]
    if not named:
        return
    finite = torch.stack([torch.isfinite(x).all() for _, x in named]).tolist()
    bad = [name for (name, _), ok in zip(named, finite) if not ok]
    if bad:
        raise ValueError(f"kda_kcp: gradient values outside the domain (validate=True): {', '.join(bad)} "
                         f"hold{'s' if len(bad) == 1 else ''} non-finite values (NaN or Inf)")


def _check_gradient(name: str, x, want: list, of: str, device) -> None:
    """A gradient handed to the backward: a floating tensor of the shape ``want`` (that of ``of``) on ``device``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {want}, got {type(x).__name__}")
    if list(x.shape) != want:
        raise ValueError(f"{name} must have {of} shape {want}, got {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the forward ran on {device}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")


def check_grad_output(do, q, v) -> None:
    _check_gradient("do", do, [q.shape[0], q.shape[1], v.shape[2]], "the output's", q.device)


def check_initial_state(h0, num_docs: int, q, v, state_dtype: torch.dtype) -> None:
    """``initial_state``: None, or [N, H, K, V] (N = the context's documents) on q's device, contiguous, float32;
    float64 too when the call's states are FP64 (the torch backend with an FP64 input: ``state_dtype``)."""
    check_state_for(h0, num_docs, q.shape[1], q.shape[2], v.shape[2], q.device, state_dtype)


def check_state_for(h0, num_docs: int, H: int, K: int, V: int, device, state_dtype: torch.dtype) -> None:
    """``check_initial_state`` from the call's sizes and device (before its packed tensors exist)."""
    if h0 is None:
        return
    want = [num_docs, H, K, V]
    if not isinstance(h0, torch.Tensor):
        raise TypeError(f"initial_state must be a torch.Tensor of shape [N, H, K, V] = {want} or None, "
                        f"got {type(h0).__name__}")
    if list(h0.shape) != want:
        raise ValueError(f"initial_state must be [N, H, K, V] = {want} (N: the context's {num_docs} documents), "
                         f"got {list(h0.shape)}")
    if h0.dtype != torch.float32 and not (h0.dtype == torch.float64 == state_dtype):
        also = " (or float64, as the call computes in FP64)" if state_dtype == torch.float64 else ""
        raise TypeError(f"initial_state must be float32{also}, got {h0.dtype}")
    if h0.device != torch.device(device):
        raise ValueError(f"initial_state is on {h0.device} but q is on {device}")
    if not h0.is_contiguous():
        raise ValueError(f"initial_state must be contiguous (call .contiguous() first); got strides {h0.stride()}")


def check_final_state_grad(dht, num_docs: int, q, v) -> None:
    """``dht``, the final states' gradient: None, or a floating [N, H, K, V] tensor on q's device."""
    if dht is not None:
        _check_gradient("dht", dht, [num_docs, q.shape[1], q.shape[2], v.shape[2]], "the final state's", q.device)
