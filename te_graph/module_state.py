"""State the callables update in place, across warmup and capture: module buffers and
inputs.

Warmup runs each module several times; buffers that its forward updates in place (running
statistics, step counters, an MoE router's expert bias) would keep those updates. They are
saved before warmup and copied back afterwards, so graphing leaves the model as it was;
the captured graph then updates them in place at every replay, as eager calls do.

A forward that *reassigns* a buffer (``self.count = self.count + 1``) cannot be replayed: the
graph writes the new value into memory the module no longer points to, and the module's
attribute never moves again. That is refused, with the fix.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from . import compat

__all__ = ["ModuleBuffers", "InputUpdates"]


class ModuleBuffers:
    """The buffers of ``modules``, saved so warmup and capture leave no trace in them."""

    def __init__(self, modules: Iterable[torch.nn.Module], names: Iterable[str]):
        # (callable's name, owning module, buffer name there, qualified name, buffer)
        self._slots: list[tuple[str, torch.nn.Module, str, str, torch.Tensor]] = []
        seen: set[int] = set()
        for module, where in zip(modules, names):
            for prefix, sub in module.named_modules():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                for name, buffer in compat.buffer_slots(sub).items():
                    if buffer is not None:
                        qualified = f"{prefix}.{name}" if prefix else name
                        self._slots.append((where, sub, name, qualified, buffer))
        self._saved = [b.detach().clone() for *_, b in self._slots]

    def check_not_reassigned(self) -> None:
        """Raise if a forward replaced a buffer instead of updating it in place."""
        for where, module, name, qualified, buffer in self._slots:
            if compat.buffer_slots(module).get(name) is not buffer:
                raise ValueError(
                    f"make_graphed_callables: the forward of {where} reassigns its buffer "
                    f"{qualified!r} (like `self.{name} = self.{name} + 1`); a graph cannot replay "
                    "that: it would write the new value where the module no longer looks. Update "
                    f"the buffer in place instead (`self.{name}.add_(1)`, `.copy_(...)`)."
                )

    def restore(self) -> None:
        """Put every buffer object back in its module and copy its saved value into it."""
        with torch.no_grad():
            for (_, module, name, _, buffer), saved in zip(self._slots, self._saved):
                compat.buffer_slots(module)[name] = buffer
                buffer.copy_(saved)


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
