"""In what order the graphs of one memory pool may replay (``ReplayOrder``, ``OrderSlot``),
the clock of several captured shapes (``Clock``), the weight-gradient passes waiting for
``backward_dw()`` (``WgradBook``), and where one runner sits among them (``ReplayContext``)."""
from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["ReplayOptions", "Clock", "NO_CLOCK", "ReplayOrder", "OrderSlot", "WgradBook", "ReplayContext",
           "shapes_text"]


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

    def join(self, position: int, runner: Any) -> int:
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

    def check(self, runner: Any, refused_activations: int, refused_queued: int, what: str) -> None:
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

    def mark(self, runner: Any, refused: int) -> None:
        """Right before ``runner`` replays: the graphs keeping activations it may overwrite."""
        hit = self.retained & refused & ~self.clobbered
        self.clobbered |= hit
        while hit:
            low = hit & -hit
            self._clobbered_by[low.bit_length() - 1] = runner.name
            hit ^= low

    def check_kept(self, runner: Any, bit: int) -> None:
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


def shapes_text(shape: Any) -> str:
    return ", ".join(str(tuple(s)) for s in shape) if shape else "()"



class WgradBook:
    """The weight-gradient passes of one ``make_graphed_callables`` call that wait for their
    ``backward_dw()``: per callable, oldest first (TE keeps one queue per module), each with
    the clock tick of its backward.

    Checked before every replay, graphs and eager replay alike:

    * ``backward_dw()`` takes the oldest backward of its callable (TE's queue pops it), and
      no graph of another shape (``more_shapes``, same pool) replayed since its backward;
    * a graph's next forward or backward waits for its own pass (the pass reads its
      buffers);
    * without an order, no forward replays while any pass waits: the passes are captured
      after every backward, so a forward's memory may hold what they read. (With an order,
      replays follow the order, which places each pass.)
    """

    def __init__(self, ordered: bool) -> None:
        self.ordered = ordered
        self.waiting: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    def waits(self, runner: Any) -> bool:
        """Whether the weight-gradient pass of ``runner``'s last backward still waits."""
        return any(r is runner for r, _ in self.waiting[runner.owner])

    def check_forward(self, runner: Any) -> None:
        if self.waits(runner):
            raise RuntimeError(self._busy(runner, "forward"))
        if not self.ordered:
            for queue in self.waiting.values():
                if queue:
                    raise RuntimeError(
                        f"{runner.name}: forward while the backward_dw() of {queue[0][0].name} has not "
                        "run; without an order, run every waiting backward_dw() before the next "
                        "forward (the weight-gradient passes are captured after every backward, so "
                        "a forward may overwrite what they read)."
                    )

    def check_backward(self, runner: Any) -> None:
        if self.waits(runner):
            raise RuntimeError(self._busy(runner, "backward"))

    @staticmethod
    def _busy(runner: Any, what: str) -> str:
        return (f"{runner.name}: {what} while the backward_dw() of its last backward has not run; the "
                "weight-gradient pass reads the buffers this would overwrite. Call backward_dw() "
                "after each backward, before the next call.")

    def backward_done(self, runner: Any, tick: int) -> None:
        self.waiting[runner.owner].append((runner, tick))

    def check_take(self, runner: Any, tick: int) -> None:
        """Before ``runner``'s ``backward_dw()``: it is the oldest of its callable waiting,
        and no other shape's graphs replayed since its backward."""
        queue = self.waiting[runner.owner]
        if not self.waits(runner):
            raise RuntimeError(
                f"{runner.name}: backward_dw() without a backward waiting for it; call it once "
                "after each backward."
            )
        head, head_tick = queue[0]
        if head is not runner:
            raise RuntimeError(
                f"{runner.name}: backward_dw() out of order: the backward of {head.name} ran before "
                "this one's and still waits for its backward_dw(); eager Transformer Engine would "
                "compute that one's weight gradient here. Call backward_dw() in the order the "
                "backwards ran."
            )
        if head_tick != tick:
            raise RuntimeError(
                f"{runner.name}: backward_dw() after graphs of another shape replayed since its "
                "backward; they share its memory pool and may have overwritten what the "
                "weight-gradient pass reads. Run backward_dw() before calls of another shape."
            )

    def taken(self, runner: Any) -> None:
        self.waiting[runner.owner].popleft()



@dataclass(frozen=True)
class ReplayContext:
    """Where a runner sits among the graphs of its ``make_graphed_callables`` call: how its
    calls hand out gradients, the shapes' clock, its sample set, the call's weight-gradient
    passes waiting, and its place in its pool's replay order."""

    options: ReplayOptions
    slot: OrderSlot
    clock: Any = None  # Clock, or NO_CLOCK with one sample set
    variant: int = 0  # its sample set
    wgrad_book: Optional["WgradBook"] = None
    borrowed: bool = False  # its outputs' memory goes to later graphs after its backward (buffer reuse)
    tracker: Any = None  # the RNG tracker the call was graphed with (``rng.process_tracker()`` by default)
