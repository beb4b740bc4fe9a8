"""``chunk_kda``'s in-call activations fused on the CUDA backend: csrc/kda_act.cu (program ``kda_act``), one pass each
way for FLA's q/k L2 norm, the KDA gate (``A_log``, ``dt_bias``, ``lower_bound``) and the beta sigmoid.

``fused_activations`` is what ``kda_kcp.fla.chunk_kda`` calls on the CUDA backend: an autograd Function around the
two kernels in eager calls, the custom ops ``kda_kcp::act_fwd`` / ``kda_kcp::act_bwd`` (fake functions, registered
autograd) under torch.compile. The torch ops of kda_kcp.fla (``l2_normalize``, ``kda_gate``, ``beta_activation``)
are the reference and the torch backend's path; this computes the same in FP32 and hands the KDA kernels their
dtypes: q, k BF16 (normalised, then repeated for the HV / H value heads of each q/k head: FLA's GVA), g FP32, beta
BF16. Gradients come back in the caller's dtypes; those of ``A_log`` and ``dt_bias`` are per-item partial sums
(64 tokens of one head each) summed over the items by torch: deterministic, no atomics.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .common import _D

__all__ = ["fused_activations", "act_forward", "act_backward", "ENTRY_POINTS", "ROWS_PER_ITEM"]

# the program's entry points this module calls (scripts/check_entry_points.py checks them in every build)
ENTRY_POINTS = ("act_fwd", "act_bwd", "act_rows_per_item")
ROWS_PER_ITEM = 64  # tokens per item, the partial sums' granularity (csrc/kda_act.h kRowsPerItem)
_RAW_DTYPES = (torch.bfloat16, torch.float32)  # what the kernels read (kda_act.h Dtype)
_SOFTPLUS, _BOUNDED_RATE, _BOUNDED = 0, 1, 2  # kda_act.h GateForm


def load(device=None):
    """The tvm_ffi module of kda_act (build.json) for the arch of ``device`` (kda_kcp.jit caches it)."""
    from ..jit import load_program

    return load_program("kda_act", device)


def _gate_form(A_log, lower_bound) -> int:
    if lower_bound is None:
        return _SOFTPLUS
    return _BOUNDED_RATE if A_log is not None else _BOUNDED


def _items(n: int) -> int:
    return -(-n // ROWS_PER_ITEM)


def act_forward(q, k, g, beta, A_log, dt_bias, heads_v: int, lower_bound: Optional[float], beta_scale: float):
    """q, k ``[N, H, 128]``, g ``[N, HV, 128]``, beta ``[N, HV]`` (BF16 or FP32, contiguous; None: that activation
    is off), A_log ``HV`` and dt_bias ``HV * 128`` values (None: absent) -> ``(qn, kn, g_act, beta_act, rq, rk)``:
    qn, kn BF16 ``[N, HV, 128]``, g_act FP32, beta_act BF16 ``[N, HV]``, rq, rk the inverse norms FP32 ``[N, H]``
    (None where off)."""
    ref = next(x for x in (q, g, beta) if x is not None)
    N, HV, dev = ref.shape[0], heads_v, ref.device
    H = q.shape[1] if q is not None else HV
    none = ref.new_empty(0)
    qn = kn = rq = rk = g_act = beta_act = None
    if q is not None:
        qn, kn = (torch.empty(N, HV, _D, dtype=torch.bfloat16, device=dev) for _ in range(2))
        rq, rk = (torch.empty(N, H, dtype=torch.float32, device=dev) for _ in range(2))
    if g is not None:
        g_act = torch.empty(N, HV, _D, dtype=torch.float32, device=dev)
    if beta is not None:
        beta_act = torch.empty(N, HV, dtype=torch.bfloat16, device=dev)
    a_log32, dt32 = _params(A_log, dt_bias)
    load(dev).act_fwd(*_or(none, q, k, g, beta, a_log32, dt32, qn, kn, rq, rk, g_act, beta_act), N, H, HV,
                      _gate_form(A_log, lower_bound), float(lower_bound or 0.0), float(beta_scale))
    return qn, kn, g_act, beta_act, rq, rk


def act_backward(q, k, g, beta, A_log, dt_bias, rq, rk, dqn, dkn, dg_act, dbeta_act, heads_v: int,
                 lower_bound: Optional[float], beta_scale: float):
    """The gradients ``(dq, dk, dg, dbeta, dA_log, ddt_bias)`` of ``act_forward``'s inputs (None where absent) from
    those of its outputs (None or empty: zero), in the inputs' dtypes and shapes."""
    ref = next(x for x in (q, g, beta) if x is not None)
    N, HV = ref.shape[0], heads_v
    H = q.shape[1] if q is not None else HV
    none = ref.new_empty(0)

    def grad_of(d, shape, dtype):  # a gradient the kernel reads: an absent one is zero
        if d is None or d.numel() != N * (shape[0] if len(shape) == 1 else shape[0] * shape[1]):
            return torch.zeros(N, *shape, dtype=dtype, device=ref.device)
        return d.reshape(N, *shape).to(dtype).contiguous()

    dq = dk = dg = dbeta = part_a = part_dt = None
    if q is not None:
        dqn, dkn = (grad_of(d, (HV, _D), torch.bfloat16) for d in (dqn, dkn))
        dq, dk = torch.empty_like(q), torch.empty_like(k)
    if g is not None:
        dg_act = grad_of(dg_act, (HV, _D), torch.float32)
        dg = torch.empty_like(g)
        if A_log is not None:  # every gate form with A_log reads it
            part_a = torch.empty(_items(N), HV, dtype=torch.float32, device=ref.device)
        if dt_bias is not None:
            part_dt = torch.empty(_items(N), HV, _D, dtype=torch.float32, device=ref.device)
    if beta is not None:
        dbeta_act = grad_of(dbeta_act, (HV,), torch.bfloat16)
        dbeta = torch.empty_like(beta)
    a_log32, dt32 = _params(A_log, dt_bias)
    load(ref.device).act_bwd(*_or(none, q, k, g, beta, a_log32, dt32, rq, rk, dqn, dkn, dg_act, dbeta_act, dq, dk, dg,
                                  dbeta, part_a, part_dt),
                             N, H, HV, _gate_form(A_log, lower_bound), float(lower_bound or 0.0), float(beta_scale))
    # the items' partial sums, summed in torch's fixed order
    dA_log = part_a.sum(0).to(A_log.dtype).reshape(A_log.shape) if part_a is not None else None
    ddt_bias = part_dt.sum(0).to(dt_bias.dtype).reshape(dt_bias.shape) if part_dt is not None else None
    return dq, dk, dg, dbeta, dA_log, ddt_bias


