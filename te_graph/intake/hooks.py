"""Capture-time hooks: hooks that run while graphs are prepared, never replayed.

Transformer Engine's ``capture_time_hooks`` argument (TE 2.20): one entry per callable,
``None`` or a mapping with some of the keys ``forward_pre_hooks``, ``forward_hooks``,
``backward_pre_hooks`` and ``backward_hooks``, each a ``{hook_id: fn}`` dict as
``nn.Module`` keeps its hooks. Every hook is called ``fn(module)`` (the callable graphed)
and must return None.

They run around every warmup forward and backward and once more around each capture,
outside the graph (so they are never recorded and never replayed): the forward-pre hooks
before a forward, the forward hooks after it, and likewise around a backward. With
``order``, the hooks of a layer run for every microbatch of it.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

__all__ = ["CaptureTimeHooks", "normalise_capture_time_hooks", "HOOK_KINDS"]

HOOK_KINDS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


class CaptureTimeHooks:
    """The capture-time hooks of one callable."""

    def __init__(self, where: str, entry: Mapping[str, Any]):
        self.where = where
        unknown = sorted(set(entry) - set(HOOK_KINDS))
        if unknown:
            raise ValueError(
                f"make_graphed_callables: capture_time_hooks for {where} has unknown key(s) "
                f"{unknown}; use {', '.join(HOOK_KINDS)}."
            )
        self.hooks: dict[str, tuple[Callable, ...]] = {}
        for kind in HOOK_KINDS:
            hooks = entry.get(kind) or {}
            if not isinstance(hooks, Mapping) or not all(callable(h) for h in hooks.values()):
                raise TypeError(
                    f"make_graphed_callables: capture_time_hooks[{kind!r}] for {where} must be a "
                    "dict {hook_id: callable}, as nn.Module keeps its hooks."
                )
            self.hooks[kind] = tuple(hooks.values())

    def run(self, kind: str, module: Any) -> None:
        """Call every hook of ``kind`` as ``hook(module)``."""
        for hook in self.hooks[kind]:
            if hook(module) is not None:
                raise RuntimeError(
                    f"make_graphed_callables: a capture-time {kind[:-1].replace('_', ' ')} of "
                    f"{self.where} returned a value; capture-time hooks only observe (nothing "
                    "could replay a change they make). Return None."
                )


def normalise_capture_time_hooks(
    hooks: Optional[Sequence[Optional[Mapping[str, Any]]]], names: Sequence[str]
) -> list[Optional[CaptureTimeHooks]]:
    """One :class:`CaptureTimeHooks` (or None) per callable, checked before anything runs."""
    if hooks is None:
        return [None] * len(names)
    if isinstance(hooks, Mapping) or not isinstance(hooks, Sequence):
        raise TypeError(
            "make_graphed_callables: capture_time_hooks must be a list with one entry (None or a "
            f"dict of hook dicts) per callable; got {type(hooks).__name__}."
        )
    if len(hooks) != len(names):
        raise ValueError(
            f"make_graphed_callables: capture_time_hooks has {len(hooks)} entries for "
            f"{len(names)} callables; give one entry (None or a dict) per callable."
        )
    result: list[Optional[CaptureTimeHooks]] = []
    for where, entry in zip(names, hooks):
        if entry is not None and not isinstance(entry, Mapping):
            raise TypeError(
                f"make_graphed_callables: capture_time_hooks entry for {where} is a "
                f"{type(entry).__name__}; use None or a dict like "
                "{'forward_pre_hooks': {0: fn}}."
            )
        result.append(CaptureTimeHooks(where, entry) if entry else None)
    return result
