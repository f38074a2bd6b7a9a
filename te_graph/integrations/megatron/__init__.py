"""megatron-core under te_graph's graphs: its helper's path (``helper``: :func:`enable`,
:func:`disable`), its whole training step as one graph (``step``:
:func:`make_graphed_train_step`) and dropless MoE layers in capacity graphs (``moe``). Registered with the
engine's seam (``te_graph.extension``) on import; megatron-core is imported only when used."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ...extension import Extension, register
from . import helper
from .helper import checkpoint, disable, enable, enabled, submodules_run_eagerly, te_checkpoint
from .step import GraphedTrainStep, make_graphed_train_step

__all__ = ["Megatron", "enable", "disable", "enabled", "checkpoint", "te_checkpoint", "submodules_run_eagerly",
           "make_graphed_train_step", "GraphedTrainStep"]


class Megatron(Extension):
    """How megatron-core's layers are entered for capture and replayed by its helper."""

    name = "megatron"

    def capture_entry(self, module: torch.nn.Module) -> Optional[Callable]:
        return helper.capture_entry(module)

    def routes_capture(self, module: torch.nn.Module) -> bool:
        return helper.routes_capture(module)

    def submodules_run_eagerly(self, module: torch.nn.Module) -> frozenset:
        return helper.submodules_run_eagerly(module)

    def manual_hooks(self, module: torch.nn.Module) -> Optional[list]:
        return helper.manual_hooks(module)

    def hooks_run_by_hand(self, module: torch.nn.Module) -> frozenset:
        return helper.hooks_run_by_hand(module)

    def modules_run_by_hand(self, module: torch.nn.Module) -> frozenset:
        return helper.modules_run_by_hand(module)


register(Megatron())
