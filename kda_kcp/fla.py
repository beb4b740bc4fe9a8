"""``chunk_kda`` with the call of flash-linear-attention 0.6.0's ``fla.ops.kda.chunk_kda``, on kda_kcp.

Code that trains with FLA swaps one import::

    from fla.ops.kda import chunk_kda      ->      from kda_kcp import chunk_kda

Tensors are ``[B, T, H, K]`` as in FLA; the call packs them into one batch for ``kda_kcp.chunk_kda_kcp``
(B equal-length sequences become B documents; with ``cu_seqlens``, B = 1) and runs it at W = 1, or on this
rank's shard under context parallelism when ``cp_context`` is a ``KcpContext``. FLA is not imported here.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from .agreement import agree_failure
from .backend import TORCH, select_backend
from .context import KcpContext
from .library import chunk_kda_op
from .packing import packed_context
from .validate import check_flag, check_scale, check_state_for

__all__ = ["chunk_kda", "l2_normalize", "kda_gate", "beta_activation"]

L2NORM_EPS = 1e-6  # FLA's l2norm epsilon (added to the sum of squares)


def _compute_dtype(*xs) -> torch.dtype:
    """FP64 when any input is FP64 (the tests' oracle runs), else FP32."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, in FP32 (FP64 for FP64 x); the result is in that dtype."""
    x = x.to(_compute_dtype(x))
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def kda_gate(g: torch.Tensor, A_log=None, dt_bias=None, lower_bound=None) -> torch.Tensor:
    """FLA's KDA gate activation over ``g [..., H, K]`` (A_log: H values, dt_bias: H * K values), in FP32
    (FP64 when an input is FP64):

    - ``lower_bound`` None: ``-exp(A_log) * softplus(g + dt_bias)``;
    - ``lower_bound`` set: ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, or
      ``lower_bound * sigmoid(g + dt_bias)`` without A_log (the form FLA uses whenever lower_bound is given).
    """
    H, K = g.shape[-2], g.shape[-1]
    dt = _compute_dtype(g, A_log, dt_bias)
    x = g.to(dt)
    if dt_bias is not None:
        x = x + dt_bias.to(dt).reshape(H, K)
    rate = A_log.to(dt).reshape(H, 1).exp() if A_log is not None else None
    if lower_bound is None:
        return -rate * F.softplus(x)
    return lower_bound * torch.sigmoid(x if rate is None else rate * x)


def beta_activation(beta: torch.Tensor, allow_neg_eigval: bool = False) -> torch.Tensor:
    """sigmoid(beta), times 2 with allow_neg_eigval (beta in (0, 2)), in FP32 (FP64 for FP64 beta)."""
    b = torch.sigmoid(beta.to(_compute_dtype(beta)))
    return 2.0 * b if allow_neg_eigval else b


# ---- the W = 1 contexts a call builds itself, and the host copy of cu_seqlens ----

# ---- option checks ----

_REFUSED_FLAGS = {
    "disable_recompute": "kda_kcp's backward always recomputes its chunk records from the inputs (leave it False)",
    "return_intermediate_states": "intermediate states (an inference feature) are not supported",
    "state_v_first": "kda_kcp's states are [N, H, K, V] (FLA's default layout) only",
    "use_graph": "not needed: a kda_kcp call is CUDA-graph capturable with a WorkspaceKcp (workspace=)",
}


def _check_before_activations(backend, tensors, scale, initial_state, ctx, HV: int) -> None:
    """The KDA call's checks that do not need the activated tensors: the backend's head dims, the scale and the
    initial state's shape, dtype, device and layout (the rest hold by construction: the activations' outputs are
    new contiguous tensors in the dtypes the backend takes)."""
    q, v = tensors[0], tensors[2]
    K, V = q.shape[-1], v.shape[-1]
    backend.check_head_dims(K, V)
    check_scale(scale, K)
    if ctx is not None:
        check_state_for(initial_state, ctx.num_docs, HV, K, V, q.device, backend.summary_dtype(*tensors))


def _check_options(flags: dict, max_num_seqs, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                   safe_gate, use_beta_sigmoid_in_kernel, allow_neg_eigval, extra: dict) -> None:
    for name, value in flags.items():
        check_flag(name, value)
        if value and name in _REFUSED_FLAGS:
            raise ValueError(f"chunk_kda: {name}=True is not supported by kda_kcp: {_REFUSED_FLAGS[name]}")
    if max_num_seqs is not None:
        raise ValueError("chunk_kda: max_num_seqs (FLA's CUDA-graph padding, with use_graph) is not supported by kda_kcp")
    for name, value in extra.items():
        if name == "chunk_size":
            if value != 64:
                raise ValueError(f"chunk_kda: chunk_size={value!r} is not supported: kda_kcp's chunks are 64 tokens")
        elif name == "transpose_state_layout":  # FLA's deprecated name of state_v_first
            if check_flag(name, value):
                raise ValueError(f"chunk_kda: {name}=True is not supported by kda_kcp: {_REFUSED_FLAGS['state_v_first']}")
        else:
            raise ValueError(f"chunk_kda: unknown or unsupported keyword argument {name!r}")
    if not use_gate_in_kernel:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is not None:
                raise ValueError(f"chunk_kda: {name} is only used with use_gate_in_kernel=True (it would be ignored)")
    elif A_log is None and lower_bound is None:
        raise ValueError("chunk_kda: A_log must be given when use_gate_in_kernel=True and lower_bound is not set")
    if lower_bound is not None:
        # numbers.Real: numpy's float32 too, as for scale
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real) or not math.isfinite(lower_bound):
            raise TypeError(f"chunk_kda: lower_bound must be a finite float or None, got {lower_bound!r}")
        if not -5.0 <= lower_bound < 0.0:
            raise ValueError(
                f"chunk_kda: lower_bound must lie in [-5, 0), got {lower_bound!r} (kda_kcp's kernels take log decays >= -5)"
            )
    if safe_gate and use_gate_in_kernel and lower_bound is None:
        raise ValueError("chunk_kda: lower_bound must be given when safe_gate=True and use_gate_in_kernel=True")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("chunk_kda: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")


