"""The process-wide state a graph's kernels were chosen under, checked at every call of a
graphed callable: autocast and the numerics flags (TF32, reduced-precision reductions,
deterministic algorithms)."""
from __future__ import annotations

import torch

from .. import compat

__all__ = ["Settings"]


class Settings:
    """The process-wide state a graph's kernels were chosen under: autocast (enabled and
    dtype, for the graph's device type) and the numerics flags (``compat.numerics_settings``)."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.captured = self.read()

    def read(self) -> tuple:
        device = self.device_type
        enabled = torch.is_autocast_enabled(device)
        return (enabled, torch.get_autocast_dtype(device) if enabled else None) + compat.numerics_settings()

    def changes(self) -> list[str]:
        now = self.read()
        if now == self.captured:
            return []
        found = []
        if now[:2] != self.captured[:2]:
            found.append(
                f"autocast on {self.device_type} is {_autocast_text(now[:2])}, but the graph was "
                f"captured with {_autocast_text(self.captured[:2])}"
            )
        for name, then, value in zip(compat.NUMERICS_SETTINGS, self.captured[2:], now[2:]):
            if then != value:
                found.append(f"{name} is {value!r}, but was {then!r} at capture")
        return found


def _autocast_text(state: tuple) -> str:
    return f"on ({state[1]})" if state[0] else "off"

