"""What warmup reads of each graph's autograd graph, for the replays to act as eager
autograd would: the outputs its backward reads (found by a probe in the last pass, so that
an in-place update of one before the backward is refused as eager refuses it), the inputs
the outputs' backward reaches (calls where none requires grad get no backward), and which
outputs feed others (a loss may leave one out where another delivers its gradient)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from checkpointing import is_reentrant_checkpoint_node

from .. import compat
from ..layout import OutputLayout
from ..memory import in_memory_of, module_memory, sharing_memory
from ..records import GraphSpec, IdleCalls, SavedOutputs, StreamUse
from .passes import GraphPass, run_backward, run_forward
from .wgrad import drop_queued_work

__all__ = ["candidates", "probed_backward", "inputs_reached", "outputs_reaching_inputs", "outputs_fed"]


def candidates(spec: GraphSpec, outputs: Any) -> list[torch.Tensor]:
    """The outputs an in-place update could make a backward refuse, one per output of the
    layout (``OutputLayout.tensors``), None where it cannot: the module's own memory (a view
    of a parameter or buffer, whose version counter is theirs). Outputs without grad count
    (a router's top-k indices, which the backward reads; a detached alias of an output)."""
    own = module_memory(spec.func)
    return [None if in_memory_of(o, own) else o for o in OutputLayout(spec.name, outputs).tensors]


def probed_backward(step: GraphPass, outputs: Any, forward_use: Optional[StreamUse],
                    stash: Optional[list]) -> tuple[SavedOutputs, Any, Optional[StreamUse], tuple]:
    """The last pass's backward, run after moving the version counter of every output, as an
    in-place update of them would: where it runs through, the backward reads no output and
    this was the pass's backward. Where autograd refuses it, the outputs it refuses are
    found one by one and the pass's forward and backward run again. Counted as read: an
    output a saved tensor shares its version counter with, and a view a custom Function
    returned (eager autograd refuses any in-place update of it). ``stash``: the precision's
    recompute stash before the forward. Returns the outputs read, the pass's outputs and
    draws, and what ``run_backward`` found."""
    found = candidates(step.spec, outputs)
    # A view whose in-place update eager autograd refuses at once (a custom Function's, as a
    # reentrant checkpoint returns) counts as read without a probe, which could only fail.
    # So does an output requiring grad that shares memory with another (a view of it, or it
    # of the other): eager autograd carries an in-place update of one into the other's
    # history, which the outputs handed out, viewing the graph's memory each on its own,
    # cannot. (Without grad, an update changes values only, which they share.)
    shared = sharing_memory([o if o is not None and o.requires_grad else None for o in found])
    refused = tuple(i for i, o in enumerate(found) if o is not None and (
        i in shared or (o.requires_grad and compat.view_update_refused(o))))
    probe = [i for i, o in enumerate(found) if o is not None and i not in refused]
    for i in probe:
        _bump(found[i])
    del found
    try:
        done = run_backward(step, outputs)
        return SavedOutputs(refused), outputs, forward_use, done
    except RuntimeError as error:
        if not compat.is_inplace_refusal(error):
            raise
    # The refused backward ran part of the graph at most: what the forward left for the
    # backward to take (a weight-gradient pass's queue, TE's recompute stash, ``stash``: as
    # it was before that forward) is dropped before the pass runs again.
    _forget_forward(step, stash)
    del outputs
    read = tuple(probe) if len(probe) == 1 else tuple(i for i in probe if _reads(step, i, stash))
    read = read or tuple(probe)  # refused only together (outputs sharing a version counter): all count
    outputs, forward_use = run_forward(step)
    done = run_backward(step, outputs)
    return SavedOutputs(tuple(sorted(read + refused))), outputs, forward_use, done


def _bump(t: torch.Tensor) -> None:
    """Move ``t``'s version counter as an in-place update would, through a detached alias
    (which shares the counter): on the output itself, a view a custom Function made, torch
    raises (an in-place update of it would have to rebase its custom backward)."""
    compat.bump_version(t.detach())


def _forget_forward(step: GraphPass, stash: Optional[list]) -> None:
    """After a backward autograd refused: what its forward left for it is let go."""
    drop_queued_work(step.delayed)
    if stash is not None:
        step.session.precision.restore_recompute_stash(stash)


def _reads(step: GraphPass, index: int, stash: Optional[list]) -> bool:
    """Whether the backward reads output ``index``: a forward, that output's version counter
    moved, and a backward that autograd refuses or runs through."""
    quiet = dataclasses.replace(step, device=None)  # no draws recorded
    outputs, _ = run_forward(quiet)
    _bump(candidates(step.spec, outputs)[index])
    try:
        run_backward(quiet, outputs)
    except RuntimeError as error:
        if not compat.is_inplace_refusal(error):
            raise
        _forget_forward(step, stash)
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
