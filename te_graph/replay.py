"""The replay path: what runs on every call of a graphed callable.

One ``torch.autograd.Function`` serves every graph. Its forward copies a new input into the
static buffer unless it already lies there, records the live streams its recompute must
start from, replays the forward graph and returns the static outputs detached. Its
backward copies the incoming grads (same rule), readies the parameter gradients
(``grads``), sets the recompute generators where its own forward left the streams, and
replays the backward graph.

Each call gets an ``Invocation`` that lives on the autograd node, so the RNG record
follows the call, and a backward whose activations a later forward replay overwrote (of
the same graph, or of another shape sharing its memory) is refused instead of silently
computing wrong gradients.

Two runners share that wrapper: :class:`GraphRunner` replays a :class:`CapturedGraph`;
:class:`EagerRunner` runs the callable itself on the same static buffers (eager replay: a
debugging mirror, "is it the graph or my model?", that also runs on CPU).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import compat, grads
from .te_support import accepts_is_first_microbatch
from .grads import grads_redirected
from .parameters import StandIns
from .module_state import in_memory_of, module_memory, shares_memory
from .records import CapturedGraph, GraphSpec, IdleCalls, SavedOutputs, WarmupRecord
from .wgrad import DelayedWgrad, WgradBook, check_grads_as_captured, check_still_delayed, run_backward_dw

__all__ = ["ReplayOptions", "Clock", "NO_CLOCK", "ReplayOrder", "OrderSlot", "Runner", "GraphRunner", "EagerRunner",
           "run", "shapes_text"]

_DOUBLE_BACKWARD = (
    "{name}: double backward (create_graph=True, or torch.autograd.grad(..., "
    "create_graph=True)) through a graphed callable is not supported: its backward is a "
    "replayed graph, whose gradients autograd cannot differentiate again. Compute "
    "higher-order gradients with the module's eager forward (module.forward.__wrapped__)."
)


@dataclass(frozen=True)
class ReplayOptions:
    """How calls of one make_graphed_callables call hand out gradients."""

    always_autograd: bool = False  # parameter grads through autograd at every call
    clone_param_grads: bool = True  # copy parameter grads that autograd or hooks could keep


class Clock:
    """Shared by the graphs of one call captured for several shapes (sample sets), which
    share memory: it ticks whenever a forward of another sample set than the last one
    replays. Layers of one sample set may have different shapes from each other."""

    __slots__ = ("variant", "shape", "tick")

    def __init__(self) -> None:
        self.variant = -1
        self.shape: Any = None  # of the forward that last ticked, for error messages
        self.tick = 0

    def forward(self, variant: int, shape: Any) -> int:
        if variant != self.variant:
            self.variant = variant
            self.shape = shape
            self.tick += 1
        return self.tick


class _NoClock:
    """One sample set: nothing else shares the graphs' memory, the clock never ticks."""

    tick = 0
    shape = None

    @staticmethod
    def forward(variant: int, shape: Any) -> int:
        return 0


NO_CLOCK = _NoClock()


class ReplayOrder:
    """What the graphs of one memory pool hold, as bitmasks over their positions:
    ``activations`` (a forward's, until its backward), ``queued`` (what a backward left for
    its weight-gradient pass, until ``backward_dw()``) and ``retained`` (activations a
    backward kept: ``retain_graph_in_backward``).

    Each forward and backward was captured while the pool's other graphs held some of that
    (``plan.GraphPlan.activations_at_*`` and ``queued_at_*``; graphs of another
    ``make_graphed_callables`` call into the pool held nothing then): its replay may write
    where anything held since lies. A replay while a graph holds activations or queued
    work that it did not hold at that capture is refused; one while a graph keeps
    activations it did not keep then marks it, and a second backward through that call is
    refused. One or two mask tests per replay; a hit is confirmed against the calls still
    alive (a forward whose result was dropped leaves its bit set) before it is refused.
    Graphs of another sample set of the same call are left to ``Clock``."""

    __slots__ = ("activations", "queued", "retained", "clobbered", "_runners", "_size", "_clobbered_by",
                 "__weakref__")

    def __init__(self) -> None:
        self.activations = 0
        self.queued = 0
        self.retained = 0
        self.clobbered = 0
        self._runners: dict[int, Any] = {}  # position -> weakref to its runner
        self._size = 0
        self._clobbered_by: dict[int, str] = {}

    def reserve(self, count: int) -> int:
        """Positions for ``count`` more graphs of the pool; the first of them."""
        first, self._size = self._size, self._size + count
        return first

    def join(self, position: int, runner: "Runner") -> int:
        """Register ``runner`` at ``position``; its bit."""
        self._runners[position] = weakref.ref(runner)
        return 1 << position

    def release(self, position: int) -> None:
        """The graph at ``position`` was freed (``reset()``): it holds nothing any more."""
        keep = ~(1 << position)
        self.activations &= keep
        self.queued &= keep
        self.retained &= keep
        self.clobbered &= keep
        self._runners.pop(position, None)

    def check(self, runner: "Runner", refused_activations: int, refused_queued: int, what: str) -> None:
        """Refuse ``runner``'s ``what`` if a graph it must not overwrite still holds activations
        or queued work (recounted from the calls alive)."""
        activations = queued = 0
        for position, ref in list(self._runners.items()):
            other = ref()
            if other is None:
                del self._runners[position]
                continue
            if other.awaits_backward():
                activations |= 1 << position
            if other.has_wgrad and other.wgrad_book.waits(other):
                queued |= 1 << position
        self.activations, self.queued = activations, queued
        blocking = (activations & refused_activations) or (queued & refused_queued)
        if not blocking:
            return
        awaited = "backward" if activations & refused_activations else "backward_dw()"
        other = self._runners[(blocking & -blocking).bit_length() - 1]()
        if other.call_first != runner.call_first:
            raise RuntimeError(
                f"{runner.name}: its {what} replays while {other.name} of another make_graphed_callables call "
                f"into the same pool still waits for its {awaited}: the graphs of each call were captured "
                f"while the other's held nothing, so this replay may overwrite what that {awaited} reads. Run "
                f"that {awaited} first, or graph the two into separate pools."
            )
        before = "forward" if awaited == "backward" else "backward"
        raise RuntimeError(
            f"{runner.name}: its {what} replays while {other.name} still waits for its {awaited}, but when this "
            f"{what} was captured that graph did not hold what its {awaited} reads (its {before} came later, or "
            f"its {awaited} earlier, in the captured order): the graphs share one memory pool, so this replay "
            f"may overwrite it. Call the graphs in the order they were captured (without order=: forwards in the "
            f"order of the callables, backwards in reverse; with order=: as it says), or run that {awaited} first."
        )

    def mark(self, runner: "Runner", refused: int) -> None:
        """Right before ``runner`` replays: the graphs keeping activations it may overwrite."""
        hit = self.retained & refused & ~self.clobbered
        self.clobbered |= hit
        while hit:
            low = hit & -hit
            self._clobbered_by[low.bit_length() - 1] = runner.name
            hit ^= low

    def check_kept(self, runner: "Runner", bit: int) -> None:
        """Before a second backward through one call: refused if a replay since may have
        overwritten its activations."""
        if self.clobbered & bit:
            raise RuntimeError(
                f"{runner.name}: a second backward through this call, but since its first one "
                f"{self._clobbered_by[bit.bit_length() - 1]} replayed, captured while this graph's "
                "activations were not kept: they share one memory pool, so that replay may have overwritten "
                "what this backward reads. Run every backward through a call before calling graphs captured "
                "before it, or call the graph again."
            )

    def forget(self, bit: int) -> None:
        """A new call of the graph at ``bit`` replays: what it kept is overwritten by its own
        replay (the old call's backward is refused by its generation)."""
        self.retained &= ~bit
        self.clobbered &= ~bit