def _params(A_log, dt_bias):
    """A_log and dt_bias as the kernels read them: FP32, contiguous (their gradients are cast back)."""
    return tuple(None if x is None else x.detach().to(torch.float32).contiguous().reshape(-1) for x in (A_log, dt_bias))


def _or(none, *xs):
    return tuple(none if x is None else x for x in xs)


class _FusedActivations(torch.autograd.Function):
    """The eager route: the forward kernel, its backward kernel as the node's backward."""

    @staticmethod
    def forward(ctx, q, k, g, beta, A_log, dt_bias, heads_v, lower_bound, beta_scale):
        qn, kn, g_act, beta_act, rq, rk = act_forward(q, k, g, beta, A_log, dt_bias, heads_v, lower_bound, beta_scale)
        ctx.save_for_backward(q, k, g, beta, A_log, dt_bias, rq, rk)
        ctx.options = (heads_v, lower_bound, beta_scale)
        return qn, kn, g_act, beta_act

    @staticmethod
    @once_differentiable
    def backward(ctx, dqn, dkn, dg_act, dbeta_act):
        grads = act_backward(*ctx.saved_tensors, dqn, dkn, dg_act, dbeta_act, *ctx.options)
        return (*grads, None, None, None)


# ---- the compiled route: custom ops (schemas inferred from the annotations) ----

Tensor = torch.Tensor


def _present(outs, like):
    """An op's outputs: the absent ones as empty tensors (an op returns tensors)."""
    return tuple(like.new_empty(0) if x is None else x for x in outs)


def _absent_as_none(x):
    return None if x is None or x.numel() == 0 else x


