"""The backward of a call whose loss leaves some outputs out, exact.

A backward graph is captured with a gradient for every differentiable output. Where a loss
leaves one out (attention weights only logged, an entropy returned beside the hidden
states), eager autograd skips that output's part of the backward, while pushing zeros
through it could turn into NaN (a log or a square root at zero). Such a call's backward is
computed as eager code computes it: the forward runs again eagerly, from the call's own
static inputs and from where its random streams stood at its forward replay (recorded on
the call), on stand-ins of the parameters, and autograd differentiates only the outputs
that got a gradient. Module buffers the forward updates are put back afterwards, so the
rerun leaves no trace. Gradients then go where the graph's would have: input gradients
back through the call's node, parameter gradients through autograd or into ``.grad``.
It costs one eager forward and backward of the callable, at those calls only.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from ..capture.parameters import StandIns
from .runner import IN_GRAPH, THROUGH_AUTOGRAD

__all__ = ["stream_positions", "backward_recomputed", "refuse_rerun"]

_REFUSED = (
    "{name}: output {index} got no gradient in this backward (the loss does not use it); a call like "
    "that is differentiated by rerunning its forward eagerly, which te_graph does not do for graphs of "
    "{what}. Use every differentiable output in the loss, or return only the outputs you use (detach "
    "the others inside the callable)."
)


def refuse_rerun(runner: Any, missing: int) -> None:
    """Refused, graphs and eager replay alike: a call leaving output ``missing`` out, where
    an eager rerun of its forward would not leave the module as the graph does (FP8 amax
    history, weight-gradient queues)."""
    if runner.spec.fp8 or runner.has_wgrad:
        what = "FP8 (the rerun would record another amax)" if runner.spec.fp8 else \
            "modules that delay their weight gradients (backward_dw)"
        raise RuntimeError(_REFUSED.format(name=runner.name, index=missing, what=what))


def stream_positions(generators: Sequence[torch.Generator]) -> tuple:
    """Where each generator stands now: ``(generator, seed, offset)``."""
    return tuple((g, g.initial_seed(), g.get_offset()) for g in generators)


@contextlib.contextmanager
def _streams_at(positions: tuple) -> Iterator[None]:
    """Inside: each generator stands where ``positions`` say; put back on exit."""
    now = stream_positions([g for g, _, _ in positions])
    try:
        for g, seed, offset in positions:
            g.manual_seed(seed)
            g.set_offset(offset)
        yield
    finally:
        for g, seed, offset in now:
            g.manual_seed(seed)
            g.set_offset(offset)


def backward_recomputed(runner: Any, invocation: Any, grads: tuple, asked: Any) -> tuple:
    """The call's input gradients and the parameter gradients this backward asks for
    (``Runner._asked``), computed by an eager rerun of its forward (see the module
    docstring): handed to autograd, or added to ``.grad`` on the in-graph path."""
    spec, graph = runner.spec, runner.graph
    module = spec.func if isinstance(spec.func, torch.nn.Module) else None
    params = graph.param_grads.params if graph.param_grads is not None else ()
    wanted = [True] * len(params) if asked in (IN_GRAPH, THROUGH_AUTOGRAD) else list(asked)
    stand = StandIns([module], only=params) if module is not None and any(wanted) else None
    inputs = [t.detach().requires_grad_(t.requires_grad) for t in runner.static_inputs]
    buffers = list(module.buffers()) if module is not None else []
    kept = [b.clone() for b in buffers]
    args, kwargs = spec.layout.unflatten(inputs)
    with torch.enable_grad(), _streams_at(invocation.start), stand.installed() if stand else contextlib.nullcontext():
        outputs = runner.output.tensors_of(spec.call(*args, **kwargs))
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        leaves = [t for t in inputs if t.requires_grad]
        stand_ins = [s for s, w in zip(stand(params), wanted) if w] if stand is not None else []
        found = torch.autograd.grad([o for o, _ in pairs], leaves + stand_ins, [g for _, g in pairs],
                                    allow_unused=True) if pairs and (leaves or stand_ins) else ()
    with torch.no_grad():
        for b, value in zip(buffers, kept):
            b.copy_(value)
    found = iter(found)
    input_grads = tuple(next(found) if t.requires_grad else None for t in inputs)
    param_grads = [next(found) if w else None for w in wanted]
    for p in runner.fused_params:
        p.grad_added_to_main_grad = True  # as Transformer Engine's backward sets it
    if asked is THROUGH_AUTOGRAD:
        return input_grads + tuple(param_grads)
    if asked is not IN_GRAPH:
        return input_grads + (None,) + tuple(param_grads)
    with torch.no_grad():
        for p, g in zip(params, param_grads):
            if g is None:
                continue  # this backward gives it none: eager autograd leaves its .grad alone
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)  # eager autograd's accumulation
    return input_grads + (None,) * len(runner.edges)
