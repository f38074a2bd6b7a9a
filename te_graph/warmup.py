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
(``recompute_rng``). The last pass also finds the outputs each backward reads (autograd
saved them), which a call may not update in place before its backward: it moves their
version counters first, as an in-place update would, and where autograd then refuses the
backward, it finds them one by one and runs the pass again (``_probed_backward``). The
result is one :class:`WarmupRecord` per graph.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import torch
import torch.utils._pytree as pytree

import rng
from checkpointing import is_reentrant_checkpoint_node
from checkpointing.capture_hook import capture_hook_set

from . import compat
from .te_support import FP8Capture, visited_te_modules
from .grads import grads_redirected
from .layout import OutputLayout
from .module_state import InputUpdates, ModuleState, in_memory_of, module_memory, shares_memory, sharing_memory
from .parameters import ForeignLeaves, StandIns
from .recompute_rng import BackwardDraws, ForwardDraws, StreamUse
from .records import GraphSpec, IdleCalls, SavedOutputs, WarmupRecord
from .schedule import FORWARD, Step
from .wgrad import DelayedWgrad, check_no_queued_work, delayed_wgrad_modules, drop_queued_work, learn_wgrad

__all__ = ["warm_up", "grad_mode", "fp8_context", "differentiable", "outputs_fed", "inputs_reached"]


def warm_up(
    specs: Sequence[GraphSpec],
    steps: Sequence[Step],
    num_iters: int,
    allow_unused_input: bool,
    tracker: Any,
    record_draws: bool,
    stand_ins: StandIns,
    state: ModuleState,
    updates: InputUpdates,
    fp8: Optional[FP8Capture] = None,
    find_saved: bool = True,
) -> list[WarmupRecord]:
    """Run the warmup passes over ``specs`` in the forward order of ``steps``; after each
    pass, ``state`` compares what the forwards changed of the modules. ``find_saved``: the
    last pass finds the outputs each backward reads (``_probed_backward``); it must not be
    the first (the user asked for one pass: every output then counts as read)."""
    device = torch.device("cuda", torch.cuda.current_device()) if record_draws else None
    forwards = [step.flat_index for step in steps if step.kind == FORWARD]
    outputs_seen: dict[int, OutputLayout] = {}
    unused_seen: dict[int, tuple[int, ...]] = {}
    updated_seen: dict[int, tuple[int, ...]] = {}
    te_seen: dict[int, tuple] = {}
    wgrad_seen: dict[int, DelayedWgrad] = {}
    idle_seen: dict[int, frozenset] = {}  # parameters the first backward gave no gradient
    fused_seen: dict[int, frozenset] = {}
    fed_seen: dict[int, tuple] = {}  # per output, the outputs whose backward feeds it (outputs_fed)
    saved_seen: dict[int, SavedOutputs] = {}  # the outputs the backward reads (_probed_backward)
    idle_calls_seen: dict[int, Optional[IdleCalls]] = {}  # inputs_reached
    idle_outputs_seen: dict[int, tuple] = {}  # outputs_reaching_inputs
    draws: dict[int, tuple[Optional[StreamUse], Optional[StreamUse]]] = {}
    for iteration in range(num_iters):
        first, last = iteration == 0, iteration == num_iters - 1
        for index in forwards:
            spec = specs[index]
            watch = device if last and record_draws else None
            inputs = updates.watch(spec.static_inputs) if first else None
            # The first pass checks what the backward would accumulate into, before it does.
            leaves = ForeignLeaves(spec.name, spec.static_inputs + stand_ins(spec.params)) if first and spec.needs_backward else None
            visiting = visited_te_modules(spec.func) if first and spec.has_te else contextlib.nullcontext(None)
            guard = fp8.checkpoint_guard(spec.name) if first and fp8 is not None and spec.fp8 else contextlib.nullcontext()
            probing = last and find_saved and spec.needs_backward
            stash = fp8.recompute_stash() if probing and fp8 is not None and spec.fp8 else None
            with leaves if leaves is not None else contextlib.nullcontext():
                with visiting as te_modules, guard:
                    outputs, forward_use = _forward(spec, watch, tracker, leaves, fp8)
                if te_modules is not None:
                    te_seen[index] = tuple(te_modules)
                state.check_not_reassigned()
                if first or last:
                    out = tuple(_tensor_leaves(outputs))
                    state.check_references(spec.owner, spec.static_inputs, out,
                                           tuple(s for s in stand_ins(spec.params) if s is not None))
                if first:
                    _check_first_forward(spec, out)
                    layout = OutputLayout(spec.name, outputs)
                    outputs_seen[index] = layout.without_memory()
                    updated_seen[index] = _check_updated(spec, inputs.close())
                    if spec.needs_backward:
                        fed_seen[index] = outputs_fed(layout.tensors)
                        idle_calls_seen[index] = inputs_reached(layout.tensors, spec.static_inputs)
                        idle_outputs_seen[index] = outputs_reaching_inputs(layout.tensors, spec.static_inputs)
                    del layout
                backward_use = None
                if spec.needs_backward:
                    delayed = delayed_wgrad_modules(te_seen.get(index, ()))
                    known = wgrad_seen.get(index)
                    if probing:
                        saved_seen[index], outputs, forward_use, done = _probed_backward(
                            spec, stand_ins, outputs, forward_use, watch, tracker, delayed, known, fp8, stash)
                    else:
                        if last:  # every output counts as read
                            saved_seen[index] = SavedOutputs(
                                tuple(i for i, o in enumerate(_candidates(spec, outputs)) if o is not None), probed=False)
                        done = _backward(spec, stand_ins, outputs, watch, tracker, delayed, known)
                    unused, backward_use, learned, idle, fused = done
                    if learned is not None:
                        wgrad_seen[index] = learned
                    if leaves is not None:
                        leaves.check_backward()
                    if first:
                        _check_unused(spec, unused, allow_unused_input)
                        unused_seen[index] = unused
                        idle_seen[index] = idle
                        fused_seen[index] = fused
                del outputs
            if watch is not None:
                draws[index] = (forward_use, backward_use)
        state.after_pass(executed=True)
    return [
        WarmupRecord(
            output=outputs_seen[i], unused=unused_seen.get(i, ()), updated=updated_seen[i],
            te_modules=te_seen.get(i, ()), forward_draws=draws.get(i, (None, None))[0],
            backward_draws=draws.get(i, (None, None))[1], wgrad=wgrad_seen.get(i),
            unused_params=idle_seen.get(i, frozenset()),
            fused_params=fused_seen.get(i, frozenset()),
            fed=fed_seen.get(i, ()),
            saved=saved_seen.get(i, SavedOutputs()),
            idle_calls=idle_calls_seen.get(i),
            idle_outputs=idle_outputs_seen.get(i, ()),
        )
        for i in range(len(specs))
    ]


