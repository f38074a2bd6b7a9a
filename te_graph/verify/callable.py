"""The graphed callable that verifies: a ``GraphedCallable`` whose class is switched to
``VerifiedCallable`` while verification is on, so that a callable without it pays nothing
per call. A call the schedule picks runs the graph (its parameter gradients through the
autograd node, where they can be read), then its eager shadow (``shadow``), and compares
the outputs at once and the gradients when the call's backward has run."""
from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import torch

from ..replay.function import run
from ..replay.graphed import GraphedCallable
from ..resources import graphed_callables_in
from .compare import differences, report
from .options import Schedule, Verify
from .shadow import ModuleSnapshot, Shadow, arguments_before

__all__ = ["VerifiedCallable", "verify"]


class VerifiedCallable(GraphedCallable):
    """A graphed callable with verification on (``verify``)."""

    _verification: Schedule
    _failed: bool

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._failed or not self._eligible() or not self._verification.due():
            return super().__call__(*args, **kwargs)
        self._fingerprint.check()
        first = kwargs.pop("is_first_microbatch", None) if self._pops_first_microbatch else None
        runner, tensors = self._pick(args, kwargs)
        if runner is None:
            return self._unseen(args, kwargs, tensors)
        before = ModuleSnapshot(runner.spec.func, runner.tracker)
        copied = arguments_before(args, kwargs)
        outputs = run(runner, tensors, first, through_autograd=bool(runner.params))
        shadow = Shadow(runner, *copied, first, before)
        found = differences([(f"output {i}", o, e) for i, (o, e) in enumerate(zip(outputs, shadow.outputs))])
        if found:
            self._mismatch(report(self.__name__, found, "output"), found)
        else:
            self._check_backward(runner, tensors, outputs, shadow)
        return runner.output.build(outputs)

    def _eligible(self) -> bool:
        """Calls that replay a graph (not the eager forward of the other training mode)."""
        if self._module is not None and self._module.training != self._training:
            return False
        return not (self._grad_mode_dependent and not torch.is_grad_enabled())

    def _check_backward(self, runner: Any, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                        shadow: Shadow) -> None:
        """When the call's backward runs: the shadow's backward first, from the same incoming
        gradients and random state (when eager code's would run: before the graph's backward
        changes anything, such as the FP8 scales the first FP8 call's backward updates), then
        the graph's, then the comparison of their gradients."""
        node = next((o.grad_fn for o in outputs if o.requires_grad and o.grad_fn is not None), None)
        if node is None:
            return
        count = len(tensors)
        eager: list = []

        def shadow_backward(grad_outputs: tuple) -> None:
            first.remove()
            eager.append(shadow.backward(grad_outputs))

        def compare(grad_inputs: tuple, grad_outputs: tuple) -> None:
            second.remove()
            inputs, params = eager.pop()
            named = [(f"gradient of input {i}", g, e) for i, (g, e) in enumerate(zip(grad_inputs[:count], inputs))
                     if tensors[i].requires_grad]
            graphed_params = grad_inputs[count:count + len(runner.params)]
            names, skipped = _parameter_names(runner), _not_compared(runner)
            named += [(f"gradient of parameter {names.get(id(p), tuple(p.shape))!r}", g, e)
                      for p, g, e in zip(runner.params, graphed_params, params) if id(p) not in skipped]
            found = differences(named)
            if found:
                self._mismatch(report(self.__name__, found, "gradient"), found)

        first = node.register_prehook(shadow_backward)
        second = node.register_hook(compare)

    def _mismatch(self, text: str, found: list) -> None:
        options = self._verification.options
        if options.tolerance == "rounding" and all(d.rounding for d in found):
            warnings.warn(text, stacklevel=3)
            return
        if options.on_mismatch == "raise":
            raise RuntimeError(text)
        if options.on_mismatch == "eager":
            self._failed = True
            self.__class__ = EagerAfterMismatch
            text += " Running this callable eagerly from now on (on_mismatch='eager')."
        warnings.warn(text, stacklevel=3)


class EagerAfterMismatch(VerifiedCallable):
    """A callable whose verified call differed, with ``on_mismatch="eager"``: its own forward
    runs at every call from then on."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("is_first_microbatch", None) if self._pops_first_microbatch else None
        return self._eager(*args, **kwargs)


def _not_compared(runner: Any) -> set:
    """Ids of the parameters whose gradients the backward does not give: those holding a
    ``main_grad`` (the kernels accumulate into it; the shadow's is put back) and those a
    ``backward_dw()`` pass sets (the backward leaves them alone or hands a placeholder)."""
    params = runner.spec.params
    skipped = {id(p) for p in params if "main_grad" in p.__dict__}
    if getattr(runner, "wgrad", None) is not None:
        skipped |= {id(params[i]) for per_module in runner.wgrad.sets for i, _ in per_module}
    return skipped


def _parameter_names(runner: Any) -> dict:
    module = runner.spec.func if runner.spec is not None else None
    return {id(p): n for n, p in module.named_parameters()} if isinstance(module, torch.nn.Module) else {}


def verify(*graphed: Any, first: int = 8, every: int = 0, fraction: float = 0.0, on_mismatch: str = "raise",
           tolerance: str = "bitwise", seed: int = 0, options: Optional[Verify] = None) -> None:
    """Turn verification on (or, with ``first=0`` and nothing else, off) for callables
    already graphed: graphed callables or modules, or tuples of them as
    ``make_graphed_callables`` returned them. See ``te_graph.Verify`` for the arguments."""
    if options is not None and not isinstance(options, Verify):
        raise TypeError(f"te_graph.verify(): options must be a te_graph.Verify, got {type(options).__name__}.")
    options = options if options is not None else Verify(first, every, fraction, on_mismatch, tolerance, seed)
    off = options.first == 0 and options.every == 0 and options.fraction == 0
    found = graphed_callables_in(graphed)
    for obj, callable_ in found:
        if not isinstance(callable_, GraphedCallable):
            raise TypeError(f"te_graph.verify(): {type(obj).__name__} is not a graphed callable or a module "
                            "graphed by make_graphed_callables.")
    for _, callable_ in found:
        turn_on(callable_, None if off else options)


def turn_on(callable_: GraphedCallable, options: Optional[Verify]) -> None:
    """Switch ``callable_``'s verification to ``options`` (None: off)."""
    if options is None:
        callable_.__class__ = GraphedCallable
        return
    callable_.__class__ = VerifiedCallable
    callable_._verification = Schedule(options)
    callable_._failed = False
