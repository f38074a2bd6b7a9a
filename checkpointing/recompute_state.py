"""What a recompute must get back from its forward: random streams and autocast state.

Two ways to get the random numbers back:

* eagerly, content snapshots of every stream (CPU and CUDA default generators and every
  tracker stream) are taken at the forward and copied back in for the recompute; the live
  streams are put back afterwards, so the recompute consumes nothing from them;
* inside a te_graph capture, the forward region and the recompute draw from a dedicated
  generator pair that ``rng.graph_streams`` prepared before capture and keeps in step at
  every replay.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

import rng
from rng import graph_streams


def _cuda_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _Autocast:
    """The autocast state of one device type, to be re-entered by the recompute."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.enabled = torch.is_autocast_enabled(device_type)
        self.dtype = torch.get_autocast_dtype(device_type)
        self.cache = torch.is_autocast_cache_enabled()

    def context(self) -> contextlib.AbstractContextManager:
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=self.cache)


class RecomputeState:
    """Captured at a checkpoint's forward; replays RNG and autocast for its recompute."""

    def __init__(self, tracker: Any):
        self.tracker = tracker
        self.region = None
        self.snapshot = None
        self.autocast = [_Autocast("cpu")]
        if torch.cuda.is_available():
            self.autocast.append(_Autocast("cuda"))
        if _cuda_capturing():
            self.region = graph_streams.capture_region()
            if self.region is None:
                raise RuntimeError(
                    "checkpoint() is being captured into a CUDA graph outside "
                    "te_graph.make_graphed_callables, so its recompute could not reproduce the "
                    "forward's random numbers. Graph the layer with "
                    "te_graph.make_graphed_callables(), which prepares the recompute streams."
                )

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Context for the checkpointed forward."""
        if self.region is not None:
            with graph_streams.streams_swapped(self.region.forward, self.tracker, _device()):
                yield
            return
        self.snapshot = rng.snapshot_streams(self.tracker)
        token = graph_streams.region_begin()
        yield
        graph_streams.region_end(token)

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        """Context for the recompute: the forward's random numbers and autocast state."""
        with contextlib.ExitStack() as stack:
            for autocast in self.autocast:
                stack.enter_context(autocast.context())
            if self.region is not None:
                stack.enter_context(
                    graph_streams.streams_swapped(self.region.backward, self.tracker, _device())
                )
                yield
                return
            live = rng.snapshot_streams(self.tracker)
            rng.restore_streams(self.tracker, self.snapshot)
            try:
                yield
            finally:
                rng.restore_streams(self.tracker, live)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
