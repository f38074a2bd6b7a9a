"""Warmup: eager passes over the graphs before capture, and what they teach.

``num_warmup_iters`` passes, each forward followed at once by its backward (as torch's own
warmup does) and, for Transformer Engine modules that delay their weight gradients, by
their ``backward_dw()``, which teaches what that pass sets (``wgrad``). Only one graph's
activations are alive at a time, so warmup leaves little in the allocator's cache and
capture starts from about the memory a step needs. Lazy initialisation (cuBLAS handles,
autotuning) happens here, outside any graph.

The first pass checks that nothing but the inputs and the modules' parameters requires
grad and that no input is unused; the last pass (graphs only) records which random
streams each forward, backward and checkpointed region draws from, and where
(``recompute_rng``), and finds the outputs each backward reads (``backward_reads``). The
result is one ``WarmupRecord`` per graph.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from .. import compat
from ..extension import SEAM
from ..layout import OutputLayout
from ..memory import shares_memory
from ..planning.schedule import FORWARD, Step
from ..records import GraphSpec, SavedOutputs, WarmupRecord
from .backward_reads import candidates, inputs_reached, outputs_fed, outputs_reaching_inputs, probed_backward
from .parameters import ForeignLeaves
from .passes import GraphPass, run_backward, run_forward, tensor_leaves
from .session import CaptureOptions, CaptureSession
from .wgrad import delayed_wgrad_modules

__all__ = ["warm_up"]


def warm_up(specs: Sequence[GraphSpec], steps: Sequence[Step], options: CaptureOptions,
            session: CaptureSession) -> list[WarmupRecord]:
    """Run ``options.passes`` warmup passes over ``specs`` in the forward order of ``steps``;
    after each pass, ``session.state`` compares what the forwards changed of the modules.
    Where ``options.finds_saved``, the last pass finds the outputs each backward reads."""
    device = None if options.eager_replay else torch.device("cuda", torch.cuda.current_device())
    forwards = [step.flat_index for step in steps if step.kind == FORWARD]
    found: dict[int, dict] = {i: {} for i in forwards}  # per graph: WarmupRecord's fields as learned
    for iteration in range(options.passes):
        first, last = iteration == 0, iteration == options.passes - 1
        for index in forwards:
            _one_graph(specs[index], found[index], first, last, device if last else None, options, session)
        session.state.after_pass(executed=True)
    return [WarmupRecord(**found.get(i, {})) for i in range(len(specs))]


def _one_graph(spec: GraphSpec, learned: dict, first: bool, last: bool, device: Optional[torch.device],
               options: CaptureOptions, session: CaptureSession) -> None:
    """One graph's forward and backward in one pass, and what they teach (into ``learned``)."""
    stand_ins, precision = session.stand_ins, session.precision
    inputs = session.updates.watch(spec.static_inputs) if first else None
    # The first pass checks what the backward would accumulate into, before it does.
    leaves = ForeignLeaves(spec.name, spec.static_inputs + stand_ins(spec.params)) if first and spec.needs_backward else None
    visiting = SEAM.visited_modules(spec.func) if first and spec.framework_modules else contextlib.nullcontext(None)
    reduced = precision is not None and spec.fp8
    guard = precision.checkpoint_guard(spec.name) if first and reduced else contextlib.nullcontext()
    probing = last and options.finds_saved and spec.needs_backward
    stash = precision.recompute_stash() if probing and reduced else None
    step = GraphPass(spec, session, options.tracker, device,
                     delayed_wgrad_modules(learned.get("framework_modules", ())), learned.get("wgrad"))
    with leaves if leaves is not None else contextlib.nullcontext():
        with visiting as modules, guard:
            outputs, forward_use = run_forward(step, leaves)
        if modules is not None:
            learned["framework_modules"] = tuple(modules)
            step = GraphPass(spec, session, options.tracker, device, delayed_wgrad_modules(tuple(modules)),
                             learned.get("wgrad"))
        session.state.check_not_reassigned()
        if first or last:
            out = tuple(tensor_leaves(outputs))
            session.state.check_references(spec.owner, spec.static_inputs, out,
                                           tuple(s for s in stand_ins(spec.params) if s is not None))
        if first:
            _check_first_forward(spec, out)
            layout = OutputLayout(spec.name, outputs)
            learned["output"] = layout.without_memory()
            learned["updated"] = _check_updated(spec, inputs.close())
            if spec.needs_backward:
                learned["fed"] = outputs_fed(layout.tensors)
                learned["idle_calls"] = inputs_reached(layout.tensors, spec.static_inputs)
                learned["idle_outputs"] = outputs_reaching_inputs(layout.tensors, spec.static_inputs)
            del layout
        backward_use = None
        if spec.needs_backward:
            if probing:
                learned["saved"], outputs, forward_use, done = probed_backward(step, outputs, forward_use, stash)
            else:
                if last:  # every output counts as read
                    learned["saved"] = SavedOutputs(
                        tuple(i for i, o in enumerate(candidates(spec, outputs)) if o is not None), probed=False)
                done = run_backward(step, outputs)
            unused, backward_use, wgrad, idle, fused = done
            if wgrad is not None:
                learned["wgrad"] = wgrad
            if leaves is not None:
                leaves.check_backward()
            if first:
                _check_unused(spec, unused, options.allow_unused_input)
                learned["unused"] = unused
                learned["unused_params"] = idle
                learned["fused_params"] = fused
        del outputs
    if device is not None:
        learned["forward_draws"], learned["backward_draws"] = forward_use, backward_use


def _check_first_forward(spec: GraphSpec, outputs: Sequence[torch.Tensor]) -> None:
    """What the first forward shows that no replay could do: hooks it registered on its
    inputs (they would stay on te_graph's static buffers and never see a call's input), and
    outputs that are its inputs (a graph's outputs are its own buffers)."""
    for index, t in enumerate(spec.static_inputs):
        if compat.tensor_hooks(t) or t.retains_grad or (compat.HAS_POST_ACCUMULATE_HOOKS and compat.post_accumulate_hooks(t)):
            raise ValueError(
                f"make_graphed_callables: the forward of {spec.name} registers a hook on its "
                f"{spec.layout.label(index)} (register_hook, retain_grad, ...); it would stay on "
                "te_graph's static input buffer and never see the tensor a call passes. Register "
                "the hook on the input before calling the graphed callable, or on an activation "
                "inside the forward."
            )
    for position, o in enumerate(outputs):
        for index, t in enumerate(spec.static_inputs):
            if shares_memory(o, t):
                raise ValueError(
                    f"make_graphed_callables: {spec.name} returns its {spec.layout.label(index)} (or "
                    f"a view of it) as output {position}; a graph's outputs are buffers of its own, so "
                    "this output would be te_graph's static input buffer, overwritten at the next "
                    "call, instead of your tensor. Return a copy (x.clone()), or leave the input out "
                    "of the outputs (the caller has it)."
                )


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

