"""The process-wide state a graph's kernels were chosen under, checked at every call of a
graphed callable: autocast, the numerics flags (TF32, reduced-precision reductions,
deterministic algorithms), the saved-tensor hooks active, and, for a forward that calls
scaled-dot-product attention, the SDPA backends allowed."""
from __future__ import annotations

import torch

from .. import compat

__all__ = ["Settings"]


# Saved-tensor hooks that change nothing a graph computes: activation checkpoints around the
# graphed call (torch's, te_graph's, Transformer Engine's drop and recompute what autograd
# saves; the graph keeps its own activations), told apart by the module of the pack hook.
_EXACT_HOOK_MODULES = ("torch.utils.checkpoint", "checkpointing.", "transformer_engine.pytorch.distributed")


def _hooks_token() -> object:
    """The active saved-tensor hooks as the check compares them: None for none (or an
    activation checkpoint's), else the pack hook."""
    hooks = compat.saved_tensor_hooks()
    if hooks is None:
        return None
    pack = hooks[0]
    return None if getattr(pack, "__module__", "").startswith(_EXACT_HOOK_MODULES) else pack


class Settings:
    """The process-wide state a graph's kernels were chosen under: autocast (enabled and
    dtype, for the graph's device type), the numerics flags (``compat.numerics_settings``),
    the saved-tensor hooks (lossy activation compression or CPU offload would change what
    eager autograd saves, which a graph's backward never reads) and, where the forward
    calls scaled-dot-product attention (``sdpa``), the backends allowed."""

    def __init__(self, device_type: str, sdpa: bool = False):
        self.device_type = device_type
        self.sdpa = sdpa
        self.captured = self.read()

    def read(self) -> tuple:
        device = self.device_type
        enabled = torch.is_autocast_enabled(device)
        return ((enabled, torch.get_autocast_dtype(device) if enabled else None) + compat.numerics_settings()
                + (_hooks_token(),) + (compat.sdpa_settings() if self.sdpa else ()))

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
        numerics = 2 + len(compat.NUMERICS_SETTINGS)
        for name, then, value in zip(compat.NUMERICS_SETTINGS, self.captured[2:numerics], now[2:numerics]):
            if then != value:
                found.append(f"{name} is {value!r}, but was {then!r} at capture")
        if now[numerics] is not self.captured[numerics]:
            found.append("saved-tensor hooks are active (torch.autograd.graph.saved_tensors_hooks or save_on_cpu: "
                         "eager autograd would pack what it saves through them, while the graph's backward reads "
                         "its own activations), which they were not at capture" if now[numerics] is not None else
                         "the saved-tensor hooks active at capture are not any more")
        for name, then, value in zip(compat.SDPA_BACKENDS, self.captured[numerics + 1:], now[numerics + 1:]):
            if then != value:
                found.append(f"the {name} SDPA backend is {'allowed' if value else 'not allowed'} "
                             f"(torch.nn.attention.sdpa_kernel), but {'was' if then else 'was not'} at capture, and "
                             "the forward calls scaled-dot-product attention")
        return found


def _autocast_text(state: tuple) -> str:
    return f"on ({state[1]})" if state[0] else "off"