@torch.library.custom_op("kda_kcp::act_fwd", mutates_args=())
def _act_fwd_op(q: Optional[Tensor], k: Optional[Tensor], g: Optional[Tensor], beta: Optional[Tensor],
                A_log: Optional[Tensor], dt_bias: Optional[Tensor], heads_v: int, lower_bound: Optional[float],
                beta_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    ref = next(x for x in (q, g, beta) if x is not None)
    return _present(act_forward(q, k, g, beta, A_log, dt_bias, heads_v, lower_bound, beta_scale), ref)


@_act_fwd_op.register_fake
def _act_fwd_fake(q, k, g, beta, A_log, dt_bias, heads_v, lower_bound, beta_scale):
    ref = next(x for x in (q, g, beta) if x is not None)
    N, HV = ref.shape[0], heads_v
    bf16, f32, empty = torch.bfloat16, torch.float32, ref.new_empty(0)
    qn = ref.new_empty(N, HV, _D, dtype=bf16) if q is not None else empty
    kn = ref.new_empty(N, HV, _D, dtype=bf16) if q is not None else empty.clone()
    rq = ref.new_empty(N, q.shape[1], dtype=f32) if q is not None else empty.clone()
    rk = ref.new_empty(N, q.shape[1], dtype=f32) if q is not None else empty.clone()
    g_act = ref.new_empty(N, HV, _D, dtype=f32) if g is not None else empty.clone()
    beta_act = ref.new_empty(N, HV, dtype=bf16) if beta is not None else empty.clone()
    return qn, kn, g_act, beta_act, rq, rk


@torch.library.custom_op("kda_kcp::act_bwd", mutates_args=())
def _act_bwd_op(q: Optional[Tensor], k: Optional[Tensor], g: Optional[Tensor], beta: Optional[Tensor],
                A_log: Optional[Tensor], dt_bias: Optional[Tensor], rq: Tensor, rk: Tensor, dqn: Optional[Tensor],
                dkn: Optional[Tensor], dg_act: Optional[Tensor], dbeta_act: Optional[Tensor], heads_v: int,
                lower_bound: Optional[float], beta_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    ref = next(x for x in (q, g, beta) if x is not None)
    return _present(act_backward(q, k, g, beta, A_log, dt_bias, _absent_as_none(rq), _absent_as_none(rk), dqn, dkn,
                                 dg_act, dbeta_act, heads_v, lower_bound, beta_scale), ref)


@_act_bwd_op.register_fake
def _act_bwd_fake(q, k, g, beta, A_log, dt_bias, rq, rk, dqn, dkn, dg_act, dbeta_act, heads_v, lower_bound,
                  beta_scale):
    ref = next(x for x in (q, g, beta) if x is not None)
    return tuple(ref.new_empty(0) if x is None else torch.empty_like(x) for x in (q, k, g, beta, A_log, dt_bias))


def _setup_context(ctx, inputs, output):  # ctx: autograd's (torch passes it by this name)
    q, k, g, beta, A_log, dt_bias, heads_v, lower_bound, beta_scale = inputs
    ctx.save_for_backward(q, k, g, beta, A_log, dt_bias, output[4], output[5])
    ctx.options = (heads_v, lower_bound, beta_scale)


def _backward(ctx, dqn, dkn, dg_act, dbeta_act, _drq, _drk):
    q, k, g, beta, A_log, dt_bias, rq, rk = ctx.saved_tensors
    grads = _act_bwd_op(q, k, g, beta, A_log, dt_bias, rq, rk, dqn, dkn, dg_act, dbeta_act, *ctx.options)
    return (*(None if x is None else d for x, d in zip((q, k, g, beta, A_log, dt_bias), grads)), None, None, None)


_act_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def fused_activations(q, k, g, beta, A_log, dt_bias, heads_v: int, lower_bound: Optional[float], beta_scale: float):
    """The activations ``chunk_kda`` asks for, on its ``[B, T, ...]`` tensors: q, k ``[B, T, H, 128]`` (None: no
    norm) -> BF16 ``[B, T, HV, 128]``, L2-normalised and repeated for the value heads; g ``[B, T, HV, 128]`` (None: no
    gate) -> the FP32 log decay; beta ``[B, T, HV]`` (None: no sigmoid) -> BF16 ``beta_scale * sigmoid(beta)``.
    Returns the four (None where off). Inputs of other dtypes than BF16 and FP32 are converted to FP32 first."""
    ref = next(x for x in (q, g, beta) if x is not None)
    B, T = ref.shape[:2]
    if q is not None and (q.dtype != k.dtype or q.dtype not in _RAW_DTYPES):
        q, k = q.float(), k.float()

    def flat(x, *tail):
        if x is None:
            return None
        x = x if x.dtype in _RAW_DTYPES else x.float()
        return x.reshape(B * T, *tail).contiguous()

    args = (flat(q, q.shape[2], _D) if q is not None else None, flat(k, k.shape[2], _D) if k is not None else None,
            flat(g, heads_v, _D), flat(beta, heads_v), A_log, dt_bias, heads_v, lower_bound, float(beta_scale))
    if torch.compiler.is_compiling():
        outs = _act_fwd_op(*args)[:4]
        outs = tuple(o if x is not None else None for o, x in zip(outs, args[:4]))
    else:
        outs = _FusedActivations.apply(*args)
    tails = ((heads_v, _D), (heads_v, _D), (heads_v, _D), (heads_v,))
    return tuple(None if o is None else o.reshape(B, T, *tail) for o, tail in zip(outs, tails))
