"""Parameters during warmup and capture: stand-ins, and the check that nothing else trains.

Warmup and capture run each callable's backward with ``torch.autograd.backward`` (reentrant
checkpoint refuses ``torch.autograd.grad``), which accumulates into every leaf it reaches
and runs that leaf's hooks. On the real parameters this would fire user hooks, DDP's
reducer and Megatron's grad-accumulation hooks during warmup, and *capture* them into the
backward graph. So while warmup and capture run, each trainable parameter of the graphed
modules is replaced, in its module, by a stand-in: a new leaf ``Parameter`` on the same
storage (the graphs read the real parameter's memory by address) that carries the same
Python attributes (Megatron's ``main_grad`` and flags) and no hooks. Autograd accumulates
into the stand-ins; the real parameters get their gradients at replay, in the graph or
through autograd, where their hooks run once per backward as in eager code.

A callable that trains a tensor the graph cannot see (a leaf requiring grad that is neither
a static input nor a parameter of a graphed module, e.g. a weight a function closes over)
would get its gradient accumulated into whatever ``.grad`` it had at capture, forever:
:class:`ForeignLeaves` finds such tensors in the last warmup pass and the capture refuses.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode

from .layout import describe

__all__ = ["StandIns", "ForeignLeaves"]


class StandIns:
    """Stand-ins for the trainable parameters of ``modules`` (shared parameters share one)."""

    def __init__(self, modules: Iterable[torch.nn.Module]):
        self.of: dict[int, torch.nn.Parameter] = {}  # id(real parameter) -> stand-in
        self.real: dict[int, torch.Tensor] = {}  # id(stand-in) -> real parameter
        self._slots: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
        seen_modules: set[int] = set()
        for module in modules:
            for sub in module.modules():
                if id(sub) in seen_modules:
                    continue
                seen_modules.add(id(sub))
                for name, p in sub._parameters.items():
                    if p is None or not p.requires_grad:
                        continue
                    if id(p) not in self.of:
                        stand_in = torch.nn.Parameter(p.detach(), requires_grad=True)
                        stand_in.__dict__.update(p.__dict__)
                        self.of[id(p)] = stand_in
                        self.real[id(stand_in)] = p
                    self._slots.append((sub, name, p))

    def __call__(self, params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The stand-ins of ``params`` (real parameters), in order."""
        return tuple(self.of[id(p)] for p in params)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Inside the block the modules hold the stand-ins; the real parameters come back
        on exit, also when the block raises."""
        try:
            for module, name, p in self._slots:
                module._parameters[name] = self.of[id(p)]
            yield
        finally:
            for module, name, p in self._slots:
                module._parameters[name] = p


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """The tensors in a torch function's arguments: nested tuples, lists and dicts (what
    torch functions take), without pytree's generality, which costs on every op."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class ForeignLeaves(TorchFunctionMode):
    """Records the leaves requiring grad that torch functions receive, other than ``allowed``."""

    def __init__(self, allowed: Iterable[torch.Tensor]):
        super().__init__()
        self.allowed = {id(t) for t in allowed}
        self.found: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in _tensors((args, kwargs)):
            if leaf.requires_grad and leaf.is_leaf:
                # A view made with grad off (weight.t() inside an autograd Function's
                # forward) is a leaf too: judge it by the tensor it views.
                base = leaf
                while base._base is not None:
                    base = base._base
                if id(base) not in self.allowed:
                    self.found.setdefault(id(base), base)
        return func(*args, **kwargs)

    def raise_if_any(self, name: str) -> None:
        if not self.found:
            return
        what = "; ".join(describe(t) for t in list(self.found.values())[:3])
        raise ValueError(
            f"make_graphed_callables: {name} uses {len(self.found)} tensor(s) that require grad "
            f"but are neither its inputs nor parameters of a graphed module ({what}). The "
            "graph would accumulate their gradient into whatever .grad they had at capture. "
            "Pass such a tensor as an input, make it a parameter of the module you graph, or "
            "set requires_grad=False on it."
        )
