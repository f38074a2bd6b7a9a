"""Random numbers of activation recompute inside CUDA graphs: the per-graph bookkeeping.

Facts this rests on (torch's CUDA generator with graphs):

* A captured kernel reads its Philox seed and offset from device memory that each replay
  fills from its generator's *host* state, and the replay then advances the host offset by
  the graph's total consumption. A draw inside a graph therefore uses
  ``(live seed, host offset at that replay + I)``, where ``I`` is the draw's offset inside
  the graph: fixed at capture, and equal to what the same code consumes eagerly before it.
* ``clone_state()`` is forbidden during capture, and on torch < 2.14 every generator a
  graph draws from must be registered with it before capture.

The scheme. The forward graph draws from the live streams exactly as eager code does, the
checkpointed regions included, so graphs on equals graphs off. Each region gets, before
capture, a private generator per stream it draws from; only the *recompute*, captured in
the backward graph, draws from it. At every forward replay the host (seed, offset) of the
live streams the regions use is recorded on that call; before the call's backward replay
each private generator is set to ``(recorded seed, recorded offset + I)``, where ``I`` is
where the region's draws began inside the forward graph (learned in the last warmup pass
from host offsets, which eager code advances exactly as the graph will). The recompute
then draws the forward's numbers, bit for bit, and consumes nothing from the live streams.

The record belongs to the call (it lives on the call's autograd node), so many forwards
before their backwards, backwards in another order, ``retain_graph`` re-runs and a reseed
between a forward and its backward all stay exact. No seed is derived from anything.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

import torch

import rng

from ..records import RegionDraws, StreamUse

__all__ = [
    "ForwardDraws", "BackwardDraws", "RegionDraws", "StreamUse", "RecomputeRNG", "NO_RECOMPUTE",
    "TrackerSync", "NO_SYNC",
]


def _offsets(streams: Mapping[str, torch.Generator]) -> dict[str, int]:
    return {key: g.get_offset() for key, g in streams.items()}


class ForwardDraws:
    """The capture hook of the last warmup pass, for one forward: which streams the forward
    draws from, and which streams each checkpointed region draws from and where.

    Used as ``checkpointing.capture_hook``'s hook; it only observes (yields ``None``), so
    the regions run as eager checkpoints do. ``close()`` gives the record.
    """

    def __init__(self, streams: Mapping[str, torch.Generator]):
        self.streams = dict(streams)
        self.start = _offsets(self.streams)
        self.regions: list[RegionDraws] = []

    @contextlib.contextmanager
    def forward_region(self) -> Iterator[None]:
        begin = _offsets(self.streams)
        yield None
        end = _offsets(self.streams)
        self.regions.append(
            RegionDraws({k: begin[k] - self.start[k] for k in self.streams if end[k] > begin[k]})
        )

    def close(self) -> StreamUse:
        return StreamUse(self.streams, _drawn_from(self.streams, self.start), tuple(self.regions))


class BackwardDraws:
    """Which live streams a backward draws from outside recompute (which restores them)."""

    def __init__(self, streams: Mapping[str, torch.Generator]):
        self.streams = dict(streams)
        self.start = _offsets(self.streams)

    def close(self) -> StreamUse:
        return StreamUse(self.streams, _drawn_from(self.streams, self.start))


def _drawn_from(streams: Mapping[str, torch.Generator], start: Mapping[str, int]) -> tuple[str, ...]:
    end = _offsets(streams)
    return tuple(k for k in streams if end[k] > start[k])


@dataclass
class RecomputeRNG:
    """The random streams of one graphed callable: what its graphs draw from, and the
    record and restore around its replays that keep recompute equal to the forward."""

    forward_generators: tuple[torch.Generator, ...]  # live tracker streams the forward uses
    backward_generators: tuple[torch.Generator, ...]  # live streams + private, for backward
    regions: list[dict[str, torch.Generator]]  # per region: stream key -> private generator
    live: tuple[torch.Generator, ...] = ()  # live streams the regions draw from (recorded)
    targets: tuple[tuple[torch.Generator, int, int], ...] = ()  # (private, live index, I)
    _seeds: list[int] = field(default_factory=list, repr=False)  # last seed set per target

    @classmethod
    def create(cls, forward: StreamUse, backward: Optional[StreamUse], device: torch.device) -> "RecomputeRNG":
        """Allocate the private generators (never during capture: none can be made there)."""
        streams = forward.streams
        used_live = sorted({k for region in forward.regions for k in region.offsets}, key=list(streams).index)
        live_index = {k: i for i, k in enumerate(used_live)}
        regions, targets = [], []
        for region in forward.regions:
            private = {k: torch.Generator(device=device) for k in region.offsets}
            regions.append(private)
            targets.extend((private[k], live_index[k], region.offsets[k]) for k in region.offsets)
        backward_live = tuple(backward.streams[k] for k in backward.used if k != rng.DEFAULT_STREAM) if backward else ()
        return cls(
            forward_generators=tuple(streams[k] for k in forward.used if k != rng.DEFAULT_STREAM),
            backward_generators=backward_live + tuple(g for g, _, _ in targets),
            regions=regions,
            live=tuple(streams[k] for k in used_live),
            targets=tuple(targets),
            _seeds=[-1] * len(targets),
        )

    def for_replay(self) -> "RecomputeRNG | _NoRecompute":
        """What replay calls around each call: itself, or ``NO_RECOMPUTE`` when no
        checkpointed region draws random numbers (nothing to record or restore)."""
        return self if self.targets else NO_RECOMPUTE

    # -- capture ----------------------------------------------------------------------
    def capture_hook(self) -> "_CaptureRegions":
        """The capture hook of the forward capture: hands each region its generators."""
        return _CaptureRegions(self.regions)

    # -- replay -----------------------------------------------------------------------
    def record(self) -> tuple[tuple[int, int], ...]:
        """Before a forward replay: host (seed, offset) of every live stream the regions use
        (host reads, no device sync)."""
        return tuple((g.initial_seed(), g.get_offset()) for g in self.live)

    def restore(self, record: tuple[tuple[int, int], ...]) -> None:
        """Before the matching backward replay: each private generator where its region's
        draws began in that forward replay."""
        seeds = self._seeds
        for i, (generator, index, inside) in enumerate(self.targets):
            seed, offset = record[index]
            if seeds[i] != seed:
                generator.manual_seed(seed)
                seeds[i] = seed
            generator.set_offset(offset + inside)


class _NoRecompute:
    """A callable whose recompute draws nothing: replay records and restores nothing."""

    @staticmethod
    def record() -> tuple:
        return ()

    @staticmethod
    def restore(record: tuple) -> None:
        pass


NO_RECOMPUTE = _NoRecompute()


class _CaptureRegions:
    """``checkpointing.capture_hook`` hook during one forward capture."""

    def __init__(self, regions: list[dict[str, torch.Generator]]):
        self.regions = regions
        self.next = 0

    @contextlib.contextmanager
    def forward_region(self) -> Iterator[dict[str, torch.Generator]]:
        if self.next >= len(self.regions):
            raise RuntimeError(
                f"te_graph: the capture reached checkpointed region {self.next + 1}, but warmup "
                f"saw {len(self.regions)}; a graphed callable must run the same checkpoint() "
                "calls every time (no data- or step-dependent control flow)."
            )
        region = self.regions[self.next]
        self.next += 1
        yield region

    def check_complete(self) -> None:
        if self.next != len(self.regions):
            raise RuntimeError(
                f"te_graph: warmup saw {len(self.regions)} checkpointed regions but the capture "
                f"ran {self.next}; a graphed callable must run the same checkpoint() calls "
                "every time."
            )


class TrackerSync:
    """Keeps the generators a graph draws from in step with a duck-typed tracker.

    Graphs draw from the generator *states* they were captured with. Our tracker keeps its
    generator objects for good (reseeding and ``set_states`` copy content in place).
    Megatron-core's and TE's trackers hand out new ``Generator`` objects: every ``fork``
    stores ``graphsafe_get_state()`` (a new object on the same state, harmless), and
    ``reset()``/``add()`` or ``set_states()`` (reseeding, loading a checkpoint) put new
    *states* in place, which the graphs would not see. So around each replay the captured
    generator takes the tracker's current (seed, offset) when they differ, and the tracker's
    generator takes the offset the replay advanced to: the graphs follow the tracker as
    eager code would.
    """

    def __init__(self, tracker: Any, streams: Mapping[str, torch.Generator]):
        self.tracker = tracker
        self.streams = tuple((k, g) for k, g in streams.items() if k != rng.DEFAULT_STREAM)

    @classmethod
    def needed(cls, tracker: Any, streams: Mapping[str, torch.Generator]) -> "TrackerSync | _NoSync":
        """A sync for the tracker streams in ``streams``; ``NO_SYNC`` where none is needed
        (our tracker keeps its generator objects, or no tracker stream is drawn from)."""
        if tracker is None or isinstance(tracker, rng.CudaRNGStatesTracker):
            return NO_SYNC
        sync = cls(tracker, streams)
        return sync if sync.streams else NO_SYNC

    def before_replay(self, name: str) -> list:
        """Make the captured generators hold the tracker's current states."""
        states = self.tracker.get_states()
        moved = []
        for key, ours in self.streams:
            theirs = states.get(key)
            if theirs is ours:
                continue
            if not isinstance(theirs, torch.Generator) or theirs.device != ours.device:
                raise RuntimeError(
                    f"{name}: the RNG tracker's stream {key!r} is now "
                    f"{type(theirs).__name__ if theirs is not None else 'missing'}, not a "
                    f"generator on {ours.device}; the graphs draw from it. Keep the tracker in "
                    "its graph-safe mode (generator states) while graphed layers run."
                )
            seed, offset = theirs.initial_seed(), theirs.get_offset()
            if seed != ours.initial_seed() or offset != ours.get_offset():
                ours.manual_seed(seed)
                ours.set_offset(offset)
            moved.append((theirs, ours))
        return moved

    @staticmethod
    def after_replay(moved: list) -> None:
        """Hand the tracker's generators the offsets the replay advanced to."""
        for theirs, ours in moved:
            theirs.set_offset(ours.get_offset())


class _NoSync:
    """Nothing to keep in step: ``before_replay`` moves nothing."""

    @staticmethod
    def before_replay(name: str) -> tuple:
        return ()

    @staticmethod
    def after_replay(moved: Any) -> None:
        pass


NO_SYNC = _NoSync()
