"""When to verify: ``Verify`` and what ``verify=`` (or ``TE_GRAPH_VERIFY``) accepts."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any, Optional

import rng

__all__ = ["Verify", "verify_options", "Schedule", "ON_MISMATCH", "TOLERANCES"]

ON_MISMATCH = ("raise", "warn", "eager")
TOLERANCES = ("bitwise", "rounding")
FIRST_BY_DEFAULT = 8


@dataclass(frozen=True)
class Verify:
    """Which calls of each graphed callable are verified, and what a difference does.

    ``first``: the first N calls; ``every``: each k-th call after them (0: none);
    ``fraction``: besides those, each call with this probability (a generator of the
    verifier's own, seeded with ``seed``: the user's random streams are left alone).
    ``on_mismatch``: ``"raise"`` (a ``RuntimeError`` with the report), ``"warn"``, or
    ``"eager"`` (warn once and run that callable eagerly from then on). ``tolerance``:
    ``"bitwise"`` (default: any difference is a mismatch) or ``"rounding"`` (a difference
    within a few units in the last place is reported as rounding, not a mismatch)."""

    first: int = FIRST_BY_DEFAULT
    every: int = 0
    fraction: float = 0.0
    on_mismatch: str = "raise"
    tolerance: str = "bitwise"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("first", "every", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"te_graph.Verify: {name} must be an int >= 0, got {value!r} ({type(value).__name__}).")
            if value < 0:
                raise ValueError(f"te_graph.Verify: {name} must be an int >= 0, got {value!r}.")
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)):
            raise TypeError(f"te_graph.Verify: fraction must be a number from 0 to 1, got {self.fraction!r} "
                            f"({type(self.fraction).__name__}).")
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"te_graph.Verify: fraction must be a number from 0 to 1, got {self.fraction!r}.")
        if self.on_mismatch not in ON_MISMATCH:
            raise ValueError(f"te_graph.Verify: on_mismatch={self.on_mismatch!r}; use one of "
                             f"{', '.join(map(repr, ON_MISMATCH))}.")
        if self.tolerance not in TOLERANCES:
            raise ValueError(f"te_graph.Verify: tolerance={self.tolerance!r}; use 'bitwise' or 'rounding'.")


def verify_options(value: Any, who: str = "make_graphed_callables") -> Optional[Verify]:
    """``verify=`` as given: None or False (off; None reads ``TE_GRAPH_VERIFY``), True (the
    first calls), an int N (the first N calls) or a ``Verify``."""
    if value is None:
        value = _from_environment()
    if value is None or value is False:
        return None
    if value is True:
        return Verify()
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{who}: verify={value}; give the number of first calls to verify (>= 0).")
        return Verify(first=value) if value else None
    if isinstance(value, Verify):
        return value
    raise TypeError(f"{who}: verify must be True/False, an int (the first calls to verify) or a "
                    f"te_graph.Verify, got {value!r} ({type(value).__name__}).")


def _from_environment() -> Any:
    """``TE_GRAPH_VERIFY``: a boolean word, or the number of first calls to verify."""
    text = os.environ.get("TE_GRAPH_VERIFY", "").strip()
    if text.isascii() and text.isdigit():
        return int(text)
    try:
        return rng.env_flag("TE_GRAPH_VERIFY")
    except ValueError as error:
        raise ValueError(f"{error} (TE_GRAPH_VERIFY also takes a count: verify the first N calls, N >= 0)") from None


class Schedule:
    """Counts one callable's calls and says which are verified."""

    def __init__(self, options: Verify):
        self.options = options
        self.calls = 0
        self._random = random.Random(options.seed)

    def due(self) -> bool:
        options, n = self.options, self.calls
        self.calls += 1
        if n < options.first:
            return True
        if options.every and (n - options.first + 1) % options.every == 0:
            return True
        return options.fraction > 0 and self._random.random() < options.fraction
