"""The KcpContext a call on FLA-shaped ``[B, T, ...]`` tensors runs under (``kda_kcp.chunk_kda``, the layer, and
the custom op that ``chunk_kda`` becomes under torch.compile): its ``cp_context``, or a cached W = 1 context of its
``cu_seqlens`` or of B equal rows."""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from .context import KcpContext, build_context_kcp
from .partition import check_cu_seqlens

__all__ = ["packed_context"]

_CONTEXT_CACHE_SIZE = 32

_contexts: OrderedDict = OrderedDict()  # tuple(offsets) -> KcpContext (W = 1), least recently used first
_host_offsets: dict = {}  # id(tensor) -> (weakref, tensor._version, offsets): no device read for a tensor seen before


def _offsets_of(cu_seqlens, name: str) -> list[int]:
    """``cu_seqlens`` as Python ints. Reading a CUDA tensor waits for the GPU, so the result is kept for the tensor
    object while it lives and is not written to (the layers of one step pass the same tensor)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        return check_cu_seqlens(cu_seqlens, name)
    hit = _host_offsets.get(id(cu_seqlens))
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == cu_seqlens._version:
        return hit[2]
    cu = check_cu_seqlens(cu_seqlens, name)
    if len(_host_offsets) >= _CONTEXT_CACHE_SIZE:  # forget the tensors that are gone, else the oldest
        gone = [key for key, entry in _host_offsets.items() if entry[0]() is None]
        for key in gone or [next(iter(_host_offsets))]:
            del _host_offsets[key]
    _host_offsets[id(cu_seqlens)] = (weakref.ref(cu_seqlens), cu_seqlens._version, cu)
    return cu


def _single_rank_context(cu: list[int]) -> KcpContext:
    key = tuple(cu)
    ctx = _contexts.get(key)
    if ctx is None:
        ctx = _contexts[key] = build_context_kcp(cu)
        if len(_contexts) > _CONTEXT_CACHE_SIZE:
            _contexts.popitem(last=False)
    else:
        _contexts.move_to_end(key)
    return ctx


def packed_context(B, T, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None) -> KcpContext:
    """The context a call on ``[B, T, ...]`` tensors runs under: ``cp_context`` itself (checked against T), or the
    cached W = 1 context of ``cu_seqlens`` (B = 1) or of B documents of T tokens."""
    if cp_context is not None:
        if not isinstance(cp_context, KcpContext):
            raise TypeError(
                f"chunk_kda: cp_context must be a kda_kcp.KcpContext (kda_kcp.build_context_kcp), got {type(cp_context).__name__}"
            )
        if B != 1:
            raise ValueError(f"chunk_kda: with cp_context the tensors are this rank's shard [1, T_local, ...], got B = {B}")
        if T != cp_context.local_tokens:
            raise ValueError(f"chunk_kda: cp_context gives rank {cp_context.rank} {cp_context.local_tokens} local tokens "
                             f"(of {cp_context.num_tokens}), but the tensors have T = {T}; pass cp_context.shard(x)")
        if cu_seqlens is not None or cu_seqlens_cpu is not None:
            given = _offsets_of(cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens, "cu_seqlens")
            if given != cp_context.cu_seqlens:
                raise ValueError("chunk_kda: cu_seqlens differs from cp_context's offsets (pass either, or the same)")
        return cp_context
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("chunk_kda: cu_seqlens_cpu was given without cu_seqlens")
        return _single_rank_context([b * T for b in range(B + 1)])  # B documents, empty ones too when T = 0
    if B != 1:
        raise ValueError(f"chunk_kda: the batch size must be 1 with cu_seqlens (flatten the documents into one row), got B = {B}")
    if cu_seqlens_cpu is not None:
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and isinstance(cu_seqlens_cpu, torch.Tensor) \
                and cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"chunk_kda: cu_seqlens_cpu has {tuple(cu_seqlens_cpu.shape)} entries, cu_seqlens "
                             f"{tuple(cu_seqlens.shape)}; it must be cu_seqlens' host copy")
        cu = _offsets_of(cu_seqlens_cpu, "cu_seqlens_cpu")
        # a host cu_seqlens costs nothing to compare (a CUDA one would cost the synchronization the copy avoids)
        if not (isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.is_cuda) \
                and _offsets_of(cu_seqlens, "cu_seqlens") != cu:
            raise ValueError("chunk_kda: cu_seqlens_cpu holds other offsets than cu_seqlens; it must be cu_seqlens' "
                             "host copy")
    else:
        cu = _offsets_of(cu_seqlens, "cu_seqlens")
    if cu[-1] != T:
        raise ValueError(f"chunk_kda: cu_seqlens ends at {cu[-1]} but the tensors hold T = {T} tokens")
    return _single_rank_context(cu)
