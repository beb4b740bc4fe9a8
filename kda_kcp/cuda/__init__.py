"""CUDA backend: the forward and backward kernels of csrc/, loaded through kda_kcp.jit.

Forward: the staged v4 kernels (csrc/kda_fwd_staged.cu, ``.staged``: parallel chunk prep, V-tiled walks)
by default; ``KDA_KCP_FWD_KERNEL=fused`` selects the fused v3 kernel (csrc/kda_fwd.cu), kept for
comparison until v4 is measured at every head count (NOTES.md). Both use kda_fwd's FP32 affine merge.
Backward: csrc/kda_bwd.cu through ``.backward``.

Tensors: q, k, v bf16 [T, H, 128]; g fp32 [T, H, 128]; beta bf16 [T, H]; states fp32 [R, H, 128, 128]
indexed [run, head, key, value]; summaries (M [n, H, K, K], E [n, H, K, V]) with S_next = M @ S + E.
"""

from __future__ import annotations

import os

import torch

from .common import _D, _c, _none, check_tensors

from . import staged
from .segments import forward_tables, summary_tables

__all__ = ["CudaBackend"]



def _forward_kind(forward: str | None) -> str:
    kind = (forward or os.environ.get("KDA_KCP_FWD_KERNEL", "staged")).strip().lower()
    if kind not in ("staged", "fused"):
        raise ValueError(f"the forward kernel must be 'staged' or 'fused' (KDA_KCP_FWD_KERNEL), got {kind!r}")
    return kind


def _module(device):
    from ..jit import load_program

    return load_program("kda_fwd", device)


class CudaBackend:
    name = "cuda"

    def __init__(self, deterministic: bool = True, forward: str | None = None):
        # the forward has no reductions in parallel: one implementation serves both packages.
        # forward: "staged" (v4) or "fused" (v3); None reads KDA_KCP_FWD_KERNEL at each call (default staged)
        self.deterministic = deterministic
        self.forward = forward
        self._loaded: set[str] = set()  # devices whose programs are loaded (select_backend asks every call)

    def load(self, device) -> None:
        """Load (prebuilt or JIT-build) the programs for ``device`` now, so that a missing compiler or
        arch build surfaces at backend selection (KernelBuildError), not inside a call."""
        key = str(torch.device(device))
        if key in self._loaded:
            return
        _module(device)
        staged.load_staged(device)
        from .backward import load

        load(device)
        self._loaded.add(key)

    # ---------------- scratch (kda_kcp.arena; the fused v3 forward allocates its own) ----------------
    def arena_bytes(self, op: str, plan, num_heads: int, device, run_ids=(), passes=None) -> int:
        """Arena bytes one call of ``op`` (fwd_output, fwd_summaries, bwd_grads, bwd_summaries) carves;
        ``passes``: the lean backward's pass count (None: replay)."""
        from . import backward

        if op in ("fwd_output", "fwd_summaries") and _forward_kind(self.forward) != "staged":
            return 0
        if op == "fwd_output":
            return staged.fwd_output_arena_bytes(plan, num_heads, device)
        if op == "fwd_summaries":
            return staged.fwd_summaries_arena_bytes(plan, num_heads, run_ids, device)
        if op == "bwd_grads":
            return backward.bwd_grads_arena_bytes(plan, num_heads, device, passes)
        if op == "bwd_summaries":
            return backward.bwd_summaries_arena_bytes(plan, num_heads, run_ids)
        raise ValueError(f"unknown op {op!r}")

    # ---------------- forward ----------------
    def fwd_output(self, q, k, v, g, beta, scale, plan, state_in=None, arena=None):
        if _forward_kind(self.forward) == "staged":
            return staged.fwd_output(q, k, v, g, beta, scale, plan, state_in, arena)
        check_tensors("CUDA backend", q, k, v, g, beta)
        q, k, v, g, beta = (_c(x) for x in (q, k, v, g, beta))
        dev = q.device
        T, H, _ = q.shape
        o = torch.empty(T, H, _D, dtype=torch.bfloat16, device=dev)
        if T == 0 or plan.num_runs == 0:
            return o
        mod = _module(dev)
        tabs = forward_tables(plan, H, dev)
        sin_t = state_in.contiguous().float() if state_in is not None else _none(dev)
        if state_in is not None and tuple(sin_t.shape) != (plan.num_runs, H, _D, _D):
            raise ValueError(f"state_in must be [{plan.num_runs}, {H}, {_D}, {_D}], got {tuple(state_in.shape)}")
        seg_states = _none(dev)
        if tabs.num_summary > 0:
            m = torch.empty(tabs.num_summary, H, _D, _D, dtype=torch.float32, device=dev)
            e = torch.empty_like(m)
            mod.fwd_summary(q, k, v, g, beta, tabs.summary, m, e, float(scale))
            seg_states = torch.empty(tabs.num_sin, H, _D, _D, dtype=torch.float32, device=dev)
            mod.merge_fold(m, e, tabs.chains, sin_t, seg_states)
        mod.fwd_output(q, k, v, g, beta, tabs.fwd, sin_t, seg_states, o, float(scale))
        return o

    def fwd_summaries(self, q, k, v, g, beta, scale, plan, run_ids, arena=None):
        if _forward_kind(self.forward) == "staged":
            return staged.fwd_summaries(q, k, v, g, beta, scale, plan, run_ids, arena)
        check_tensors("CUDA backend", q, k, v, g, beta)
        q, k, v, g, beta = (_c(x) for x in (q, k, v, g, beta))
        dev = q.device
        H = q.shape[1]
        run_ids = tuple(int(r) for r in run_ids)
        M = torch.empty(len(run_ids), H, _D, _D, dtype=torch.float32, device=dev)
        E = torch.empty_like(M)
        if not run_ids:
            return M, E
        mod = _module(dev)
        summ, chains, nsum = summary_tables(plan, run_ids, H, dev)
        m = torch.empty(nsum, H, _D, _D, dtype=torch.float32, device=dev)
        e = torch.empty_like(m)
        mod.fwd_summary(q, k, v, g, beta, summ, m, e, float(scale))
        mod.merge_compose(m, e, chains, M, E)
        return M, E

    # ---------------- backward (csrc/kda_bwd.cu through .backward) ----------------
    def bwd_summaries(self, q, k, v, g, beta, do, scale, plan, run_ids, arena=None):
        from .backward import bwd_summaries

        return bwd_summaries(q, k, v, g, beta, do, scale, plan, run_ids, arena)

    def bwd_grads(self, q, k, v, g, beta, do, scale, plan, state_in=None, dstate_out=None, arena=None, passes=None):
        from .backward import bwd_grads

        return bwd_grads(q, k, v, g, beta, do, scale, plan, state_in, dstate_out, self.deterministic, arena=arena,
                         passes=passes)
