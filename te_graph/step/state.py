"""Everything a training step changes, as values to put back: the modules' parameters, their
``.grad`` (object and values) and ``main_grad``, the buffers, the optimizer's state and the
random streams, and the flag Transformer Engine sets on a weight whose gradient it wrote
into ``main_grad`` itself (``grad_added_to_main_grad``, gradient-accumulation fusion), which
DDP's grad hook reads to skip adding it again. Warmup leaves no trace through it, a failed capture puts it all back, and
the verifier compares the graph's step with the eager one through it."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

import rng

__all__ = ["StepState"]

_ADDED = "grad_added_to_main_grad"


def _tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_of(v)]
    return []


class StepState:
    """A snapshot of what a step of ``modules`` and ``optimizer`` changes."""

    def __init__(self, modules: Sequence[torch.nn.Module], optimizer: Optional[Any], tracker: Any):
        self.tracker = tracker
        # nn.Module's own methods: a wrapper may shadow them (megatron-core's DDP keeps its
        # gradient buffers as ``buffers``).
        self.params = [p for m in modules for p in torch.nn.Module.parameters(m)]
        self.buffers = [b for m in modules for b in torch.nn.Module.buffers(m)]
        self.streams = rng.snapshot_streams(tracker)
        with torch.no_grad():
            self.param_values = [p.detach().clone() for p in self.params]
            self.grads = [(p.grad, p.grad.detach().clone() if p.grad is not None else None) for p in self.params]
            self.main_grads = [(p, p.main_grad.detach().clone()) for p in self.params
                               if isinstance(p.__dict__.get("main_grad"), torch.Tensor)]
            self.buffer_values = [b.detach().clone() for b in self.buffers]
            self.flags = [(p, p.__dict__[_ADDED]) for p in self.params if _ADDED in p.__dict__]
            self.optimizer = optimizer
            self.optimizer_state = []
            if optimizer is not None:
                for state in optimizer.state.values():
                    self.optimizer_state += [(t, t.detach().clone()) for t in _tensors_of(state)]

    def restore(self) -> None:
        """Put every value back (the ``.grad`` objects too)."""
        rng.restore_streams(self.tracker, self.streams)
        with torch.no_grad():
            for p, value in zip(self.params, self.param_values):
                p.copy_(value)
            for p, (grad, value) in zip(self.params, self.grads):
                if grad is not None:
                    grad.copy_(value)
                p.grad = grad
            for p, value in self.main_grads:
                p.main_grad.copy_(value)
            for p, flag in self.flags:
                setattr(p, _ADDED, flag)
            for b, value in zip(self.buffers, self.buffer_values):
                b.copy_(value)
            for t, value in self.optimizer_state:
                t.copy_(value)

    def main_grad_tensors(self) -> list[torch.Tensor]:
        """The ``main_grad`` tensors the step accumulates into (DDP's buffer views)."""
        return [p.main_grad for p, _ in self.main_grads]

    def named(self) -> list[tuple[str, Optional[torch.Tensor]]]:
        """What the state holds now, named, for a comparison (parameters, their gradients,
        buffers, the optimizer's state tensors)."""
        named: list[tuple[str, Optional[torch.Tensor]]] = []
        named += [(f"parameter {i}", p.detach().clone()) for i, p in enumerate(self.params)]
        named += [(f"gradient of parameter {i}", None if p.grad is None else p.grad.detach().clone())
                  for i, p in enumerate(self.params)]
        named += [(f"main_grad of parameter {i}", p.main_grad.detach().clone()) for i, (p, _) in enumerate(self.main_grads)]
        named += [(f"buffer {i}", b.detach().clone()) for i, b in enumerate(self.buffers)]
        named += [(f"optimizer state tensor {i}", t.detach().clone()) for i, (t, _) in enumerate(self.optimizer_state)]
        return named