def fp8_context(fp8: Optional[FP8Capture], spec: GraphSpec):
    """Transformer Engine's autocast, which every forward of an FP8 capture runs in (each
    callable's own ``enabled``)."""
    return fp8.autocast(spec.fp8) if fp8 is not None else contextlib.nullcontext()


def grad_mode(spec: GraphSpec):
    """Forward-only graphs run (and are captured) under ``no_grad``."""
    return contextlib.nullcontext() if spec.needs_backward else torch.no_grad()


def differentiable(outputs: Any) -> list[torch.Tensor]:
    return [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]


def _forward(spec: GraphSpec, device, tracker, leaves: Optional[ForeignLeaves], fp8: Optional[FP8Capture]) -> tuple[Any, Optional[StreamUse]]:
    args, kwargs = spec.layout.unflatten(spec.static_inputs)
    draws = ForwardDraws(rng.live_stream_generators(tracker, device)) if device is not None else None
    if spec.hooks is not None:
        spec.hooks.run("forward_pre_hooks", spec.func)
    with capture_hook_set(_WarmupRegions(draws, leaves)), grad_mode(spec), fp8_context(fp8, spec):
        outputs = spec.call(*args, **kwargs)
    if spec.hooks is not None:
        spec.hooks.run("forward_hooks", spec.func)
    if leaves is not None:
        leaves.check_forward(differentiable(outputs))
    return outputs, draws.close() if draws is not None else None


