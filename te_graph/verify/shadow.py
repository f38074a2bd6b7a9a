"""The eager shadow of one verified call: the callable run again eagerly, from the call's own
inputs and from where the random streams and the module's buffers stood before the graph
replayed, on stand-ins of its parameters (no hook of a real parameter runs, no ``.grad`` or
``main_grad`` takes anything), and then everything put back as the graph left it: buffers,
Python attributes, random streams, the precision's state (Transformer Engine's FP8 meta).
Its backward runs, right before the graph's, from the gradients the graph's backward gets,
in the same way; work it queues for a ``backward_dw()`` pass is dropped."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

import rng

from ..capture.module_state import attribute_tensors
from ..capture.parameters import StandIns
from ..capture.wgrad import delayed_modules_in, delayed_wgrad_modules
from ..extension import SEAM
from ..grads import grads_redirected
from ..replay.eager_runner import takes_keyword

__all__ = ["ModuleSnapshot", "Shadow", "arguments_before"]


class ModuleSnapshot:
    """A module's buffers and tensor attributes (values), Python attributes (shallow) and the
    random streams, to put back: the state before a call, or as the graph left it after."""

    def __init__(self, module: Any, tracker: Any):
        self.tracker = tracker
        self.streams = rng.snapshot_streams(tracker)
        self.modules = list(module.modules()) if isinstance(module, torch.nn.Module) else []
        self.buffers = [(b, b.detach().clone()) for m in self.modules for b in m._buffers.values()
                        if isinstance(b, torch.Tensor)]
        # The plain tensors of attributes (a running statistic in a list) of modules whose state
        # no framework keeps, by value.
        self.tensors = [(t, t.detach().clone()) for m in self.modules if not SEAM.keeps_own_state(m)
                        for t in attribute_tensors(m)]
        self.attributes = [(m, dict(m.__dict__)) for m in self.modules]

    def restore(self) -> None:
        rng.restore_streams(self.tracker, self.streams)
        with torch.no_grad():
            # Through .data where plain: autograd saved some of them (the call's own graph, the
            # shadow's), and a version moved by this copy back would fail their backward.
            for t, value in self.buffers + self.tensors:
                (t.data if type(t) is torch.Tensor else t).copy_(value)
        for m, saved in self.attributes:
            for key in [k for k in m.__dict__ if k not in saved]:
                del m.__dict__[key]
            for key, value in saved.items():
                if m.__dict__.get(key) is not value:
                    m.__dict__[key] = value


@contextlib.contextmanager
def _own_wgrad_queues(modules: Sequence[Any]) -> Iterator[None]:
    """Inside: the queues of modules that delay their weight gradients to ``backward_dw()``
    (Transformer Engine's ``delay_wgrad_compute=True``) hold only what the shadow's backward
    queues, which is dropped on exit; the work queued before (eager replay's, the user's)
    is back in its place, so the next ``backward_dw()`` takes what it would have taken."""
    queues = [q for q in (SEAM.queued_wgrad(m) for m in modules) if q is not None]
    held = [(q, list(q)) for q in queues]
    for q in queues:
        q.clear()
    try:
        yield
    finally:
        for q, work in held:
            q.clear()
            q.extend(work)


@contextlib.contextmanager
def _main_grads_kept(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Inside: kernels that accumulate into ``main_grad`` (through the stand-ins, which share
    it) leave it, and its flag, as they were."""
    kept = [(p, p.main_grad.clone(), p.__dict__.get("grad_added_to_main_grad")) for p in params
            if isinstance(p.__dict__.get("main_grad"), torch.Tensor)]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value, flag in kept:
                p.main_grad.copy_(value)
                if flag is not None:
                    p.grad_added_to_main_grad = flag


def _copy(value: Any) -> Any:
    return value.detach().clone().requires_grad_(value.requires_grad) if isinstance(value, torch.Tensor) else value


def arguments_before(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Copies of a call's tensors, taken before the graph runs: an input the callable
    updates in place (a cache, a counter) reaches the shadow as eager code got it."""
    return pytree.tree_map(_copy, (tuple(args), dict(kwargs)))


class Shadow:
    """The eager run of one call of ``runner`` with the call's own ``args`` and ``kwargs``
    (``arguments_before``)."""

    def __init__(self, runner: Any, args: tuple, kwargs: dict, first_microbatch: Any, before: ModuleSnapshot):
        spec = runner.spec
        self.spec = spec
        self.tracker = before.tracker
        module = spec.func if isinstance(spec.func, torch.nn.Module) else None
        self.params = tuple(runner.params)
        self.stand_ins = StandIns([module], only=spec.params) if module is not None and spec.params else None
        kwargs = dict(kwargs)
        self.inputs = list(runner.layout.flatten(args, kwargs))  # in the order of the graph's inputs
        self.modules = runner.framework_modules
        delayed = delayed_modules_in([module] if module is not None else []) + list(delayed_wgrad_modules(self.modules))
        self.delayed = list({id(m): m for m in delayed}.values())
        if first_microbatch is not None and takes_keyword(spec.call, "is_first_microbatch"):
            kwargs["is_first_microbatch"] = first_microbatch  # as eager replay passes it
        after = ModuleSnapshot(spec.func, before.tracker)
        before.restore()
        try:
            with self._installed(), SEAM.precision.kept(self.modules), torch.enable_grad():
                # The stand-ins drop what the module cached of the real parameters (``installed``),
                # so the shadow's backward never reaches a real .grad; ``after`` puts the call's
                # own caches back.
                self.outputs = runner.output.tensors_of(spec.call(*args, **kwargs))
        finally:
            after.restore()

    def _installed(self) -> contextlib.AbstractContextManager:
        return self.stand_ins.installed() if self.stand_ins is not None else contextlib.nullcontext()

    def backward(self, grads: Sequence[Any]) -> tuple[list, list]:
        """The input and parameter gradients eager code computes from ``grads`` (the
        gradients the call's outputs got): per input, per parameter of ``runner.params``.
        The random streams are as they were before on return (a recompute draws from them)."""
        streams = rng.snapshot_streams(self.tracker)
        try:
            return self._backward(grads)
        finally:
            rng.restore_streams(self.tracker, streams)

    def _backward(self, grads: Sequence[Any]) -> tuple[list, list]:
        pairs = [(o, g) for o, g in zip(self.outputs, grads) if g is not None and o.requires_grad]
        leaves = [t for t in self.inputs if t.requires_grad]
        stand = [s for s in self.stand_ins(self.params)] if self.stand_ins is not None else []
        targets = leaves + [s for s in stand if s is not None]
        with self._installed(), SEAM.precision.kept(self.modules), _main_grads_kept(self.params), \
                _own_wgrad_queues(self.delayed), grads_redirected(targets):
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            inputs = [t.grad if t.requires_grad else None for t in self.inputs]
            params = [None if s is None else s.grad for s in stand]
        return inputs, params
