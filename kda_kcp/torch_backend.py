"""The torch backend: the four local operations of a KCP call, built from the chunk stages and walks.

It runs anywhere PyTorch runs (CPU, any GPU), for any head size and FP32/FP64 (BF16 inputs are
computed in FP32). The CUDA backend (``kda_kcp.cuda``) implements the same four methods with kernels.

    fwd_summaries  (M, E) of listed runs from a zero state            -> forward exchange
    fwd_output     o of every run from its incoming state
    bwd_summaries  (M^T, F) of listed runs from a zero state gradient  -> backward exchange
    bwd_grads      dq, dk, dv, dg, dbeta of every run from its incoming state and outgoing state gradient
"""

from __future__ import annotations

import os

import torch

from .archs import KERNEL_CAPABILITIES
from .chunk import Prep, chunk_grads, chunk_prep, fwd_o
from .plan import LocalPlan
from .status import domain_error
from .walk import Steps, reverse_walk, state_walk

__all__ = ["TorchBackend", "compute_dtype"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class _ChunkSet:
    """The chunks of a subset of runs: a gather index [N, C] into the local tokens (padding -> T)."""

    def __init__(self, plan: LocalPlan, run_ids: tuple[int, ...], device):
        C = plan.chunk_size
        rows, counts = [], []
        for r in run_ids:
            run = plan.runs[r]
            bounds = run.chunk_offsets(C)
            counts.append(len(bounds))
            for off, n in bounds:
                s = run.local_start + off
                rows.append(list(range(s, s + n)) + [plan.num_tokens] * (C - n))
        self.index = torch.tensor(rows, dtype=torch.long, device=device).reshape(-1, C)
        self.steps = Steps.from_counts(counts, device)
        self.num_tokens = plan.num_tokens

    def gather(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T, H, *] -> [N, H, C, *] (zero padding rows)."""
        x = x.to(dtype)
        pad = torch.cat([x, x.new_zeros(1, *x.shape[1:])], 0)
        y = pad[self.index]  # [N, C, H, *]
        return y.movedim(1, 2).contiguous()

    def scatter(self, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """[N, H, C, *] -> rows of out [T, H, *] (padding rows dropped)."""
        y = y.movedim(2, 1)  # [N, C, H, *]
        flat_idx = self.index.reshape(-1)
        keep = flat_idx < self.num_tokens
        out[flat_idx[keep]] = y.reshape(-1, *y.shape[2:])[keep].to(out.dtype)
        return out


def _chunk_set(plan: LocalPlan, run_ids, device) -> _ChunkSet:
    cache = plan._tables.setdefault("torch_chunk_sets", {})
    key = (tuple(run_ids), str(device))
    if key not in cache:
        cache[key] = _ChunkSet(plan, tuple(run_ids), device)
    return cache[key]


class _Prepared:
    """The torch backend's side of a prepared call: its stages recompute what they need."""

    def __init__(self, summaries, local):
        self.summaries = summaries
        self.output = self.grads = local

    def reserve_early(self):
        return None  # no early output pass: the output pass recomputes what it reads


class TorchBackend:
    """The reference stages in torch (any device, FP32 or FP64). Its scratch is torch's own: the ``arena``
    arguments are accepted for the common interface and not used (it carves nothing)."""

    name = "torch"
    uses_arena = False

    @staticmethod
    def describe(device) -> str:
        """Why the torch backend runs tensors on ``device``."""
        device = torch.device(device)
        if os.environ.get("KDA_KCP_BACKEND", "").strip().lower() == "torch":
            why = "KDA_KCP_BACKEND=torch"
        elif device.type != "cuda":
            why = "no CUDA device"
        elif torch.cuda.get_device_capability(device) not in KERNEL_CAPABILITIES:
            major, minor = torch.cuda.get_device_capability(device)
            why = f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}; kernels exist for " + ", ".join(
                sorted(KERNEL_CAPABILITIES.values()))
        else:
            why = "the CUDA kernels could not be loaded (the warning above says why)"
        return f"torch ({why})"

    @staticmethod
    def check_supported(q, k, v, g, beta) -> None:
        """Floating inputs, k and v in q's dtype, g FP32 or FP64; any head dims."""
        if q.dtype not in _FLOATS:
            raise TypeError(f"q must be a floating tensor (bfloat16, float16, float32, float64), got {q.dtype}")
        for name, x in (("k", k), ("v", v)):
            if x.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
        if g.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"g must be float32 (or float64 on the torch backend), got {g.dtype}")
        if beta.dtype not in _FLOATS:
            raise TypeError(f"beta must be a floating tensor, got {beta.dtype}")

    @staticmethod
    def check_head_dims(head_dim: int, value_dim: int) -> None:
        return None  # any size

    @staticmethod
    def summary_dtype(*xs: torch.Tensor) -> torch.dtype:
        return compute_dtype(*xs)

    @staticmethod
    def fused_activations(q, k, g, beta, A_log, dt_bias, heads_v, lower_bound, beta_scale):
        return None  # kda_kcp.fla's torch ops are this backend's activations

    @staticmethod
    def input_dtypes(q, k, v, g, beta) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        qkv = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        return qkv, (g.dtype if g.dtype in (torch.float32, torch.float64) else torch.float32), beta.dtype

    @staticmethod
    def grad_output(do: torch.Tensor) -> torch.Tensor:
        return do  # computed in compute_dtype at the gather

    def table_knobs(self) -> tuple:
        return ()  # no tables, no carves

    def upload_tables(self, ctx, num_heads: int, device, passes=None) -> None:
        return None  # its gather indices are built at the first call

    @staticmethod
    def check_call(q, k, v, g, beta, plan) -> None:
        """This backend's checks of one call, before the ranks agree (kda_kcp.function): values outside the domain
        raise ValueError before anything is computed (kda_kcp.status; a host synchronization, which this backend
        does not avoid anyway)."""
        msg = domain_error(q, k, v, g, beta)
        if msg is not None:
            raise ValueError(msg)

    def fwd_prepare(self, q, k, v, g, beta, scale, plan, arena=None, output_next=False, lead=False):
        return _Prepared(
            lambda ids, arena=None: self.fwd_summaries(q, k, v, g, beta, scale, plan, ids),
            lambda state_in: self.fwd_output(q, k, v, g, beta, scale, plan, state_in),
        )

    def bwd_prepare(self, q, k, v, g, beta, do, scale, plan, arena=None, passes=None):
        return _Prepared(
            lambda ids, arena=None: self.bwd_summaries(q, k, v, g, beta, do, scale, plan, ids),
            lambda state_in, dstate_out: self.bwd_grads(q, k, v, g, beta, do, scale, plan, state_in, dstate_out),
        )

    def _inputs(self, cs: _ChunkSet, q, k, v, g, beta):
        dt = compute_dtype(q, k, v, g, beta)
        qc, kc, vc, gc = (cs.gather(x, dt) for x in (q, k, v, g))
        bc = cs.gather(beta.unsqueeze(-1), dt).squeeze(-1)
        return dt, qc, kc, vc, gc, bc

    def fwd_summaries(self, q, k, v, g, beta, scale, plan: LocalPlan, run_ids, arena=None):
        cs = _chunk_set(plan, run_ids, q.device)
        _, qc, kc, vc, gc, bc = self._inputs(cs, q, k, v, g, beta)
        prep = chunk_prep(qc, kc, vc, gc, bc, scale)
        _, E, M = state_walk(prep, cs.steps, None, summary=True)
        return M, E

    def fwd_output(self, q, k, v, g, beta, scale, plan: LocalPlan, state_in=None, arena=None):
        cs = _chunk_set(plan, range(plan.num_runs), q.device)
        _, qc, kc, vc, gc, bc = self._inputs(cs, q, k, v, g, beta)
        prep = chunk_prep(qc, kc, vc, gc, bc, scale)
        h, _, _ = state_walk(prep, cs.steps, state_in)
        o = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        return cs.scatter(fwd_o(prep, h, scale), o)

    def bwd_summaries(self, q, k, v, g, beta, do, scale, plan: LocalPlan, run_ids, arena=None):
        cs = _chunk_set(plan, run_ids, q.device)
        dt, qc, kc, vc, gc, bc = self._inputs(cs, q, k, v, g, beta)
        prep = chunk_prep(qc, kc, vc, gc, bc, scale)
        _, F, Mt = reverse_walk(prep, cs.gather(do, dt), cs.steps, scale, None, summary=True)
        return Mt, F

    def bwd_grads(self, q, k, v, g, beta, do, scale, plan: LocalPlan, state_in=None, dstate_out=None, arena=None,
                  passes=None):
        cs = _chunk_set(plan, range(plan.num_runs), q.device)
        dt, qc, kc, vc, gc, bc = self._inputs(cs, q, k, v, g, beta)
        doc = cs.gather(do, dt)
        prep: Prep = chunk_prep(qc, kc, vc, gc, bc, scale)
        h, _, _ = state_walk(prep, cs.steps, state_in)
        dh, _, _ = reverse_walk(prep, doc, cs.steps, scale, dstate_out)
        del prep
        grads = chunk_grads(qc, kc, vc, gc, bc, doc, h, dh, scale)
        outs = []
        for grad, x in zip(grads[:4], (q, k, v, g)):
            outs.append(cs.scatter(grad, torch.zeros_like(x)))
        outs.append(cs.scatter(grads[4].unsqueeze(-1), torch.zeros_like(beta).unsqueeze(-1)).squeeze(-1))
        return tuple(outs)
