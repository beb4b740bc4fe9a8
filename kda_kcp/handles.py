"""Handles: one-element int64 CPU tensors that name a KcpContext or WorkspaceKcp in torch.compile graphs
(kda_kcp.library passes them to its custom ops). The registry holds the objects weakly, so a handle keeps nothing
alive."""

from __future__ import annotations

import itertools
import weakref

import torch

__all__ = ["new_handle", "object_of"]

_objects: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_numbers = itertools.count(1)


def new_handle(obj) -> torch.Tensor:
    """A new handle naming ``obj`` (a KcpContext or WorkspaceKcp) in compiled graphs; the object keeps it."""
    number = next(_numbers)
    _objects[number] = obj
    return torch.full((1,), number, dtype=torch.int64)  # torch.full: half the host time of torch.tensor


def object_of(handle, what: str):
    if handle is None:
        return None
    obj = _objects.get(int(handle[0]))
    if obj is None:
        raise RuntimeError(
            f"kda_kcp: the {what} of this compiled call no longer exists; under torch.compile the {what} is passed by "
            "handle, so keep it alive until the call's backward has run"
        )
    return obj