def _check_tensors(q, k, v, g, beta, A_log, dt_bias):
    for name, x, dims in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"chunk_kda: {name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"chunk_kda: {name} must be a floating tensor, got {x.dtype}")
        if x.dim() != dims:
            want = "[B, T, HV]" if name == "beta" else "[B, T, H, K]" if name in "qk" else "[B, T, HV, V or K]"
            raise ValueError(f"chunk_kda: {name} must be {want}, got shape {tuple(x.shape)}")
    B, T, H, K = q.shape
    HV = v.shape[2]
    if B < 1 or H < 1:
        raise ValueError(f"chunk_kda: q [B, T, H, K] must hold at least one sequence and at least one head, "
                         f"got shape {tuple(q.shape)}")
    if tuple(k.shape) != (B, T, H, K):
        raise ValueError(f"chunk_kda: k must have q's shape {[B, T, H, K]}, got {list(k.shape)}")
    if v.shape[:2] != (B, T) or HV % H != 0 or HV < H:
        raise ValueError(f"chunk_kda: v must be [B, T, HV, V] with B = {B}, T = {T} and HV a multiple of H = {H}, "
                         f"got {list(v.shape)}")
    if tuple(g.shape) != (B, T, HV, K):
        raise ValueError(f"chunk_kda: g must be [B, T, HV, K] = {[B, T, HV, K]}, got {list(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"chunk_kda: beta must be [B, T, HV] = {[B, T, HV]}, got {list(beta.shape)}")
    for name, x, n in (("A_log", A_log, HV), ("dt_bias", dt_bias, HV * K)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise TypeError(f"chunk_kda: {name} must be a floating torch.Tensor, got {type(x).__name__}")
        if x.numel() != n:
            raise ValueError(f"chunk_kda: {name} must hold {n} values ({'HV' if name == 'A_log' else 'HV * K'}), "
                             f"got shape {tuple(x.shape)}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log), ("dt_bias", dt_bias)):
        if x is not None and x.device != q.device:
            raise ValueError(f"chunk_kda: {name} is on {x.device} but q is on {q.device}")
    return B, T, H, K, HV


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context: KcpContext | None = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    deterministic: bool = True,
    workspace=None,
    **kwargs,
):
    """KDA with FLA 0.6.0's ``chunk_kda`` call (same parameter names, order and defaults); returns
    ``(o, final_state)``, final_state None unless ``output_final_state``.

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]`` (HV a multiple of H: each
    group of HV / H value heads shares one q, k head, FLA's GVA). o is ``[B, T, HV, V]`` in q's dtype.

    - ``cu_seqlens`` (N + 1 offsets, B = 1) packs N documents; without it the B rows are B documents of T tokens.
      ``cu_seqlens_cpu``, its host copy, spares reading the device tensor. A call builds (and caches) the W = 1
      context of the offsets.
    - ``cp_context``: a ``kda_kcp.KcpContext`` (``build_context_kcp(cu_seqlens, group, layout)``); the tensors
      are then this rank's shard ``[1, T_local, ...]`` (``ctx.shard`` of the global rows) and o is its shard.
    - ``initial_state``: ``[N, HV, K, V]`` FP32, one state per sequence (N = len(cu_seqlens) - 1, else B);
      ``output_final_state=True`` returns each sequence's final state, ``[N, HV, K, V]`` FP32 (FP64 on the torch
      backend for FP64 inputs). Both differentiable. With ``cp_context`` every rank passes every sequence's
      initial state, which enters on the rank where its sequence starts; each rank's final_state holds the
      sequences that end on it (zeros elsewhere), and the initial state's gradient on each rank the sequences that
      start there (summed over the ranks: the whole gradient). FLA's context parallelism refuses both.
    - ``use_qk_l2norm_in_kernel``: q, k divided by sqrt(sum of squares + 1e-6) over K.
    - ``use_gate_in_kernel``: g is the raw gate and ``A_log`` (HV values), ``dt_bias`` (HV * K, optional) are
      keywords, as in FLA: ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound`` (in [-5, 0))
      ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``lower_bound * sigmoid(g + dt_bias)`` when A_log is
      None). kda_kcp's kernels take log decays in [-5, 0): the softplus form can go below -5, so pass
      ``lower_bound=-5`` (FLA's recommendation) unless the gates are known to stay above it;
      ``KDA_KCP_VALIDATE=1`` checks the values.
    - ``safe_gate`` selects a kernel in FLA for gates bounded below; kda_kcp's kernels always assume that bound,
      so it changes nothing here beyond FLA's own check (with ``use_gate_in_kernel`` it needs ``lower_bound``).
      ``lower_bound`` without ``use_gate_in_kernel`` likewise only describes the caller's gates, as in FLA.
    - ``use_beta_sigmoid_in_kernel``: beta = sigmoid(beta), times 2 with ``allow_neg_eigval`` (which requires it).
    - ``deterministic``, ``workspace``: as in ``kda_kcp.chunk_kda_kcp``.

    The activations are differentiable. On the CUDA backend they run fused, one kernel pass each way
    (the backend's ``fused_activations``: ``kda_kcp.cuda.activations``, csrc/kda_act.cu: FP32 math, q and k normalised before the GVA repeat, the
    gradients of ``A_log`` and ``dt_bias`` summed deterministically); they hand the KDA kernels q, k, beta in BF16 and
    g in FP32. On the torch backend they are the torch ops ``l2_normalize``, ``kda_gate`` and ``beta_activation``
    of this module (in FP32; FP64 for FP64 inputs), which are also the fused pass's reference. Either way the KDA
    kernels' value check sees a non-finite raw input as a non-finite activated one. Tensors the activations do not
    touch reach the CUDA kernels converted differentiably (q, k, v, beta to BF16, g to FP32) when their dtypes differ.

    Not supported, each raising ``ValueError`` that names it: ``disable_recompute=True``, ``return_intermediate_states=True``, ``state_v_first=True``, ``use_graph=True``,
    ``max_num_seqs``, ``chunk_size`` other than 64, and any keyword FLA does not define.
    """
    from . import _package, chunk_kda_kcp  # the facade (this module is imported by the package's __init__)

    compiling = torch.compiler.is_compiling()  # the custom op then makes the context when it runs (kda_kcp.library)

    def checked_and_packed(q, k, v, g, beta, initial_state):
        """The call's checks, its context, the activations and the packed [B * T, ...] inputs."""
        flags = dict(output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                     allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, disable_recompute=disable_recompute,
                     return_intermediate_states=return_intermediate_states, state_v_first=state_v_first,
                     use_graph=use_graph, deterministic=deterministic)
        _check_options(flags, max_num_seqs, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate,
                       use_beta_sigmoid_in_kernel, allow_neg_eigval, kwargs)
        bound = None if lower_bound is None else float(lower_bound)  # a Python float for the kernels' argument
        B, T, H, K, HV = _check_tensors(q, k, v, g, beta, A_log, dt_bias)
        if isinstance(initial_state, torch.Tensor):  # any layout, as FLA takes it (e.g. one state expanded over B)
            initial_state = initial_state.contiguous()
        ctx = None if compiling else packed_context(B, T, cu_seqlens, cu_seqlens_cpu, cp_context)
        out_dtype = q.dtype

        # off the GPU the torch backend runs (or, with KDA_KCP_BACKEND=cuda, the call raises at its checks)
        backend = select_backend(q.device, _package(deterministic, 4).DETERMINISTIC) if q.is_cuda else TORCH
        fused = None
        if use_qk_l2norm_in_kernel or use_gate_in_kernel or use_beta_sigmoid_in_kernel:
            # what the KDA call would refuse is refused before the fused pass launches anything
            _check_before_activations(backend, (q, k, v, g, beta), scale, initial_state, ctx, HV)
            fused = backend.fused_activations(
                q if use_qk_l2norm_in_kernel else None, k if use_qk_l2norm_in_kernel else None,
                g if use_gate_in_kernel else None, beta if use_beta_sigmoid_in_kernel else None,
                A_log, dt_bias, HV, bound, 2.0 if allow_neg_eigval else 1.0)
        if fused is not None:
            q_act, k_act, g_act, beta_act = fused
            q, k = (q_act, k_act) if use_qk_l2norm_in_kernel else (q, k)  # normalised q, k come with HV heads
            g = g_act if use_gate_in_kernel else g
            beta = beta_act if use_beta_sigmoid_in_kernel else beta
        else:
            if use_qk_l2norm_in_kernel:
                q, k = l2_normalize(q), l2_normalize(k)
            if use_gate_in_kernel:
                g = kda_gate(g, A_log, dt_bias, bound)
            if use_beta_sigmoid_in_kernel:
                beta = beta_activation(beta, allow_neg_eigval)
        qkv_dtype, g_dtype, beta_dtype = backend.input_dtypes(q, k, v, g, beta)
        if q.shape[2] != HV:
            q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)

        def packed(x, dtype):
            return x.to(dtype).reshape(B * T, *x.shape[2:]).contiguous()

        q, k, v, g, beta = packed(q, qkv_dtype), packed(k, qkv_dtype), packed(v, qkv_dtype), packed(g, g_dtype), \
            packed(beta, beta_dtype)
        return q, k, v, g, beta, initial_state, ctx, out_dtype, B, T, HV

    args = (q, k, v, g, beta, initial_state)
    if compiling:  # (no collective under a compiled graph's tracing)
        packed_call = checked_and_packed(*args)
    else:
        try:
            packed_call = checked_and_packed(*args)
        except Exception as exc:  # noqa: BLE001 - under KCP one rank's failure raises on every rank
            agree_failure(cp_context, "forward", exc)
    q, k, v, g, beta, initial_state, ctx, out_dtype, B, T, HV = packed_call
    states = dict(initial_state=initial_state, output_final_state=output_final_state)
    if compiling:
        cu = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
        out = chunk_kda_op(q, k, v, g, beta, cp_context, scale, _package(deterministic).DETERMINISTIC, workspace,
                           cu_seqlens=cu, packed_rows=B, **states)
    else:
        out = chunk_kda_kcp(q, k, v, g, beta, ctx, scale=scale, deterministic=deterministic, workspace=workspace,
                            **states)
    o, final_state = out if output_final_state else (out, None)
    return o.reshape(B, T, HV, o.shape[-1]).to(out_dtype), final_state