class _WarmupRegions:
    """``checkpointing.capture_hook``'s hook during warmup: the checkpointed regions run as
    eager checkpoints do, observed by the last pass's draw record (``ForwardDraws``) and,
    in the first pass, their recompute checked for foreign leaves (``ForeignLeaves``)."""

    def __init__(self, draws: Optional[ForwardDraws], leaves: Optional[ForeignLeaves]):
        self.draws = draws
        self.leaves = leaves

    def forward_region(self):
        return self.draws.forward_region() if self.draws is not None else contextlib.nullcontext()

    def recomputed(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
        if self.leaves is not None:
            self.leaves.recomputed(outputs, inputs)


def _backward(spec: GraphSpec, stand_ins: StandIns, outputs: Any, device, tracker, delayed: tuple,
              known: Optional[DelayedWgrad]) -> tuple[tuple[int, ...], Optional[StreamUse], Optional[DelayedWgrad],
                                                      frozenset, frozenset]:
    """The backward, and the weight-gradient pass of modules that delay it (``wgrad``): the
    unused inputs, the streams drawn from, what the weight-gradient pass set, the parameters
    it gave no gradient, and those whose gradient a kernel accumulated into main_grad."""
    out = differentiable(outputs)
    grads = [torch.zeros_like(o) for o in out]
    draws = BackwardDraws(rng.live_stream_generators(tracker, device)) if device is not None else None
    for s in stand_ins(spec.params):
        if "grad_added_to_main_grad" in s.__dict__:
            s.grad_added_to_main_grad = False  # this backward sets it again, or not
    if spec.hooks is not None:
        spec.hooks.run("backward_pre_hooks", spec.func)
    stand = stand_ins(spec.params)
    try:
        try:
            with grads_redirected(spec.grad_inputs):
                if out:
                    torch.autograd.backward(out, grads)
                # Read before the .grads are put back.
                unused = tuple(i for i, t in enumerate(spec.static_inputs) if t.requires_grad and t.grad is None)
        finally:  # around every backward, a refused probe's too (hooks may pair up)
            if spec.hooks is not None:
                spec.hooks.run("backward_hooks", spec.func)
        # A kernel that accumulated the weight gradient into main_grad itself says so with
        # Megatron's flag (Transformer Engine's fuse_wgrad_accumulation; set on the stand-in).
        fused = frozenset(i for i, s in enumerate(stand) if s.__dict__.get("grad_added_to_main_grad") is True)
        learned = learn_wgrad(delayed, spec.params, stand, known) if delayed else None
        if delayed:
            check_no_queued_work(delayed, f"after {spec.name}'s weight-gradient pass in warmup: it runs more "
                                 "than once in one forward, which te_graph cannot graph")
        idle = frozenset(i for i, p in enumerate(stand) if p.grad is None)  # eager leaves their .grad alone
    finally:
        for p in stand:
            p.grad = None  # throwaway: the next pass (or a probe's retry) starts clean
            if "grad_added_to_main_grad" in p.__dict__:
                p.grad_added_to_main_grad = False
    return unused, draws.close() if draws is not None else None, learned, idle, fused


def _candidates(spec: GraphSpec, outputs: Any) -> list[torch.Tensor]:
    """The outputs an in-place update could make a backward refuse, one per output of the
    layout (``OutputLayout.tensors``), None where it cannot: the module's own memory (a view
    of a parameter or buffer, whose version counter is theirs). Outputs without grad count
    (a router's top-k indices, which the backward reads; a detached alias of an output)."""
    own = module_memory(spec.func)
    return [None if in_memory_of(o, own) else o for o in OutputLayout(spec.name, outputs).tensors]


def _probed_backward(spec: GraphSpec, stand_ins: StandIns, outputs: Any, forward_use: Optional[StreamUse], device,
                     tracker, delayed: tuple, known: Optional[DelayedWgrad], fp8: Optional[FP8Capture],
                     stash: Optional[list]) -> tuple[SavedOutputs, Any, Optional[StreamUse], tuple]:
    """The last pass's backward, run after moving the version counter of every output, as an
    in-place update of them would: where it runs through, the backward reads no output and
    this was the pass's backward. Where autograd refuses it, the outputs it refuses are
    found one by one and the pass's forward and backward run again. Counted as read: an
    output a saved tensor shares its version counter with, and a view a custom Function
    returned (eager autograd refuses any in-place update of it). Returns the outputs read,
    the pass's outputs and draws, and what ``_backward`` found."""
    candidates = _candidates(spec, outputs)
    # A view whose in-place update eager autograd refuses at once (a custom Function's, as a
    # reentrant checkpoint returns) counts as read without a probe, which could only fail.
    # So does an output requiring grad that shares memory with another (a view of it, or it
    # of the other): eager autograd carries an in-place update of one into the other's
    # history, which the outputs handed out, viewing the graph's memory each on its own,
    # cannot. (Without grad, an update changes values only, which they share.)
    shared = sharing_memory([o if o is not None and o.requires_grad else None for o in candidates])
    refused = tuple(i for i, o in enumerate(candidates) if o is not None and (
        i in shared or (o.requires_grad and compat.view_update_refused(o))))
    probe = [i for i, o in enumerate(candidates) if o is not None and i not in refused]
    for i in probe:
        _bump(candidates[i])
    del candidates
    try:
        done = _backward(spec, stand_ins, outputs, device, tracker, delayed, known)
        return SavedOutputs(refused), outputs, forward_use, done
    except RuntimeError as error:
        if not compat.is_inplace_refusal(error):
            raise
    # The refused backward ran part of the graph at most: what the forward left for the
    # backward to take (a weight-gradient pass's queue, TE's recompute stash, ``stash``: as
    # it was before that forward) is dropped before the pass runs again.
    _forget_forward(delayed, fp8, stash)
    del outputs
    read = tuple(probe) if len(probe) == 1 else tuple(
        i for i in probe if _reads(spec, i, stand_ins, tracker, delayed, known, fp8, stash))
    read = read or tuple(probe)  # refused only together (outputs sharing a version counter): all count
    outputs, forward_use = _forward(spec, device, tracker, None, fp8)
    done = _backward(spec, stand_ins, outputs, device, tracker, delayed, known)
    return SavedOutputs(tuple(sorted(read + refused))), outputs, forward_use, done


def _bump(t: torch.Tensor) -> None:
    """Move ``t``'s version counter as an in-place update would, through a detached alias
    (which shares the counter): on the output itself, a view a custom Function made, torch
    raises (an in-place update of it would have to rebase its custom backward)."""
    compat.bump_version(t.detach())


def _forget_forward(delayed: tuple, fp8: Optional[FP8Capture], stash: Optional[list]) -> None:
    """After a backward autograd refused: what its forward left for it is let go."""
    drop_queued_work(delayed)
    if stash is not None:
        fp8.restore_recompute_stash(stash)


def _reads(spec: GraphSpec, index: int, stand_ins: StandIns, tracker, delayed: tuple, known: Optional[DelayedWgrad],
           fp8: Optional[FP8Capture], stash: Optional[list]) -> bool:
    """Whether the backward reads output ``index``: a forward, that output's version counter
    moved, and a backward that autograd refuses or runs through."""
    outputs, _ = _forward(spec, None, tracker, None, fp8)
    _bump(_candidates(spec, outputs)[index])
    try:
        _backward(spec, stand_ins, outputs, None, tracker, delayed, known)
    except RuntimeError as error:
        if not compat.is_inplace_refusal(error):
            raise
        _forget_forward(delayed, fp8, stash)
        return True
    return False


def inputs_reached(tensors: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Optional[IdleCalls]:
    """The inputs (indices) whose gradient a backward from the outputs reaches, where it
    reaches no other leaf; None where it reaches one (a parameter), or an output is a leaf.

    Eager autograd makes an output require grad only where it was computed from a tensor
    that does: where every path from the outputs ends at inputs, a call whose inputs of
    these require no grad gives outputs that require none, and no backward (a reentrant
    checkpoint of a layer, whose parameters are no edge of its node, trains nothing then;
    te_graph's own refuses such a call, ``refused``). Read from the autograd graph of the
    first warmup forward, without running it."""
    positions = {id(t): i for i, t in enumerate(inputs) if t.requires_grad}
    starts = []
    for o in tensors:
        if o.requires_grad:
            if o.grad_fn is None:
                return None
            starts.append(o.grad_fn)
    walked = _inputs_reached_from(starts, positions, cross_functions=True)
    if walked is None:
        return None
    reached, nodes = walked
    return IdleCalls(reached, any(map(is_reentrant_checkpoint_node, nodes)))


def outputs_reaching_inputs(tensors: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> tuple:
    """(output, inputs) for each output whose backward reaches only those inputs, through
    torch's built-in nodes. Eager autograd makes such an output require no grad at a call
    where none of those inputs requires grad, and a loss may leave it out; the graphs,
    captured with a gradient for it, then push zeros into its part of the backward, which
    reach only those inputs' gradients (a built-in node passes gradients to its own inputs
    only), and hand none of them back. A custom Function on the way ends it (a reentrant
    checkpoint's backward reaches parameters through no edge of its node): that output
    keeps requiring grad. So does an output sharing memory with another (a view of it): the
    outputs handed out do not view each other, so an in-place update of one with a tensor
    requiring grad would not reach the other's history, as it does in eager code. Read from
    the autograd graph of the first warmup forward."""
    positions = {id(t): i for i, t in enumerate(inputs) if t.requires_grad}
    shared = sharing_memory(tensors)
    found = []
    for index, o in enumerate(tensors):
        if o.requires_grad and o.grad_fn is not None and index not in shared:
            walked = _inputs_reached_from([o.grad_fn], positions, cross_functions=False)
            if walked is not None and walked[0]:
                found.append((index, walked[0]))
    return tuple(found)


def _inputs_reached_from(starts: list, positions: dict, cross_functions: bool) -> Optional[tuple[frozenset, set]]:
    """The inputs (``positions``: tensor id to index) a backward from the nodes ``starts``
    reaches, and the nodes on the way; None where it reaches another leaf, or, unless
    ``cross_functions``, a custom Function's node."""
    reached: set = set()
    seen: set = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if compat.is_accumulate_grad(node):
            position = positions.get(id(node.variable))
            if position is None:
                return None
            reached.add(position)
            continue
        # (A custom Function of Python's; C++ nodes are all crossed.)
        if not cross_functions and isinstance(node, torch.autograd.function.BackwardCFunction):
            return None
        stack.extend(edge for edge, _ in node.next_functions if edge is not None)
    return frozenset(reached), seen


def outputs_fed(tensors: Sequence[torch.Tensor]) -> tuple[frozenset, ...]:
    """Per output, the other outputs whose backward delivers a gradient to it (they were
    computed from it). Where one of those gets a gradient at a call, a zero gradient for
    this output only adds to theirs where it arrives, which leaves the sum as it is (up to
    the sign of a zero): the backward graph, captured with a gradient for every output, then
    computes what eager autograd computes without this one. megatron-core's MoE layers,
    graphed up to token dispatch, return the router's probabilities beside the permuted ones
    computed from them and use only the latter.

    Read from the autograd graph, without running it: output ``j`` feeds output ``i`` where
    a path from ``j``'s node reaches ``i``'s own slot (its node and output number) through
    torch's built-in nodes only. Two outputs of one node (``torch.linalg.eigh``'s) do not
    feed each other, and a custom ``autograd.Function`` on the way (which may hand back no
    gradient) ends the path: eager autograd would then skip this output's part of the
    backward, where zeros could turn into NaN, so that output must get a gradient at every
    call. The exceptions are the custom Functions of ``_CUSTOM_DELIVERIES``, crossed from the
    outputs whose gradient they are known to pass on."""
    slots = [(t.grad_fn, t.output_nr) if t.requires_grad and t.grad_fn is not None else None for t in tensors]
    if sum(s is not None for s in slots) < 2:
        return tuple(frozenset() for _ in tensors)
    reached = [_slots_reached(*s) if s is not None else frozenset() for s in slots]
    return tuple(
        frozenset(j for j, seen in enumerate(reached) if j != i and slot is not None and slot in seen)
        for i, slot in enumerate(slots)
    )


# Custom autograd Functions known to hand an input a gradient whenever a given output of
# theirs gets one, by the name of their forward class: {output number: positions among the
# forward's tensor inputs (a non-tensor argument has no edge)}. TE's fused MoE permutation
# (TE 2.20 ``permutation.py``, the custom op ``te_moe::permute_mask_map_fwd`` whose autograd
# torch generates): its tensor inputs are the tokens, the routing map and the router's
# probabilities (then the pad offsets, where given), and its backward returns the
# probabilities' gradient wherever they require grad and the permuted probabilities (output
# 2) got one (``_moe_permute_mask_map_backward_wrapper``). megatron-core's MoE layers graphed
# up to token dispatch with ``moe_permute_fusion`` return the router's probabilities beside
# the permuted ones.
_CUSTOM_DELIVERIES = {
    "GeneratedBackwardFor_te_moe_permute_mask_map_fwd_default": {2: (2,)},
}


def _slots_reached(start: Any, output_nr: int) -> frozenset:
    """The (node, output number) slots a backward from output ``output_nr`` of ``start``
    delivers gradients to, through built-in nodes (from any of their outputs) and the custom
    Functions of ``_CUSTOM_DELIVERIES`` (from the outputs named there); any other custom
    Function's node is reached, not crossed."""
    seen: set = set()
    stack, crossed = [(start, output_nr)], {_crossing(start, output_nr)}
    while stack:
        node, entered = stack.pop()
        edges = node.next_functions
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            delivered = _CUSTOM_DELIVERIES.get(getattr(getattr(node, "_forward_cls", None), "__name__", None), {})
            edges = tuple(edges[i] for i in delivered.get(entered, ()) if i < len(edges))
        for edge, nr in edges:
            if edge is None:
                continue
            seen.add((edge, nr))
            if _crossing(edge, nr) not in crossed:
                crossed.add(_crossing(edge, nr))
                stack.append((edge, nr))
    return frozenset(seen)


def _crossing(node: Any, output_nr: int) -> tuple:
    """A built-in node is crossed once, whichever output it is entered from; a custom
    Function's once per output (what it passes on depends on the output)."""
    return (node, output_nr if isinstance(node, torch.autograd.function.BackwardCFunction) else None)


def _tensor_leaves(outputs: Any) -> list[torch.Tensor]:
    return [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor)]


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
