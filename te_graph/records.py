"""The records one graph's state flows through, each frozen and complete when made:

    GraphSpec (what to capture) -> WarmupRecord (what warmup learned)
        -> GraphPlan (``plan``: buffers shared with other graphs)
        -> CapturedGraph (what capture produced; what the replay runner holds)

``make_spec`` builds a spec from the user's callable and samples; ``warmup`` makes the
warmup records, ``plan`` the plans and ``capture`` the captured graphs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .grads import ParamGrads
from .hooks import CaptureTimeHooks
from .te_support import te_modules_in
from .layout import InputLayout, OutputLayout
from .recompute_rng import StreamUse
from .wgrad import DelayedWgrad

__all__ = ["GraphSpec", "make_spec", "WarmupRecord", "CapturedGraph"]


@dataclass(frozen=True)
class GraphSpec:
    """One graph pair to capture: a callable with one set of static inputs."""

    name: str  # "callable 2 (GPTBlock)", with ", microbatch 1" under an order
    owner: str  # the callable's part of the name: "callable 2 (GPTBlock)"
    func: Callable  # what the user passed (module or function)
    call: Callable  # what runs: the function, or the module's own forward (kept if replaced)
    layout: InputLayout
    static_inputs: tuple[torch.Tensor, ...]  # detached leaves on the samples' memory
    params: tuple[torch.Tensor, ...]  # the real trainable parameters
    training: bool
    needs_backward: bool
    retain_graph: bool = False
    hooks: Optional[CaptureTimeHooks] = None
    fp8: bool = False  # runs under Transformer Engine's FP8 autocast (``te_support``)
    has_te: bool = False  # holds Transformer Engine modules

    @property
    def grad_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in self.static_inputs if t.requires_grad)


def make_spec(
    name: str,
    owner: str,
    func: Callable,
    args: Sequence,
    kwargs: dict,
    grad_enabled: bool,
    retain_graph: bool,
    hooks: Optional[CaptureTimeHooks] = None,
    fp8: bool = False,
) -> GraphSpec:
    """Static inputs are detached leaves sharing the sample tensors' memory.

    A backward graph is captured when grad is enabled and something requires grad (an
    input or a parameter), in train and in eval mode alike, as eager autograd would
    differentiate either; graphing under ``torch.no_grad()`` makes forward-only graphs.
    """
    layout = InputLayout(name, args, kwargs)
    params: tuple = ()
    training = True
    if isinstance(func, torch.nn.Module):
        params = tuple(p for p in func.parameters() if p.requires_grad)
        training = func.training
    needs_backward = grad_enabled and (any(t.requires_grad for t in layout.samples) or bool(params))
    static = tuple(t.detach().requires_grad_(t.requires_grad and needs_backward) for t in layout.samples)
    call = func.forward if isinstance(func, torch.nn.Module) else func
    return GraphSpec(
        name, owner, func, call, layout, static, params, training, needs_backward, retain_graph, hooks,
        fp8, te_modules_in(func),
    )


@dataclass(frozen=True)
class WarmupRecord:
    """What the warmup passes learned about one graph."""

    output: OutputLayout  # the outputs' layout (meta tensors: no memory is kept)
    unused: tuple[int, ...]  # inputs requiring grad that no output depends on
    updated: tuple[int, ...]  # inputs the forward updates in place (copied back at replay)
    te_modules: tuple = ()  # the Transformer Engine modules its forward runs
    forward_draws: Optional[StreamUse] = None  # last pass, graphs only: streams drawn from
    backward_draws: Optional[StreamUse] = None
    wgrad: Optional[DelayedWgrad] = None  # TE modules that delay their weight gradients


@dataclass(frozen=True)
class CapturedGraph:
    """What capture produced for one graph: everything its replay needs."""

    fwd_graph: Any  # torch.cuda.CUDAGraph
    bwd_graph: Any  # None for a forward-only graph
    static_inputs: tuple[torch.Tensor, ...]  # its own, or taken over from a buffer donor
    output: OutputLayout  # static outputs (non-owning aliases once passed on to another graph)
    static_grad_outputs: tuple  # per output: its incoming grad's buffer, None if not differentiable
    static_grad_inputs: tuple  # per input: its grad's buffer, None where it takes no grad
    param_grads: Optional[ParamGrads]
    rng: Any  # RecomputeRNG.for_replay(): the record and restore around each replay
    sync_forward: Any  # TrackerSync or NO_SYNC: keeps duck-typed trackers in step
    sync_backward: Any
    lends_grad_buffer: bool  # its input-grad buffer is another graph's grad-output buffer
    updated_inputs: tuple[int, ...] = ()  # inputs the forward updates in place
    fp8: Any = None  # te_support.fp8_replay(): Transformer Engine's FP8 bookkeeping around replays
    wgrad: Any = None  # wgrad.WgradReplay: the weight-gradient pass, replayed by backward_dw()
