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
from typing import Any, Iterator, Optional, Sequence

import torch

from .. import compat
from ..extension import SEAM
from ..guards.reads import ForwardReads, reads_recorded
from ..layout import OutputLayout
from ..memory import shares_memory, storage_of
from ..planning.schedule import FORWARD, Step
from ..records import GraphSpec, SavedOutputs, WarmupRecord
from .backward_reads import candidates, inputs_reached, outputs_fed, outputs_reaching_inputs, probed_backward
from .module_state import attribute_tensors
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
    module = [spec.func] if isinstance(spec.func, torch.nn.Module) else []
    recording = reads_recorded(module, session.reads.setdefault(spec.owner, ForwardReads())) if first \
        else contextlib.nullcontext()
    # The first pass watches what the forward touches outside its modules (``host_state``).
    state = _module_state(spec) if first else ()
    host = session.host.watching(spec.name, options.tracker, _module_tensors(spec, stand_ins), state,
                                 spec.static_inputs) if first \
        else contextlib.nullcontext()
    with recording, leaves if leaves is not None else contextlib.nullcontext():
        with visiting as modules, guard, host, _first_forward(spec.name) if first else contextlib.nullcontext():
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
            learned["state_access"] = session.host.state_access(spec.name)
            on_state = {storage_of(t) for t in state} - {None}
            learned["inputs_on_state"] = tuple(i for i, t in enumerate(spec.static_inputs) if storage_of(t) in on_state)
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
    if first and spec.needs_backward:
        learned["grad_mode_dependent"] = has_grad_mode_fast_path(spec.func)
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


def _module_state(spec: GraphSpec) -> tuple:
    """The buffers and tensor attributes of its modules whose state no framework keeps, whose
    reads and writes the first pass orders (``records.StateAccess``)."""
    if not isinstance(spec.func, torch.nn.Module):
        return ()
    return tuple(t for m in spec.func.modules() if not SEAM.keeps_own_state(m)
                 for t in (*m.buffers(recurse=False), *attribute_tensors(m)))


def _module_tensors(spec: GraphSpec, stand_ins: Any) -> list[torch.Tensor]:
    """The tensors a forward may update in place that are its own: its static inputs, its
    modules' parameters (and their stand-ins), buffers and tensor attributes (one container
    deep: Transformer Engine keeps its FP8 meta in a dict)."""
    found = list(spec.static_inputs) + [s for s in stand_ins(spec.params) if s is not None]
    if isinstance(spec.func, torch.nn.Module):
        for m in spec.func.modules():
            found += list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
            for value in list(m.__dict__.values()):
                items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
                found += [t for t in items if isinstance(t, torch.Tensor)]
    return found


@contextlib.contextmanager
def _first_forward(name: str) -> Iterator[None]:
    """The first forward on the sample inputs: an error torch raises there (a dtype the
    module does not take, a meta tensor) is told as the forward's; autograd's refusal of an
    in-place update of an input that requires grad becomes te_graph's."""
    try:
        yield
    except RuntimeError as error:
        if "a leaf Variable that requires grad is being used in an in-place operation" in str(error):
            raise ValueError(
                f"make_graphed_callables: the forward of {name} updates an input that requires grad in place (an "
                "in-place dropout or activation on its input?). A graph cannot replay what autograd records for an "
                "in-place update of a differentiable input: the caller's tensor would get the new values without "
                "their history. Use the out-of-place op (inplace=False), or pass that input without grad."
            ) from error
        if not str(error).startswith(("make_graphed_callables", "checkpoint")) and hasattr(error, "add_note"):
            error.add_note(f"(te_graph: raised by the forward of {name} on its sample inputs, in the first warmup "
                           "pass of make_graphed_callables; the same call would raise eagerly)")
        raise


# torch's modules whose forward takes another path under torch.no_grad() (a fused "fast path",
# other kernels, other rounding) where it takes the differentiable one with grad enabled.
_FAST_PATHS = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerEncoder)


def has_grad_mode_fast_path(func: Any) -> bool:
    """Whether ``func`` holds a module that computes otherwise under ``torch.no_grad()``: a
    call under no_grad then runs it eagerly, as eager code would, instead of replaying the
    differentiable program captured with grad enabled."""
    return isinstance(func, torch.nn.Module) and any(isinstance(m, _FAST_PATHS) for m in func.modules())
