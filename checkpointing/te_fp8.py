"""Transformer Engine's FP8 state across a checkpointed region, as TE's own checkpoint
keeps it (TE 2.20, ``transformer_engine/pytorch/distributed.py``).

The region's forward runs in TE's "activation recompute" mode (its DelayedScaling modules
keep the forward's scales for the recompute), and the recompute re-enters the FP8
autocast the forward ran in, in TE's recompute phase (those modules then quantize with the
forward's scales and leave the amax history alone). Without this, a recompute in the
backward, outside the user's ``te.autocast``, would run the layers in high precision while
their forward ran in FP8.

TE is never imported here: only used when the process already has it.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, ContextManager, Optional

__all__ = ["TEFP8State"]


class TEFP8State:
    """Captured at a checkpointed forward; what the forward and the recompute run in."""

    def __init__(self) -> None:
        self._te = sys.modules.get("transformer_engine.pytorch")
        self.fp8 = False
        self.recipe: Optional[Any] = None
        if self._te is not None:
            from transformer_engine.pytorch.quantization import FP8GlobalStateManager

            self.fp8 = FP8GlobalStateManager.is_fp8_enabled()
            self.recipe = FP8GlobalStateManager.get_fp8_recipe() if self.fp8 else None

    def forward(self) -> ContextManager[None]:
        if self._te is None:
            return contextlib.nullcontext()
        from transformer_engine.pytorch.distributed import activation_recompute_forward

        return activation_recompute_forward(activation_recompute=True, recompute_phase=False)

    def recompute(self) -> ContextManager[None]:
        if self._te is None:
            return contextlib.nullcontext()
        from transformer_engine.pytorch.distributed import activation_recompute_forward

        stack = contextlib.ExitStack()
        stack.enter_context(activation_recompute_forward(activation_recompute=True, recompute_phase=True))
        stack.enter_context(self._te.autocast(enabled=self.fp8, recipe=self.recipe))
        return stack
