"""Generator states as *content*: snapshots that never alias a live stream.

A generator state is one of two things:

* a byte tensor (``Generator.get_state()``), the classic form, works on every device;
* a ``torch.Generator`` (a *graph-safe* state), the form CUDA graphs can swap in with
  ``graphsafe_set_state`` and register with a graph.

``Generator.graphsafe_get_state()`` returns a *reference* to the live state: restoring
such a reference later does not rewind the Philox offset, because the offset has moved
with the live stream. Every snapshot taken here is therefore a copy (``get_state`` or
``clone_state``), and every restore copies content *into* the live generator, so the live
generator keeps its identity (and any CUDA graph registration it has).
"""
from __future__ import annotations

import os
from typing import Union

import torch

RNGState = Union[torch.Tensor, torch.Generator]

__all__ = [
    "RNGState",
    "graph_safe_rng_available",
    "is_graph_safe_rng_state",
    "generator_registration_required",
    "env_flag",
    "default_generator",
    "snapshot_generator",
    "restore_generator",
    "get_rng_state",
    "set_rng_state",
    "to_byte_state",
    "to_generator_state",
]


def graph_safe_rng_available() -> bool:
    """True when CUDA is usable and torch has the graph-safe generator API (torch >= 2.4)."""
    return (
        torch.cuda.is_available()
        and hasattr(torch.Generator, "graphsafe_get_state")
        and hasattr(torch.Generator, "graphsafe_set_state")
        and hasattr(torch.Generator, "clone_state")
    )


def is_graph_safe_rng_state(state: object) -> bool:
    """True for a generator-object state (graph-safe form), False for a byte tensor."""
    return isinstance(state, torch.Generator)


def generator_registration_required() -> bool:
    """Whether generators used in a capture must be registered with the graph beforehand.

    torch 2.4-2.13 need ``CUDAGraph.register_generator_state`` before capture. torch 2.14
    registers generators lazily on first use and turns the call into a deprecated no-op
    that warns on every call, so we must not call it there. Detected from the API itself
    (the method's presence and its deprecation note); ``TE_GRAPH_LAZY_GENERATOR_REGISTRATION``
    set to ``1`` or ``0`` overrides the detection.
    """
    method = getattr(torch.cuda.CUDAGraph, "register_generator_state", None)
    if method is None:
        return False
    override = env_flag("TE_GRAPH_LAZY_GENERATOR_REGISTRATION")
    if override is not None:
        return not override
    doc = (getattr(method, "__doc__", None) or "").lower()
    return "deprecat" not in doc and "no-op" not in doc


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str) -> bool | None:
    """The boolean environment variable ``name``: None where unset or empty, else one of
    ``1/true/yes/on`` or ``0/false/no/off`` (any case). Anything else is a ``ValueError``
    naming the variable and what it accepts, raised before any state changes."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    word = value.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(
        f"environment variable {name}={value!r} is not a boolean; set it to one of "
        f"{', '.join(_TRUE)} (on) or {', '.join(_FALSE)} (off), or unset it."
    )


def default_generator(device: torch.device | str | int | None = None) -> torch.Generator:
    """The default generator of ``device`` (current CUDA device when CUDA and ``None``)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type == "cpu":
        return torch.default_generator
    if device.type != "cuda":
        raise ValueError(f"rng: unsupported device {device}; use 'cpu' or 'cuda'.")
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.init()
    return torch.cuda.default_generators[index]


def snapshot_generator(generator: torch.Generator, graph_safe: bool | None = None) -> RNGState:
    """Copy of ``generator``'s state that does not move when the generator advances.

    ``graph_safe=None`` picks the generator form on CUDA (when available) and the byte form
    elsewhere.
    """
    if graph_safe is None:
        graph_safe = generator.device.type == "cuda" and graph_safe_rng_available()
    if graph_safe:
        return generator.clone_state()
    return generator.get_state()


def restore_generator(generator: torch.Generator, state: RNGState) -> None:
    """Copy ``state``'s content into ``generator`` in place (its identity is kept)."""
    if isinstance(state, torch.Generator):
        if generator.device.type == "cuda" and state.device.type == "cuda":
            # Seed and Philox offset are the whole CUDA state; copying them keeps the
            # generator's state object, so graph registrations stay valid.
            generator.manual_seed(state.initial_seed())
            generator.set_offset(state.get_offset())
            return
        state = state.get_state()
    generator.set_state(state)


def get_rng_state(
    device: torch.device | str | int | None = None, graph_safe: bool | None = None
) -> RNGState:
    """Snapshot of the default generator of ``device`` (content, never a live reference)."""
    return snapshot_generator(default_generator(device), graph_safe)


def set_rng_state(state: RNGState, device: torch.device | str | int | None = None) -> None:
    """Restore the default generator of ``device`` to ``state`` (byte or generator form)."""
    restore_generator(default_generator(device), state)


def to_byte_state(state: RNGState) -> torch.Tensor:
    """Byte-tensor form of a state (a copy)."""
    if isinstance(state, torch.Generator):
        return state.get_state()
    return state.clone()


def to_generator_state(state: RNGState, device: torch.device | str = "cuda") -> torch.Generator:
    """Generator form of a state: a new generator on ``device`` holding a copy of it."""
    if isinstance(state, torch.Generator):
        return state.clone_state()
    generator = torch.Generator(device=device)
    generator.set_state(state)
    return generator
