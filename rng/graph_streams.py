"""RNG bookkeeping for activation recompute inside CUDA graphs.

Why this exists. A captured kernel reads its Philox seed and offset from device memory
that the graph refreshes, at every replay, from the *host-side* state of each generator
registered with it; the replay then advances that host state by the graph's total
consumption. A recompute captured in a backward graph therefore draws from wherever its
generator stands when the backward replays, which is not where the forward stood.
Restoring a live reference (what Transformer Engine and Megatron-core do) does not help:
the reference has advanced with the stream.

The scheme. Every checkpointed region of a graphed callable gets, *before capture*, a
pair of dedicated generators per stream it draws from (the default generator and each
tracker stream): one swapped in while the forward graph captures the region, one while
the backward graph captures its recompute. Both start at intra-graph offset 0 and share a
seed, so they produce the same numbers for the same host offset. At each forward replay
the engine records the forward generators' host offsets (a host read, no sync); before the
matching backward replay it sets the backward generators to those offsets. The record
lives with the invocation, so many forwards before their backwards, backwards in another
order and ``retain_graph`` re-runs all replay the right numbers.

Seeds are derived from the live stream's seed, the callable's ordinal and the region index,
so masks differ between layers (and between per-microbatch graphs), advance from step to
step, keep their tensor-parallel meaning (a default-stream region is identical on every TP
rank, a ``'model-parallel-rng'`` region differs) and are the same run after run.

Which streams a region uses is learned in the last warmup iteration, from the host offsets
of the live generators around each region (warmup runs the same code eagerly).
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

from .states import default_generator

__all__ = [
    "DEFAULT_STREAM",
    "live_stream_generators",
    "streams_swapped",
    "RegionLog",
    "recording_regions",
    "region_begin",
    "region_end",
    "capture_region",
    "RecomputeStreams",
    "GraphRNG",
    "next_graph_ordinal",
    "reset_graph_ordinals",
]

DEFAULT_STREAM = "<default>"
"""Key of the device's default generator among the stream keys (tracker names otherwise)."""


def live_stream_generators(tracker: Any, device: torch.device) -> dict[str, torch.Generator]:
    """The live generator objects of every stream: the default generator and the tracker's.

    Works with our tracker and with duck-typed graph-safe trackers (Megatron-core,
    Transformer Engine), whose ``get_states()`` returns the live generator references.
    Byte-tensor tracker states cannot be used inside a graph and are left out.
    """
    streams = {DEFAULT_STREAM: default_generator(device)}
    if tracker is None:
        return streams
    live = getattr(tracker, "_live_generators", None)
    states = live() if live is not None else tracker.get_states()
    streams.update({n: s for n, s in states.items() if isinstance(s, torch.Generator)})
    return streams


def _replace_tracker_generators(tracker: Any, replacements: Mapping[str, torch.Generator]) -> dict:
    replace = getattr(tracker, "_replace_generators", None)
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

    Swaps generator *objects* (``graphsafe_set_state``), which is legal during capture.
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


# -- warmup: which streams does each region draw from? -------------------------------------
class RegionLog:
    """Streams drawn from by each checkpointed region, and by the code around them."""

    def __init__(self, streams: Mapping[str, torch.Generator]):
        self._streams = dict(streams)
        self._start = self._offsets()
        self._inside = dict.fromkeys(self._streams, 0)
        self.regions: list[tuple[str, ...]] = []
        self.outside: tuple[str, ...] = ()

    def _offsets(self) -> dict[str, int]:
        return {k: g.get_offset() for k, g in self._streams.items()}

    def _close(self) -> None:
        end = self._offsets()
        self.outside = tuple(
            k for k in self._streams if end[k] - self._start[k] - self._inside[k] > 0
        )


_recording: RegionLog | None = None


@contextlib.contextmanager
def recording_regions(tracker: Any, device: torch.device) -> Iterator[RegionLog]:
    """Record the streams used by regions (and outside them) while the block runs eagerly."""
    global _recording
    if _recording is not None:
        raise RuntimeError("rng.recording_regions() does not nest.")
    log = RegionLog(live_stream_generators(tracker, device))
    _recording = log
    try:
        yield log
    finally:
        _recording = None
        log._close()


def region_begin() -> dict[str, int] | None:
    """Called by checkpoint() when an eager region starts; a token for region_end()."""
    return _recording._offsets() if _recording is not None else None


def region_end(token: dict[str, int] | None) -> None:
    """Called by checkpoint() when the eager region that region_begin() opened ends."""
    log = _recording
    if token is None or log is None:
        return
    end = log._offsets()
    used = tuple(k for k in log._streams if end[k] > token[k])
    for k in used:
        log._inside[k] += end[k] - token[k]
    log.regions.append(used)


