"""The inputs a graphed callable updates in place, found and put back around graphing."""
from __future__ import annotations

from typing import Sequence

import torch

from .. import compat

__all__ = ["InputUpdates"]


class InputUpdates:
    """Inputs a callable updates in place (a KV cache, a step counter, statistics passed
    in), found in the first warmup pass by their version counters.

    Warmup runs on the sample tensors themselves (they are the static buffers), so each
    watched graph's inputs are copied before its first forward and the updated ones are
    put back when capture ends: graphing leaves the samples as they were. Updates that do
    not go through torch's in-place ops (``x.data.add_``, a custom kernel writing into an
    input) bump no version counter and are not seen.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def watch(self, inputs: Sequence[torch.Tensor]) -> "_Watch":
        """Call before the forward; ``close()`` after it gives the updated inputs' indices."""
        return _Watch(self, inputs)

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, saved in reversed(self._saved):
                tensor.copy_(saved)


class _Watch:
    def __init__(self, owner: InputUpdates, inputs: Sequence[torch.Tensor]):
        self._owner = owner
        self._inputs = tuple(inputs)
        self._versions = [compat.version_of(t) for t in self._inputs]
        self._copies = [t.detach().clone() for t in self._inputs]

    def close(self) -> tuple[int, ...]:
        updated = tuple(
            i for i, t in enumerate(self._inputs) if compat.version_of(t) != self._versions[i]
        )
        self._owner._saved.extend((self._inputs[i], self._copies[i]) for i in updated)
        self._copies = []
        return updated
