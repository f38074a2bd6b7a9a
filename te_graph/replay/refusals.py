"""The per-call refusals of a graphed callable (graphs and eager replay alike): each
raises, before the replay changes anything, where the replay would part from eager code,
saying what to do instead."""
from __future__ import annotations

from typing import Any

import torch

from .. import compat, grads
from ..memory import address_range, storage_of
from .copy_in import overlap
from .order import shapes_text

__all__ = ["DOUBLE_BACKWARD", "forward_only_error", "missing_gradient", "check_in_graph_backward",
           "check_updated_apart", "check_saved_outputs", "check_fresh"]


DOUBLE_BACKWARD = (
    "{name}: double backward (create_graph=True, or torch.autograd.grad(..., "
    "create_graph=True)) through a graphed callable is not supported: its backward is a "
    "replayed graph, whose gradients autograd cannot differentiate again. Compute "
    "higher-order gradients with the module's eager forward (module.forward.__wrapped__)."
)



def forward_only_error(runner: Any) -> ValueError:
    return ValueError(
        f"{runner.name}: called with grad enabled where its result would require grad (an "
        "input requires grad, or the module has trainable parameters), but it was graphed "
        "without a backward (under torch.no_grad(), or with nothing requiring grad). Call it "
        "under torch.no_grad(), or graph it with grad enabled and samples whose "
        "requires_grad matches the real inputs."
    )



def missing_gradient(runner: Any, invocation: Any, grads: tuple) -> Any:
    """The first differentiable output that got no gradient in this backward, where no
    output whose backward feeds it got one (``capture.backward_reads.outputs_fed``); None
    where every one is covered (zeros pushed through a fed output's part leave the sum as
    it is)."""
    return next((i for i, g in enumerate(grads) if g is None and i not in runner.non_differentiable
                 and i not in invocation.idle and not any(grads[j] is not None for j in runner.fed[i])), None)


def check_in_graph_backward(runner: Any, invocation: Any) -> None:
    """Before a backward whose parameter gradients the graph (or eager replay's nested
    backward) adds to ``.grad`` itself, as its forward chose where nothing observed them:
    no hook was put on a parameter since, which the graph would skip. (Another use of a
    parameter in the same backward is ``in_graph``'s check.) One counter read."""
    if invocation.hooks_seen != compat.hook_handles_made() and grads.hooked(runner.accumulated):
        raise RuntimeError(
            f"{runner.name}: a gradient hook (or main_grad) was put on one of its parameters after "
            "this call's forward and before its backward; the forward, finding none, left the "
            "parameters' gradients to the graph, which adds them to .grad without autograd and "
            "would skip the hook, while eager autograd runs it. Register parameter hooks before "
            "the forward, or pass accumulate_grads_in_graph=False to make_graphed_callables."
        )


def check_updated_apart(runner: Any, inputs: tuple[torch.Tensor, ...]) -> None:
    """Each input the forward updates in place overlaps no other input's bytes, and no input
    lies on its modules' state where the forward writes one of the two before it reads the
    other (a buffer passed in as an argument; ``records.StateAccess``): each input is read
    from a buffer of its own, so it would not see the update that eager code sees through the
    shared memory. (Disjoint slices of one buffer pass; strided views whose address ranges
    interleave are refused, without looking at each byte.)"""
    for index in runner.inputs_on_state:
        if not runner.input_slots[index].holds(inputs[index]):
            raise RuntimeError(
                f"{runner.name}: input {index} was graphed with a tensor of its module as its sample (a "
                "buffer or a tensor attribute), which is the graph's input buffer: this call, with another "
                "tensor, would copy into the module's state. Graph it with a copy as the sample (.clone()), "
                "or pass that tensor at every call."
            )
    access = runner.state_access
    for index, t in enumerate(inputs if access is not None else ()):
        if not isinstance(t, torch.Tensor) or runner.input_slots[index].holds(t):
            continue  # (its static buffer: the graph reads and writes it there, as eager code)
        storage = storage_of(t)  # (memory shared is one storage)
        if storage in access.storages and access.hazard(index, *address_range(t), storage):
            raise RuntimeError(
                f"{runner.name}: input {index} shares memory with a tensor of its module (a buffer or a "
                "tensor attribute), and the forward updates one of the two in place before it reads the "
                "other; eager code would see the update through the shared memory, but the graph reads "
                "each input from a buffer of its own. Pass a copy (.clone()), or read that state from "
                "the module inside the forward."
            )
    for index in runner.updated:
        t = inputs[index]
        for other, u in enumerate(inputs):
            if other != index and overlap(t, u):
                raise RuntimeError(
                    f"{runner.name}: inputs {index} and {other} share memory, and the forward updates "
                    f"input {index} in place; eager code would see the update through input {other} "
                    "too, but the graph reads each input from a buffer of its own. Pass tensors that "
                    "do not share memory (a .clone() of one)."
                )


def check_saved_outputs(runner: Any, node: Any) -> None:
    """Before the backward of a call whose outputs its backward reads (``saved``): none
    was updated in place since the forward. The call's node saved them, so autograd's
    own version check finds an update, as it does for eager code."""
    try:
        node.saved_tensors
    except RuntimeError as error:
        if not compat.is_saved_version_error(error):
            raise
        unknown = "" if runner.saved.probed else (
            " (with num_warmup_iters=1 te_graph cannot tell which outputs the backward reads, and takes "
            "every one as read; graph with num_warmup_iters >= 2 if the updated output is not)")
        raise RuntimeError(
            f"{runner.name}: an output of this call was updated in place after its forward, and the backward "
            "reads that output (one of the variables needed for gradient computation has been modified by "
            "an inplace operation), or it is a view whose update eager autograd refuses (one a custom "
            "Function or a multi-output operation returned): eager autograd refuses these too. Or it "
            "shares memory with another output (a view of it), whose history eager autograd changes with "
            f"it and a graph's outputs cannot{unknown}. Update a copy of the output (y = y + ...) instead."
        ) from error


def check_fresh(runner: Any, invocation: Any) -> None:
    invocation.backwards += 1
    if invocation.backwards > 1 and not runner.retains_graph:
        raise RuntimeError(
            f"{runner.name}: a second backward through the same call needs the captured "
            "autograd graph, which was freed after capture. Pass "
            "retain_graph_in_backward=True to make_graphed_callables."
        )
    if invocation.generation != runner.generation:
        raise RuntimeError(
            f"{runner.name}: this backward belongs to a forward replay whose activations a later "
            "forward replay of the same graph has overwritten. Run each backward before the "
            "graph's next forward, or capture one graph per microbatch (order=...)."
        )
    if invocation.tick != runner.clock.tick:
        raise RuntimeError(
            f"{runner.name}: this backward belongs to a forward replay of shape "
            f"{shapes_text(runner.shape)}, but since then graphs of another sample set (shape "
            f"{shapes_text(runner.clock.shape)}) replayed, and the graphs of every shape share one "
            "memory pool, so they overwrote its activations. Run the backwards of one shape "
            "before the forwards of another (one shape per step)."
        )

