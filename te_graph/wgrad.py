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
  order once their backward has (after the whole backward, or each at once), since nothing
  captured later can reuse what they read. The passes share a pool of their own, and their
  outputs are handed back to it (non-owning aliases): a pass's gradients are copied out
  right after its replay, before any other pass runs.
* **Replay** (:class:`WgradReplay`) replays that graph, then does what ``backward_dw()``'s
  Python did, module by module: sets each ``.grad`` where eager TE would (a copy: eager
  hands out a new tensor each time) and runs the module's hooks. Eager replay calls the
  modules' own ``backward_dw()``.
* **Order** (:class:`WgradQueue`, one per graphed callable): ``backward_dw()`` takes the
  oldest backward still waiting for it, as TE's queue does; a graph's next forward or
  backward waits until then (the pass reads that graph's buffers).
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

__all__ = [
    "OVERWRITES", "SETS_IF_NONE", "UNKNOWN", "DelayedWgrad", "delayed_wgrad_modules", "learn_wgrad",
    "run_backward_dw", "wgrad_hooks_held", "WgradReplay", "WgradQueue",
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


class WgradReplay:
    """One graph's captured weight-gradient pass and what its replay does around it."""

    def __init__(self, name: str, learned: DelayedWgrad, params: Sequence[torch.Tensor], graph: Any,
                 outputs: Sequence[Sequence[torch.Tensor]]):
        self.name = name
        self.modules = learned.modules
        self.graph = graph
        # per module: (real parameter, kind, static gradient the graph writes)
        self.sets = tuple(
            tuple((params[i], kind, out) for (i, kind), out in zip(per_module, per_outputs))
            for per_module, per_outputs in zip(learned.sets, outputs)
        )
        self.kept = tuple(params[i] for i in learned.kept)

    def run(self) -> None:
        for p in self.kept:
            if p.grad is None:
                raise RuntimeError(
                    f"{self.name}: backward_dw() found the .grad of a parameter its backward gave a "
                    f"gradient (shape {tuple(p.shape)}) set to None since; its graph was captured with "
                    "that gradient in place, where eager TE may decide otherwise. Leave those "
                    "gradients in place between the backward and backward_dw()."
                )
        for per_module in self.sets:
            for p, kind, _ in per_module:
                if kind == UNKNOWN and p.grad is not None:
                    raise RuntimeError(
                        f"{self.name}: backward_dw() found a .grad (shape {tuple(p.shape)}) that only "
                        "the weight-gradient pass sets already in place; with one warmup pass te_graph "
                        "cannot tell whether eager TE would overwrite it or keep it. Set it to None "
                        "first (zero_grad(set_to_none=True)), or graph with num_warmup_iters >= 2."
                    )
        self.graph.replay()
        for module, per_module in zip(self.modules, self.sets):
            for p, kind, out in per_module:
                if kind == OVERWRITES or p.grad is None:
                    p.grad = out.clone()
            _run_hooks(module)

    def reset(self) -> None:
        if hasattr(self.graph, "reset"):
            self.graph.reset()
        self.graph = None
        self.sets = ()


class WgradQueue:
    """The graphs of one graphed callable whose backward ran and whose ``backward_dw()`` has
    not, oldest first (TE's queue of weight-gradient work, one per module)."""

    def __init__(self) -> None:
        self.waiting: collections.deque = collections.deque()

    def check_free(self, runner: Any, what: str) -> None:
        """Before ``runner``'s forward or backward: its last weight-gradient pass has run."""
        if any(r is runner for r in self.waiting):
            raise RuntimeError(
                f"{runner.name}: {what} while the backward_dw() of its last backward has not run; "
                "the weight-gradient pass reads the buffers this would overwrite. Call "
                "backward_dw() after each backward, before the next call."
            )

    def backward(self, runner: Any) -> None:
        self.check_free(runner, "backward")
        self.waiting.append(runner)

    def take(self, runner: Any) -> None:
        """``runner``'s ``backward_dw()``: it must be the oldest waiting."""
        if not any(r is runner for r in self.waiting):
            raise RuntimeError(
                f"{runner.name}: backward_dw() without a backward waiting for it; call it once "
                "after each backward."
            )
        if self.waiting[0] is not runner:
            raise RuntimeError(
                f"{runner.name}: backward_dw() out of order: the backward of "
                f"{self.waiting[0].name} ran before this one's and still waits for its "
                "backward_dw(); eager Transformer Engine would compute that one's weight "
                "gradient here. Call backward_dw() in the order the backwards ran."
            )
        self.waiting.popleft()
