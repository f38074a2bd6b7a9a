"""Checks of what users hand to ``rng``: seeds and generator states.

They run before anything changes, so a bad seed or state is refused where it is given
instead of corrupting a stream that fails far away (at the next ``fork()`` or draw).
"""
from __future__ import annotations

import functools
import operator

import torch

__all__ = ["SEED_MIN", "SEED_MAX", "as_seed", "state_size", "check_state"]

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""torch's seed range; ``manual_seed`` takes a seed modulo 2**64 (-1 is 2**64 - 1)."""


def as_seed(value: object, where: str, example: str) -> int:
    """``value`` as an int seed (numpy ints too) within torch's range.

    Bools are refused: a flag in a seed position is a mistake, not seed 0 or 1.
    ``where`` names the argument in messages; ``example`` shows a correct call.
    """
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(
            f"{where} must be an int (not a bool), got {value!r} ({type(value).__name__}); "
            f"pass an integer seed, e.g. {example}."
        )
    seed = operator.index(value)
    if not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(
            f"{where} {seed} is outside torch's seed range [-2**63, 2**64 - 1]; pass a seed "
            "inside it."
        )
    return seed


@functools.lru_cache(maxsize=None)
def state_size(device_type: str) -> int:
    """Bytes of a byte-tensor state (``Generator.get_state()``) on ``device_type``: fixed per
    generator kind (CPU: Mersenne Twister; CUDA: Philox seed and offset), read from torch."""
    return torch.Generator(device=device_type).get_state().numel()


def check_state(state: object, device_type: str, what: str) -> None:
    """Raise unless ``state`` can be copied into a generator on ``device_type``.

    A state is a byte tensor of that kind's size (``Generator.get_state()``: 1-D uint8 on
    the CPU) or a ``torch.Generator`` of that device type. ``what`` names the state in
    messages (``"...: the state of stream 'x'"``).
    """
    if isinstance(state, torch.Generator):
        if state.device.type != device_type:
            raise ValueError(
                f"{what} is a torch.Generator on {state.device.type}, but the streams are on "
                f"{device_type}; pass a {device_type} generator or a state from "
                "tracker.get_states()."
            )
        return
    if not isinstance(state, torch.Tensor):
        raise TypeError(
            f"{what} is a {type(state).__name__}; pass a byte tensor (Generator.get_state()) "
            f"or a torch.Generator on {device_type}, as tracker.get_states() returns."
        )
    if state.dtype != torch.uint8 or state.device.type != "cpu" or state.dim() != 1:
        raise ValueError(
            f"{what} is a {state.dtype} tensor of shape {tuple(state.shape)} on {state.device}; "
            "a byte state is a 1-D torch.uint8 tensor on the CPU, as Generator.get_state() "
            "returns."
        )
    expected = state_size(device_type)
    if state.numel() != expected:
        raise ValueError(
            f"{what} is {state.numel()} bytes, but a {device_type} generator's state is "
            f"{expected} bytes; pass a state taken from a {device_type} generator "
            f"(tracker.get_states(), or get_state() of a {device_type} torch.Generator)."
        )
