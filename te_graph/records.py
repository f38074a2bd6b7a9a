"""The records one graph's state flows through, each frozen and complete when made:

    GraphSpec (intake: what to capture) -> WarmupRecord (capture.warmup: what warmup learned)
        -> GraphPlan (planning.buffers: buffers shared with other graphs)
        -> CapturedGraph (capture: what the replay runner holds; the warmup record and the
           plan travel in it whole)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .grads import ParamGrads
from .layout import InputLayout, OutputLayout

__all__ = ["GraphSpec", "SavedOutputs", "IdleCalls", "RegionDraws", "StreamUse", "DelayedWgrad", "OVERWRITES",
           "SETS_IF_NONE", "UNKNOWN", "WarmupRecord", "GraphPlan", "CapturedGraph"]


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
    hooks: Any = None  # intake.hooks.CaptureTimeHooks: run while the graphs are prepared
    fp8: bool = False  # runs under the registered reduced precision (Transformer Engine's FP8 autocast)
    # Holds modules an integration serves (Transformer Engine's), which take
    # ``is_first_microbatch`` per call.
    framework_modules: bool = False
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


@dataclass(frozen=True)
class RegionDraws:
    """Where one checkpointed region draws, per stream: its offset inside the forward."""

    offsets: dict[str, int]


@dataclass(frozen=True)
class StreamUse:
    """What the last warmup pass learned about one forward or backward: the live streams
    (by key), which of them it drew from, and where each checkpointed region drew."""

    streams: dict[str, torch.Generator]
    used: tuple[str, ...]
    regions: tuple[RegionDraws, ...] = ()

    def used_generators(self) -> dict[str, torch.Generator]:
        return {k: self.streams[k] for k in self.used}


OVERWRITES = "overwrites"  # backward_dw sets .grad whatever it held (a weight)


SETS_IF_NONE = "sets if None"  # only where .grad is None (a bias)


UNKNOWN = "unknown"  # one warmup pass cannot tell: .grad must be None at backward_dw


@dataclass(frozen=True)
class DelayedWgrad:
    """What warmup learned about one graph's weight-gradient pass."""

    modules: tuple  # the modules whose backward_dw() it runs, in forward order
    sets: tuple[tuple[tuple[int, str], ...], ...]  # per module: (index into spec.params, kind)
    split_params: frozenset  # those the backward leaves alone: only the pass gives them a gradient
    kept: tuple[int, ...]  # parameters the backward gave a gradient that backward_dw may read


@dataclass(frozen=True)
class SavedOutputs:
    """The outputs whose backward reads them (autograd saved them): an in-place update of
    one between a call's forward and its backward is refused, as eager autograd refuses it.
    Found in the last warmup pass (``capture.backward_reads.probed_backward``); with a single pass there is
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
    unused: tuple[int, ...] = ()  # inputs requiring grad that no output depends on
    updated: tuple[int, ...] = ()  # inputs the forward updates in place (copied back at replay)
    # The order of its reads and writes of its modules' buffers and tensor attributes and of
    # its inputs (None: it writes neither): an input sharing memory with such state is refused
    # where eager code would see a write through the other (``StateAccess.hazard``).
    state_access: Optional[StateAccess] = None
    # Inputs whose sample is its modules' state itself (a buffer passed as the sample): a call
    # with another tensor would copy into that state (refused).
    inputs_on_state: tuple[int, ...] = ()
    framework_modules: tuple = ()  # the modules of integrations (Transformer Engine's) its forward runs
    forward_draws: Optional[StreamUse] = None  # last pass, graphs only: streams drawn from
    backward_draws: Optional[StreamUse] = None
    wgrad: Optional[DelayedWgrad] = None  # modules that delay their weight gradients to backward_dw()
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
    # It computes other values under torch.no_grad() (a fast path): calls under no_grad run eagerly.
    grad_mode_dependent: bool = False


@dataclass(frozen=True)
class StateAccess:
    """When the first warmup pass read and wrote its modules' state and its inputs, by op
    index: ``writes``/``reads``: (first address, past the last, op, storage) of each view of
    the state written (its first write) or read (its last read); per input, its last read and
    first write (-1: none)."""

    storages: frozenset  # the state's storage addresses it touched
    writes: tuple
    reads: tuple
    input_last_read: tuple
    input_first_write: tuple

    def hazard(self, index: int, lo: int, hi: int, storage: int) -> bool:
        """Whether input ``index``, lying on bytes [lo, hi) of the state's ``storage``, would
        differ from eager code, where the two are one memory: it is read after the state there
        was written, or written itself (the graph writes it back after the forward); or, written,
        the storage is read after (there, the update is not seen; anywhere, what autograd saved
        of it sees its version moved by the write back after the forward)."""
        written = self.input_first_write[index]
        if any(a < hi and lo < b and (op < self.input_last_read[index] or written >= 0)
               for a, b, op, _ in self.writes):
            return True
        return written >= 0 and any(s == storage and op > written for _, _, op, s in self.reads)


@dataclass(frozen=True)
class GraphPlan:
    """How one graph shares buffers with others."""

    donor: Optional[int] = None  # graph whose static inputs and grad-output buffers it takes over
    grad_output_from: Optional[int] = None  # graph whose input-grad buffer is its grad output
    lends_grad_buffer: bool = False  # its input-grad buffer is another graph's grad output
    releases_buffers: bool = False  # outputs and input grads go back to the pool after its backward
    # What the other graphs held when its forward, and its backward, were captured (bit i:
    # graph i): activations (from a forward to its backward; for good where the backward
    # keeps the autograd graph) and what a backward queued for its weight-gradient pass
    # (to backward_dw()). At replay, a graph may hold only what it held then.
    activations_at_forward: int = 0
    activations_at_backward: int = 0
    queued_at_forward: int = 0
    queued_at_backward: int = 0


@dataclass(frozen=True)
class CapturedGraph:
    """What capture produced for one graph: everything its replay needs."""

    fwd_graph: Any  # torch.cuda.CUDAGraph
    bwd_graph: Any  # None for a forward-only graph
    warmup: WarmupRecord  # what warmup learned, whole
    plan: GraphPlan  # the buffers it shares with other graphs
    static_inputs: tuple[torch.Tensor, ...]  # its own, or taken over from a buffer donor
    output: OutputLayout  # static outputs (non-owning aliases where ``plan.releases_buffers``)
    static_grad_outputs: tuple  # per output: its incoming grad's buffer, None if not differentiable
    static_grad_inputs: tuple  # per input: its grad's buffer, None where it takes no grad
    param_grads: Optional[ParamGrads]
    rng: Any  # capture.recompute_rng.RecomputeRNG.for_replay(): the record and restore around each replay
    sync_forward: Any  # capture.recompute_rng.TrackerSync or NO_SYNC: keeps duck-typed trackers in step
    sync_backward: Any
    precision: Any  # the extension's replay steps around each replay (``extension.Precision.replay``)
    wgrad: Any = None  # capture.wgrad.WgradReplay: the weight-gradient pass, replayed by backward_dw()
