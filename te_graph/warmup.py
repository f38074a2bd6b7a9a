"""Warmup: eager passes over the graphs before capture, and what they teach.

``num_warmup_iters`` passes, each forward followed at once by its backward (as torch's own
warmup does): only one graph's activations are alive at a time, so warmup leaves little in
the allocator's cache and capture starts from about the memory a step needs. Lazy
initialisation (cuBLAS handles, autotuning) happens here, outside any graph.

The first pass checks that nothing but the inputs and the modules' parameters requires
grad and that no input is unused; the last pass (graphs only) records which random
streams each forward, backward and checkpointed region draws from, and where
(``recompute_rng``). The result is one :class:`WarmupRecord` per graph.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import torch
import torch.utils._pytree as pytree

import rng
from checkpointing.capture_hook import capture_hook_set

from .grads import grads_redirected
from .layout import OutputLayout
from .module_state import InputUpdates, ModuleBuffers
from .parameters import ForeignLeaves, StandIns
from .recompute_rng import BackwardDraws, ForwardDraws, StreamUse
from .records import GraphSpec, WarmupRecord
from .schedule import FORWARD, Step

__all__ = ["warm_up", "grad_mode", "differentiable"]


def warm_up(
    specs: Sequence[GraphSpec],
    steps: Sequence[Step],
    num_iters: int,
    allow_unused_input: bool,
    tracker: Any,
    record_draws: bool,
    stand_ins: StandIns,
    buffers: ModuleBuffers,
    updates: InputUpdates,
) -> list[WarmupRecord]:
    """Run the warmup passes over ``specs`` in the forward order of ``steps``."""
    device = torch.device("cuda", torch.cuda.current_device()) if record_draws else None
    forwards = [step.flat_index for step in steps if step.kind == FORWARD]
    outputs_seen: dict[int, OutputLayout] = {}
    unused_seen: dict[int, tuple[int, ...]] = {}
    updated_seen: dict[int, tuple[int, ...]] = {}
    draws: dict[int, tuple[Optional[StreamUse], Optional[StreamUse]]] = {}
    for iteration in range(num_iters):
        first, last = iteration == 0, iteration == num_iters - 1
        for index in forwards:
            spec = specs[index]
            watch = device if last and record_draws else None
            inputs = updates.watch(spec.static_inputs) if first else None
            outputs, forward_use = _forward(spec, stand_ins, first, watch, tracker)
            buffers.check_not_reassigned()
            if first:
                outputs_seen[index] = OutputLayout(spec.name, outputs).without_memory()
                updated_seen[index] = _check_updated(spec, inputs.close())
            backward_use = None
            if spec.needs_backward:
                unused, backward_use = _backward(spec, stand_ins, outputs, watch, tracker)
                if first:
                    _check_unused(spec, unused, allow_unused_input)
                    unused_seen[index] = unused
            del outputs
            if watch is not None:
                draws[index] = (forward_use, backward_use)
    return [
        WarmupRecord(outputs_seen[i], unused_seen.get(i, ()), updated_seen[i], *draws.get(i, (None, None)))
        for i in range(len(specs))
    ]


def grad_mode(spec: GraphSpec):
    """Forward-only graphs run (and are captured) under ``no_grad``."""
    return contextlib.nullcontext() if spec.needs_backward else torch.no_grad()


def differentiable(outputs: Any) -> list[torch.Tensor]:
    return [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]


def _forward(spec: GraphSpec, stand_ins: StandIns, first: bool, device, tracker) -> tuple[Any, Optional[StreamUse]]:
    args, kwargs = spec.layout.unflatten(spec.static_inputs)
    draws = ForwardDraws(rng.live_stream_generators(tracker, device)) if device is not None else None
    # In the first pass, before any backward could accumulate into a foreign leaf.
    watcher = ForeignLeaves(spec.static_inputs + stand_ins(spec.params)) if first else None
    if spec.hooks is not None:
        spec.hooks.forward_pre(spec.func, args, kwargs)
    with capture_hook_set(draws), watcher if watcher is not None else contextlib.nullcontext(), grad_mode(spec):
        outputs = spec.call(*args, **kwargs)
    if spec.hooks is not None:
        spec.hooks.forward(spec.func, args, kwargs, outputs)
    if watcher is not None:
        watcher.raise_if_any(spec.name)
    return outputs, draws.close() if draws is not None else None


def _backward(spec: GraphSpec, stand_ins: StandIns, outputs: Any, device, tracker) -> tuple[tuple[int, ...], Optional[StreamUse]]:
    out = differentiable(outputs)
    grads = [torch.zeros_like(o) for o in out]
    draws = BackwardDraws(rng.live_stream_generators(tracker, device)) if device is not None else None
    if spec.hooks is not None:
        spec.hooks.backward_pre(spec.func, tuple(grads))
    with grads_redirected(spec.grad_inputs):
        if out:
            torch.autograd.backward(out, grads)
        grad_inputs = tuple(t.grad for t in spec.grad_inputs)
        # Read before the .grads are put back.
        unused = tuple(i for i, t in enumerate(spec.static_inputs) if t.requires_grad and t.grad is None)
    if spec.hooks is not None:
        spec.hooks.backward(spec.func, grad_inputs, tuple(grads))
    for p in stand_ins(spec.params):
        p.grad = None  # throwaway: the next pass starts clean
    return unused, draws.close() if draws is not None else None


def _check_updated(spec: GraphSpec, updated: tuple[int, ...]) -> tuple[int, ...]:
    """Inputs updated in place are copied back at every replay; a differentiable one is
    refused (autograd records an in-place update of it, which no graph can replay)."""
    for index in updated:
        if spec.static_inputs[index].requires_grad:
            raise ValueError(
                f"make_graphed_callables: {spec.name} updates its {spec.layout.label(index)} in "
                "place, and that sample requires grad. A graph cannot replay what autograd "
                "records for an in-place update of a differentiable input. Pass that input with "
                "requires_grad=False (a cache or a counter needs no gradient), or update a copy "
                "of it inside the callable."
            )
    return updated


def _check_unused(spec: GraphSpec, unused: tuple[int, ...], allow_unused_input: bool) -> None:
    if allow_unused_input or not unused:
        return
    raise ValueError(
        f"make_graphed_callables: input {unused[0]} of {spec.name} requires grad, but no "
        "output depends on it. Pass allow_unused_input=True, or pass it with "
        "requires_grad=False."
    )
