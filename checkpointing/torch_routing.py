"""torch's own ``torch.utils.checkpoint.checkpoint`` inside CUDA graphs, made exact.

torch's checkpoint stashes the random state of the default generators at the forward
(``torch.cuda.get_rng_state``) and puts it back for the recompute (``set_rng_state``): a
host read and a host reset, which a graph cannot replay, so the recompute captured in a
backward graph would draw other dropout masks than the forward's replay (Hugging Face's
gradient checkpointing calls it with ``use_reentrant=False`` and its default
``preserve_rng_state=True``). While :func:`torch_checkpoint_routed` is active (te_graph
enters it around warmup and capture), a call of torch's checkpoint that preserves the random
state runs this package's recompute instead, with torch's semantics otherwise: the same
paths (reentrant or not), the forward and recompute contexts of ``context_fn``, and the
default generators restored (no tracker stream). Calls with ``preserve_rng_state=False`` or
``debug=True``, and reentrant calls where no input requires grad, keep torch's own code.

torch keeps its two paths in module globals that ``checkpoint()`` looks up at each call,
``CheckpointFunction`` (reentrant) and ``_checkpoint_without_reentrant_generator`` (a
generator entered before and after torch runs the function; private, torch 2.1-2.13,
positional arguments read from its signature); where either is missing, torch's own runs.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint

from .checkpoint import checkpoint
from .checks import contexts_from
from .non_reentrant import Recompute
from .recompute_state import RecomputeState

__all__ = ["torch_checkpoint_routed"]


class _DefaultStreamsOnly:
    """A tracker with no streams: the recompute restores the default generators alone, as
    torch's ``preserve_rng_state`` does."""

    @staticmethod
    def get_states() -> dict:
        return {}

    @staticmethod
    def set_states(states: dict) -> None:
        pass

    @staticmethod
    @contextlib.contextmanager
    def fork(name: str = "") -> Iterator[None]:
        raise RuntimeError("torch's checkpoint has no tracker streams to fork")
        yield


_DEFAULT_ONLY = _DefaultStreamsOnly()


def _reentrant(original: Any) -> type:
    class RoutedCheckpointFunction:
        """torch's reentrant path with this package's recompute."""

        @staticmethod
        def apply(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
            if not preserve_rng_state or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                return original.apply(function, preserve_rng_state, *args)
            return checkpoint(function, *args, use_reentrant=True, get_rng_state_tracker=lambda: _DEFAULT_ONLY)

    return RoutedCheckpointFunction


def _non_reentrant(original: Any) -> Any:
    named = [p for p in inspect.signature(original).parameters.values()
             if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    names = [p.name for p in named]

    def routed(*given: Any, **kwargs: Any) -> Iterator[None]:
        options = dict(zip(names, given))
        args = given[len(names):]
        for p in named:
            options.setdefault(p.name, kwargs.pop(p.name, p.default))
        if not options.get("preserve_rng_state", True) or options.get("debug", False):
            yield from original(*given, **kwargs)
            return
        forward_context, recompute_context = contexts_from(options.get("context_fn"))
        state = RecomputeState(_DEFAULT_ONLY)
        recompute = Recompute(options["fn"] if "fn" in options else given[0], args, kwargs, state, recompute_context)
        with forward_context or contextlib.nullcontext(), state.forward():
            with torch.autograd.graph.saved_tensors_hooks(recompute.pack, recompute.unpack):
                yield

    return routed


@contextlib.contextmanager
def torch_checkpoint_routed() -> Iterator[None]:
    """Inside: torch's checkpoint recomputes with this package's exact random streams."""
    originals = {name: getattr(torch_checkpoint, name, None)
                 for name in ("CheckpointFunction", "_checkpoint_without_reentrant_generator")}
    if any(value is None for value in originals.values()):
        yield
        return
    torch_checkpoint.CheckpointFunction = _reentrant(originals["CheckpointFunction"])
    torch_checkpoint._checkpoint_without_reentrant_generator = _non_reentrant(
        originals["_checkpoint_without_reentrant_generator"])
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(torch_checkpoint, name, value)
