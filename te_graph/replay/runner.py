"""What both runners share at every call: the static inputs and the copy-in, the call's
record (``Invocation``, kept on its autograd node until its backward), the per-call
refusals (``refusals``) and the bookkeeping of the pool's replay order (``order``).
``graph_runner`` replays captured graphs; ``eager_runner`` runs the callable on the same
static buffers (eager replay: the debugging mirror, which also runs on CPU)."""
from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import compat
from ..capture.wgrad import check_still_delayed
from ..records import GraphSpec, WarmupRecord
from .copy_in import copy_in
from .order import NO_CLOCK, ReplayContext
from .in_graph import before_in_graph
from .refusals import check_fresh, check_in_graph_backward, check_updated_apart, missing_gradient

__all__ = ["Invocation", "Runner", "OBSERVED", "IN_GRAPH", "THROUGH_AUTOGRAD", "asks_none"]


OBSERVED = -2  # Invocation.hooks_seen of a call whose forward found the parameters' gradients observed
IN_GRAPH, THROUGH_AUTOGRAD = "in graph", "through autograd"  # Runner._asked, besides one flag per parameter


class Invocation:
    """One forward call's state, kept on its autograd node until its backward."""

    __slots__ = ("generation", "tick", "record", "copy_grads", "outputs", "backwards", "through_autograd", "fp8_first",
                 "hooks_seen", "idle", "start", "route", "__weakref__")

    def __init__(self, generation: int, tick: int, record: tuple, copy_grads: tuple, through_autograd: bool,
                 outputs: Any = None, fp8_first: bool = False, hooks_seen: int = OBSERVED, idle: tuple = ()):
        self.backwards = 0  # how many times this call's backward ran (retain_graph)
        self.generation = generation
        self.tick = tick
        self.record = record  # live streams' (seed, offset) at this forward replay
        self.copy_grads = copy_grads  # per input: hand its grad on as a copy (_grad_copied)
        self.through_autograd = through_autograd
        self.outputs = outputs  # eager replay only: the live outputs to backprop through
        self.fp8_first = fp8_first  # the first FP8 call of its te.autocast (the precision's replay steps: TE's ``FP8Replay``)
        # Where the forward left the parameters' gradients to the graph (nothing observed
        # them): the process's hook-handle count then (``refusals.check_in_graph_backward``);
        # else OBSERVED.
        self.hooks_seen = hooks_seen
        # Outputs that take no gradient at this call, though they may at others: computed
        # only from inputs that require none now (``Runner.idle_now``).
        self.idle = idle
        # Where the streams its forward draws from stood at its replay, for a backward that
        # reruns the forward eagerly (``partial_backward``); set by the graph runner.
        self.start: tuple = ()
        # Eager replay: the parameter stand-ins its forward ran on (``EagerRunner``), or None.
        self.route: Any = None


