"""Weight gradients a module delays to a ``backward_dw()`` pass (Transformer Engine's
``delay_wgrad_compute=True``; the module protocol is the integration's, through the seam)
under te_graph's graphs, with eager TE's meaning.

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
  before the next forward: ``replay.order.WgradBook``). The passes share a pool of their own,
  and their outputs are handed back to it (non-owning aliases): a pass's gradients are
  copied out right after its replay, before any other pass runs.
* **Replay** (:class:`WgradReplay`) replays that graph, then does what ``backward_dw()``'s
  Python did, module by module: sets each ``.grad`` where eager TE would (a copy: eager
  hands out a new tensor each time) and runs the module's hooks. Eager replay calls the
  modules' own ``backward_dw()``.
* **Order** (``replay.order.WgradBook``, one per ``make_graphed_callables`` call): ``backward_dw()``
  takes the oldest backward of its callable still waiting for it, as TE's queue does; a
  graph's next forward or backward waits until then (the pass reads that graph's buffers),
  and without an order every forward waits for every pass.
* **TE's queues** must be empty when graphing starts and after each warmup pass (a module
  run twice in one forward would leave work behind: :func:`check_no_queued_work`), and
  are emptied if graphing fails (:func:`drop_queued_work`).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..extension import SEAM
from ..records import OVERWRITES, SETS_IF_NONE, UNKNOWN, DelayedWgrad

__all__ = ["delayed_wgrad_modules", "delayed_modules_in", "check_no_queued_work", "drop_queued_work", "learn_wgrad",
           "check_still_delayed", "check_grads_as_captured", "WgradReplay"]


def delayed_wgrad_modules(modules: Sequence[Any]) -> tuple:
    """The modules among ``modules`` that delay their weight gradients (``backward_dw()``)."""
    return tuple(m for m in modules if SEAM.delays_wgrad(m))


def delayed_modules_in(modules: Sequence[Any]) -> list:
    """Every submodule of ``modules`` that delays its weight gradients."""
    subs = {id(m): m for module in modules if isinstance(module, torch.nn.Module) for m in module.modules()}
    return list(delayed_wgrad_modules(list(subs.values())))


def check_no_queued_work(modules: Sequence[Any], when: str) -> None:
    """Refuse where a module's queue holds work (``when``: what would go wrong)."""
    for m in modules:
        queued = SEAM.queued_wgrad(m)
        if queued:
            raise RuntimeError(
                f"make_graphed_callables: {type(m).__name__} (built with delay_wgrad_compute=True) "
                f"holds {len(queued)} backward(s) waiting for backward_dw() {when}."
            )


def drop_queued_work(modules: Sequence[Any]) -> None:
    """Empty the modules' queues (after a failed capture: what it queued is not the user's)."""
    for m in modules:
        queued = SEAM.queued_wgrad(m)
        if queued:
            queued.clear()


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
    with SEAM.wgrad_hooks_held(modules):
        for module in modules:
            before = [p.grad for p in stand]
            SEAM.run_backward_dw(module)
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
        if not SEAM.delays_wgrad(m):
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
            SEAM.run_wgrad_hooks(module)

    def reset(self) -> None:
        if hasattr(self.graph, "reset"):
            self.graph.reset()
        self.graph = None
        self.sets = self.params = ()


