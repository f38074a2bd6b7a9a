"""The live generator objects behind every random stream, and swapping them.

A layer draws from the device's default generator and from the tracker's named streams.
Graph-safe trackers keep one ``torch.Generator`` per stream (ours, Megatron-core's with
``use_cudagraphable_rng=True``, Transformer Engine's); the default generator's state can
be swapped with ``graphsafe_set_state``. Swapping generator *objects* is the one way to
redirect a stream that is legal while a CUDA graph is being captured.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch

from .states import default_generator

__all__ = ["DEFAULT_STREAM", "live_stream_generators", "streams_swapped"]

DEFAULT_STREAM = "<default>"
"""Key of the device's default generator among stream keys (tracker names otherwise)."""


def live_stream_generators(tracker: Any, device: torch.device) -> dict[str, torch.Generator]:
    """The live generator of every stream: the default generator and each tracker stream.

    Works with our tracker and with duck-typed graph-safe trackers, whose ``get_states()``
    returns the live generator references. Byte-tensor tracker states are left out: they
    are copied in and out by ``fork`` and cannot be drawn from inside a graph.
    """
    streams = {DEFAULT_STREAM: default_generator(device)}
    if tracker is None:
        return streams
    live = getattr(tracker, "live_generators", None)  # ours; duck-typed trackers lack it
    states = live() if live is not None else tracker.get_states()
    streams.update({n: s for n, s in states.items() if isinstance(s, torch.Generator)})
    return streams


def _replace_tracker_generators(tracker: Any, replacements: Mapping[str, torch.Generator]) -> dict:
    replace = getattr(tracker, "replace_generators", None)  # ours; duck-typed trackers lack it
    if replace is not None:
        return replace(replacements)
    # Duck-typed graph-safe trackers store whatever set_states() hands them: references.
    states = dict(tracker.get_states())
    previous = {name: states[name] for name in replacements}
    states.update(replacements)
    tracker.set_states(states)
    return previous


@contextlib.contextmanager
def streams_swapped(
    replacements: Mapping[str, torch.Generator], tracker: Any, device: torch.device
) -> Iterator[None]:
    """Inside the block, each named stream draws from the given generator instead.

    Swaps generator objects (``graphsafe_set_state`` for the default generator, the
    tracker's own dict for its streams), which is legal during capture; everything is
    put back on exit.
    """
    generator = default_generator(device)
    replacement = replacements.get(DEFAULT_STREAM)
    tracked = {k: g for k, g in replacements.items() if k != DEFAULT_STREAM}
    previous_default = generator.graphsafe_get_state() if replacement is not None else None
    if replacement is not None:
        generator.graphsafe_set_state(replacement)
    previous_tracked = _replace_tracker_generators(tracker, tracked) if tracked else None
    try:
        yield
    finally:
        if previous_tracked is not None:
            _replace_tracker_generators(tracker, previous_tracked)
        if previous_default is not None:
            generator.graphsafe_set_state(previous_default)