# -- capture and replay ---------------------------------------------------------------------
_next_ordinal = 0


def next_graph_ordinal() -> int:
    """Position of the next graphed callable since the last reseed (part of its seeds)."""
    global _next_ordinal
    _next_ordinal += 1
    return _next_ordinal - 1


def reset_graph_ordinals() -> None:
    """Called on reseeding, so the same seed and program give the same recompute streams
    even when an earlier capture in the process came before."""
    global _next_ordinal
    _next_ordinal = 0


def _derived_seed(base_seed: int, stream: str, ordinal: int, region: int) -> int:
    text = f"te-graph:{base_seed}:{stream}:{ordinal}:{region}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


@dataclass
class RecomputeStreams:
    """The generator pair of each stream one checkpointed region draws from."""

    forward: dict[str, torch.Generator]
    backward: dict[str, torch.Generator]


@dataclass
class _Cursor:
    rng: "GraphRNG"
    next_region: int = 0


_capturing: _Cursor | None = None


def capture_region() -> RecomputeStreams | None:
    """Called by checkpoint() during capture: the generators of the next region, in order.

    Returns None when no te_graph forward capture is under way.
    """
    cursor = _capturing
    if cursor is None:
        return None
    regions = cursor.rng.regions
    if cursor.next_region >= len(regions):
        raise RuntimeError(
            f"te_graph: the capture reached checkpointed region {cursor.next_region + 1}, but "
            f"warmup saw {len(regions)}; a graphed callable must run the same checkpoint() "
            "calls every time (no data- or step-dependent control flow)."
        )
    region = regions[cursor.next_region]
    cursor.next_region += 1
    return region


@dataclass
class GraphRNG:
    """Recompute generators of one graphed callable, and their per-replay bookkeeping."""

    regions: list[RecomputeStreams]
    forward_live: tuple[torch.Generator, ...] = ()
    backward_live: tuple[torch.Generator, ...] = ()
    _forward_gens: tuple[torch.Generator, ...] = field(default=(), repr=False)
    _backward_gens: tuple[torch.Generator, ...] = field(default=(), repr=False)

    @classmethod
    def create(
        cls,
        forward_log: RegionLog,
        backward_log: RegionLog,
        ordinal: int,
        device: torch.device,
    ) -> "GraphRNG":
        """Allocate the generator pairs (never during capture: generators can't be made there)."""
        regions = []
        for index, keys in enumerate(forward_log.regions):
            pair = RecomputeStreams({}, {})
            for key in keys:
                seed = _derived_seed(forward_log._streams[key].initial_seed(), key, ordinal, index)
                for side in (pair.forward, pair.backward):
                    side[key] = torch.Generator(device=device)
                    side[key].manual_seed(seed)
            regions.append(pair)
        rng = cls(
            regions,
            tuple(forward_log._streams[k] for k in forward_log.outside if k != DEFAULT_STREAM),
            tuple(backward_log._streams[k] for k in backward_log.outside if k != DEFAULT_STREAM),
        )
        rng._forward_gens = tuple(g for r in regions for g in r.forward.values())
        rng._backward_gens = tuple(g for r in regions for g in r.backward.values())
        return rng

    @property
    def has_regions(self) -> bool:
        return bool(self._forward_gens)

    def generators_to_register(self, phase: str) -> tuple[torch.Generator, ...]:
        """Generators the ``phase`` ('forward' or 'backward') graph draws from, default aside."""
        if phase == "forward":
            return self.forward_live + self._forward_gens
        return self.backward_live + self._backward_gens

    @contextlib.contextmanager
    def capturing_forward(self) -> Iterator[None]:
        """While the forward graph captures, checkpoint() takes its regions from here."""
        global _capturing
        cursor = _Cursor(self)
        _capturing = cursor
        try:
            yield
        finally:
            _capturing = None
        if cursor.next_region != len(self.regions):
            raise RuntimeError(
                f"te_graph: warmup saw {len(self.regions)} checkpointed regions but the capture "
                f"ran {cursor.next_region}; a graphed callable must run the same checkpoint() "
                "calls every time."
            )

    def record(self) -> tuple[int, ...]:
        """Before a forward replay: the host offsets its recompute must start from."""
        return tuple(g.get_offset() for g in self._forward_gens)

    def restore(self, record: tuple[int, ...]) -> None:
        """Before the matching backward replay: start the recompute where the forward did."""
        for generator, offset in zip(self._backward_gens, record):
            generator.set_offset(offset)
