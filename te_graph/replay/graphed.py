"""What ``make_graphed_callables`` hands back: a callable that picks a runner and replays it.

For a module, the graph runs only in the training mode it was captured in; in the other
mode the module's own forward runs eagerly. With several captured shapes, the shape of the
call's tensors picks the graph (one dict lookup); an unseen shape raises, or runs eagerly
when graphed with ``unseen_shape="eager"``.
"""
from __future__ import annotations

import types
import warnings
from typing import Any, Iterator

import torch

from ..guards.fingerprint import Fingerprint
from ..records import GraphSpec
from ..resources import RESOURCES, Graphed
from .function import run
from .order import shapes_text
from .runner import Runner

__all__ = ["GraphedCallable", "install_on_module", "Ungraphed"]


class GraphedCallable(Graphed):
    """One graphed callable (one per callable, or per (layer, microbatch) under an order):
    call it like the original."""

    def __init__(self, runners: list[Runner], spec: GraphSpec, pool: Any, fingerprint: Fingerprint,
                 unseen_shape: str = "error", replay_order: Any = None, pool_lease: Any = None):
        self._runners = {r.shape: r for r in runners}
        # One shape and no eager fallback: the call's checks alone pick the graph.
        self._single = runners[0] if len(runners) == 1 and unseen_shape == "error" else None
        self._layout = spec.layout
        self._module = spec.func if isinstance(spec.func, torch.nn.Module) else None
        self._training = spec.training
        self._eager = spec.func.forward if self._module is not None else spec.call  # the other mode, unseen shapes
        self._unseen_shape = unseen_shape
        self._fingerprint = fingerprint  # what the graphs froze, checked at every call (``guards.fingerprint``)
        self._warned = False
        self._reset = False
        # Its forward computes other values under no_grad (``capture.warmup``): calls then run eagerly.
        self._grad_mode_dependent = any(r.grad_mode_dependent for r in runners)
        # Transformer Engine's per-call keyword, taken off the calls of a callable holding TE
        # modules (as TE's graphed callables do) unless it was a captured keyword; and off a
        # megatron-core layer's, whose replay passes it to every graph (``routed``; megatron-core
        # 0.19 ``_get_te_cuda_graph_replay_args``), TE modules in it or not (``transformer_impl="local"``).
        self._pops_first_microbatch = (spec.framework_modules or spec.routed) and "is_first_microbatch" not in spec.layout.kw_keys
        self.pool = pool
        self.replay_order = replay_order  # its pool's replay.ReplayOrder, for calls that share the pool
        self.pool_lease = pool_lease  # resources.PoolLease: its pool stays capturable into while it lives
        self.__name__ = spec.name
        RESOURCES.add_callable(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._module is not None and self._module.training != self._training:
            return self._eager(*args, **kwargs)
        if self._grad_mode_dependent and not torch.is_grad_enabled():
            return self._eager(*args, **kwargs)  # its forward computes otherwise without grad (a fast path)
        self._fingerprint.check()
        first = kwargs.pop("is_first_microbatch", None) if self._pops_first_microbatch else None
        runner = self._single
        if runner is None:
            return self._dispatch(args, kwargs, first)
        tensors = runner.layout.flatten(args, kwargs)
        return runner.output.build(run(runner, tensors, first))

    def _dispatch(self, args: tuple, kwargs: dict, first: Any) -> Any:
        runner, tensors = self._pick(args, kwargs)
        if runner is None:
            return self._unseen(args, kwargs, tensors)
        return runner.output.build(run(runner, tensors, first))

    def _pick(self, args: tuple, kwargs: dict) -> tuple[Any, list]:
        """The runner of the call's shapes (None for an unseen shape) and its flat inputs."""
        if self._reset:
            raise RuntimeError(
                f"{self.__name__}: this graphed callable was reset(), which freed its graphs and "
                "buffers. Graph it again with make_graphed_callables (a module that was graphed "
                "has its eager forward back: call the module itself)."
            )
        if self._single is not None:
            return self._single, self._single.layout.flatten(args, kwargs)
        tensors = self._layout.gather(args, kwargs)
        runner = self._runners.get(tuple(getattr(t, "shape", None) for t in tensors))
        if runner is not None:
            runner.layout.check(tensors)
        return runner, tensors

    def _unseen(self, args: tuple, kwargs: dict, tensors: list) -> Any:
        captured = "; ".join(shapes_text(shape) for shape in self._runners)
        got = shapes_text(tuple(getattr(t, "shape", ()) for t in tensors))
        if self._unseen_shape != "eager":
            raise ValueError(
                f"{self.__name__}: called with tensor shapes {got}, but graphs were captured for "
                f"{captured}. Pass more_shapes=[...] to make_graphed_callables to capture this "
                "shape too, or unseen_shape='eager' to run unseen shapes eagerly."
            )
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.__name__}: no graph for tensor shapes {got} (captured: {captured}); "
                "running it eagerly (unseen_shape='eager'). Warned once per callable.",
                stacklevel=3,
            )
        return self._eager(*args, **kwargs)

    def backward_dw(self) -> None:
        """Transformer Engine's ``backward_dw()``: the weight-gradient pass of this callable's
        oldest backward still waiting for it, for modules built with
        ``delay_wgrad_compute=True`` (``capture.wgrad``); nothing for other callables, as in TE."""
        if self._reset:
            raise RuntimeError(f"{self.__name__}: backward_dw() after reset(), which freed its graphs.")
        runners = list(self._runners.values())
        book = runners[0].wgrad_book
        queue = book.waiting[runners[0].owner] if book is not None else ()
        head = queue[0][0] if queue else None
        (head if any(r is head for r in runners) else runners[0]).backward_dw()

    def accumulated_parameters(self) -> Iterator[torch.Tensor]:
        """The parameters whose gradients its graphs may add to ``.grad`` without autograd
        (``Runner.accumulated``; none once reset)."""
        for runner in self._runners.values():
            yield from runner.accumulated

    def static_inputs(self) -> Iterator[torch.Tensor]:
        """Its graphs' static input buffers (none once reset)."""
        for runner in self._runners.values():
            yield from runner.static_inputs

    def share_parameters(self, ids: set) -> None:
        """Parameters (by id) that graphs of a later call use too: their gradients go through
        autograd from the next call on (``Runner.share``)."""
        for runner in self._runners.values():
            runner.share(ids)

    def awaits_backward(self) -> bool:
        """Whether one of its graphs holds the activations of a call whose backward has not run
        (another call now would be refused: a graph reuses its activations at every call)."""
        return any(runner.awaits_backward() for runner in self._runners.values())

    def reset(self) -> None:
        """Free this callable's graphs and static buffers; later calls raise (TE's reset()).
        A module whose forward this callable was gets its eager forward back (and loses the
        ``backward_dw``/``reset`` attributes graphing gave it), so it can be graphed again."""
        for runner in self._runners.values():
            runner.reset()
        self._runners = {}
        self._single = None
        self._reset = True
        self.pool_lease = None
        module = self._module
        if module is not None and module.__dict__.get("forward") is self:
            for name in ("forward", "backward_dw", "reset"):
                attribute = module.__dict__.get(name)
                if attribute is self or getattr(attribute, "__self__", None) is self:
                    del module.__dict__[name]

    def __repr__(self) -> str:
        return f"<graphed {self.__name__}>"

    def __reduce__(self) -> tuple:
        """``torch.save`` of a graphed module pickles it with its own forward (graphs are
        device state, not saved): loaded, it runs eagerly and can be graphed again."""
        if self._module is None:
            raise TypeError(f"{self.__name__}: a graphed function cannot be pickled; pickle the function itself.")
        return (Ungraphed, (self._module,))

    def __deepcopy__(self, memo: dict) -> Any:
        """A deep copy of a graphed module (a teacher, an EMA model) runs eagerly: the graphs
        read this module's parameters by address, not the copy's."""
        copy = memo.get(id(self._module)) if self._module is not None else None
        if copy is None:
            raise TypeError(
                f"{self.__name__}: a graphed callable cannot be copied on its own (its graphs read "
                "the parameters they were captured with); copy the module, whose copy runs "
                "eagerly, or copy before graphing."
            )
        return types.MethodType(type(copy).forward, copy)


class Ungraphed:
    """What a graphed module's forward pickles as: the module's own forward (and its own
    ``backward_dw``), so that a module saved while graphed loads as an eager one."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.module).forward(self.module, *args, **kwargs)

    def backward_dw(self) -> None:
        own = getattr(type(self.module), "backward_dw", None)
        if own is not None:
            own(self.module)

    def reset(self) -> None:
        """Nothing to free: no graphs were loaded."""


def install_on_module(module: torch.nn.Module, graphed: GraphedCallable) -> None:
    """Replace ``module.forward`` with the graphed callable (it keeps the original reachable
    as ``module.forward.__wrapped__`` and runs it in the other training mode), ``backward_dw``
    with the graphed one (as TE does: a TE module's own would find no queued work), and give
    the module TE's ``reset()`` where it has no attribute of that name."""
    graphed.__wrapped__ = module.forward  # type: ignore[attr-defined]
    module.forward = graphed
    module.backward_dw = graphed.backward_dw
    if not hasattr(module, "reset"):
        module.reset = graphed.reset