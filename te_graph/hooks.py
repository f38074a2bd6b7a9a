"""Capture-time hooks: module-style hooks that run while graphs are prepared, never replayed.

Transformer Engine's ``capture_time_hooks`` argument: one entry per callable, ``None`` or a
mapping with some of these keys, each a ``{hook_id: fn}`` dict as ``nn.Module`` keeps them:

==========================  ===================================================
``forward_pre_hooks``        ``fn(module, args)``, or ``fn(module, args, kwargs)`` when its
                             id is in ``forward_pre_hooks_with_kwargs``
``forward_hooks``            ``fn(module, args, output)``, or
                             ``fn(module, args, kwargs, output)`` when its id is in
                             ``forward_hooks_with_kwargs``
``backward_pre_hooks``       ``fn(module, grad_output)``
``backward_hooks``           ``fn(module, grad_input, grad_output)``
==========================  ===================================================

They run around every warmup forward and backward and once more around each capture,
outside the graph (so they are never recorded and never replayed). They observe: a hook
that returns a value is an error, since nothing could replay the change. With ``order``,
the hooks of a layer run for every microbatch of it.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

__all__ = ["CaptureTimeHooks", "normalise_capture_time_hooks"]

_HOOK_KINDS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")
_KWARG_SETS = ("forward_pre_hooks_with_kwargs", "forward_hooks_with_kwargs")


class CaptureTimeHooks:
    """The capture-time hooks of one callable."""

    def __init__(self, where: str, entry: Mapping[str, Any]):
        self.where = where
        unknown = sorted(set(entry) - set(_HOOK_KINDS) - set(_KWARG_SETS))
        if unknown:
            raise ValueError(
                f"make_graphed_callables: capture_time_hooks for {where} has unknown key(s) "
                f"{unknown}; use {', '.join(_HOOK_KINDS + _KWARG_SETS)}."
            )
        self.hooks: dict[str, dict[Any, Callable]] = {}
        for kind in _HOOK_KINDS:
            hooks = entry.get(kind) or {}
            if not isinstance(hooks, Mapping) or not all(callable(h) for h in hooks.values()):
                raise TypeError(
                    f"make_graphed_callables: capture_time_hooks[{kind!r}] for {where} must be a "
                    "dict {hook_id: callable}, as nn.Module keeps its hooks."
                )
            self.hooks[kind] = dict(hooks)
        self.with_kwargs = {kind: set(entry.get(kind) or ()) for kind in _KWARG_SETS}

    def _run(self, kind: str, calls: Sequence[tuple[Callable, tuple]]) -> None:
        for hook, args in calls:
            if hook(*args) is not None:
                raise RuntimeError(
                    f"make_graphed_callables: a capture-time {kind[:-1].replace('_', ' ')} of "
                    f"{self.where} returned a value; capture-time hooks only observe (nothing "
                    "could replay a change they make). Return None."
                )

    def forward_pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        kw = self.with_kwargs["forward_pre_hooks_with_kwargs"]
        self._run("forward_pre_hooks", [
            (h, (module, args, kwargs) if i in kw else (module, args))
            for i, h in self.hooks["forward_pre_hooks"].items()
        ])

    def forward(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        kw = self.with_kwargs["forward_hooks_with_kwargs"]
        self._run("forward_hooks", [
            (h, (module, args, kwargs, output) if i in kw else (module, args, output))
            for i, h in self.hooks["forward_hooks"].items()
        ])

    def backward_pre(self, module: Any, grad_output: tuple) -> None:
        self._run("backward_pre_hooks", [(h, (module, grad_output)) for h in self.hooks["backward_pre_hooks"].values()])

    def backward(self, module: Any, grad_input: tuple, grad_output: tuple) -> None:
        self._run("backward_hooks", [(h, (module, grad_input, grad_output)) for h in self.hooks["backward_hooks"].values()])


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
