"""What the backward running now will do: the autograd engine's privates (part of ``compat``)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch


def accumulate_grad_node(leaf: torch.Tensor) -> Any:
    """A leaf's gradient accumulator node (the way torch's own docs and DDP reach it: the
    first next function of a view's grad_fn). Keep a reference: the node is made on demand
    and the leaf holds it weakly."""
    with torch.enable_grad():
        return leaf.view_as(leaf).grad_fn.next_functions[0][0]


_ACCUMULATE_GRAD = type(accumulate_grad_node(torch.zeros((), requires_grad=True)))


def is_accumulate_grad(node: Any) -> bool:
    """Whether an autograd node is a leaf's gradient accumulator, whose ``variable`` is the
    leaf (a custom Function's node may carry an attribute of that name too)."""
    return type(node) is _ACCUMULATE_GRAD


# ``torch._C._will_engine_execute_node`` (private, torch >= 2.0; torch/utils/checkpoint.py uses it
# to stop recompute early): whether the backward running now will execute a node. A
# backward asked only for some tensors' gradients (``torch.autograd.grad``,
# ``backward(inputs=...)``) executes only the nodes on the way to them.
engine_will_execute: Callable[[Any], bool] = getattr(torch._C, "_will_engine_execute_node", lambda node: True)


def _captured_or_executed(node: Any) -> tuple[bool, bool]:
    """``(captured, executed)`` for ``node``, a leaf's accumulator, in the backward running
    now: ``backward(inputs=...)`` runs it, ``torch.autograd.grad`` captures the leaf's
    gradient instead. For a captured leaf ``_will_engine_execute_node`` raises instead of
    answering (torch >= 2.0, engine.cpp: "A leaf node was passed to _will_engine_execute_node
    but we are currently running autograd.grad()"): that refusal means captured."""
    try:
        return False, engine_will_execute(node)
    except RuntimeError as error:
        if "autograd.grad" in str(error):
            return True, False
        raise


def engine_asks_for(leaf: torch.Tensor) -> bool:
    """Whether the backward running now asks for ``leaf``'s gradient (runs its accumulator
    or captures it)."""
    return any(_captured_or_executed(accumulate_grad_node(leaf)))


def engine_captures(nodes: Sequence[Any]) -> bool:
    """Whether the backward running now is a ``torch.autograd.grad`` that captures the
    gradient of a leaf among those whose accumulators are ``nodes`` (it hands them to its
    caller, who keeps them). One query where the first node will execute (a full backward,
    or ``backward(inputs=...)`` naming it: neither captures anything)."""
    captured, executed = _captured_or_executed(nodes[0])
    if captured or executed:
        return captured
    return any(_captured_or_executed(node)[0] for node in nodes[1:])


def after_this_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward running now has finished (the engine's
    ``queue_callback``, which DDP and FSDP use too); an error it raises leaves that backward."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# ``torch._C._current_graph_task_id`` (private, torch >= 2.0; torch/utils/checkpoint.py uses it
# for non-reentrant checkpoints): the id of the backward running on this thread, -1 outside one.
graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def in_backward() -> bool:
    """Whether this thread runs inside a backward (an activation recompute, for one)."""
    return graph_task_id() >= 0


# The saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, ``save_on_cpu``) are a
# per-thread stack: ``torch._C._autograd._top_saved_tensors_default_hooks``, ``_push_...`` and
# ``_pop_saved_tensors_default_hooks`` (private, torch >= 2.1; torch/autograd/graph.py pushes and
# pops through them). Where torch lacks them, none are seen and none are taken off.
_autograd = torch._C._autograd
_top_hooks = getattr(_autograd, "_top_saved_tensors_default_hooks", None)
_push_hooks = getattr(_autograd, "_push_saved_tensors_default_hooks", None)
_pop_hooks = getattr(_autograd, "_pop_saved_tensors_default_hooks", None)


def saved_tensor_hooks() -> Any:
    """The innermost active default ``(pack, unpack)`` pair (the one autograd packs through), or None."""
    return _top_hooks(False) if _top_hooks is not None else None


@contextlib.contextmanager
def saved_tensor_hooks_off() -> Iterator[None]:
    """Autograd saves as with no saved-tensor hooks inside; the stack is pushed back as it was
    on the way out (hooks pushed inside must be popped inside, as every context does)."""
    taken = []
    if _push_hooks is not None and _pop_hooks is not None:
        while (top := saved_tensor_hooks()) is not None:
            _pop_hooks()
            taken.append(top)
    try:
        yield
    finally:
        for pack, unpack in reversed(taken):
            _push_hooks(pack, unpack)