@dataclass(frozen=True)
class OrderSlot:
    """Where one runner sits in its pool's ``ReplayOrder``: its position, the first
    position of its call, and what the others may hold at its forward and backward replays
    (the plan's, shifted to the pool's positions, and everything of the call's other
    sample sets, which ``Clock`` covers)."""

    order: ReplayOrder
    position: int
    call_first: int
    activations_at_forward: int
    activations_at_backward: int
    queued_at_forward: int
    queued_at_backward: int


OBSERVED = -2  # Invocation.hooks_seen of a call whose forward found the parameters' gradients observed


class Invocation:
    """One forward call's state, kept on its autograd node until its backward."""

    __slots__ = ("generation", "tick", "record", "copy_grads", "outputs", "backwards", "through_autograd", "fp8_first",
                 "hooks_seen", "idle", "__weakref__")

    def __init__(self, generation: int, tick: int, record: tuple, copy_grads: tuple, through_autograd: bool,
                 outputs: Any = None, fp8_first: bool = False, hooks_seen: int = OBSERVED, idle: tuple = ()):
        self.backwards = 0  # how many times this call's backward ran (retain_graph)
        self.generation = generation
        self.tick = tick
        self.record = record  # live streams' (seed, offset) at this forward replay
        self.copy_grads = copy_grads  # per input: hand its grad on as a copy (_grad_copied)
        self.through_autograd = through_autograd
        self.outputs = outputs  # eager replay only: the live outputs to backprop through
        self.fp8_first = fp8_first  # the first FP8 call of its te.autocast (te_support.FP8Replay)
        # Where the forward left the parameters' gradients to the graph (nothing observed
        # them): the process's hook-handle count then (``Runner._check_in_graph_backward``);
        # else OBSERVED.
        self.hooks_seen = hooks_seen
        # Outputs that take no gradient at this call, though they may at others: computed
        # only from inputs that require none now (``Runner.idle_now``).
        self.idle = idle


