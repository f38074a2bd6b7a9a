"""The records one graph's state flows through, each frozen and complete when made:

    GraphSpec (what to capture) -> WarmupRecord (what warmup learned)
        -> GraphPlan (``plan``: buffers shared with other graphs)
        -> CapturedGraph (what capture produced; what the replay runner holds)

``make_spec`` builds a spec from the user's callable and samples; ``warmup`` makes the
warmup records, ``plan`` the plans and ``capture`` the captured graphs.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .grads import ParamGrads
from .hooks import CaptureTimeHooks
from .integrations import megatron
from .te_support import te_modules_in
from .layout import InputLayout, OutputLayout
from .recompute_rng import StreamUse
from .wgrad import DelayedWgrad

__all__ = ["GraphSpec", "make_spec", "SampleMemory", "none_default_keywords", "SavedOutputs", "IdleCalls", "WarmupRecord", "CapturedGraph"]


@dataclass(frozen=True)
class GraphSpec:
    """One graph pair to capture: a callable with one set of static inputs."""

    name: str  # "callable 2 (GPTBlock)", with ", microbatch 1" under an order
    owner: str  # the callable's part of the name: "callable 2 (GPTBlock)"
    func: Callable  # what the user passed (module or function)
    call: Callable  # what runs: the function, or the module's forward or routed __call__ (``_entry``)
    layout: InputLayout
    static_inputs: tuple[torch.Tensor, ...]  # detached leaves on the samples' memory
    params: tuple[torch.Tensor, ...]  # the real trainable parameters
    training: bool
    needs_backward: bool
    retain_graph: bool = False
    hooks: Optional[CaptureTimeHooks] = None
    fp8: bool = False  # runs under Transformer Engine's FP8 autocast (``te_support``)
    has_te: bool = False  # holds Transformer Engine modules
    # Parameters (indices into ``params``) another callable uses too: a tied weight, whose
    # gradients always go through autograd (``grads``), so that every use's gradient is
    # summed before it reaches .grad, as eager autograd sums them.
    tied_params: frozenset = frozenset()
    # A module whose class routes the call in its own ``__call__`` (megatron-core's layers,
    # ``_entry``): its replays come from there, without ``nn.Module.__call__`` and its hooks.
    routed: bool = False

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
    memory: Optional["SampleMemory"] = None,
    shared: frozenset = frozenset(),
) -> GraphSpec:
    """``shared``: ids of the parameters that several callables use.

    Static inputs are detached leaves sharing the sample tensors' memory, except where
    that memory is already another static input's (``SampleMemory``).

    A backward graph is captured when grad is enabled and something requires grad (an
    input or a parameter), in train and in eval mode alike, as eager autograd would
    differentiate either; graphing under ``torch.no_grad()`` makes forward-only graphs.
    """
    call = _entry(func)
    optional = none_default_keywords(call)
    routed = isinstance(func, torch.nn.Module) and call != func.forward
    if routed:  # the forward's keywords too
        optional |= none_default_keywords(func.forward)
    layout = InputLayout(name, args, kwargs, optional)
    params: tuple = ()
    training = True
    if isinstance(func, torch.nn.Module):
        params = tuple(p for p in func.parameters() if p.requires_grad)
        training = func.training
    needs_backward = grad_enabled and (any(t.requires_grad for t in layout.samples) or bool(params))
    own = memory.own if memory is not None else (lambda t: t)
    static = tuple(own(t.detach()).requires_grad_(t.requires_grad and needs_backward) for t in layout.samples)
    tied = frozenset(i for i, p in enumerate(params) if id(p) in shared)
    return GraphSpec(
        name, owner, func, call, layout, static, params, training, needs_backward, retain_graph, hooks,
        fp8, te_modules_in(func), tied, routed,
    )


class SampleMemory:
    """The memory the static inputs of one ``make_graphed_callables`` call take.

    A static input is its sample's memory, so that a call passing the sample itself copies
    nothing. Where two samples share memory (one tensor as every layer's sample, one mask
    in every layer's kwargs, views of one buffer), their graphs would share one static
    buffer, and a call of one would overwrite what another's backward (its recompute)
    still reads; so each later one in the same storage gets a copy of its own. A sample
    whose elements overlap each other (an expanded tensor) cannot take a copy-in: it gets a
    contiguous copy.
    """

    def __init__(self) -> None:
        self._taken: set[tuple[torch.device, int]] = set()  # (device, storage address)

    def own(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 0 or t.device.type == "meta":
            return t
        if torch._debug_has_internal_overlap(t) == 1:  # 1: its elements overlap (0 no, 2 unknown)
            t = t.contiguous()
        key = (t.device, t.untyped_storage().data_ptr())
        if key in self._taken:
            # Another static input lives in this storage: even disjoint views of one storage
            # share a version counter, which autograd reads.
            t = t.clone()
            key = (t.device, t.untyped_storage().data_ptr())
        self._taken.add(key)
        return t


def _entry(func: Callable) -> Callable:
    """What graphing calls: a function itself; a module's ``forward`` (module hooks are
    refused, so ``__call__`` would add nothing), except where its class routes capture in
    ``__call__``, as megatron-core's layers do while Megatron's capture flag is set
    (Transformer Engine's graphs call ``__call__`` and get the routed function; te_graph
    calls that function itself, so that eager replay does not route a call back to the
    replay)."""
    if not isinstance(func, torch.nn.Module):
        return func
    routed = megatron.capture_entry(func)
    return routed if routed is not None else func.forward


def none_default_keywords(call: Callable) -> frozenset:
    """The keyword parameters ``call`` declares with a default of ``None`` (a call may then
    leave them out, or pass None, where they were None at capture)."""
    try:
        parameters = inspect.signature(call).parameters.values()
    except (TypeError, ValueError):  # builtins and C callables may have no signature
        return frozenset()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in parameters if p.kind in keyword and p.default is None)


@dataclass(frozen=True)
class SavedOutputs:
    """The outputs whose backward reads them (autograd saved them): an in-place update of
    one between a call's forward and its backward is refused, as eager autograd refuses it.
    Found in the last warmup pass (``warmup._probed_backward``); with a single pass there is
    none to find them in, and every output counts (``probed`` False)."""

    indices: tuple[int, ...] = ()  # into the output layout's tensors
    probed: bool = True


@dataclass(frozen=True)
class IdleCalls:
    """Where the outputs' backward reaches only inputs, no parameter (``warmup.inputs_reached``):
    those inputs. A call where none of them requires grad gets outputs that need none, and
    no backward, as in eager code; or, where the forward runs te_graph's reentrant
    checkpoint on the way (``refused``), the ValueError eager code gets from it."""

    inputs: frozenset
    refused: bool = False


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
    # Parameters (indices into the spec's) that got no gradient in the first backward: eager
    # autograd leaves their .grad alone, and so do the graphs.
    unused_params: frozenset = frozenset()
    # Parameters whose weight gradient a kernel accumulates into main_grad itself (Transformer
    # Engine's fuse_wgrad_accumulation): each backward replay flags them as TE's Python does.
    fused_params: frozenset = frozenset()
    # Per output, the other outputs whose backward delivers a gradient to it
    # (``warmup.outputs_fed``): it may go without one at a call where one of those gets one.
    fed: tuple = ()
    saved: SavedOutputs = SavedOutputs()  # the outputs its backward reads
    idle_calls: Optional[IdleCalls] = None  # calls without a backward (warmup.inputs_reached)
    # (output, inputs) for each output whose backward reaches only those inputs, through
    # torch's built-in nodes (``warmup.outputs_reaching_inputs``): at a call where none of
    # them requires grad, that output requires none, as in eager code.
    idle_outputs: tuple = ()


@dataclass(frozen=True)
class CapturedGraph:
    """What capture produced for one graph: everything its replay needs."""

    fwd_graph: Any  # torch.cuda.CUDAGraph
    bwd_graph: Any  # None for a forward-only graph
    static_inputs: tuple[torch.Tensor, ...]  # its own, or taken over from a buffer donor
    output: OutputLayout  # static outputs (non-owning aliases where ``borrowed_outputs``)
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
    # Parameters to flag grad_added_to_main_grad=True after each backward replay, as
    # Transformer Engine's backward does for weights it accumulates into main_grad itself.
    fused_params: tuple = ()
    fed: tuple = ()  # WarmupRecord.fed: which outputs may go without a gradient, and when
    saved: SavedOutputs = SavedOutputs()  # WarmupRecord.saved
    idle_calls: Optional[IdleCalls] = None  # WarmupRecord.idle_calls
    idle_outputs: tuple = ()  # WarmupRecord.idle_outputs
    # Its outputs' and input grads' memory is handed on to later graphs once its backward
    # ran (``reuse_graph_input_output_buffers``): the static tensors own none of it.
    borrowed_outputs: bool = False
