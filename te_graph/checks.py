"""Checks on what the user hands to make_graphed_callables, run before anything is changed.

Each error says what is wrong and what to do; docs/troubleshooting.md lists them all.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .layout import InputLayout, describe

EAGER_REPLAY_HINT = (
    "To debug on a machine without graphs, pass eager_replay=True (or set "
    "TE_GRAPH_EAGER_REPLAY=1): it runs the same static-buffer wrapper eagerly."
)


def check_environment(eager_replay: bool) -> None:
    """CUDA graphs need CUDA; autocast's weight cache would be captured stale."""
    if not eager_replay and not torch.cuda.is_available():
        raise RuntimeError(
            "make_graphed_callables: CUDA is not available, and capturing CUDA graphs needs a "
            "CUDA device. " + EAGER_REPLAY_HINT
        )
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        raise RuntimeError(
            "make_graphed_callables: autocast is enabled with its cache, which would bake "
            "stale casts of the weights into the graph. Use "
            "torch.autocast(..., cache_enabled=False)."
        )


def check_modules(callables: Sequence[Callable]) -> None:
    """No hooks (they would run once, at capture), no buffer requiring grad, one mode."""
    modes = {}
    for index, c in enumerate(callables):
        if not isinstance(c, torch.nn.Module):
            continue
        modes.setdefault(c.training, index)
        for name, module in c.named_modules():
            hooks = [
                kind
                for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
                if getattr(module, kind, None)
            ]
            if hooks:
                where = f"submodule {name!r} of callable {index}" if name else f"callable {index}"
                raise ValueError(
                    f"make_graphed_callables: {where} has hooks registered ({', '.join(hooks)}); "
                    "hooks would run only once, during capture. Remove them before graphing "
                    "(hooks registered on the module after graphing are fine)."
                )
        for name, buffer in c.named_buffers():
            if buffer.requires_grad:
                raise ValueError(
                    f"make_graphed_callables: buffer {name!r} of callable {index} requires grad; "
                    "only parameters may be trainable in a graphed module. Make it a Parameter "
                    "or call .requires_grad_(False) on it."
                )
    if len(modes) > 1:
        raise ValueError(
            f"make_graphed_callables: callables are in mixed training modes (callable "
            f"{modes[True]} is in train mode, callable {modes[False]} in eval mode); a graph is "
            "used only in the mode it was captured in. Call .train() or .eval() on all of them."
        )


def check_devices(
    callables: Sequence[Callable], layouts: Sequence[InputLayout], eager_replay: bool
) -> None:
    """Graph capture works on CUDA tensors of one device only."""
    if eager_replay:
        return
    current = torch.cuda.current_device()
    for index, (c, layout) in enumerate(zip(callables, layouts)):
        tensors = list(layout.samples)
        if isinstance(c, torch.nn.Module):
            tensors += list(c.parameters()) + list(c.buffers())
        for t in tensors:
            if t.device.type != "cuda":
                raise ValueError(
                    f"make_graphed_callables: {layout.name} has a tensor on {t.device} "
                    f"({describe(t)}); CUDA graphs capture CUDA tensors only. Move the module "
                    "and its inputs to CUDA. " + EAGER_REPLAY_HINT
                )
            if t.device.index != current:
                raise ValueError(
                    f"make_graphed_callables: {layout.name} has a tensor on {t.device}, but the "
                    f"current device is cuda:{current}; a graph captures work of one device. "
                    "Call torch.cuda.set_device() to the module's device before graphing."
                )


def check_sample_kwargs(sample_args: Sequence[Any], sample_kwargs: Sequence[Any]) -> None:
    """One dict of sample kwargs per tuple of sample args (the planner checks the args)."""
    if len(sample_kwargs) != len(sample_args):
        raise ValueError(
            f"make_graphed_callables: got {len(sample_args)} sample_args but "
            f"{len(sample_kwargs)} sample_kwargs; give one dict of sample kwargs per tuple "
            "of sample args."
        )
