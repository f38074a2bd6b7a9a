"""Which tensors share memory: what an output handed out, an input and a module's own
parameters and buffers may have in common (pure reads of storages, no CUDA work)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

__all__ = ["storage_of", "address_range", "shares_memory", "module_memory", "in_memory_of", "sharing_memory"]


def storage_of(t: torch.Tensor) -> Optional[int]:
    """The address of ``t``'s storage (None on the meta device, for an empty storage, and for
    a tensor subclass without storage)."""
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return None


def address_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` may touch: from its first element's address to past its last."""
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    return start, start + (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' storages are one (a view, the same tensor, or a detached one)."""
    return a.device == b.device and storage_of(a) is not None and storage_of(a) == storage_of(b)


def module_memory(func: Any) -> tuple[torch.Tensor, ...]:
    """The parameters and buffers of a graphed module (nothing for a function): an output
    viewing one is the module's own memory, not the graph's, and its version counter is
    theirs."""
    if not isinstance(func, torch.nn.Module):
        return ()
    return tuple(func.parameters()) + tuple(func.buffers())


def in_memory_of(t: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``t`` shares its storage with one of ``tensors`` (``module_memory``)."""
    return any(shares_memory(t, m) for m in tensors)


def sharing_memory(tensors: Sequence[Optional[torch.Tensor]]) -> frozenset:
    """The indices of the tensors (None and empty ones left out) whose storage another of
    them shares."""
    present = [(i, t) for i, t in enumerate(tensors) if t is not None and t.numel()]
    return frozenset(i for i, t in present if any(j != i and shares_memory(t, u) for j, u in present))

