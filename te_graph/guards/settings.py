"""The process-wide state a graph's kernels were chosen under, checked at every call of a
graphed callable: autocast, the numerics flags (TF32, reduced-precision reductions,
deterministic algorithms), the saved-tensor hooks active, and, for a forward that calls
scaled-dot-product attention, the SDPA backends allowed."""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from .. import compat

__all__ = ["Settings", "exact_hooks", "hooks_off_if_exact"]


# Saved-tensor hooks that change no value a graph computes: activation checkpoints (torch's,
# te_graph's, Transformer Engine's drop what autograd saves and rebuild it exactly, by the same
# operations), told apart by the pack hook's module. Not ``save_on_cpu``: what it brings back is
# a copy, contiguous where the saved tensor was a view that skips memory (with ``pin_memory``,
# always: torch 2.4-2.13 ``torch.autograd.graph.save_on_cpu`` copies into ``torch.empty(size)``),
# and eager's backward may then pick other kernels than over the original.
_EXACT_HOOK_MODULES = ("torch.utils.checkpoint", "checkpointing.", "transformer_engine.pytorch.distributed")


def exact_hooks(hooks: Any) -> bool:
    """Whether ``hooks`` (a ``(pack, unpack)`` pair) change nothing a graph computes: graphing
    and each graphed call then run without them (``compat.saved_tensor_hooks_off``), the graphs
    keeping their own activations, so a checkpoint around graphed layers does not rebuild what
    a graph holds by calling the layer again."""
    return (getattr(hooks[0], "__module__", None) or "").startswith(_EXACT_HOOK_MODULES)


def hooks_off_if_exact() -> Any:
    """A context with the active saved-tensor hooks off where they are exact (``exact_hooks``);
    others stay on, where the check at each call holds them to the ones of capture."""
    hooks = compat.saved_tensor_hooks()
    return compat.saved_tensor_hooks_off() if hooks is not None and exact_hooks(hooks) else contextlib.nullcontext()


def _hooks_token() -> object:
    """The active saved-tensor hooks as the check compares them: None for none or exact ones,
    else the pack hook."""
    hooks = compat.saved_tensor_hooks()
    return None if hooks is None or exact_hooks(hooks) else hooks[0]


class Settings:
    """The process-wide state a graph's kernels were chosen under: autocast (enabled and
    dtype, for the graph's device type), the numerics flags (``compat.numerics_settings``),
    the saved-tensor hooks (lossy activation compression or CPU offload would change what
    eager autograd saves, which a graph's backward never reads) and, where the forward
    calls scaled-dot-product attention (``sdpa``), the backends allowed."""

    def __init__(self, device_type: str, sdpa: bool = False):
        self.device_type = device_type
        self.sdpa = sdpa
        self.autocast = _autocast(device_type)
        # One C-level pass over getters per call. Captured with autocast off, one call asks
        # whether autocast is on for any device (the per-device getters parse the device
        # string, several times slower); on for another device, the slow path takes it in.
        self._watch(precise=self.autocast[0] or compat.any_autocast_enabled is None)

    def _watch(self, precise: bool) -> None:
        """Take the getters the fast path calls, and what they read now."""
        device_type = self.device_type
        self._autocast_getters = ((functools.partial(torch.is_autocast_enabled, device_type),
                                   functools.partial(torch.get_autocast_dtype, device_type)) if precise
                                  else (compat.any_autocast_enabled,))
        self._getters = (self._autocast_getters + compat.NUMERICS_GETTERS + (_hooks_token,)
                         + (compat.SDPA_GETTERS if self.sdpa else ()))
        self.captured = self.read()

    def read(self) -> tuple:
        return tuple(map(compat.invoke, self._getters))

    def changes(self) -> list[str]:
        """What differs from the capture; a difference that changes nothing the kernels do
        (the autocast dtype while autocast is off, autocast on for another device) is taken in."""
        now = self.read()
        if now == self.captured:
            return []
        found = []
        autocast = _autocast(self.device_type)
        if autocast != self.autocast:
            found.append(
                f"autocast on {self.device_type} is {_autocast_text(autocast)}, but the graph was "
                f"captured with {_autocast_text(self.autocast)}"
            )
        now_any = len(self._autocast_getters) == 1 and bool(now[0])
        now, captured = now[len(self._autocast_getters):], self.captured[len(self._autocast_getters):]
        numerics = len(compat.NUMERICS_SETTINGS)
        for name, then, value in zip(compat.NUMERICS_SETTINGS, captured[:numerics], now[:numerics]):
            if then != value:
                found.append(f"{name} is {value!r}, but was {then!r} at capture")
        if now[numerics] is not captured[numerics]:
            found.append(_hooks_change(captured[numerics], now[numerics]))
        for name, then, value in zip(compat.SDPA_BACKENDS, captured[numerics + 1:], now[numerics + 1:]):
            if then != value:
                found.append(f"the {name} SDPA backend is {'allowed' if value else 'not allowed'} "
                             f"(torch.nn.attention.sdpa_kernel), but {'was' if then else 'was not'} at capture, and "
                             "the forward calls scaled-dot-product attention")
        if not found:  # autocast on for another device: watch this device's own from now on
            self._watch(precise=len(self._autocast_getters) == 2 or now_any)
        return found


def _hooks_change(then: Any, now: Any) -> str:
    if then is None:
        return ("saved-tensor hooks are active (torch.autograd.graph.saved_tensors_hooks or save_on_cpu: "
                "eager autograd would pack what it saves through them, and save_on_cpu brings back copies "
                "whose layout may change the kernels of eager's backward, while the graph's backward reads "
                "its own activations), which they were not at capture")
    if now is None:
        return "the saved-tensor hooks active at capture are not any more"
    return ("other saved-tensor hooks are active than at capture (a saved_tensors_hooks context opened per "
            "step with new hook functions differs from the one graphing ran in): keep one context around "
            "both graphing and the calls, or pass it the same functions")


def _autocast(device_type: str) -> tuple:
    """(enabled, dtype or None) of autocast on ``device_type``."""
    enabled = torch.is_autocast_enabled(device_type)
    return (enabled, torch.get_autocast_dtype(device_type) if enabled else None)


def _autocast_text(state: tuple) -> str:
    return f"on ({state[1]})" if state[0] else "off"

