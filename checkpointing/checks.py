"""Checks of ``checkpoint()``'s arguments, with messages that say what to pass.

Each runs before the checkpointed function or any RNG snapshot, so a bad call changes
nothing and fails where it is made, not inside Python's or torch's internals.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

import rng

_TRACKER_METHODS = ("get_states", "set_states", "fork")


def describe(value: object) -> str:
    """A short description of ``value`` for a message: its repr when short and simple
    (``5 (int)``), else its type (``a Tensor``)."""
    if isinstance(value, (bool, int, float, str, type(None))) and len(repr(value)) <= 40:
        return f"{value!r} ({type(value).__name__})"
    return f"a {type(value).__name__}"


def check_call(
    function: Any,
    args: tuple,
    *,
    use_reentrant: Any,
    distribute_saved_activations: Any,
    get_rng_state_tracker: Any,
    context_fn: Any,
) -> None:
    """Refuse a non-callable function, non-bool flags, a non-callable tracker getter or
    ``context_fn``, and Megatron's positional argument order."""
    if not callable(function):
        raise TypeError(
            f"checkpoint: the first argument must be the function to recompute, got "
            f"{describe(function)}, which cannot be called; pass it first: "
            "checkpoint(function, *args, ...)."
        )
    flags = {"use_reentrant": use_reentrant, "distribute_saved_activations": distribute_saved_activations}
    for name, value in flags.items():
        if not isinstance(value, bool):
            reads = f" (Python reads {value!r} as {bool(value)})" if isinstance(value, (int, float, str, type(None))) else ""
            raise TypeError(f"checkpoint: {name} must be True or False, got {describe(value)}; pass a bool{reads}.")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError(
            f"checkpoint: get_rng_state_tracker must be a function that returns the tracker, got "
            f"{describe(get_rng_state_tracker)}; pass the function, not its result: "
            "get_rng_state_tracker=rng.get_cuda_rng_tracker, or lambda: tracker."
        )
    if context_fn is not None and not callable(context_fn):
        raise TypeError(
            f"checkpoint: context_fn must be a function returning two context managers, got "
            f"{describe(context_fn)}; e.g. context_fn=lambda: (forward_context, recompute_context)."
        )
    if args and isinstance(args[0], bool) and any(isinstance(a, torch.Tensor) for a in args[1:]):
        raise TypeError(
            f"checkpoint({getattr(function, '__name__', 'function')}, {args[0]}, ...): the "
            "first argument after the function is a bool, which looks like Megatron's "
            "argument order checkpoint(function, distribute_saved_activations, *args). Here "
            "the options are keywords: checkpoint(function, *args, "
            "distribute_saved_activations=...). (A function whose first argument really is a "
            "bool: pass it by keyword.)"
        )


def tracker_from(getter: Callable[[], Any] | None, who: str = "checkpoint") -> Any:
    """The tracker ``getter`` returns (ours when ``getter`` is None), checked for
    ``get_states``, ``set_states`` and ``fork``; ``who`` names the caller in the error."""
    if getter is None:
        return rng.get_cuda_rng_tracker()
    tracker = getter()
    missing = [m for m in _TRACKER_METHODS if not callable(getattr(tracker, m, None))]
    if missing:
        raise TypeError(
            f"{who}: get_rng_state_tracker() returned {describe(tracker)}, which has no "
            f"{', '.join(missing)}; it must return an RNG tracker with get_states(), "
            "set_states() and fork() (ours: rng.get_cuda_rng_tracker(); Megatron's, apex's "
            "and Transformer Engine's work too)."
        )
    return tracker


def contexts_from(context_fn: Callable[[], Any] | None) -> tuple[Any, Any]:
    """``context_fn()``'s (forward, recompute) context managers; ``(None, None)`` without it."""
    if context_fn is None:
        return None, None
    contexts = context_fn()
    pair = isinstance(contexts, (tuple, list)) and len(contexts) == 2
    if not pair or not all(_is_context(c) for c in contexts):
        got = f"a {type(contexts).__name__} of {len(contexts)}" if isinstance(contexts, (tuple, list)) else describe(contexts)
        raise TypeError(
            f"checkpoint: context_fn() returned {got}; it must return a pair of "
            "context managers (forward_context, recompute_context), the first entered around "
            "the forward and the second around the recompute, e.g. lambda: "
            "(contextlib.nullcontext(), my_context())."
        )
    return contexts[0], contexts[1]


def _is_context(value: object) -> bool:
    return isinstance(value, contextlib.AbstractContextManager) or (
        hasattr(value, "__enter__") and hasattr(value, "__exit__")
    )
