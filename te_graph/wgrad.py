"""Transformer Engine's split weight gradients (``delay_wgrad_compute=True`` and
``backward_dw()``) under te_graph's graphs, with eager TE's meaning.

Eager TE 2.20 (``module/base.py``, ``layernorm_mlp.py``, ``grouped_linear.py``): the
backward of such a module computes input gradients only and queues its weight-gradient
GEMMs; ``backward_dw()`` takes the oldest queued work, runs it, sets the parameters'
``.grad`` (a weight's always, overwriting; a bias's only where it is None) and then runs
the module's wgrad accumulation-and-reduce hooks (Megatron registers them). te_graph:

* **Warmup** (:func:`learn_wgrad`) runs each such graph's ``backward_dw()`` after its
  backward, hooks held back, and learns which parameters it sets (ones the backward left
  alone) and, from a later pass that first gives them a gradient, which it overwrites.
* **Capture** records the pass as a third graph per (layer, microbatch), with those
  parameters' ``.grad`` None; the gradients it sets are its static outputs. Where: at the
  order's ``-c-0.5`` entries (replays then follow the order, as for forwards and
  backwards); without an order, after every backward, so that the passes may run in any
  order once their backward has (after the whole backward, or each at once, but all
  before the next forward: :class:`WgradBook`). The passes share a pool of their own,
  and their outputs are handed back to it (non-owning aliases): a pass's gradients are
  copied out right after its replay, before any other pass runs.
* **Replay** (:class:`WgradReplay`) replays that graph, then does what ``backward_dw()``'s
  Python did, module by module: sets each ``.grad`` where eager TE would (a copy: eager
  hands out a new tensor each time) and runs the module's hooks. Eager replay calls the
  modules' own ``backward_dw()``.
* **Order** (:class:`WgradBook`, one per ``make_graphed_callables`` call): ``backward_dw()``
  takes the oldest backward of its callable still waiting for it, as TE's queue does; a
  graph's next forward or backward waits until then (the pass reads that graph's buffers),
  and without an order every forward waits for every pass.
* **TE's queues** must be empty when graphing starts and after each warmup pass (a module
  run twice in one forward would leave work behind: :func:`check_no_queued_work`), and
  are emptied if graphing fails (:func:`drop_queued_work`).
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

__all__ = [
    "OVERWRITES", "SETS_IF_NONE", "UNKNOWN", "DelayedWgrad", "delayed_wgrad_modules", "learn_wgrad",
    "run_backward_dw", "wgrad_hooks_held", "check_grads_as_captured", "WgradReplay", "WgradBook",
    "delayed_modules_in", "check_no_queued_work", "drop_queued_work", "check_still_delayed",
]

OVERWRITES = "overwrites"  # backward_dw sets .grad whatever it held (a weight)
SETS_IF_NONE = "sets if None"  # only where .grad is None (a bias)
UNKNOWN = "unknown"  # one warmup pass cannot tell: .grad must be None at backward_dw


@dataclass(frozen=True)
class DelayedWgrad:
    """What warmup learned about one graph's weight-gradient pass."""

    modules: tuple  # the TE modules whose backward_dw() it runs, in forward order
    sets: tuple[tuple[tuple[int, str], ...], ...]  # per module: (index into spec.params, kind)
    split_params: frozenset  # those the backward leaves alone: only the pass gives them a gradient
    kept: tuple[int, ...]  # parameters the backward gave a gradient that backward_dw may read


def delayed_wgrad_modules(modules: Sequence[Any]) -> tuple:
    """The TE modules among ``modules`` built with ``delay_wgrad_compute=True``."""
    return tuple(m for m in modules if callable(getattr(m, "need_backward_dw", None)) and m.need_backward_dw())


def delayed_modules_in(modules: Sequence[Any]) -> list:
    """Every submodule of ``modules`` that delays its weight gradients (a TE module)."""
    subs = {id(m): m for module in modules if isinstance(module, torch.nn.Module) for m in module.modules()}
    return list(delayed_wgrad_modules(list(subs.values())))


def _queued(module: Any) -> Any:
    """The deque of work ``module``'s backward queued for ``backward_dw()`` (TE 2.20
    ``module/_common.py``: ``WeightGradStore.context``, a ``queue.Queue``), or None."""
    return getattr(getattr(getattr(module, "wgrad_store", None), "context", None), "queue", None)


def check_no_queued_work(modules: Sequence[Any], when: str) -> None:
    """Refuse where a module's queue holds work (``when``: what would go wrong)."""
    for m in modules:
        if _queued(m):
            raise RuntimeError(
                f"make_graphed_callables: {type(m).__name__} (built with delay_wgrad_compute=True) "
                f"holds {len(_queued(m))} backward(s) waiting for backward_dw() {when}."
            )


def drop_queued_work(modules: Sequence[Any]) -> None:
    """Empty the modules' queues (after a failed capture: what it queued is not the user's)."""
    for m in modules:
        queued = _queued(m)
        if queued:
            queued.clear()


def run_backward_dw(module: Any) -> None:
    """The module's own ``backward_dw()`` (its class's: on a module graphed without an order,
    the attribute of that name is the graphed one, as in TE)."""
    type(module).backward_dw(module)


def _run_hooks(module: Any) -> None:
    """What ``backward_dw()`` ends with: the module's wgrad accumulation-and-reduce hooks."""
    for hook in getattr(module, "wgrad_accumulation_and_reduce_hooks", ()):
        hook()


