"""The one hook between ``checkpoint()`` and a CUDA-graph capture in progress.

``te_graph`` runs each graphed callable eagerly during warmup and then captures it. While
it does, it sets :data:`CAPTURE_HOOK` to an object with one method, ``forward_region()``,
that ``checkpoint()`` enters around the forward of every checkpointed region:

* during the last warmup pass the hook only observes (it reads the host offsets of the
  live streams around the region to learn which streams the region draws from and where)
  and yields ``None``: the region then runs like any eager checkpoint;
* during a forward capture it yields, per stream key (``rng.DEFAULT_STREAM`` or a tracker
  stream name), the private generator that the region's *recompute* must draw from.
  ``checkpoint()`` swaps those in while the backward graph captures the recompute; the
  graphed callable sets them, before each backward replay, to where the live streams stood
  when the matching forward replayed.

Optionally the hook also has ``recomputed(outputs, inputs)``: a reentrant region calls it
in its backward, after the recompute and before backpropagating through it, with the
recomputed tensors and the fresh input leaves it made, so that te_graph's first warmup pass
can check which leaves that backward would accumulate into (the forward ran the region
under no_grad, so its autograd graph hides them).

The hook is read only in the forward, on the thread that runs it (the autograd engine
runs backwards on threads of its own, where a context variable set by the caller is not
visible): the region keeps the object it found for its backward.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import ContextManager, Iterator, Mapping, Optional, Protocol

import torch

__all__ = ["RegionHook", "CAPTURE_HOOK", "capture_hook_set"]


class RegionHook(Protocol):
    """What a graph capture in progress offers ``checkpoint()``."""

    def forward_region(self) -> ContextManager[Optional[Mapping[str, torch.Generator]]]:
        """Wraps the forward of one checkpointed region; yields ``None`` (run eagerly) or
        the generators its recompute draws from, per stream key."""
        ...

    # Optional: recomputed(outputs: list[Tensor], inputs: list[Tensor]) -> None (above).


CAPTURE_HOOK: ContextVar[Optional[RegionHook]] = ContextVar("checkpointing_capture_hook", default=None)


@contextlib.contextmanager
def capture_hook_set(hook: Optional[RegionHook]) -> Iterator[None]:
    """Make ``hook`` the capture hook inside the block."""
    token = CAPTURE_HOOK.set(hook)
    try:
        yield
    finally:
        CAPTURE_HOOK.reset(token)
