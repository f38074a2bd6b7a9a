"""Named RNG streams (Megatron's CUDA RNG states tracker) and content snapshots of any
tracker's streams.

Each named stream is either its own ``torch.Generator`` (graph-safe mode: ``fork`` swaps
it into the default generator with ``graphsafe_set_state``, which is legal during CUDA
graph capture) or a byte tensor (fallback mode: ``fork`` copies states in and out, the
classic Megatron scheme; this is what CPU generators use).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import torch

from .checks import SEED_MAX, as_seed, check_state
from .states import (
    RNGState,
    default_generator,
    graph_safe_rng_available,
    restore_generator,
    snapshot_generator,
    to_byte_state,
    to_generator_state,
)

__all__ = [
    "CudaRNGStatesTracker",
    "get_cuda_rng_tracker",
    "snapshot_tracker_states",
    "restore_tracker_states",
    "snapshot_streams",
    "restore_streams",
    "MODEL_PARALLEL_RNG",
    "EXPERT_PARALLEL_RNG",
    "DATA_PARALLEL_RNG",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"


class CudaRNGStatesTracker:
    """Named RNG streams that ``fork`` swaps in for the default generator.

    Args:
        device: device whose default generator ``fork`` replaces; ``None`` means CUDA
            when available, else CPU.
        graph_safe: keep each stream as its own ``torch.Generator``; ``None`` means yes
            wherever the graph-safe API exists on CUDA, and the byte-tensor fallback
            elsewhere.

    ``get_states()`` returns copies (they do not move when the streams advance) and
    ``set_states()`` copies states back in, so a snapshot restores the exact numbers.
    """

    def __init__(self, device: torch.device | str | None = None, graph_safe: bool | None = None):
        if graph_safe is not None and not isinstance(graph_safe, bool):
            raise TypeError(f"CudaRNGStatesTracker: graph_safe must be True, False or None (pick for the device), "
                            f"got {graph_safe!r} ({type(graph_safe).__name__}).")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"CudaRNGStatesTracker: device must be a torch.device or a device string such as "
                             f"'cuda' or 'cuda:1', got {device!r} ({error}).") from None
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"CudaRNGStatesTracker: device must be a CUDA device (or the CPU, for eager replay), "
                             f"got {self.device}.")
        if graph_safe is None:
            graph_safe = self.device.type == "cuda" and graph_safe_rng_available()
        if graph_safe and not (self.device.type == "cuda" and graph_safe_rng_available()):
            raise ValueError(
                "CudaRNGStatesTracker(graph_safe=True) needs CUDA and torch's graph-safe "
                "generator API (torch >= 2.4); pass graph_safe=False for byte-tensor states."
            )
        self.graph_safe = graph_safe
        self._states: dict[str, RNGState] = {}
        self._seeds: dict[int, str] = {}  # seed modulo 2**64 (as torch takes it) -> stream
        # Generator objects of streams dropped by reset(), reused when the name is added
        # again: CUDA graphs register generator *objects*, so reseeding in place keeps
        # graphs captured before a reseed drawing from the reseeded stream.
        self._retired: dict[str, torch.Generator] = {}

    # -- bookkeeping ----------------------------------------------------------------
    def reset(self) -> None:
        """Forget every stream and seed."""
        self._retired.update(self.live_generators())
        self._states = {}
        self._seeds = {}

    def is_initialized(self) -> bool:
        """True once at least one stream was added."""
        return bool(self._states)

    def names(self) -> tuple[str, ...]:
        """Names of the streams, in the order they were added."""
        return tuple(self._states)

    def add(self, name: str, seed: int) -> None:
        """Add stream ``name`` seeded with ``seed``; names and seeds must be unique.

        ``seed`` is an int (numpy ints too; bools are refused), checked with ``name``
        before anything changes.
        """
        if not isinstance(name, str):
            raise TypeError(
                f"CudaRNGStatesTracker.add: name must be a str, got {name!r} "
                f"({type(name).__name__}); the name comes first: tracker.add(name, seed)."
            )
        seed = as_seed(seed, "CudaRNGStatesTracker.add: seed", f"tracker.add({name!r}, 1234)")
        key = seed % (SEED_MAX + 1)
        if key in self._seeds:
            raise ValueError(
                f"CudaRNGStatesTracker.add: seed {seed} is already used by stream "
                f"'{self._seeds[key]}'; give '{name}' a different seed."
            )
        if name in self._states:
            raise ValueError(
                f"CudaRNGStatesTracker.add: stream '{name}' already exists; call reset() "
                "first or pick another name."
            )
        generator = self._retired.pop(name, None) or torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self._states[name] = generator if self.graph_safe else generator.get_state()
        self._seeds[key] = name

    def get_states(self) -> dict[str, RNGState]:
        """Copies of every stream's state (content that later draws do not move)."""
        return {name: self._copy(state) for name, state in self._states.items()}

    def set_states(self, states: Mapping[str, RNGState]) -> None:
        """Restore streams from ``states`` (copies in; unknown names are added).

        Every state is checked first (a byte tensor of this device's state size, or a
        ``torch.Generator`` of this device type), so a bad one changes nothing.
        """
        if not isinstance(states, Mapping):
            raise TypeError(
                f"CudaRNGStatesTracker.set_states: expected a dict {{stream name: state}}, got "
                f"a {type(states).__name__}; pass what get_states() returned."
            )
        for name, state in states.items():
            if not isinstance(name, str):
                raise TypeError(
                    f"CudaRNGStatesTracker.set_states: stream names are str, got {name!r} "
                    f"({type(name).__name__}); key the dict by stream name, as get_states() does."
                )
            check_state(state, self.device.type, f"CudaRNGStatesTracker.set_states: the state of stream {name!r}")
        for name, state in states.items():
            live = self._states.get(name)
            if isinstance(live, torch.Generator):
                restore_generator(live, state)
            elif self.graph_safe:
                self._states[name] = to_generator_state(state, self.device)
            else:
                self._states[name] = to_byte_state(state)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` instead of the default generator inside the block."""
        if name not in self._states:
            known = ", ".join(repr(n) for n in self._states) or "none"
            raise KeyError(
                f"CudaRNGStatesTracker.fork: no stream named {name!r} (known: {known}); "
                "add it with tracker.add(name, seed) or model_parallel_cuda_manual_seed()."
            )
        generator = default_generator(self.device)
        state = self._states[name]
        if isinstance(state, torch.Generator):
            previous = generator.graphsafe_get_state()
            generator.graphsafe_set_state(state)
            try:
                yield
            finally:
                generator.graphsafe_set_state(previous)
        else:
            previous = generator.get_state()
            generator.set_state(state)
            try:
                yield
            finally:
                self._states[name] = generator.get_state()
                generator.set_state(previous)

    # -- the live generator objects (rng.streams): never copies ----------------------------
    def live_generators(self) -> dict[str, torch.Generator]:
        """The live ``torch.Generator`` of each graph-safe stream, by name: the objects
        themselves, not copies (``get_states()`` returns copies).

        CUDA graphs register and draw from generator *objects*, so code that points a
        graph at a stream needs the very object ``fork()`` swaps in. Drawing from one
        advances its stream. Byte-state streams are left out (empty when not graph-safe).
        """
        return {n: s for n, s in self._states.items() if isinstance(s, torch.Generator)}

    def replace_generators(self, replacements: Mapping[str, torch.Generator]) -> dict[str, torch.Generator]:
        """Make each named stream *be* the given generator object; returns the objects it
        replaced (pass them back to undo).

        Swapping objects, rather than copying state into them, is the one way to redirect
        a stream that is legal while a CUDA graph is being captured. Only streams that
        ``live_generators()`` lists can be replaced; everything is checked first.
        """
        for name, generator in replacements.items():
            if not isinstance(self._states.get(name), torch.Generator):
                known = ", ".join(repr(n) for n in self.live_generators()) or "none"
                raise KeyError(
                    f"CudaRNGStatesTracker.replace_generators: {name!r} is not a generator "
                    f"stream of this tracker (generator streams: {known}); replace only names "
                    "that live_generators() returns."
                )
            if not isinstance(generator, torch.Generator) or generator.device.type != self.device.type:
                raise TypeError(
                    f"CudaRNGStatesTracker.replace_generators: the replacement for {name!r} is "
                    f"{_describe(generator)}; pass a torch.Generator on {self.device.type}."
                )
        previous = {name: self._states[name] for name in replacements}
        self._states.update(replacements)
        return previous

    def _copy(self, state: RNGState) -> RNGState:
        if isinstance(state, torch.Generator):
            return snapshot_generator(state, graph_safe=True)
        return state.clone()


def _describe(value: object) -> str:
    if isinstance(value, torch.Generator):
        return f"a torch.Generator on {value.device.type}"
    return f"a {type(value).__name__}"


_TRACKER: CudaRNGStatesTracker | None = None


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide tracker (created on first use, on CUDA when available)."""
    global _TRACKER
    if _TRACKER is None:
        _TRACKER = CudaRNGStatesTracker()
    return _TRACKER


def snapshot_tracker_states(tracker: object) -> dict[str, RNGState]:
    """Content copies of every stream of any tracker (ours, Megatron-core's, apex's, TE's).

    Duck-typed graph-safe trackers return live references from ``get_states()``; copying
    them here is what makes a later restore rewind the Philox offset.
    """
    states = tracker.get_states()
    if isinstance(tracker, CudaRNGStatesTracker):
        return states  # already copies
    return {
        name: snapshot_generator(s, graph_safe=True) if isinstance(s, torch.Generator) else s.clone()
        for name, s in states.items()
    }


def restore_tracker_states(tracker: object, states: Mapping[str, RNGState]) -> None:
    """Copy ``states`` into any tracker's streams, keeping their generator objects."""
    if isinstance(tracker, CudaRNGStatesTracker):
        tracker.set_states(states)
        return
    live = tracker.get_states()  # references, for duck-typed graph-safe trackers
    byte_states = {}
    for name, state in states.items():
        if isinstance(live.get(name), torch.Generator):
            restore_generator(live[name], state)
        else:
            byte_states[name] = to_byte_state(state)
    if byte_states:
        # Megatron-style set_states() replaces the whole dict: hand it every stream.
        tracker.set_states({**live, **byte_states})


def snapshot_streams(tracker: object | None) -> tuple:
    """Content snapshot of every random stream a layer may draw from: the CPU and current
    CUDA default generators and each of ``tracker``'s streams."""
    cuda = snapshot_generator(default_generator("cuda")) if torch.cuda.is_available() else None
    states = snapshot_tracker_states(tracker) if tracker is not None else None
    return snapshot_generator(torch.default_generator), cuda, states


def restore_streams(tracker: object | None, snapshot: tuple) -> None:
    """Put every stream back to ``snapshot`` (from :func:`snapshot_streams`), in place."""
    cpu, cuda, states = snapshot
    restore_generator(torch.default_generator, cpu)
    if cuda is not None:
        restore_generator(default_generator("cuda"), cuda)
    if states is not None:
        restore_tracker_states(tracker, states)
