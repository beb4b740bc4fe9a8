"""``build_context_kcp``: a packed batch's split over a process group, checked to agree on every rank."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .handles import new_handle
from .partition import LAYOUTS, check_cu_seqlens, partition_kcp
from .plan import KcpPlan, LocalPlan, build_plan
from . import validate
from .validate import check_positive_int

__all__ = ["KcpContext", "build_context_kcp"]


class KcpContext:
    """One rank's view of a packed batch split over a group (docs/design.md §3).

    Attributes: ``cu_seqlens`` (list of global offsets), ``layout``, ``group``, ``world_size``, ``rank``,
    ``pieces`` (this rank's (start, end) global ranges, local order), ``token_index`` (global position of
    every local token, int64, on the device of the cu_seqlens passed in), ``num_tokens`` (global T),
    ``local_tokens`` (``rank_tokens``: every rank's), ``plan`` (every rank's runs and exchange slots), ``local``
    (this rank's runs), ``host_group`` (where the ranks agree before an exchange, kda_kcp.agreement).
    """

    def __init__(self, cu: list[int], layout: str, group, world_size: int, rank: int, device, host_group=None,
                 fingerprint: list[int] | None = None):
        self.cu_seqlens = cu
        self.layout = layout
        self.group = group
        # where the ranks agree before each exchange (kda_kcp.agreement)
        self.host_group = host_group if host_group is not None or group is None else host_group_of(group)
        if fingerprint is not None:  # build_context_kcp has it from its agreement
            self._fingerprint = fingerprint
        self.world_size = world_size
        self.rank = rank
        self.parts = partition_kcp(cu, world_size, layout)
        self.pieces = self.parts[rank]
        self.plan: KcpPlan = build_plan(cu, self.parts)
        self.num_tokens = cu[-1]
        self.rank_tokens = [sum(e - s for s, e in pieces) for pieces in self.parts]  # every rank's local T
        self.local_tokens = self.rank_tokens[rank]
        self.local = LocalPlan(self.local_tokens, self.plan.rank_runs[rank])
        idx = [torch.arange(s, e, dtype=torch.long) for s, e in self.pieces]
        self.token_index = (torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)).to(device)
        self._index_on = {str(self.token_index.device): self.token_index}
        if self.token_index.is_cuda:  # the plan's chunk tables reach the GPU here, once
            self.local.device_tables(self.token_index.device)
        self._graph_handle = new_handle(self)  # names this context in torch.compile graphs (kda_kcp.library)
        # the document count as a shape, which a compiled graph reads as a size instead of a constant (the final
        # states' rows; kda_kcp.library)
        self._doc_count = torch.empty(self.num_docs, 0)

    def index_on(self, device) -> torch.Tensor:
        """token_index on ``device`` (copied there once, then cached)."""
        key = str(torch.device(device))
        if key not in self._index_on:
            self._index_on[key] = self.token_index.to(device)
        return self._index_on[key]

    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def fingerprint(self) -> list[int]:
        """``fingerprint`` of this context's cu_seqlens, layout and world size (made once)."""
        if "_fingerprint" not in self.__dict__:
            self._fingerprint = fingerprint(self.cu_seqlens, self.layout, self.world_size)
        return self._fingerprint

    def same_as(self, other: "KcpContext") -> bool:
        """Whether ``other`` is this rank's view of the same split (same cu_seqlens, layout, world size, rank)."""
        return other is self or (other.rank == self.rank and other.fingerprint == self.fingerprint)

    @staticmethod
    def _check_rows(what: str, x, rows: int, which: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} expects a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[0] != rows:
            raise ValueError(f"{what} expects a tensor with {which} = {rows} rows, got shape {tuple(x.shape)}")

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a global [T, ...] tensor, in local order (a new tensor)."""
        self._check_rows("shard", x, self.num_tokens, "T")
        return x.index_select(0, self.index_on(x.device))

    def unshard(self, x_local: torch.Tensor) -> torch.Tensor:
        """Scatter this rank's local tokens into a zero global [T, ...] tensor (other ranks' rows stay 0)."""
        self._check_rows("unshard", x_local, self.local_tokens, "the local T")
        out = x_local.new_zeros(self.num_tokens, *x_local.shape[1:])
        out[self.index_on(x_local.device)] = x_local
        return out

    def __repr__(self) -> str:
        return (
            f"KcpContext(layout={self.layout!r}, world_size={self.world_size}, rank={self.rank}, "
            f"T={self.num_tokens}, local_tokens={self.local_tokens}, docs={self.num_docs}, pieces={self.pieces})"
        )


validate.KcpContextClass = KcpContext  # what validate.check_context tests against


def fingerprint(cu: list[int], layout: str, world_size: int) -> list[int]:
    """Six ints that tell contexts apart: world size, layout, documents, T and two checksums of the offsets."""
    blob = ",".join(map(str, cu)).encode()
    return [world_size, LAYOUTS.index(layout), len(cu) - 1, cu[-1], zlib.crc32(blob), zlib.adler32(blob)]


_host_groups: dict = {}  # NCCL group -> its gloo companion


def host_group_of(group):
    """The group the ranks of ``group`` agree on with host tensors: ``group`` itself unless it is NCCL, else
    a gloo companion over the same ranks, made once per group (every member takes part in making it, here in
    build_context_kcp) and kept, so contexts built every step reuse it."""
    if dist.get_backend(group) != "nccl":
        return group
    if group not in _host_groups:
        _host_groups[group] = dist.new_group(
            ranks=dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True
        )
    return _host_groups[group]


def _checked(cu_seqlens, layout, world_size, W) -> list[int]:
    """cu_seqlens as ints, after this rank's checks of the arguments."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    cu = check_cu_seqlens(cu_seqlens)
    check_positive_int("world_size", world_size, none_ok=True)
    if world_size is not None and world_size != W:
        raise ValueError(f"world_size={world_size} does not match the group, which has {W} ranks")
    return cu


def build_context_kcp(cu_seqlens, group=None, layout: str = "contiguous", world_size: int | None = None) -> KcpContext:
    """Split the packed batch described by ``cu_seqlens`` over the ranks of ``group``.

    group=None means one rank (W = 1, no collective). ``world_size``, if given, must equal the group's
    size. With W > 1 every rank must call this with the same cu_seqlens and layout: one small host
    all-gather (kda_kcp.agreement) compares them, and a disagreement, or a bad argument on any one rank,
    raises the same ValueError on every rank instead of hanging later. For an NCCL group the first
    context also makes the group's gloo companion (kda_kcp.context.host_group_of), a collective of its ranks.
    """
    if group is None:
        W, rank = 1, 0
    else:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group was given but torch.distributed is not initialized")
        W, rank = dist.get_world_size(group), dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the group passed to build_context_kcp")
    if W == 1:
        cu, hosts, fp = _checked(cu_seqlens, layout, world_size, W), None, None
    else:
        from .agreement import agree_context  # it builds on KcpContext

        hosts = host_group_of(group)
        cu, fp = agree_context(hosts, W, rank, lambda: _checked(cu_seqlens, layout, world_size, W), layout)
    device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu")
    return KcpContext(cu, layout, group, W, rank, device, hosts, fp)
