"""``checkpoint()``: activation recompute with exact random numbers, eagerly and in graphs.

The signature is Transformer Engine's. Two paths:

* reentrant (default): an autograd Function runs the forward without grad, saves only the
  inputs, and in its backward recomputes with grad and calls ``torch.autograd.backward``.
  ``torch.autograd.backward`` is what CUDA-graph capture of a backward must use too, since
  this path refuses ``torch.autograd.grad`` (it cannot hand grads back through it);
* non-reentrant: saved-tensor hooks drop every tensor the forward saves and recompute them
  all on the first unpack.

Both reproduce the forward's random numbers for the recompute (see ``recompute_state``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from .checks import check_call, contexts_from, tracker_from
from .distribute import check_replicated, gather_slices, keep_slice
from .recompute_state import RecomputeState

__all__ = ["checkpoint"]

_GRAD_ERROR = (
    "checkpoint(use_reentrant=True) was reached through torch.autograd.grad() (or "
    ".backward(inputs=...)), which it cannot hand gradients back through. Call .backward() / "
    "torch.autograd.backward() without inputs= instead, or use checkpoint(..., use_reentrant=False)."
)
_NO_GRAD_OUTPUT_ERROR = (
    "checkpoint(): no output of the checkpointed function requires grad, so its backward has "
    "nothing to recompute. Make an input require grad, or call the function without checkpoint()."
)


def checkpoint(
    function: Callable,
    *args: Any,
    use_reentrant: bool = True,
    distribute_saved_activations: bool = False,
    get_rng_state_tracker: Callable[[], Any] | None = None,
    tp_group: Any = None,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in
    the backward with the forward's exact random numbers.

    Args:
        function: the region to recompute. Any output structure (a tensor, a tuple, a
            list or dict of tensors and constants); non-tensor args and kwargs pass through.
        use_reentrant: autograd-Function path (True) or saved-tensor-hooks path (False).
        distribute_saved_activations: keep only this rank's 1/TP slice of the first input
            between forward and backward (needs ``tp_group`` or the default group). The
            first input must be the same on every rank of the group (not a sequence-parallel
            shard); that is checked at every forward.
        get_rng_state_tracker: a function returning the tracker whose streams the region
            forks (ours, Megatron-core's, apex's or TE's: anything with
            get_states/set_states/fork); defaults to ``rng.get_cuda_rng_tracker``.
        tp_group: tensor-parallel process group for ``distribute_saved_activations``.
        context_fn: returns two context managers, entered around the forward and around
            the recompute respectively.

    The arguments are checked before anything runs (``TypeError`` for a function that
    cannot be called, a flag that is not a bool, a tracker getter or ``context_fn`` that is
    not callable or returns the wrong thing), so a bad call changes no state.
    """
    check_call(
        function, args, use_reentrant=use_reentrant,
        distribute_saved_activations=distribute_saved_activations,
        get_rng_state_tracker=get_rng_state_tracker, context_fn=context_fn,
    )
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    tracker = tracker_from(get_rng_state_tracker)
    forward_context, recompute_context = contexts_from(context_fn)
    state = RecomputeState(tracker)
    if use_reentrant:
        tensor_inputs = [a for a in args if isinstance(a, torch.Tensor)]
        if not any(t.requires_grad for t in tensor_inputs):
            raise ValueError(
                "checkpoint(use_reentrant=True): no tensor argument requires grad, so no gradient "
                "would reach the parameters used inside the function. Make an input require grad "
                "or use use_reentrant=False."
            )
        spec = _Spec(function, kwargs, state, forward_context, recompute_context)
        if distribute_saved_activations:
            spec.tp_group = tp_group
        tensors = _ReentrantCheckpoint.apply(spec, *args)
        return spec.rebuild(tensors)
    if distribute_saved_activations:
        raise ValueError(
            "checkpoint(distribute_saved_activations=True) needs use_reentrant=True."
        )
    from .non_reentrant import run_without_reentrant

    return run_without_reentrant(function, args, kwargs, state, forward_context, recompute_context)


