"""The one seam between the engine and the frameworks it serves.

The engine (every folder of ``te_graph`` but ``integrations``) never imports an
integration. An integration subclasses :class:`Extension`, overriding what its framework
needs, and registers an instance with :func:`register` when it is imported
(``te_graph.integrations`` imports the ones installed). The engine asks :data:`SEAM`, which
fans each question out to the extensions that answer it. What may be asked:

* how a module is entered for capture (``capture_entry``, ``routes_capture``), which of its
  submodules run eagerly around the graphs and which hooks run by hand before a replay
  (megatron-core's helper);
* which modules keep per-call state of their own, hold quantized parameters, or delay their
  weight gradients to a ``backward_dw()`` pass, and what to drop after capture
  (Transformer Engine's modules);
* the FP8 steps around warmup, capture and replay (:class:`Precision`; one extension may
  provide it).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

__all__ = ["Extension", "Precision", "ReplaySteps", "NO_REPLAY_STEPS", "NO_PRECISION", "register", "unregister", "SEAM"]


class Precision:
    """Reduced-precision capture (FP8) as one framework defines it. The default accepts no
    precision arguments: without a registered provider they are unknown keywords."""

    argument_names: tuple[str, ...] = ()

    def options(self, arguments: Mapping[str, Any], callables: Sequence[Callable]) -> Any:
        """The normalised options of one call (``.on``: whether any callable runs in it)."""
        return _Off(len(callables))

    def capture(self, options: Any, modules: Sequence[torch.nn.Module]) -> Any:
        """What warmup and capture run inside (``active()``, ``autocast(enabled)``, ...);
        None where the call runs without reduced precision."""
        return None

    def replay(self, enabled: bool, options: Any, modules: Sequence[Any], framework_modules: bool,
               graphs: bool) -> Any:
        """What a runner does around each call (``before_forward``, ``before_replay``,
        ``after_forward``, ``after_backward``)."""
        return NO_REPLAY_STEPS

    def kept(self, modules: Sequence[Any]) -> contextlib.AbstractContextManager:
        """Inside: what an extra eager run of ``modules`` changes of the precision's state
        (the verifier's shadow: FP8 meta) is put back on exit."""
        return contextlib.nullcontext()

    def scaling_state_in_use(self) -> Optional[str]:
        """What quantizes now with scaling state kept from step to step (FP8 delayed
        scaling), named for a message; None where nothing does."""
        return None


class _Off:
    """Options of a call without reduced precision."""

    on = False

    def __init__(self, count: int):
        self.enabled = (False,) * count


class ReplaySteps:
    """What a runner does around each replay: nothing, unless a precision says otherwise."""

    @staticmethod
    def before_forward(name: str, is_first_microbatch: Any) -> bool:
        return False

    @staticmethod
    def before_replay() -> None:
        pass

    @staticmethod
    def after_forward() -> None:
        pass

    @staticmethod
    def after_backward(first: bool) -> None:
        pass


NO_REPLAY_STEPS = ReplaySteps()
NO_PRECISION = Precision()


class Extension:
    """What an integration may tell the engine; each default means "nothing of mine"."""

    name = "extension"
    precision: Optional[Precision] = None

    @property
    def packages(self) -> frozenset:
        """The framework's top-level Python packages (by default its ``name``): their code
        and objects keep their own per-call state, so the guards learnt from reads leave
        their globals and plain objects alone."""
        return frozenset({self.name})

    # -- how a module is entered and replayed
    def capture_entry(self, module: torch.nn.Module) -> Optional[Callable]:
        """The function graphing calls for ``module`` instead of its ``forward``."""
        return None

    def routes_capture(self, module: torch.nn.Module) -> bool:
        """Whether ``module``'s class replays its graphs from its own ``__call__``."""
        return False

    def submodules_run_eagerly(self, module: torch.nn.Module) -> frozenset:
        """Qualified names of submodules the graphs never run (they run around the replay)."""
        return frozenset()

    def manual_hooks(self, module: torch.nn.Module) -> Optional[list]:
        """The list object of ``(hook, args)`` run by hand before each replay, or None."""
        return None

    def hooks_run_by_hand(self, module: torch.nn.Module) -> frozenset:
        """The code objects of forward pre-hooks run by hand before each replay."""
        return frozenset()

    def modules_run_by_hand(self, module: torch.nn.Module) -> frozenset:
        """The ids of the submodules whose forward pre-hooks are run by hand."""
        return frozenset()

    # -- module queries
    def keeps_own_state(self, module: Any) -> bool:
        """Whether the extension checks this module's per-call state itself (its Python
        attributes are then left out of the frozen fingerprint)."""
        return False

    def holds_modules(self, module: Any) -> bool:
        """Whether ``module`` holds modules of this framework."""
        return False

    def is_quantized_parameter(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a quantized parameter this framework trains (a tensor subclass)."""
        return False

    def writes_main_grad(self, module: torch.nn.Module) -> bool:
        """Whether ``module``'s kernels accumulate into its weights' ``main_grad`` by address."""
        return False

    def check_module(self, where: str, module: torch.nn.Module) -> None:
        """Refuse, before anything changes, a module built in a way graphs cannot serve."""

    def visited_modules(self, func: Any) -> contextlib.AbstractContextManager:
        """Inside: collects this framework's modules a forward of ``func`` runs."""
        return contextlib.nullcontext(None)

    def forget_stand_in_caches(self, modules: Sequence[Any]) -> None:
        """Drop what modules cached of the parameter stand-ins while graphs were made."""

    # -- weight gradients delayed to a backward_dw() pass
    def delays_wgrad(self, module: Any) -> bool:
        return False

    def queued_wgrad(self, module: Any) -> Any:
        """The container of work queued for ``module``'s ``backward_dw()``, or None."""
        return None

    def run_backward_dw(self, module: Any) -> None:
        raise NotImplementedError

    def wgrad_hooks_held(self, modules: Sequence[Any]) -> contextlib.AbstractContextManager:
        """Inside: the hooks ``backward_dw()`` ends with are held back."""
        return contextlib.nullcontext()

    def run_wgrad_hooks(self, module: Any) -> None:
        """What ``backward_dw()`` ends with (the module's accumulation hooks)."""


_EXTENSIONS: list[Extension] = []


def register(extension: Extension) -> None:
    """Add ``extension`` (once per name: registering a name again replaces it)."""
    unregister(extension.name)
    _EXTENSIONS.append(extension)
    SEAM.refresh()


def unregister(name: str) -> None:
    _EXTENSIONS[:] = [e for e in _EXTENSIONS if e.name != name]
    SEAM.refresh()


_QUERIES = ("capture_entry", "routes_capture", "submodules_run_eagerly", "manual_hooks", "hooks_run_by_hand",
            "modules_run_by_hand", "keeps_own_state", "holds_modules", "is_quantized_parameter",
            "writes_main_grad", "check_module", "visited_modules", "forget_stand_in_caches", "delays_wgrad",
            "queued_wgrad", "run_backward_dw", "wgrad_hooks_held", "run_wgrad_hooks")


class _Seam:
    """The engine's side: each question goes to the extensions that override it (bound
    methods collected at registration, so an unanswered question costs one empty loop)."""

    def __init__(self) -> None:
        self.precision: Precision = NO_PRECISION
        self._answering: dict[str, tuple] = {}
        self._packages: frozenset = frozenset()

    def packages(self) -> frozenset:
        """Every registered framework's packages (``Extension.packages``)."""
        return self._packages

    def refresh(self) -> None:
        self._packages = frozenset().union(*(e.packages for e in _EXTENSIONS))
        self._answering = {
            name: tuple(getattr(e, name) for e in _EXTENSIONS if getattr(type(e), name) is not getattr(Extension, name))
            for name in _QUERIES
        }
        providers = [e.precision for e in _EXTENSIONS if e.precision is not None]
        self.precision = providers[0] if providers else NO_PRECISION

    def _first(self, name: str, *args: Any) -> Any:
        for answer in self._answering[name]:
            found = answer(*args)
            if found is not None:
                return found
        return None

    def _any(self, name: str, *args: Any) -> bool:
        return any(answer(*args) for answer in self._answering[name])

    def _union(self, name: str, *args: Any) -> frozenset:
        found: frozenset = frozenset()
        for answer in self._answering[name]:
            found |= answer(*args)
        return found

    def capture_entry(self, module: torch.nn.Module) -> Optional[Callable]:
        return self._first("capture_entry", module)

    def routes_capture(self, module: torch.nn.Module) -> bool:
        return self._any("routes_capture", module)

    def submodules_run_eagerly(self, module: torch.nn.Module) -> frozenset:
        return self._union("submodules_run_eagerly", module)

    def manual_hooks(self, module: torch.nn.Module) -> Optional[list]:
        return self._first("manual_hooks", module)

    def hooks_run_by_hand(self, module: torch.nn.Module) -> frozenset:
        return self._union("hooks_run_by_hand", module)

    def modules_run_by_hand(self, module: torch.nn.Module) -> frozenset:
        return self._union("modules_run_by_hand", module)

    def keeps_own_state(self, module: Any) -> bool:
        return self._any("keeps_own_state", module)

    def holds_modules(self, module: Any) -> bool:
        return self._any("holds_modules", module)

    def is_quantized_parameter(self, t: torch.Tensor) -> bool:
        return self._any("is_quantized_parameter", t)

    def writes_main_grad(self, module: torch.nn.Module) -> bool:
        return self._any("writes_main_grad", module)

    def check_module(self, where: str, module: torch.nn.Module) -> None:
        for answer in self._answering["check_module"]:
            answer(where, module)

    @contextlib.contextmanager
    def visited_modules(self, func: Any) -> Iterator[Optional[list]]:
        """The framework modules a forward of ``func`` runs (None where no extension looks)."""
        answering = self._answering["visited_modules"]
        if not answering:
            yield None
            return
        with contextlib.ExitStack() as stack:
            found = [stack.enter_context(answer(func)) for answer in answering]
            merged: list = []
            yield merged
        for part in found:
            merged.extend(part or ())

    def forget_stand_in_caches(self, modules: Sequence[Any]) -> None:
        for answer in self._answering["forget_stand_in_caches"]:
            answer(modules)

    def delays_wgrad(self, module: Any) -> bool:
        return self._any("delays_wgrad", module)

    def queued_wgrad(self, module: Any) -> Any:
        return self._first("queued_wgrad", module)

    def run_backward_dw(self, module: Any) -> None:
        for answer in self._answering["run_backward_dw"]:
            return answer(module)
        raise RuntimeError(f"{type(module).__name__}: no integration runs its backward_dw()")

    @contextlib.contextmanager
    def wgrad_hooks_held(self, modules: Sequence[Any]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for answer in self._answering["wgrad_hooks_held"]:
                stack.enter_context(answer(modules))
            yield

    def run_wgrad_hooks(self, module: Any) -> None:
        for answer in self._answering["run_wgrad_hooks"]:
            answer(module)


SEAM = _Seam()
SEAM.refresh()
