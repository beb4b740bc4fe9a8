"""The KCP exchanges over torch.distributed: one all-gather of summaries per direction.

Each rank packs its published summaries (a K x K map and a K x V offset per head) into ``slots``
equally sized rows (the plan knows every rank's count, so the padding is agreed without talking) and
one all-gather hands every rank all of them. Gloo carries CPU tensors, NCCL CUDA tensors, on the
current stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gather_summaries", "summary_elements", "collective_device", "all_gather_flat"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def collective_device(group) -> torch.device:
    """The device tensors of ``group``'s collectives must live on (CUDA for NCCL, else CPU)."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group) -> torch.Tensor:
    """out[w * n:(w + 1) * n] = rank w's inp (n = inp.numel()), through one collective."""
    _all_gather(out, inp, group=group)
    return out


def summary_elements(num_heads: int, head_dim: int, value_dim: int) -> int:
    """Elements of one published summary: a K x K map and a K x V offset per head."""
    return num_heads * head_dim * (head_dim + value_dim)


def gather_summaries(maps, offsets, slots: int, world_size: int, group, buffer: torch.Tensor | None = None):
    """All-gather (maps [n, H, K, K], offsets [n, H, K, V]), n <= slots, from every rank.

    Returns (maps [W, slots, H, K, K], offsets [W, slots, H, K, V]). ``buffer`` (optional) is flat scratch
    of at least (1 + W) * slots * summary_elements elements in the summaries' dtype: send then receive.
    """
    n, H, K, _ = maps.shape
    V = offsets.shape[-1]
    per = summary_elements(H, K, V)
    total = (1 + world_size) * slots * per
    if buffer is None:
        buffer = maps.new_empty(total)
    send = buffer[: slots * per].view(slots, H, K, K + V)
    recv = buffer[slots * per : total]
    send[:n, ..., :K] = maps
    send[:n, ..., K:] = offsets
    send[n:] = 0  # padding rows are never read, but keep them defined
    if world_size == 1:
        recv.copy_(send.reshape(-1))
    else:
        all_gather_flat(recv, send.reshape(-1), group)
    both = recv.view(world_size, slots, H, K, K + V)
    return both[..., :K], both[..., K:]
