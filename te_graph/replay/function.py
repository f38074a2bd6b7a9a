"""The autograd Function of every graphed call, and ``run``: a call replays as one node
whose backward replays the backward graph, or forward-only where eager autograd would
record no backward."""
from __future__ import annotations

from typing import Any

import torch

from .. import compat
from ..guards.settings import hooks_off_if_exact
from .refusals import DOUBLE_BACKWARD, check_saved_outputs, forward_only_error
from .runner import Runner

__all__ = ["run", "ReplayBackward"]


class _Replay(torch.autograd.Function):
    """The autograd node of one call of a graphed callable."""

    @staticmethod
    def forward(ctx, runner: Runner, through_autograd: bool, is_first_microbatch: Any, *inputs: torch.Tensor) -> tuple:
        tensors = inputs[: len(runner.static_inputs)]
        invocation, outputs = runner.forward(tensors, through_autograd, True, is_first_microbatch)
        ctx.runner = runner
        ctx.invocation = invocation
        ctx.width = len(inputs)  # the inputs and the tensors beside them (``Runner.extra``)
        ctx.set_materialize_grads(False)
        if runner.non_differentiable or invocation.idle:
            ctx.mark_non_differentiable(*(outputs[i] for i in runner.non_differentiable + invocation.idle))
        if runner.saved.indices:
            ctx.save_for_backward(*(outputs[i] for i in runner.saved.indices))
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        runner = ctx.runner
        if torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD.format(name=runner.name))
        # (A second backward without retain_graph has freed them: _check_fresh refuses it.)
        if runner.saved.indices and (ctx.invocation.backwards == 0 or runner.retains_graph):
            check_saved_outputs(runner, ctx)
        return (None, None, None) + runner.backward(ctx.invocation, grads)[: ctx.width]


ReplayBackward = compat.backward_node_class(_Replay)  # the autograd node class of every graphed call


_apply_directly = compat.direct_apply(_Replay)


_functorch_active = compat.functorch_active
_saved_tensor_hooks = compat.saved_tensor_hooks


def run(runner: Runner, tensors: list, is_first_microbatch: Any = None, through_autograd: bool = False) -> tuple:
    """Replay ``runner`` for one call: an autograd node when a backward may follow.
    ``is_first_microbatch`` is Transformer Engine's per-call keyword (its weight cache);
    ``through_autograd``: the parameter gradients go through the node (the verifier's calls)."""
    if not runner.differentiable:
        if torch.is_grad_enabled() and (runner.params or any(t.requires_grad for t in tensors)):
            raise forward_only_error(runner)
        return runner.forward(tuple(tensors), False, False, is_first_microbatch)[1]
    if not torch.is_grad_enabled():
        return runner.forward(tuple(tensors), False, False, is_first_microbatch)[1]
    if runner.idle_unless is not None and not any(tensors[i].requires_grad for i in runner.idle_unless):
        # Nothing the outputs were computed from requires grad at this call: eager autograd
        # records no backward, and neither does the replay (the copies into the static
        # inputs, which require grad, are not recorded either).
        if runner.idle_refused:
            raise ValueError(
                f"{runner.name}: no input its outputs are computed from requires grad at this call, and its "
                "forward runs checkpoint(use_reentrant=True), which eager code refuses then: no gradient "
                "would reach the parameters used inside the checkpointed function. Make an input require "
                "grad, call it under torch.no_grad(), or use use_reentrant=False."
            )
        with torch.no_grad():
            return runner.forward(tuple(tensors), False, False, is_first_microbatch)[1]
    through_autograd = through_autograd or runner.through_autograd()
    extra = runner.extra(through_autograd)
    apply = _Replay.apply if _functorch_active() else _apply_directly
    if _saved_tensor_hooks() is None:
        return apply(runner, through_autograd, is_first_microbatch, *tensors, *extra)
    # The node saves its outputs only to find in-place writes to them, and its backward reads
    # the graph's own: a checkpoint around it would rebuild them by calling the layer again,
    # during the backward, while this call's backward waits.
    with hooks_off_if_exact():
        return apply(runner, through_autograd, is_first_microbatch, *tensors, *extra)

