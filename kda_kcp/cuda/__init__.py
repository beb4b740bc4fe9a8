"""CUDA backend: the forward and backward kernels of csrc/, loaded through kda_kcp.jit.

Forward: csrc/kda_fwd.cu through ``.forward`` (a parallel chunk prep, then walks split over value
columns, and the FP32 affine merge of segment summaries). Backward: csrc/kda_bwd.cu through ``.backward``.

Tensors: q, k, v bf16 [T, H, 128]; g fp32 [T, H, 128]; beta bf16 [T, H]; states fp32 [R, H, 128, 128]
indexed [run, head, key, value]; summaries (M [n, H, K, K], E [n, H, K, V]) with S_next = M @ S + E.
Scratch comes from a ``kda_kcp.arena.Arena`` (a workspace) when one is given, else from torch.
"""

from __future__ import annotations

import torch

from . import backward, forward

__all__ = ["CudaBackend"]


class CudaBackend:
    name = "cuda"

    def __init__(self, deterministic: bool = True):
        # no kernel reduces with atomics yet: one implementation serves both packages
        self.deterministic = deterministic
        self._loaded: set[str] = set()  # devices whose programs are loaded (select_backend asks every call)

    def load(self, device) -> None:
        """Load (prebuilt or JIT-build) the programs for ``device`` now, so that a missing compiler or
        arch build surfaces at backend selection (KernelBuildError), not inside a call."""
        key = str(torch.device(device))
        if key in self._loaded:
            return
        forward.load(device)
        backward.load(device)
        self._loaded.add(key)

    def arena_bytes(self, op: str, plan, num_heads: int, device, run_ids=(), passes=None) -> int:
        """Arena bytes one call of ``op`` (fwd_output, fwd_summaries, bwd_grads, bwd_summaries) carves;
        ``passes``: the lean backward's pass count (None: replay)."""
        if op == "fwd_output":
            return forward.fwd_output_arena_bytes(plan, num_heads, device)
        if op == "fwd_summaries":
            return forward.fwd_summaries_arena_bytes(plan, num_heads, run_ids, device)
        if op == "bwd_grads":
            return backward.bwd_grads_arena_bytes(plan, num_heads, device, passes)
        if op == "bwd_summaries":
            return backward.bwd_summaries_arena_bytes(plan, num_heads, run_ids)
        raise ValueError(f"unknown op {op!r}")

    def fwd_output(self, q, k, v, g, beta, scale, plan, state_in=None, arena=None):
        return forward.fwd_output(q, k, v, g, beta, scale, plan, state_in, arena)

    def fwd_summaries(self, q, k, v, g, beta, scale, plan, run_ids, arena=None):
        return forward.fwd_summaries(q, k, v, g, beta, scale, plan, run_ids, arena)

    def bwd_summaries(self, q, k, v, g, beta, do, scale, plan, run_ids, arena=None):
        return backward.bwd_summaries(q, k, v, g, beta, do, scale, plan, run_ids, arena)

    def bwd_grads(self, q, k, v, g, beta, do, scale, plan, state_in=None, dstate_out=None, arena=None, passes=None):
        return backward.bwd_grads(q, k, v, g, beta, do, scale, plan, state_in, dstate_out, self.deterministic,
                                  arena=arena, passes=passes)
