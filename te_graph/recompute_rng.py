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

__all__ = ["ForwardDraws", "BackwardDraws", "RegionDraws", "RecomputeRNG"]


def _offsets(streams: Mapping[str, torch.Generator]) -> dict[str, int]:
    return {key: g.get_offset() for key, g in streams.items()}


@dataclass
class RegionDraws:
    """Where one checkpointed region draws, per stream: its offset inside the forward."""

    offsets: dict[str, int]


class ForwardDraws:
    """The capture hook of the last warmup pass, for one forward: which streams the forward
    draws from, and which streams each checkpointed region draws from and where.

    Used as ``checkpointing.capture_hook``'s hook; it only observes (yields ``None``), so
    the regions run as eager checkpoints do.
    """

    def __init__(self, streams: Mapping[str, torch.Generator]):
        self.streams = dict(streams)
        self.start = _offsets(self.streams)
        self.regions: list[RegionDraws] = []
        self.used: tuple[str, ...] = ()

    @contextlib.contextmanager
    def forward_region(self) -> Iterator[None]:
        begin = _offsets(self.streams)
        yield None
        end = _offsets(self.streams)
        self.regions.append(
            RegionDraws({k: begin[k] - self.start[k] for k in self.streams if end[k] > begin[k]})
        )

    def close(self) -> None:
        end = _offsets(self.streams)
        self.used = tuple(k for k in self.streams if end[k] > self.start[k])


class BackwardDraws:
    """Which live streams a backward draws from outside recompute (which restores them)."""

    def __init__(self, streams: Mapping[str, torch.Generator]):
        self.streams = dict(streams)
        self.start = _offsets(self.streams)
        self.used: tuple[str, ...] = ()

    def close(self) -> None:
        end = _offsets(self.streams)
        self.used = tuple(k for k in self.streams if end[k] > self.start[k])


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
    def create(cls, forward: ForwardDraws, backward: Optional[BackwardDraws], device: torch.device) -> "RecomputeRNG":
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

    @property
    def has_regions(self) -> bool:
        return bool(self.targets)

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


class TrackerWatch:
    """Refuses replays after a duck-typed tracker replaced a stream's generator object.

    Graphs draw from the generator *objects* they were captured with. Our tracker keeps
    them for good (reseeding and ``set_states`` copy content in place), but Megatron-core's
    and TE's trackers make new objects on ``reset()``/``add()`` and store whatever
    ``set_states()`` gets: the graphs would then keep drawing from the old streams while
    eager code draws from the new ones.
    """

    def __init__(self, tracker: Any, streams: Mapping[str, torch.Generator]):
        self.tracker = tracker
        self.streams = tuple((k, g) for k, g in streams.items() if k != rng.DEFAULT_STREAM)

    @classmethod
    def needed(cls, tracker: Any, streams: Mapping[str, torch.Generator]) -> Optional["TrackerWatch"]:
        if tracker is None or isinstance(tracker, rng.CudaRNGStatesTracker):
            return None
        watch = cls(tracker, streams)
        return watch if watch.streams else None

    def check(self, name: str) -> None:
        states = self.tracker.get_states()
        for key, generator in self.streams:
            if states.get(key) is not generator:
                raise RuntimeError(
                    f"{name}: the RNG tracker's stream {key!r} is no longer the generator object "
                    "the graphs were captured with (the tracker replaced it: reseeding "
                    "Megatron-core's or TE's tracker with reset()/add(), or set_states() with "
                    "other generators). The graphs would keep drawing from the old stream. "
                    "Reseed in place with rng.model_parallel_cuda_manual_seed(seed, "
                    "tracker=...) or restore saved states with rng.restore_tracker_states(), "
                    "which keep the generator objects; or graph the layers again."
                )
