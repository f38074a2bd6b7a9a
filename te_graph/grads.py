"""Where gradients go while a backward is captured and replayed.

Inputs: during a captured backward every static input's ``.grad`` is set to None, the
backward runs through ``torch.autograd.backward`` (reentrant checkpoint refuses
``torch.autograd.grad``), and the new ``.grad``s are the static grad inputs; the old
values are put back afterwards.

Parameters (``accumulate_grads_in_graph=True``): each parameter's ``.grad`` is a
persistent buffer at a fixed address, and the captured backward accumulates into it
(autograd's in-place ``grad += new``), so no per-parameter accumulation runs outside the
graph and no grad handed to autograd aliases graph memory (PyTorch issue 181723). Graphs
that share a parameter share its buffer. ``zero_grad(set_to_none=True)`` and grads
assigned by the user are handled before each backward replay.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Iterator, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

_grad_of = operator.attrgetter("grad")

# Keyed by identity: a plain WeakKeyDictionary would compare tensors with ``==``.
_buffers = WeakIdKeyDictionary()


def grad_buffer(param: torch.Tensor) -> torch.Tensor:
    """The persistent buffer ``param.grad`` is accumulated into by every graph."""
    buffer = _buffers.get(param)
    if buffer is None:
        buffer = param.grad if param.grad is not None else torch.zeros_like(param)
        _buffers[param] = buffer
    return buffer


@contextlib.contextmanager
def grads_redirected(
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] = (),
    buffers: Sequence[torch.Tensor | None] | None = None,
) -> Iterator[None]:
    """Inside: inputs' ``.grad`` is None and each param's is its buffer (None if no buffers).

    Everything is put back on exit, also when the block raises.
    """
    saved_inputs = [t.grad for t in inputs]
    saved_params = [p.grad for p in params]
    buffers = buffers if buffers is not None else [None] * len(params)
    try:
        for t in inputs:
            t.grad = None
        for p, b in zip(params, buffers):
            p.grad = b
        yield
    finally:
        for t, g in zip(inputs, saved_inputs):
            t.grad = g
        for p, g in zip(params, saved_params):
            p.grad = g


class ParamGrads:
    """The parameters one backward graph accumulates into, and their buffers."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = tuple(params)
        self.buffers = tuple(grad_buffer(p) for p in self.params)

    def prepare(self) -> None:
        """Before a backward replay: make each ``param.grad`` its buffer, keeping its value.

        A grad set to None since (``zero_grad(set_to_none=True)``) starts from zero; a
        tensor the user assigned is copied in. The common case costs one identity check
        per parameter.
        """
        params, buffers = self.params, self.buffers
        if all(map(operator.is_, map(_grad_of, params), buffers)):
            return
        stale = [i for i in range(len(params)) if params[i].grad is not buffers[i]]
        zeroed = [buffers[i] for i in stale if params[i].grad is None]
        if zeroed:
            torch._foreach_zero_(zeroed)
        for i in stale:
            grad = params[i].grad
            if grad is not None:
                buffers[i].copy_(grad)
            params[i].grad = buffers[i]