class Runner:
    """What both runners share: the call's checks and bookkeeping around the static inputs.

    Subclasses set ``static_inputs`` and ``output`` (and call ``_take_outputs``) and
    implement ``forward``, ``backward``, ``through_autograd`` and ``reset``.
    """

    static_inputs: tuple[torch.Tensor, ...]
    output: Any
    non_differentiable: tuple[int, ...] = ()
    multi_output: bool = False

    def __init__(self, spec: GraphSpec, clock: Any, variant: int, updated: tuple[int, ...],
                 wgrad_book: Optional[WgradBook] = None, wgrad: Optional[DelayedWgrad] = None,
                 slot: Optional[OrderSlot] = None, saved: SavedOutputs = SavedOutputs(),
                 idle_calls: Optional[IdleCalls] = None, idle_outputs: tuple = ()):
        self.name = spec.name
        # Where the outputs' backward reaches only inputs: those inputs (a call where none
        # requires grad replays without a backward, as eager autograd would record none).
        self.idle_unless = tuple(sorted(idle_calls.inputs)) if idle_calls is not None else None
        self.idle_refused = idle_calls is not None and idle_calls.refused
        # Outputs whose backward reaches only some inputs (``WarmupRecord.idle_outputs``): at
        # a call where none of those requires grad, such an output takes no gradient.
        self.idle_outputs = idle_outputs
        # The outputs its backward reads: kept on each call's autograd node, so that one
        # updated in place before the backward is refused as eager autograd refuses it.
        self.saved = saved
        self.owner = spec.owner
        # The call's weight-gradient passes waiting (``wgrad``); None where it has none.
        self.wgrad_book = wgrad_book
        self.wgrad = wgrad  # what warmup learned of its weight-gradient pass; None without one
        self.has_wgrad = wgrad is not None
        self.updated = updated  # inputs the forward updates in place (warmup found them)
        self.variant = variant
        self.layout = spec.layout
        self.shape = tuple(t.shape for t in spec.layout.samples)
        self.differentiable = spec.needs_backward
        self.params = spec.params
        self.retains_graph = spec.retain_graph
        # A leaf requiring grad passed to the autograd node on the in-graph path, so the node
        # exists (and its backward replays, accumulating the parameters' grads) even when no
        # input requires grad.
        device = spec.static_inputs[0].device if spec.static_inputs else None
        self.anchor = (torch.empty(0, device=device, requires_grad=True),) if self.params else ()
        # Its gradient accumulator: whether the engine runs it tells a full backward from one
        # asked only for some inputs' gradients.
        self.anchor_node = compat.accumulate_grad_node(self.anchor[0]) if self.anchor else None
        self._module = spec.func if isinstance(spec.func, torch.nn.Module) else None  # for parameter names
        self.accumulated: tuple[torch.Tensor, ...] = ()  # what the in-graph path adds to .grad (_watch)
        self.accumulators: tuple = ()
        self.clock = clock
        self.generation = 0
        self._waiting: Any = _NOTHING  # weakref to the last call whose backward may still come
        # What of its pool's graphs its forward or its backward replay may overwrite
        # (``ReplayOrder``): what they did not hold at that capture.
        slot = slot if slot is not None else OrderSlot(ReplayOrder(), 0, 0, -1, -1, -1, -1)
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
            raise RuntimeError(
                f"{self.name}: called again while the backward of its previous call has not run; "
                "a graph reuses its activations at every call, so that backward would read this "
                "call's. Run the backward first; for several microbatches in flight, pass "
                "order=... with one sample set per microbatch; a result you will not backpropagate "
                "through, compute under torch.no_grad() (or drop it before the next call)."
            )
        if self.wgrad_book is not None:
            self.wgrad_book.check_forward(self)
            if self.has_wgrad:
                check_still_delayed(self.name, self.wgrad)
        order = self.order
        if order.activations & self.refused_at_forward or order.queued & self.refused_queued_at_forward:
            order.check(self, self.refused_at_forward, self.refused_queued_at_forward, "forward")
        if self.updated:
            self._check_updated_apart(inputs)

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

    def _before_backward(self, invocation: Invocation, grads: tuple) -> bool:
        """The backward's refusals; returns whether it is asked only for some inputs'
        gradients (``_inputs_only``: no parameter takes one)."""
        inputs_only = self._inputs_only(invocation)
        # The refusal first, so that a caller who catches it and retries gets it again.
        if self.multi_output:
            missing = next((i for i, g in enumerate(grads) if g is None and i not in self.non_differentiable
                            and i not in invocation.idle and not any(grads[j] is not None for j in self.fed[i])),
                           None)
            if missing is not None:
                raise RuntimeError(
                    f"{self.name}: output {missing} got no gradient in this backward (the loss does not "
                    "use it), but the backward graph was captured with a gradient for every "
                    "differentiable output: it would push zeros through that output's part of the "
                    "backward, where eager autograd skips it (zeros there turn into NaN through log, "
                    "sqrt or a division; an output may go without where an output computed from it "
                    "gets a gradient that autograd delivers to it). Use every differentiable output "
                    "in the loss, or return only the outputs you use (detach the others inside the "
                    "callable)."
                )
        if self.has_wgrad:
            self.wgrad_book.check_backward(self)
        order = self.order
        if order.activations & self.refused_at_backward or order.queued & self.refused_queued_at_backward:
            order.check(self, self.refused_at_backward, self.refused_queued_at_backward, "backward")
        if order.retained and invocation.backwards and invocation.generation == self.generation:
            order.check_kept(self, self.bit)
        self._check_fresh(invocation)
        if invocation.hooks_seen != OBSERVED and not inputs_only:
            self._check_in_graph_backward(invocation)
        return inputs_only

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
            _copy_in(slot, t)
        self.generation += 1

    def _copy_back(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """After the forward: the inputs it updated in place get the update, as in eager
        code (their version counter moves too, as an eager in-place op's would)."""
        for index in self.updated:
            slot, t = self.input_slots[index], inputs[index]
            if t.data_ptr() == slot.ptr and t.stride() == slot.stride:
                compat.bump_version(t)  # it is the static buffer: the update is in it
                continue
            storage = t.untyped_storage()
            shares = slot.lo <= t.data_ptr() < slot.hi or storage.data_ptr() <= slot.ptr < storage.data_ptr() + storage.nbytes()
            with torch.no_grad():
                t.copy_(slot.tensor.clone() if shares else slot.tensor)

    def _watch(self, params: tuple[torch.Tensor, ...]) -> None:
        """The parameters whose gradients the in-graph path adds to ``.grad`` without autograd,
        and their gradient accumulators (held: the leaf holds its node weakly), which tell
        whether a backward reaches a parameter by another way too."""
        self.accumulated = params
        self.accumulators = tuple(map(compat.accumulate_grad_node, params))

    def _inputs_only(self, invocation: Invocation) -> bool:
        """Whether this backward, off the autograd path, is asked only for some inputs'
        gradients (``torch.autograd.grad``, ``backward(inputs=...)``): the engine will not
        run the anchor's accumulator, and no parameter takes a gradient, as in eager."""
        return not invocation.through_autograd and bool(self.anchor) and not compat.engine_will_execute(self.anchor_node)

    def _check_in_graph_backward(self, invocation: Invocation) -> None:
        """Before a backward whose parameter gradients the graph (or eager replay's nested
        backward) adds to ``.grad`` itself, as its forward chose where nothing observed them:
        nothing may since have come to need autograd's own accumulation. A hook registered
        on a parameter after the forward would be skipped; a use of a parameter outside the
        call in this same backward (another callable's graphs, a regulariser in the loss,
        the parameter passed as an input) would add its gradient to ``.grad`` apart from the
        graph's, where eager autograd sums the two first (other rounding). One counter read
        and one engine query per parameter."""
        if not self.accumulators:
            return
        if invocation.hooks_seen != compat.hook_handles_made() and grads.hooked(self.accumulated):
            raise RuntimeError(
                f"{self.name}: a gradient hook (or main_grad) was put on one of its parameters after "
                "this call's forward and before its backward; the forward, finding none, left the "
                "parameters' gradients to the graph, which adds them to .grad without autograd and "
                "would skip the hook, while eager autograd runs it. Register parameter hooks before "
                "the forward, or pass accumulate_grads_in_graph=False to make_graphed_callables."
            )
        if not any(map(compat.engine_will_execute, self.accumulators)):
            return
        reached = next(i for i, node in enumerate(self.accumulators) if compat.engine_will_execute(node))
        raise RuntimeError(
            f"{self.name}: this backward reaches parameter {self._parameter_name(reached)} by "
            "another way too (it is used outside the graphed call, passed to it as an input, or "
            "read by the graphs of another make_graphed_callables call): the graph adds its "
            "gradient to .grad on its own and autograd adds the other use's after, where eager "
            "autograd sums the two first (a different rounding). Pass "
            "accumulate_grads_in_graph=False to make_graphed_callables (every parameter "
            "gradient then goes through autograd), or graph the callables sharing a parameter "
            "in one make_graphed_callables call."
        )

    def _parameter_name(self, index: int) -> str:
        p = self.accumulated[index]
        names = dict((id(q), n) for n, q in self._module.named_parameters()) if self._module is not None else {}
        return repr(names.get(id(p), f"of shape {tuple(p.shape)}"))

    def _check_updated_apart(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Each input the forward updates in place overlaps no other input's bytes: each input
        is read from a buffer of its own, so the other would not see the update that eager
        code sees through the shared memory. (Disjoint slices of one buffer pass; strided
        views whose address ranges interleave are refused, without looking at each byte.)"""
        for index in self.updated:
            t = inputs[index]
            for other, u in enumerate(inputs):
                if other != index and _overlap(t, u):
                    raise RuntimeError(
                        f"{self.name}: inputs {index} and {other} share memory, and the forward updates "
                        f"input {index} in place; eager code would see the update through input {other} "
                        "too, but the graph reads each input from a buffer of its own. Pass tensors that "
                        "do not share memory (a .clone() of one)."
                    )

    def check_saved_outputs(self, node: Any) -> None:
        """Before the backward of a call whose outputs its backward reads (``saved``): none
        was updated in place since the forward. The call's node saved them, so autograd's
        own version check finds an update, as it does for eager code."""
        try:
            node.saved_tensors
        except RuntimeError as error:
            if not compat.is_saved_version_error(error):
                raise
            unknown = "" if self.saved.probed else (
                " (with num_warmup_iters=1 te_graph cannot tell which outputs the backward reads, and takes "
                "every one as read; graph with num_warmup_iters >= 2 if the updated output is not)")
            raise RuntimeError(
                f"{self.name}: an output of this call was updated in place after its forward, and the backward "
                "reads that output (one of the variables needed for gradient computation has been modified by "
                "an inplace operation), or it is a view whose update eager autograd refuses (one a custom "
                "Function or a multi-output operation returned): eager autograd refuses these too. Or it "
                "shares memory with another output (a view of it), whose history eager autograd changes with "
                f"it and a graph's outputs cannot{unknown}. Update a copy of the output (y = y + ...) instead."
            ) from error

    def _check_fresh(self, invocation: Invocation) -> None:
        invocation.backwards += 1
        if invocation.backwards > 1 and not self.retains_graph:
            raise RuntimeError(
                f"{self.name}: a second backward through the same call needs the captured "
                "autograd graph, which was freed after capture. Pass "
                "retain_graph_in_backward=True to make_graphed_callables."
            )
        if invocation.generation != self.generation:
            raise RuntimeError(
                f"{self.name}: this backward belongs to a forward replay whose activations a later "
                "forward replay of the same graph has overwritten. Run each backward before the "
                "graph's next forward, or capture one graph per microbatch (order=...)."
            )
        if invocation.tick != self.clock.tick:
            raise RuntimeError(
                f"{self.name}: this backward belongs to a forward replay of shape "
                f"{shapes_text(self.shape)}, but since then graphs of another sample set (shape "
                f"{shapes_text(self.clock.shape)}) replayed, and the graphs of every shape share one "
                "memory pool, so they overwrote its activations. Run the backwards of one shape "
                "before the forwards of another (one shape per step)."
            )


class GraphRunner(Runner):
    """Replays a captured forward/backward graph pair on its static buffers."""

    def __init__(self, spec: GraphSpec, graph: CapturedGraph, options: ReplayOptions, clock: Any = NO_CLOCK, variant: int = 0,
                 wgrad_book: Optional[WgradBook] = None, slot: Optional[OrderSlot] = None):
        super().__init__(spec, clock, variant, graph.updated_inputs, wgrad_book,
                         graph.wgrad.learned if graph.wgrad is not None else None, slot, graph.saved,
                         graph.idle_calls, graph.idle_outputs)
        self.graph = graph
        if graph.param_grads is not None:
            self.params = graph.param_grads.params  # less those only the weight-gradient pass sets
            self._watch(self.params)
        self.static_inputs = graph.static_inputs
        self.input_slots = tuple(map(_Slot, graph.static_inputs))
        self.grad_output_slots = tuple(None if g is None else _Slot(g) for g in graph.static_grad_outputs)
        self.output = graph.output
        self.static_outputs = graph.output.tensors
        self.handout = GraphOutputs(self.name, self.static_outputs, spec, graph.borrowed_outputs)
        self._take_outputs(self.static_outputs, graph.fed)
        self.always_autograd = options.always_autograd
        self.clone_param_grads = options.clone_param_grads

    def through_autograd(self) -> bool:
        """Whether this call's parameter grads must go through autograd (see ``grads``)."""
        return bool(self.params) and (
            self.always_autograd or compat.ddp_forward_active() or self.graph.param_grads.observed()
        )

    def _grad_copied(self, t: torch.Tensor, buffer: Optional[torch.Tensor]) -> bool:
        """Whether the grad of input ``t`` leaves the backward as a copy of its static buffer.

        Uncopied, graph memory reaches whatever autograd does with the grad: a leaf's
        AccumulateGrad keeps it as ``.grad`` (also through view ops: ``leaf.view(...)``
        hands it a view), and the next replay would overwrite that ``.grad``. So the buffer
        goes on uncopied only to the backward of the graph whose output ``t`` is, which
        copies it into its own buffer before anything else runs, or, when this buffer is
        that graph's own grad-output buffer (``lends_grad_buffer``), reads it in place;
        a buffer lent to one graph goes uncopied to that graph alone. A hook on ``t``
        (registered by now) gets a copy too: it may keep what it sees, and a replacement
        it returns is copied into that very buffer when the buffer is lent.
        """
        if buffer is None or not t.requires_grad:
            return False
        if t.is_leaf or t.retains_grad or compat.tensor_hooks(t):
            return True
        node = t.grad_fn
        if type(node) is not _ReplayBackward or type(node.runner) is not GraphRunner:
            return True
        other = node.runner.graph
        return other is None or (self.graph.lends_grad_buffer and all(g is not buffer for g in other.static_grad_outputs))

    def forward(self, inputs: tuple[torch.Tensor, ...], through_autograd: bool, with_backward: bool = True,
                is_first_microbatch: Any = None) -> tuple[Invocation, tuple]:
        graph = self.graph
        self._before_forward(inputs)
        fp8_first = graph.fp8.before_forward(self.name, is_first_microbatch)
        self._copy_inputs(inputs)
        copy_grads = tuple(map(self._grad_copied, inputs, graph.static_grad_inputs)) if with_backward else ()
        moved = graph.sync_forward.before_replay(self.name)
        record = graph.rng.record() if with_backward else ()
        tick = self.clock.forward(self.variant, self.shape)
        self.handout.before_replay()
        self._replaying_forward()
        graph.fp8.before_replay()
        graph.fwd_graph.replay()
        graph.fp8.after_forward()
        if moved:
            graph.sync_forward.after_replay(moved)
        if self.updated:
            self._copy_back(inputs)
        outputs = self.handout.tensors()
        invocation = Invocation(self.generation, tick, record, copy_grads, through_autograd, None, fp8_first,
                                OBSERVED if through_autograd else compat.hook_handles_made(),
                                self.idle_now(inputs) if self.idle_outputs and with_backward else ())
        return (self._issued(invocation) if with_backward else invocation), outputs

    def backward(self, invocation: Invocation, grads: tuple) -> tuple:
        through_autograd = invocation.through_autograd
        # A backward asked only for some inputs' gradients (torch.autograd.grad, or
        # backward(inputs=...)) leaves the parameters' .grad alone, as eager autograd does:
        # the graph still accumulates into the buffers, which are put back afterwards.
        inputs_only = self._before_backward(invocation, grads)
        graph = self.graph
        for slot, g in zip(self.grad_output_slots, grads):
            if slot is None:
                continue
            if g is None:
                slot.tensor.zero_()
            else:
                _copy_in(slot, g)
        kept = None
        if through_autograd:
            graph.param_grads.prepare_autograd()
        elif inputs_only:
            kept = [b.clone() for b in graph.param_grads.buffers]
        else:
            graph.param_grads.prepare_in_graph()
        if invocation.record:
            graph.rng.restore(invocation.record)
        moved = graph.sync_backward.before_replay(self.name)
        self._replaying_backward()
        graph.bwd_graph.replay()
        if moved:
            graph.sync_backward.after_replay(moved)
        if kept is not None:
            for buffer, value in zip(graph.param_grads.buffers, kept):
                buffer.copy_(value)
        for p in graph.fused_params:
            p.grad_added_to_main_grad = True  # as Transformer Engine's backward sets it
        graph.fp8.after_backward(invocation.fp8_first)
        self._after_backward()
        if graph.borrowed_outputs:
            self.handout.after_reuse()
        input_grads = tuple(
            None if g is None else (g.clone() if copy else g.detach())
            for g, copy in zip(graph.static_grad_inputs, invocation.copy_grads)
        )
        if through_autograd:
            return input_grads + graph.param_grads.for_autograd(self.clone_param_grads)
        return input_grads + (None,) * len(self.anchor)

    def _run_wgrad(self) -> None:
        self.graph.wgrad.run()

    def reset(self) -> None:
        """Free the graphs and drop the static buffers (their pool memory goes back)."""
        self._forget_order()
        for captured in (self.graph.fwd_graph, self.graph.bwd_graph):
            if captured is not None and hasattr(captured, "reset"):
                captured.reset()
        if self.graph.wgrad is not None:
            self.graph.wgrad.reset()
        self.handout.reset()
        self.graph = None
        self.handout = None
        self.wgrad, self.has_wgrad = None, False
        self.static_inputs = self.static_outputs = ()
        self.input_slots = self.grad_output_slots = ()
        self.output = None


class EagerRunner(Runner):
    """Same wrapper, no graphs: runs the callable on the static buffers at every call."""

    def __init__(self, spec: GraphSpec, warmup: WarmupRecord, fp8: Any, clock: Any = NO_CLOCK, variant: int = 0,
                 wgrad_book: Optional[WgradBook] = None, options: ReplayOptions = ReplayOptions(),
                 slot: Optional[OrderSlot] = None, borrowed: bool = False):
        super().__init__(spec, clock, variant, warmup.updated, wgrad_book, warmup.wgrad, slot, warmup.saved,
                         warmup.idle_calls, warmup.idle_outputs)
        self.spec = spec
        self.fp8 = fp8  # the checks an FP8 graph's calls get (te_support.fp8_replay)
        self.takes_first_microbatch = accepts_is_first_microbatch(spec.call)
        self.static_inputs = spec.static_inputs
        self.input_slots = tuple(map(_Slot, spec.static_inputs))
        self.output = warmup.output
        self._take_outputs(warmup.output.tensors, warmup.fed)
        # The parameters whose gradients the graphs always hand to autograd (tied weights;
        # all with accumulate_grads_in_graph=False) do the same here: the forward runs on
        # stand-ins for them (``parameters``), whose fresh gradients leave the backward through
        # the call's autograd node, so every use of one is summed before it reaches .grad.
        used = [p for i, p in enumerate(spec.params) if i not in warmup.unused_params]
        routed = used if options.always_autograd else [spec.params[i] for i in sorted(spec.tied_params)]
        self.routed = StandIns([spec.func], only=routed) if routed and isinstance(spec.func, torch.nn.Module) else None
        if spec.needs_backward:  # unrouted, the real parameters take their gradients in the nested backward
            self._watch(tuple(used))
        self.handout = EagerOutputs(self.name, spec)
        self.borrowed = borrowed  # the graphs would hand its outputs' memory on after its backward

    def through_autograd(self) -> bool:
        # Otherwise the real module runs: its parameters' hooks see autograd as usual.
        return self.routed is not None

    def forward(self, inputs: tuple[torch.Tensor, ...], through_autograd: bool, with_backward: bool = True,
                is_first_microbatch: Any = None) -> tuple[Invocation, tuple]:
        spec = self.spec
        self._before_forward(inputs)
        self.fp8.before_forward(self.name, is_first_microbatch)
        self._copy_inputs(inputs)
        tick = self.clock.forward(self.variant, self.shape)
        self.handout.before_call()
        args, kwargs = spec.layout.unflatten(self.static_inputs)
        if is_first_microbatch is not None and self.takes_first_microbatch:
            kwargs["is_first_microbatch"] = is_first_microbatch  # TE's weight cache, eagerly
        routed = self.routed is not None and through_autograd
        self._replaying_forward()
        with torch.enable_grad() if spec.needs_backward and with_backward else torch.no_grad():
            with self.routed.installed() if routed else contextlib.nullcontext():
                outputs = self.output.tensors_of(spec.call(*args, **kwargs))
        if self.updated:
            self._copy_back(inputs)
        # Its grads are the live backward's own tensors, never graph memory: nothing to copy.
        # Unrouted, the real parameters take their gradients where the graphs would add them in
        # the graph, unless something observed them at this forward (the graphs then go
        # through autograd): the same checks at the backward as the graphs'.
        observed = routed or compat.ddp_forward_active() or grads.hooked(self.accumulated)
        invocation = Invocation(self.generation, tick, (), (), routed, outputs, False,
                                OBSERVED if observed else compat.hook_handles_made(),
                                self.idle_now(inputs) if self.idle_outputs and with_backward else ())
        detached = self.handout.hand_out(outputs)
        return (self._issued(invocation) if with_backward else invocation), detached

    def backward(self, invocation: Invocation, grads: tuple) -> tuple:
        inputs_only = self._before_backward(invocation, grads)
        self._replaying_backward()
        pairs = [(o, g) for o, g in zip(invocation.outputs, grads) if o.requires_grad]
        outputs = [o for o, _ in pairs]
        grads_ = [torch.zeros_like(o) if g is None else g for o, g in pairs]
        routed = self.routed(self.params) if invocation.through_autograd else ()
        if inputs_only:
            # Only some inputs' gradients are asked for: no parameter takes one (as eager).
            wanted = [t for t in self.static_inputs if t.requires_grad]
            found = iter(torch.autograd.grad(outputs, wanted, grads_, retain_graph=self.retains_graph,
                                             allow_unused=True) if pairs and wanted else ())
            self._after_backward()
            self._reused()
            return tuple(next(found) if t.requires_grad else None for t in self.static_inputs) + (None,) * len(self.anchor)
        stand_ins = [p for p in routed if p is not None]
        with grads_redirected(self.spec.grad_inputs + tuple(stand_ins)):
            if pairs:
                torch.autograd.backward(outputs, grads_, retain_graph=self.retains_graph)
            self._after_backward()
            self._reused()
            input_grads = tuple(t.grad for t in self.static_inputs)
            if invocation.through_autograd:
                return input_grads + tuple(None if s is None else s.grad for s in routed)
            return input_grads + (None,) * len(self.anchor)

    def _reused(self) -> None:
        if self.borrowed:
            self.handout.after_reuse()

    def _run_wgrad(self) -> None:
        check_grads_as_captured(self.name, self.wgrad, self.spec.params)  # as the graphs check
        for module in self.wgrad.modules:
            run_backward_dw(module)  # the module's own: its queue holds this backward's work

    def reset(self) -> None:
        self._forget_order()
        self.spec = None
        self.static_inputs = self.input_slots = ()
        self.output = None
        self.wgrad, self.has_wgrad = None, False


_OVERWRITTEN = (
    "{name}: this output was overwritten by a later call of the same graph (a graph writes its "
    "outputs into the same memory at every replay). Clone an output you keep past the graph's "
    "next call (y.clone()), or capture one graph per microbatch (order=...)."
)
_REUSED = (
    "{name}: this output lived in a buffer that other graphs reuse once its backward has run "
    "(reuse_graph_input_output_buffers=True), and that backward ran (or the graphs were reset): "
    "its memory holds other values now. Clone an output you keep past its backward (y.clone()), "
    "or graph without reuse_graph_input_output_buffers."
)


class GraphOutputs:
    """The tensors a graph's calls hand out: valid memory while the caller holds them, and
    raising when read once a later replay may have overwritten them, as CUDA Graph Trees do
    (``compat.poison_storage``).

    Each output handed out views its static output through a storage of its own that keeps
    the static memory allocated (``compat.owning_alias``), so an output held past ``reset()``,
    past the callable's collection or past ``torch.cuda.empty_cache()`` still reads its
    values. Before a replay, one whose storage someone still holds (the caller kept the
    output, or a view of it) is poisoned and a fresh alias takes its place; the common call
    pays one use-count read per output. Static outputs that other graphs reuse once this
    graph's backward ran (``borrowed``: they own no memory) are poisoned where held at that
    backward, at ``reset()`` and when this object is collected, since the memory is then
    other tensors'. Outputs that are the module's own memory (a view of a parameter) are
    never overwritten and never poisoned. Where torch cannot poison a storage (its CPU
    builds) the static outputs are handed out as they are.
    """

    def __init__(self, name: str, static: tuple[torch.Tensor, ...], spec: GraphSpec, borrowed: bool = False):
        self.name = name
        own = module_memory(spec.func)  # never overwritten: stays right after any number of calls
        self._static = static
        self._guarded = tuple(
            compat.CAN_POISON and type(o) is torch.Tensor and o.device.type == "cuda" and not in_memory_of(o, own)
            for o in static
        )
        self._held = _Held()
        self._track(tuple(map(self._alias, static, self._guarded)))
        if borrowed and any(self._guarded):
            # Collected with its graphs: the memory goes back to the pool's next owner.
            self._finalizer = weakref.finalize(self, self._held.poison, _REUSED.format(name=name))

    def _track(self, current: tuple[torch.Tensor, ...]) -> None:
        """Hand out ``current`` from now on; its storages' use counts, as they are while
        nobody else holds them, are the baseline a held output exceeds."""
        self._current = current
        self._held.track(tuple(t.untyped_storage() if g else None for t, g in zip(current, self._guarded)))

    @staticmethod
    def _alias(t: torch.Tensor, guarded: bool) -> torch.Tensor:
        return compat.owning_alias(t) if guarded else t

    def before_replay(self) -> None:
        """Poison each output of the last call that is still held, before the replay
        overwrites it."""
        self._retire(_OVERWRITTEN)

    def after_reuse(self) -> None:
        """This graph's backward ran and its borrowed static outputs are other graphs' now:
        poison each output still held."""
        self._retire(_REUSED)

    def _retire(self, message: str) -> None:
        held = self._held.held()
        if not held:
            return
        current = list(self._current)
        for i in held:
            compat.poison_storage(self._held.storages[i], message.format(name=self.name))
            current[i] = self._alias(self._static[i], True)
        self._track(tuple(current))

    def reset(self) -> None:
        """The graphs are freed: outputs held on borrowed memory are poisoned (on owned
        memory they keep it, and their values)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.detach() for t in self._current)


class _Held:
    """The storages of the outputs handed out last and their use counts while only
    te_graph holds them: a higher count means the caller holds that output."""

    __slots__ = ("storages", "baseline")

    def track(self, storages: tuple) -> None:
        self.storages = storages
        self.baseline = tuple(compat.use_count(s) if s is not None else 0 for s in storages)

    def held(self) -> list[int]:
        return [i for i, s in enumerate(self.storages) if s is not None and compat.use_count(s) > self.baseline[i]]

    def poison(self, message: str) -> None:
        for i in self.held():
            compat.poison_storage(self.storages[i], message)
        self.storages = ()


class EagerOutputs:
    """Eager replay's mirror of :class:`GraphOutputs`: each call's outputs are new tensors,
    and where graphs would have overwritten them (the module's next call) the ones still
    held are poisoned, so that a program that reads an overwritten output fails the same
    way in both (on a CUDA device, where torch can poison). The tensor handed out is
    poisoned, not its storage (which the live output owns): a view the caller made of it
    keeps its values here, where with graphs it raises too."""

    def __init__(self, name: str, spec: GraphSpec):
        self.name = name
        self._own = module_memory(spec.func)
        self._held: list = []

    def hand_out(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        detached = tuple(o.detach() for o in outputs)
        self._held = [weakref.ref(t) for t in detached if compat.CAN_POISON and type(t) is torch.Tensor and t.device.type == "cuda"]
        return detached

    def before_call(self) -> None:
        self._retire(_OVERWRITTEN)

    def after_reuse(self) -> None:
        """Where the graphs would hand this call's output memory on after its backward
        (``GraphOutputs.after_reuse``)."""
        self._retire(_REUSED)

    def _retire(self, message: str) -> None:
        for ref in self._held:
            t = ref()
            if t is not None and not in_memory_of(t, self._own):
                compat.poison_tensor(t, message.format(name=self.name))
        self._held = []


class _Nothing:
    """What ``Runner._waiting`` holds before the first call: a dead weak reference."""

    def __call__(self) -> None:
        return None


_NOTHING = _Nothing()


class _Slot:
    """A static buffer and what the per-call copy rule reads of it, read once: its address,
    strides and the address range of its storage."""

    __slots__ = ("tensor", "ptr", "stride", "lo", "hi")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.ptr = tensor.data_ptr()
        self.stride = tensor.stride()
        storage = tensor.untyped_storage()
        self.lo = storage.data_ptr()
        self.hi = self.lo + storage.nbytes()


def _address_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` may touch: from its first element's address to past its last."""
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    return start, start + (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share bytes: one storage, overlapping address ranges."""
    if not shares_memory(a, b):
        return False
    (a0, a1), (b0, b1) = _address_range(a), _address_range(b)
    return a0 < b1 and b0 < a1


def _copy_in(slot: _Slot, t: torch.Tensor) -> None:
    """Copy ``t`` into the static buffer unless it lies there already: the same address and
    the same strides (shape and dtype are checked by the layout; the strides are read only
    where the addresses match, so the common call pays nothing for them). A ``t`` starting
    inside the buffer's storage may overlap the buffer (a transposed view of it, an
    overlapping slice of one buffer): that copy goes through a temporary, since a copy
    between overlapping tensors races on the GPU and torch refuses only the cases it can
    prove."""
    p = t.data_ptr()
    if p != slot.ptr or t.stride() != slot.stride:
        slot.tensor.copy_(t.clone() if slot.lo <= p < slot.hi else t)


def shapes_text(shape: Any) -> str:
    return ", ".join(str(tuple(s)) for s in shape) if shape else "()"


class _Replay(torch.autograd.Function):
    """The autograd node of one call of a graphed callable."""

    @staticmethod
    def forward(ctx, runner: Runner, through_autograd: bool, is_first_microbatch: Any, *inputs: torch.Tensor) -> tuple:
        tensors = inputs[: len(runner.static_inputs)]
        invocation, outputs = runner.forward(tensors, through_autograd, True, is_first_microbatch)
        ctx.runner = runner
        ctx.invocation = invocation
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
            raise RuntimeError(_DOUBLE_BACKWARD.format(name=runner.name))
        # (A second backward without retain_graph has freed them: _check_fresh refuses it.)
        if runner.saved.indices and (ctx.invocation.backwards == 0 or runner.retains_graph):
            runner.check_saved_outputs(ctx)
        return (None, None, None) + runner.backward(ctx.invocation, grads)


_ReplayBackward = compat.backward_node_class(_Replay)  # the autograd node class of every graphed call
_apply_directly = compat.direct_apply(_Replay)
_functorch_active = compat.functorch_active


def _forward_only_error(runner: Runner) -> ValueError:
    return ValueError(
        f"{runner.name}: called with grad enabled where its result would require grad (an "
        "input requires grad, or the module has trainable parameters), but it was graphed "
        "without a backward (under torch.no_grad(), or with nothing requiring grad). Call it "
        "under torch.no_grad(), or graph it with grad enabled and samples whose "
        "requires_grad matches the real inputs."
    )


def run(runner: Runner, tensors: list, is_first_microbatch: Any = None) -> tuple:
    """Replay ``runner`` for one call: an autograd node when a backward may follow.
    ``is_first_microbatch`` is Transformer Engine's per-call keyword (``te_support``)."""
    if not runner.differentiable:
        if torch.is_grad_enabled() and (runner.params or any(t.requires_grad for t in tensors)):
            raise _forward_only_error(runner)
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
    through_autograd = runner.through_autograd()
    extra = runner.params if through_autograd else runner.anchor
    apply = _Replay.apply if _functorch_active() else _apply_directly
    return apply(runner, through_autograd, is_first_microbatch, *tensors, *extra)