class _Spec:
    """Everything the reentrant Function needs besides the tensors it saves.

    The Function hands autograd the tensor leaves of the function's output (so a list or
    dict of tensors gets its gradients too); ``rebuild`` puts them back in their structure.
    """

    def __init__(self, function, kwargs, state, forward_context, recompute_context):
        self.function = function
        self.kwargs = kwargs
        self.state = state
        self.forward_context = forward_context
        self.recompute_context = recompute_context
        self.tp_group: Any = _NOT_DISTRIBUTED
        self.leaves: list = []
        self.structure = None

    def tensor_leaves(self, outputs: Any) -> tuple:
        """Record the output structure; return its tensor leaves. The spec keeps only the
        constants (tensors in it would keep the autograd graph alive in a cycle through
        the node that holds the spec)."""
        leaves, self.structure = pytree.tree_flatten(outputs)
        self.leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        return tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def rebuild(self, tensors: tuple) -> Any:
        tensors = iter(tensors)
        leaves = [next(tensors) if x is _TENSOR else x for x in self.leaves]
        return pytree.tree_unflatten(leaves, self.structure)


_TENSOR = object()  # where a tensor leaf of the output goes
_NOT_DISTRIBUTED = object()


def _enter(context):
    return context if context is not None else contextlib.nullcontext()


def is_reentrant_checkpoint_node(node: Any) -> bool:
    """Whether an autograd node is the backward of ``checkpoint(use_reentrant=True)``: its
    forward refuses a call where no tensor argument requires grad (te_graph mirrors that
    refusal where a graph replays such a forward)."""
    return getattr(node, "_forward_cls", None) is _ReentrantCheckpoint


class _ReentrantCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: _Spec, *args: Any) -> Any:
        ctx.spec = spec
        distributed = spec.tp_group is not _NOT_DISTRIBUTED
        if distributed and isinstance(args[0], torch.Tensor):
            check_replicated(args[0], spec.tp_group)  # before anything runs
        with torch.no_grad(), _enter(spec.forward_context), spec.state.forward():
            outputs = spec.function(*args, **spec.kwargs)
        tensors, ctx.layout = [], []
        for index, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                ctx.layout.append((True, arg.requires_grad))
                if index == 0 and distributed:
                    ctx.first_shape = arg.shape
                    arg = keep_slice(arg, spec.tp_group)
                tensors.append(arg)
            else:
                ctx.layout.append((False, arg))
        ctx.save_for_backward(*tensors)
        return spec.tensor_leaves(outputs)

    @staticmethod
    def backward(ctx, *grads: Any) -> Any:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(_GRAD_ERROR)
        spec = ctx.spec
        saved = iter(ctx.saved_tensors)
        inputs = []
        for index, (is_tensor, value) in enumerate(ctx.layout):
            if not is_tensor:
                inputs.append(value)
                continue
            tensor = next(saved)
            if index == 0 and spec.tp_group is not _NOT_DISTRIBUTED:
                tensor = gather_slices(tensor, ctx.first_shape, spec.tp_group)
            inputs.append(tensor.detach().requires_grad_(value))
        with torch.enable_grad(), _enter(spec.recompute_context), spec.state.recompute():
            outputs = pytree.tree_leaves(spec.function(*inputs, **spec.kwargs))
        outputs = [o for o in outputs if isinstance(o, torch.Tensor)]
        # A capture in preparation checks what this backward will accumulate into, which
        # the forward's autograd graph did not show (the region ran under no_grad).
        spec.state.recomputed(outputs, [i for i in inputs if isinstance(i, torch.Tensor)])
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if not pairs:
            raise RuntimeError(_NO_GRAD_OUTPUT_ERROR)
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(
            i.grad if isinstance(i, torch.Tensor) else None for i in inputs
        )
