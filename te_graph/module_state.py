"""Module buffers across warmup and capture.

Warmup runs each module several times; buffers that its forward updates in place (running
statistics, step counters, an MoE router's expert bias) would keep those updates. They are
saved before warmup and copied back afterwards, so graphing leaves the model as it was;
the captured graph then updates them in place at every replay, as eager calls do.

A forward that *reassigns* a buffer (``self.count = self.count + 1``) cannot be replayed: the
graph writes the new value into memory the module no longer points to, and the module's
attribute never moves again. That is refused, with the fix.
"""
from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["ModuleBuffers"]


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
                for name, buffer in sub._buffers.items():
                    if buffer is not None:
                        qualified = f"{prefix}.{name}" if prefix else name
                        self._slots.append((where, sub, name, qualified, buffer))
        self._saved = [b.detach().clone() for *_, b in self._slots]

    def check_not_reassigned(self) -> None:
        """Raise if a forward replaced a buffer instead of updating it in place."""
        for where, module, name, qualified, buffer in self._slots:
            if module._buffers.get(name) is not buffer:
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
                module._buffers[name] = buffer
                buffer.copy_(saved)
