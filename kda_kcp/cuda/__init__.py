"""CUDA backend: the forward and backward kernels of csrc/, loaded through kda_kcp.jit.

Forward: csrc/kda_fwd.cu through ``.forward`` (a parallel chunk prep, then walks split over value
columns, and the affine merge of segment summaries: FP32 states, 3xTF32 products). Backward: csrc/kda_bwd.cu through ``.backward``.
chunk_kda's in-call activations: csrc/kda_act.cu through ``.activations`` (``fused_activations``).

Tensors: q, k, v bf16 [T, H, 128]; g fp32 [T, H, 128]; beta bf16 [T, H]; states fp32 [R, H, 128, 128]
indexed [run, head, key, value]; summaries (M [n, H, K, K], E [n, H, K, V]) with S_next = M @ S + E.
Scratch comes from a ``kda_kcp.arena.Arena`` (a workspace) when one is given, else from torch.
"""

from __future__ import annotations

import torch

from .. import status
from ..archs import KERNEL_CAPABILITIES
from . import activations, backward, bwd_tables, forward, tuning
from .common import _D, check_grid_bounds

__all__ = ["CudaBackend"]


class CudaBackend:
    name = "cuda"
    uses_arena = True  # every scratch buffer is carved from the call's arena (kda_kcp.function)

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
        activations.load(device)
        status.word(device)  # made here, before any call (and so outside any CUDA graph capture)
        self._loaded.add(key)

    @staticmethod
    def describe(device) -> str:
        arch = KERNEL_CAPABILITIES[torch.cuda.get_device_capability(device)]
        return f"CUDA kernels, {arch} ({torch.cuda.get_device_name(device)})"

    @staticmethod
    def check_supported(q, k, v, g, beta) -> None:
        """BF16 q, k, v, beta, FP32 g, head dim 128."""
        bf16 = torch.bfloat16
        if (q.dtype == bf16 and k.dtype == bf16 and v.dtype == bf16 and g.dtype == torch.float32 and beta.dtype == bf16
                and q.shape[2] == _D and v.shape[2] == _D):
            return  # (every call: the loop below builds its table of names first)
        for name, x, want in (("q", q, torch.bfloat16), ("k", k, torch.bfloat16), ("v", v, torch.bfloat16),
                              ("g", g, torch.float32), ("beta", beta, torch.bfloat16)):
            if x.dtype != want:
                raise TypeError(f"{name} must be {want} on the CUDA backend, got {x.dtype}")
        K, V = q.shape[2], v.shape[2]
        if K != _D or V != _D:
            raise ValueError(
                f"the CUDA backend supports head dim 128 only, got K = {K}, V = {V} "
                "(KDA_KCP_BACKEND=torch runs any size)"
            )

    @staticmethod
    def check_head_dims(head_dim: int, value_dim: int) -> None:
        if (head_dim, value_dim) != (_D, _D):
            raise ValueError(
                f"the CUDA backend supports head dim 128 only, got head_dim={head_dim}, value_dim={value_dim}")

    @staticmethod
    def summary_dtype(*xs: torch.Tensor) -> torch.dtype:
        return torch.float32  # FP32 summaries, states and exchange for any input dtype

    @staticmethod
    def fused_activations(q, k, g, beta, A_log, dt_bias, heads_v, lower_bound, beta_scale):
        """One kernel pass each way (kda_kcp.cuda.activations); None for a head dim other than 128, which the
        call's own checks then refuse."""
        if any(x is not None and x.shape[-1] != _D for x in (q, g)):
            return None
        return activations.fused_activations(q, k, g, beta, A_log, dt_bias, heads_v, lower_bound, beta_scale)

    @staticmethod
    def input_dtypes(q, k, v, g, beta) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        return torch.bfloat16, torch.float32, torch.bfloat16

    @staticmethod
    def grad_output(do: torch.Tensor) -> torch.Tensor:
        # the kernels read the output's dtype (a no-op .to still costs ~2 us before the backward's first launch)
        return do if do.dtype == torch.bfloat16 else do.to(torch.bfloat16)

    def upload_tables(self, ctx, num_heads: int, device, passes=None) -> None:
        """Build every index table a call of ``ctx`` at ``num_heads`` reads and put it on ``device`` now
        (WorkspaceKcp does, so that no call after it copies anything host to device)."""
        local, plan = ctx.local, ctx.plan
        for groups in (True, False):  # the whole plan's tables (and run groups), as a call looks them up
            forward.call_tables(local, num_heads, torch.device(device), groups)
        bwd_tables.chunk_tables(local, device)
        bwd_tables.seg_tables(local, num_heads, device)
        bwd_tables.walk_groups(local, num_heads, device)
        if passes is not None:
            bwd_tables.lean_passes(local, num_heads, device, passes)
        if plan.needs_exchange:
            early = forward.early_runs(local)
            if early:  # the two output passes of a KCP forward
                forward.forward_tables(local, num_heads, device, out_runs=early)
                late = forward.late_runs(local, early)
                if late:
                    forward.forward_tables(local, num_heads, device, out_runs=late)
            if plan.fwd_publish[ctx.rank]:
                forward.forward_tables(local, num_heads, device, run_ids=plan.fwd_publish[ctx.rank])
            if plan.bwd_publish[ctx.rank]:
                bwd_tables.summary_tables(local, tuple(plan.bwd_publish[ctx.rank]), device,
                                          own_chunks=passes is not None, heads=num_heads)

    # one call, prepared once: the chunk records serve the KCP summaries and the local pass
    def fwd_prepare(self, q, k, v, g, beta, scale, plan, arena=None, output_next=False,
                    lead=False) -> forward.PreparedForward:
        """Called by kda_kcp.function after check_inputs has passed these tensors for this backend
        (``output_next``: the output pass follows, no exchange in between; ``lead``: and nothing else is launched
        before it)."""
        return forward.PreparedForward(q, k, v, g, beta, scale, plan, arena, checked=True, output_next=output_next,
                                       lead=lead)

    def bwd_prepare(self, q, k, v, g, beta, do, scale, plan, arena=None, passes=None) -> backward.PreparedBackward:
        # (called from backward_kcp only: the inputs passed check_inputs in the forward, do check_grad_output, and
        # do is bf16 and contiguous by then)
        return backward.PreparedBackward(q, k, v, g, beta, do, scale, plan, arena, passes, checked=True)

    @staticmethod
    def check_call(q, k, v, g, beta, plan) -> None:
        """This backend's checks of one call, before the ranks agree (kda_kcp.function), so that what one rank
        raises here every rank raises: the grid's bounds, and values outside the domain that an earlier call's
        kernels reported (kda_kcp.status: a poll of landed copies, never a synchronization)."""
        check_grid_bounds(q.shape[1], plan.num_chunks)
        status.raise_pending(q.device)

    def table_knobs(self) -> tuple:
        """What this backend's tables depend on besides the shapes: the choices ``KDA_KCP_TUNING`` overrides
        (``tuning.cache_key``). A cache of anything computed from the tables, such as a call's workspace need, keys
        on it."""
        return tuning.cache_key()

    # single stages (tests, the torch backend's interface)
    def fwd_output(self, q, k, v, g, beta, scale, plan, state_in=None, arena=None):
        return forward.fwd_output(q, k, v, g, beta, scale, plan, state_in, arena)

    def fwd_summaries(self, q, k, v, g, beta, scale, plan, run_ids, arena=None):
        return forward.fwd_summaries(q, k, v, g, beta, scale, plan, run_ids, arena)

    def bwd_summaries(self, q, k, v, g, beta, do, scale, plan, run_ids, arena=None):
        return backward.bwd_summaries(q, k, v, g, beta, do, scale, plan, run_ids, arena)

    def bwd_grads(self, q, k, v, g, beta, do, scale, plan, state_in=None, dstate_out=None, arena=None, passes=None):
        return backward.bwd_grads(q, k, v, g, beta, do, scale, plan, state_in, dstate_out, self.deterministic,
                                  arena=arena, passes=passes)