class Runner:
    """What both runners share: the call's checks and bookkeeping around the static inputs.

    Subclasses set ``static_inputs`` and ``output`` (and call ``_take_outputs``) and
    implement ``forward``, ``backward``, ``through_autograd``, ``_shared`` and ``reset``.
    """

    static_inputs: tuple[torch.Tensor, ...]
    output: Any
    non_differentiable: tuple[int, ...] = ()
    multi_output: bool = False
    forward_moves_versions = False  # whether its forward's in-place ops move the versions (eagerly)

    def __init__(self, spec: GraphSpec, warmup: WarmupRecord, context: ReplayContext):
        self.name = spec.name
        # Where the outputs' backward reaches only inputs: those inputs (a call where none
        # requires grad replays without a backward, as eager autograd would record none).
        idle_calls = warmup.idle_calls
        self.idle_unless = tuple(sorted(idle_calls.inputs)) if idle_calls is not None else None
        self.idle_refused = idle_calls is not None and idle_calls.refused
        # Outputs whose backward reaches only some inputs (``WarmupRecord.idle_outputs``): at
        # a call where none of those requires grad, such an output takes no gradient.
        self.idle_outputs = warmup.idle_outputs
        # The outputs its backward reads: kept on each call's autograd node, so that one
        # updated in place before the backward is refused as eager autograd refuses it.
        self.saved = warmup.saved
        self.owner = spec.owner
        # The call's weight-gradient passes waiting (``order.WgradBook``); None where it has none.
        self.wgrad_book = context.wgrad_book
        self.wgrad = warmup.wgrad  # what warmup learned of its weight-gradient pass; None without one
        self.has_wgrad = warmup.wgrad is not None
        self.updated = warmup.updated  # inputs the forward updates in place (warmup found them)
        # When its forward reads and writes its modules' state and its inputs: an input sharing
        # memory with that state where eager code would see a write through the other is refused.
        self.state_access = warmup.state_access
        self.inputs_on_state = warmup.inputs_on_state
        self.grad_mode_dependent = warmup.grad_mode_dependent
        self.framework_modules = warmup.framework_modules  # the integrations' modules its forward runs
        self.tracker = context.tracker  # whose streams its forward draws from
        self.borrowed = context.borrowed  # later graphs take its outputs' memory after its backward
        self.variant = context.variant
        self.layout = spec.layout
        self.shape = tuple(t.shape for t in spec.layout.samples)
        self.differentiable = spec.needs_backward
        self.retains_graph = spec.retain_graph
        # A leaf requiring grad passed to the autograd node on the in-graph path. Its gradient
        # accumulator tells a full backward (the engine runs it) from one asked only for some
        # tensors' gradients (``torch.autograd.grad``, ``backward(inputs=...)``): nobody can ask
        # for the anchor's.
        device = spec.static_inputs[0].device if spec.static_inputs else None
        self.anchor = (torch.empty(0, device=device, requires_grad=True),) if spec.params else ()
        self.anchor_node = compat.accumulate_grad_node(self.anchor[0]) if self.anchor else None
        self._set_params(spec.params)
        self._module = spec.func if isinstance(spec.func, torch.nn.Module) else None  # for parameter names
        self.accumulated: tuple[torch.Tensor, ...] = ()  # what the in-graph path adds to .grad (_watch)
        self.accumulated_ids: tuple[int, ...] = ()
        self.accumulators: tuple = ()
        self.clock = context.clock if context.clock is not None else NO_CLOCK
        self.generation = 0
        self._waiting: Any = _NOTHING  # weakref to the last call whose backward may still come
        # What of its pool's graphs its forward or its backward replay may overwrite
        # (``ReplayOrder``): what they did not hold at that capture.
        slot = context.slot
        self.order, self.position, self.call_first = slot.order, slot.position, slot.call_first
        bit = self.bit = self.order.join(slot.position, self)
        self.refused_at_forward = ~(slot.activations_at_forward | bit)
        self.refused_at_backward = ~(slot.activations_at_backward | bit)
        self.refused_queued_at_forward = ~(slot.queued_at_forward | bit)
        self.refused_queued_at_backward = ~(slot.queued_at_backward | bit)

    def backward_dw(self) -> None:
        """TE's ``backward_dw()``: the weight-gradient pass of this graph's last backward
        (nothing where its modules do not delay their weight gradients, as in TE)."""
        if self.has_wgrad:
            self.wgrad_book.check_take(self, self.clock.tick)
            self._run_wgrad()
            self.wgrad_book.taken(self)
            self.order.queued &= ~self.bit

    def _run_wgrad(self) -> None:
        raise NotImplementedError

    def awaits_backward(self) -> bool:
        """Whether the last call whose backward may still come is alive and has had none."""
        waiting = self._waiting()
        return waiting is not None and waiting.backwards == 0

    def _before_forward(self, inputs: tuple[torch.Tensor, ...]) -> None:
        if self.awaits_backward():
            during = (" It is called during a backward: a non-reentrant checkpoint around it runs its region "
                      "again to rebuild what the region's eager operations saved, which calls this layer while "
                      "its backward waits. Checkpoint a region of graphed layers only (they keep their own "
                      "activations), use a reentrant checkpoint (use_reentrant=True), or checkpoint inside "
                      "the graphed layer."
                      if compat.in_backward() else "")
            raise RuntimeError(
                f"{self.name}: called again while the backward of its previous call has not run; "
                "a graph reuses its activations at every call, so that backward would read this "
                "call's. Run the backward first; for several microbatches in flight, pass "
                "order=... with one sample set per microbatch; a result you will not backpropagate "
                "through, compute under torch.no_grad() (or drop it before the next call)." + during
            )
        if self.wgrad_book is not None:
            self.wgrad_book.check_forward(self)
            if self.has_wgrad:
                check_still_delayed(self.name, self.wgrad)
        order = self.order
        if order.activations & self.refused_at_forward or order.queued & self.refused_queued_at_forward:
            order.check(self, self.refused_at_forward, self.refused_queued_at_forward, "forward")
        if self.updated or self.state_access is not None or self.inputs_on_state:
            check_updated_apart(self, inputs)

    def _take_outputs(self, outputs: tuple[torch.Tensor, ...], fed: tuple) -> None:
        """Which outputs take no gradient, and whether several do (a backward where one of
        those gets none is refused unless an output whose backward feeds it gets one:
        ``_before_backward``, ``warmup.outputs_fed``)."""
        self.non_differentiable = tuple(i for i, o in enumerate(outputs) if not o.requires_grad)
        self.multi_output = len(outputs) - len(self.non_differentiable) > 1
        self.fed = fed or tuple(frozenset() for _ in outputs)

    def idle_now(self, inputs: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
        """The outputs that require no grad at this call, as in eager code, though they may at
        others: computed only from inputs of which none requires grad now. (Their backward,
        captured with them, gets zeros there, which reach only those inputs' gradients:
        nothing this call hands back.)"""
        return tuple(i for i, reached in self.idle_outputs if not any(inputs[j].requires_grad for j in reached))

    def _issued(self, invocation: Invocation) -> Invocation:
        """Remember a call whose backward may come (checked by the next forward)."""
        self._waiting = weakref.ref(invocation)
        self.order.activations |= self.bit
        return invocation

    def _forget_order(self) -> None:
        """At ``reset()``: the graph holds nothing any more, and no call of it waits."""
        self.order.release(self.position)
        self._waiting = _NOTHING

    def _replaying_forward(self) -> None:
        """Right before the forward replays (every refusal passed): the calls keeping
        activations it may overwrite are marked, and its own kept ones are its replay's."""
        order = self.order
        if order.retained:
            order.mark(self, self.refused_at_forward)
            order.forget(self.bit)

    def _replaying_backward(self) -> None:
        if self.order.retained:
            self.order.mark(self, self.refused_at_backward)

    def _before_backward(self, invocation: Invocation, grads: tuple) -> tuple[Any, Any]:
        """The backward's refusals; returns which parameters it asks gradients for
        (``_asked``), and the first output the loss left out (``refusals.missing_gradient``),
        or None."""
        asked = self._asked(invocation)
        missing = missing_gradient(self, invocation, grads) if self.multi_output else None
        if self.has_wgrad:
            self.wgrad_book.check_backward(self)
        order = self.order
        if order.activations & self.refused_at_backward or order.queued & self.refused_queued_at_backward:
            order.check(self, self.refused_at_backward, self.refused_queued_at_backward, "backward")
        if order.retained and invocation.backwards and invocation.generation == self.generation:
            order.check_kept(self, self.bit)
        check_fresh(self, invocation)
        if asked is IN_GRAPH and invocation.hooks_seen != OBSERVED and self.accumulated:
            check_in_graph_backward(self, invocation)
            before_in_graph(self)
        return asked, missing

    def _after_backward(self) -> None:
        order = self.order
        order.activations &= ~self.bit
        if self.retains_graph:
            order.retained |= self.bit
        if self.has_wgrad:  # its weight-gradient pass reads what it queued (backward_dw)
            order.queued |= self.bit
            self.wgrad_book.backward_done(self, self.clock.tick)

    def _copy_inputs(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Each input into its static buffer, unless it lies there already (``_copy_in``)."""
        for slot, t in zip(self.input_slots, inputs):
            copy_in(slot, t)
        self.generation += 1

    def _copy_back(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """After the forward: the inputs it updated in place get the update, as in eager
        code (their version counter moves too, as an eager in-place op's would)."""
        for index in self.updated:
            slot, t = self.input_slots[index], inputs[index]
            if slot.holds(t):
                # It is the static buffer: the update is in it. A graph wrote it without
                # autograd knowing; an eager forward's in-place ops moved the version themselves.
                if not self.forward_moves_versions:
                    compat.bump_version(t)
                continue
            storage = t.untyped_storage()
            shares = slot.lo <= t.data_ptr() < slot.hi or storage.data_ptr() <= slot.ptr < storage.data_ptr() + storage.nbytes()
            with torch.no_grad():
                t.copy_(slot.tensor.clone() if shares else slot.tensor)

    def _set_params(self, params: tuple[torch.Tensor, ...]) -> None:
        """The parameters whose gradients leave its backward, and the tensors its autograd
        node takes beside the inputs on the in-graph path: the anchor and the parameters
        (edges of the node, so that a backward asked for a parameter's gradient reaches it)."""
        self.params = params
        self.edges = self.anchor + tuple(params)

    def extra(self, through_autograd: bool) -> tuple[torch.Tensor, ...]:
        """The tensors its autograd node takes beside the inputs at this call: the
        parameters, whose gradients go through it, or the in-graph path's ``edges``."""
        return self.params if through_autograd else self.edges

    def _watch(self, params: tuple[torch.Tensor, ...]) -> None:
        """The parameters whose gradients the in-graph path adds to ``.grad`` without autograd
        (their ids for ``in_graph``), and their gradient accumulators, held (the leaf holds its
        node weakly) so that hooks found on them stay theirs."""
        self.accumulated = params
        self.accumulated_ids = tuple(map(id, params))
        self.accumulators = tuple(map(compat.accumulate_grad_node, params))

    def share(self, ids: set) -> None:
        """Where one of its in-graph parameters is among ``ids`` (graphs of a later call use it
        too): its calls hand their parameter gradients to autograd from now on."""
        if not ids.isdisjoint(self.accumulated_ids):
            self._shared()

    def _shared(self) -> None:
        raise NotImplementedError

    def _asked(self, invocation: Invocation) -> Any:
        """Where this backward's parameter gradients go: THROUGH_AUTOGRAD (the forward chose
        it), IN_GRAPH (a full backward: added to ``.grad`` by the graph), or, for a backward
        asked only for some tensors' gradients, one flag per parameter: whether it asks for
        that one (autograd then gets it: ``torch.autograd.grad`` captures it,
        ``backward(inputs=...)`` accumulates it; the others keep their ``.grad``)."""
        if invocation.through_autograd:
            return THROUGH_AUTOGRAD
        if not self.anchor or compat.engine_will_execute(self.anchor_node):
            return IN_GRAPH
        return tuple(map(compat.engine_asks_for, self.params))


def asks_none(asked: Any) -> bool:
    """Whether a backward asked only for some tensors' gradients asks for no parameter's."""
    return type(asked) is tuple and not any(asked)


class _Nothing:
    """What ``Runner._waiting`` holds before the first call: a dead weak reference."""

    def __call__(self) -> None:
        return None


_NOTHING = _Nothing()

