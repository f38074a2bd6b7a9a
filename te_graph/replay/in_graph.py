"""The check of a backward in which graphs added parameter gradients to ``.grad`` themselves
(the in-graph path, ``grads``): nothing else adds to those ``.grad``s in that backward.

Eager autograd sums every use of a parameter before adding the sum to ``.grad``. The
in-graph path adds its call's part on its own, so a second use in the same backward (a
regulariser in the loss, the parameter passed to the call as an input, the graphs of
another make_graphed_callables call, a second call of the same layer) would be added apart
from it: another rounding. The parameters are edges of the call's autograd node (so that
``torch.autograd.grad`` and ``backward(inputs=...)`` reach them), so the engine cannot say
beforehand whether something else reaches them. Instead:

* a second in-graph backward of a parameter in the same backward is refused before its
  replay (a set per backward; the first call's addition is in ``.grad`` by then);
* autograd's own addition moves ``.grad``'s version counter, which a graph's replay never
  does: at the end of the backward, a moved counter is refused.
"""
from __future__ import annotations

import operator
import threading
import weakref
from typing import Any

import torch

from .. import compat

__all__ = ["before_in_graph", "after_in_graph"]

_REACHED = (
    "{name}: this backward reaches parameter {param} by another way too (it is used outside the "
    "graphed call, passed to it as an input, read by the graphs of another make_graphed_callables "
    "call, or by another call of the same graphs in this backward): the graph adds its gradient to "
    ".grad on its own and autograd adds the other use's apart, where eager autograd sums the two "
    "first (a different rounding){after}. Pass accumulate_grads_in_graph=False to "
    "make_graphed_callables (every parameter gradient then goes through autograd), or graph the "
    "callables sharing a parameter in one make_graphed_callables call."
)
_AFTER = " (the .grad this backward left is not eager's: zero the gradients before training on)"


class _Backward:
    """What the in-graph calls of one backward added: the parameters, and each call's
    ``.grad`` tensors with their version counters right after its replay. A backward that
    fails before its end leaves its book unchecked, dropped a few backwards later."""

    __slots__ = ("params", "calls")

    def __init__(self) -> None:
        self.params: set[int] = set()
        self.calls: list[tuple[Any, tuple, tuple]] = []


_lock = threading.Lock()  # a backward's nodes may run on the calling thread and a device thread
_running: dict[int, _Backward] = {}  # per backward running (its graph task id); most hold one


def before_in_graph(runner: Any) -> None:
    """Before ``runner``'s in-graph backward: refused where a call of this same backward
    already added one of its parameters' gradients in a graph."""
    task = compat.graph_task_id()
    ids = runner.accumulated_ids
    with _lock:
        book = _running.get(task)
        if book is None:
            if len(_running) > 4:  # books of backwards that failed before their end (nested ones run too)
                _running.pop(next(iter(_running)), None)
            book = _running[task] = _Backward()
            compat.after_this_backward(lambda: _check(task))
        clash = not book.params.isdisjoint(ids)
        if not clash:
            book.params.update(ids)
    if clash:
        index = next(i for i, p in enumerate(ids) if p in book.params)
        raise RuntimeError(_REACHED.format(name=runner.name, param=parameter_name(runner, index), after=_AFTER))


def after_in_graph(runner: Any) -> None:
    """After ``runner``'s in-graph backward: its parameters' ``.grad``s as they are now."""
    grads = tuple(map(_grad, runner.accumulated))
    entry = (weakref.ref(runner), grads, _versions(grads))
    with _lock:
        book = _running.get(compat.graph_task_id())
        if book is not None:
            book.calls.append(entry)


def _versions(grads: tuple) -> tuple:
    """Each ``.grad``'s version counter, -1 where a parameter has none (eager replay)."""
    return tuple(-1 if g is None else compat.version_of(g) for g in grads)


_grad = operator.attrgetter("grad")


def _check(task: int) -> None:
    with _lock:
        book = _running.pop(task, None)
    for runner_ref, grads, versions in book.calls if book is not None else ():
        runner = runner_ref()
        if runner is None:
            continue
        if all(map(operator.is_, map(_grad, runner.accumulated), grads)) and _versions(grads) == versions:
            continue
        index = next(i for i, (p, g, v) in enumerate(zip(runner.accumulated, grads, versions))
                     if p.grad is not g or (g is not None and compat.version_of(g) != v))
        raise RuntimeError(_REACHED.format(name=runner.name, param=parameter_name(runner, index), after=_AFTER))


def parameter_name(runner: Any, index: int) -> str:
    """The name of ``runner.accumulated[index]`` in the graphed module, else its shape."""
    p = runner.accumulated[index]
    module = runner._module
    names = {id(q): n for n, q in module.named_parameters()} if isinstance(module, torch.nn.Module) else {}
    return repr(names.get(id(p), f"of shape {tuple(p.shape)}"))
