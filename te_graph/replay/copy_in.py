"""Copy-in: a call's input goes into its static buffer unless it lies there already, and the
address arithmetic that decides it (no kernels where the caller passed the buffer itself)."""
from __future__ import annotations

import torch

from ..memory import address_range, shares_memory

__all__ = ["Slot", "overlap", "copy_in"]


class Slot:
    """A static buffer and what the per-call copy rule reads of it, read once: its address,
    strides and the address range of its storage."""

    __slots__ = ("tensor", "ptr", "stride", "lo", "hi")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.ptr = tensor.data_ptr()
        self.stride = tensor.stride()
        storage = tensor.untyped_storage()
        self.lo = storage.data_ptr()
        self.hi = self.lo + storage.nbytes()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is the buffer itself: the same address and strides (the strides are
        read only where the addresses match)."""
        return t.data_ptr() == self.ptr and t.stride() == self.stride


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share bytes: one storage, overlapping address ranges."""
    if not shares_memory(a, b):
        return False
    (a0, a1), (b0, b1) = address_range(a), address_range(b)
    return a0 < b1 and b0 < a1


def copy_in(slot: Slot, t: torch.Tensor) -> None:
    """Copy ``t`` into the static buffer unless it lies there already: the same address and
    the same strides (shape and dtype are checked by the layout; the strides are read only
    where the addresses match, so the common call pays nothing for them). A ``t`` starting
    inside the buffer's storage may overlap the buffer (a transposed view of it, an
    overlapping slice of one buffer): that copy goes through a temporary, since a copy
    between overlapping tensors races on the GPU and torch refuses only the cases it can
    prove."""
    if not slot.holds(t):
        slot.tensor.copy_(t.clone() if slot.lo <= t.data_ptr() < slot.hi else t)

