"""One graph's forward and backward as a warmup pass runs them eagerly: on the parameters'
stand-ins, under the checkpoint hook that watches the recompute regions, inside the
registered precision's autocast, recording which random streams each draws from."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

import rng
from checkpointing.capture_hook import capture_hook_set

from ..grads import grads_redirected
from ..records_tree import tensor_leaves
from ..records import DelayedWgrad, GraphSpec, StreamUse
from .parameters import ForeignLeaves
from .recompute_rng import BackwardDraws, ForwardDraws
from .session import CaptureSession
from .wgrad import check_no_queued_work, learn_wgrad

__all__ = ["GraphPass", "run_forward", "run_backward", "grad_mode", "precision_context", "differentiable",
           "tensor_leaves"]


@dataclass(frozen=True)
class GraphPass:
    """One graph in one warmup pass: what its forward and backward run with."""

    spec: GraphSpec
    session: CaptureSession
    tracker: Any
    device: Optional[torch.device] = None  # record the random draws on it (the last pass, graphs only)
    delayed: tuple = ()  # its modules that delay their weight gradients (``wgrad``)
    known: Optional[DelayedWgrad] = None  # what an earlier pass learned of their pass


def precision_context(precision: Any, spec: GraphSpec):
    """The registered precision's autocast (Transformer Engine's), which every forward of a
    reduced-precision capture runs in (each callable's own ``enabled``)."""
    return precision.autocast(spec.fp8) if precision is not None else contextlib.nullcontext()


def grad_mode(spec: GraphSpec):
    """Forward-only graphs run (and are captured) under ``no_grad``."""
    return contextlib.nullcontext() if spec.needs_backward else torch.no_grad()


def differentiable(outputs: Any) -> list[torch.Tensor]:
    return [o for o in tensor_leaves(outputs) if o.requires_grad]


def run_forward(step: GraphPass, leaves: Optional[ForeignLeaves] = None) -> tuple[Any, Optional[StreamUse]]:
    """The forward on the static inputs; its outputs and the streams it drew from."""
    spec = step.spec
    args, kwargs = spec.layout.unflatten(spec.static_inputs)
    draws = ForwardDraws(rng.live_stream_generators(step.tracker, step.device)) if step.device is not None else None
    if spec.hooks is not None:
        spec.hooks.run("forward_pre_hooks", spec.func)
    with capture_hook_set(_WarmupRegions(draws, leaves)), grad_mode(spec), \
            precision_context(step.session.precision, spec):
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


def run_backward(step: GraphPass, outputs: Any) -> tuple[tuple[int, ...], Optional[StreamUse], Optional[DelayedWgrad],
                                                        frozenset, frozenset]:
    """The backward, and the weight-gradient pass of modules that delay it (``wgrad``): the
    unused inputs, the streams drawn from, what the weight-gradient pass set, the parameters
    it gave no gradient, and those whose gradient a kernel accumulated into main_grad."""
    spec, stand_ins, delayed = step.spec, step.session.stand_ins, step.delayed
    out = differentiable(outputs)
    grads = [torch.zeros_like(o) for o in out]
    draws = BackwardDraws(rng.live_stream_generators(step.tracker, step.device)) if step.device is not None else None
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
        sparse = next((i for i, s in enumerate(stand) if s.grad is not None and s.grad.layout != torch.strided), None)
        if sparse is not None:
            raise ValueError(
                f"make_graphed_callables: the backward of {spec.name} gives a parameter (shape "
                f"{tuple(spec.params[sparse].shape)}) a {stand[sparse].grad.layout} gradient (nn.Embedding(sparse=True)?); "
                "a graph accumulates gradients into dense buffers at fixed addresses. Build the module with dense "
                "gradients (sparse=False), or keep it outside the graphed callable."
            )
        fused = frozenset(i for i, s in enumerate(stand) if s.__dict__.get("grad_added_to_main_grad") is True)
        learned = learn_wgrad(delayed, spec.params, stand, step.known) if delayed else None
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