@contextlib.contextmanager
def wgrad_hooks_held(modules: Sequence[Any]) -> Iterator[None]:
    """Inside: the modules' wgrad accumulation-and-reduce hooks are held back, so warmup and
    capture run (and capture) none of them; they come back on exit."""
    saved = [(m, m.wgrad_accumulation_and_reduce_hooks) for m in modules
             if isinstance(getattr(m, "wgrad_accumulation_and_reduce_hooks", None), list)]
    try:
        for m, _ in saved:
            m.wgrad_accumulation_and_reduce_hooks = []
        yield
    finally:
        for m, hooks in saved:
            m.wgrad_accumulation_and_reduce_hooks = hooks


def learn_wgrad(modules: tuple, params: Sequence[torch.Tensor], stand: Sequence[torch.Tensor],
                known: Optional[DelayedWgrad]) -> DelayedWgrad:
    """Run the graph's weight-gradient pass once, right after a warmup backward (``stand``:
    the parameters' stand-ins, installed), and learn from it.

    First pass (``known`` None): which stand-ins each module's ``backward_dw()`` gives a
    gradient: one the backward gave a gradient too (GroupedLinear's backward hands autograd
    a placeholder) is overwritten; for the others a later pass tells: they first get a
    gradient, and the ones it replaces are overwritten, the rest set only where None.
    """
    touched = {i for i, p in enumerate(stand) if p.grad is not None}
    marks: dict[int, torch.Tensor] = {}
    if known is not None:
        for i in known.split_params:
            marks[i] = stand[i].grad = torch.zeros(stand[i].shape, dtype=stand[i].dtype, device=stand[i].device)
    sets = []
    with wgrad_hooks_held(modules):
        for module in modules:
            before = [p.grad for p in stand]
            run_backward_dw(module)
            if known is None:
                sets.append(tuple((i, OVERWRITES if i in touched else UNKNOWN) for i, p in enumerate(stand)
                                  if p.grad is not None and p.grad is not before[i]))
    if known is not None:
        sets = [
            tuple((i, kind if i not in marks else OVERWRITES if stand[i].grad is not marks[i] else SETS_IF_NONE)
                  for i, kind in per_module)
            for per_module in known.sets
        ]
        split = known.split_params
    else:
        split = frozenset(i for per_module in sets for i, _ in per_module if i not in touched)
    replaced = {i for per_module in sets for i, _ in per_module}
    kept = tuple(i for i in sorted(touched - replaced) if getattr(params[i], "skip_backward_post_hook", False))
    return DelayedWgrad(modules, tuple(sets), split, kept)


def check_still_delayed(name: str, learned: DelayedWgrad) -> None:
    """Before a forward (graphed or eager replay alike): the modules still delay their
    weight gradients, as when the graphs were captured (TE's
    ``wgrad_store.disable_delay_wgrad_compute()`` would put them back in the backward)."""
    for m in learned.modules:
        if not m.need_backward_dw():
            raise RuntimeError(
                f"{name}: {type(m).__name__} no longer delays its weight gradients "
                "(delay_wgrad_compute was switched off after graphing); its graphs leave them to "
                "backward_dw(). Switch it back on, or graph the module again."
            )


def check_grads_as_captured(name: str, learned: DelayedWgrad, params: Sequence[torch.Tensor]) -> None:
    """Before a weight-gradient pass (graphed or eager replay alike): the ``.grad`` state
    its graph was captured for, where eager TE's choice depends on it."""
    for i in learned.kept:
        if params[i].grad is None:
            raise RuntimeError(
                f"{name}: backward_dw() found the .grad of a parameter its backward gave a "
                f"gradient (shape {tuple(params[i].shape)}) set to None since; its graph was "
                "captured with that gradient in place, where eager TE may decide otherwise. Leave "
                "those gradients in place between the backward and backward_dw()."
            )
    for per_module in learned.sets:
        for i, kind in per_module:
            if kind == UNKNOWN and params[i].grad is not None:
                raise RuntimeError(
                    f"{name}: backward_dw() found a .grad (shape {tuple(params[i].shape)}) that only "
                    "the weight-gradient pass sets already in place; with one warmup pass te_graph "
                    "cannot tell whether eager TE would overwrite it or keep it. Set it to None "
                    "first (zero_grad(set_to_none=True)), or graph with num_warmup_iters >= 2."
                )


class WgradReplay:
    """One graph's captured weight-gradient pass and what its replay does around it."""

    def __init__(self, name: str, learned: DelayedWgrad, params: Sequence[torch.Tensor], graph: Any,
                 outputs: Sequence[Sequence[torch.Tensor]]):
        self.name = name
        self.learned = learned
        self.params = tuple(params)
        self.graph = graph
        # per module: (real parameter, kind, static gradient the graph writes)
        self.sets = tuple(
            tuple((params[i], kind, out) for (i, kind), out in zip(per_module, per_outputs))
            for per_module, per_outputs in zip(learned.sets, outputs)
        )

    def run(self) -> None:
        check_grads_as_captured(self.name, self.learned, self.params)
        self.graph.replay()
        for module, per_module in zip(self.learned.modules, self.sets):
            for p, kind, out in per_module:
                if kind == OVERWRITES or p.grad is None:
                    p.grad = out.clone()
            _run_hooks(module)

    def reset(self) -> None:
        if hasattr(self.graph, "reset"):
            self.graph.reset()
        self.graph = None
        self.sets = self.params = ()


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
