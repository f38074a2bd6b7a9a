"""What a recompute must get back from its forward: random streams and autocast state
(torch's, and Transformer Engine's FP8 autocast where TE is in use: ``te_fp8``).

Two ways to get the random numbers back:

* eagerly, content snapshots of every stream (CPU and CUDA default generators and every
  tracker stream) are taken at the forward and copied back in for the recompute; the live
  streams are put back afterwards, so the recompute consumes nothing from them;
* inside a te_graph capture, the forward draws from the live streams exactly as eager code
  does, and the recompute draws from private generators that the capture hook
  (``checkpointing.capture_hook``) hands out and that te_graph keeps in step with the
  forward at every replay.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

import rng

from .capture_hook import CAPTURE_HOOK
from .te_fp8 import TEFP8State

_OUTSIDE_TE_GRAPH = (
    "checkpoint() is being captured into a CUDA graph without te_graph's capture hook, so "
    "its recompute could not reproduce the forward's random numbers. Either the graph is "
    "captured outside te_graph.make_graphed_callables (graph the layer with it instead), or "
    "a checkpoint() runs inside another checkpointed region's recompute (nested "
    "checkpoints are not supported inside graphs: checkpoint the outer region only)."
)


def cuda_stream_capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing (False without CUDA, where
    torch's own test raises)."""
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
        self.recompute_generators = None  # set during a te_graph capture
        self.snapshot = None  # set when the forward runs eagerly
        self.hook = None  # the capture hook the forward ran under, if any
        self.te_fp8 = TEFP8State()
        self.autocast = [_Autocast("cpu")]
        if torch.cuda.is_available():
            self.autocast.append(_Autocast("cuda"))

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Context for the checkpointed forward."""
        hook = CAPTURE_HOOK.get()
        if hook is None:
            if cuda_stream_capturing():
                raise RuntimeError(_OUTSIDE_TE_GRAPH)
            self.snapshot = rng.snapshot_streams(self.tracker)
            with self.te_fp8.forward():
                yield
            return
        self.hook = hook
        with hook.forward_region() as generators, self.te_fp8.forward():
            self.recompute_generators = generators
            if generators is None:  # the hook only observes: an eager region
                self.snapshot = rng.snapshot_streams(self.tracker)
            yield

    def recomputed(self, outputs: list, inputs: list) -> None:
        """After a reentrant recompute, before its backward: tell the capture hook the
        forward ran under (if it listens) what the recompute built."""
        listener = getattr(self.hook, "recomputed", None)
        if listener is not None:
            listener(outputs, inputs)

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        """Context for the recompute: the forward's random numbers and autocast state."""
        with contextlib.ExitStack() as stack:
            for autocast in self.autocast:
                stack.enter_context(autocast.context())
            stack.enter_context(self.te_fp8.recompute())
            if self.recompute_generators is not None:
                device = torch.device("cuda", torch.cuda.current_device())
                stack.enter_context(rng.streams_swapped(self.recompute_generators, self.tracker, device))
                yield
                return
            live = rng.snapshot_streams(self.tracker)
            rng.restore_streams(self.tracker, self.snapshot)
            try:
                yield
            finally:
                rng.restore_streams(self.tracker, live)
