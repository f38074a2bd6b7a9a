"""Eager replay's runner: the same wrapper as the graphs', no graphs. It runs the callable on
the static buffers at every call, with the same refusals, so that "is it the graph or my
model?" has an answer, on a GPU or on a CPU."""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable

import torch

from .. import compat, grads
from ..capture.conditional.runtime import backward_retaining
from ..capture.parameters import StandIns
from ..capture.wgrad import check_grads_as_captured
from ..extension import SEAM
from ..grads import grads_redirected
from ..records import GraphSpec, WarmupRecord
from .copy_in import Slot
from .order import ReplayContext
from .outputs import EagerOutputs
from .partial_backward import refuse_rerun
from .in_graph import after_in_graph
from .runner import IN_GRAPH, OBSERVED, THROUGH_AUTOGRAD, Invocation, Runner

__all__ = ["EagerRunner", "takes_keyword"]


def takes_keyword(call: Callable, name: str) -> bool:
    """Whether ``call`` takes the keyword ``name`` (TE's modules take ``is_first_microbatch``)."""
    try:
        return name in inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False


class EagerRunner(Runner):
    """Same wrapper, no graphs: runs the callable on the static buffers at every call."""

    forward_moves_versions = True

    def __init__(self, spec: GraphSpec, warmup: WarmupRecord, precision: Any, context: ReplayContext):
        super().__init__(spec, warmup, context)
        self.spec = spec
        self.precision = precision  # the checks a reduced-precision graph's calls get (``Precision.replay``)
        self.takes_first_microbatch = takes_keyword(spec.call, "is_first_microbatch")
        self.static_inputs = spec.static_inputs
        self.input_slots = tuple(map(Slot, spec.static_inputs))
        self.output = warmup.output
        self._take_outputs(warmup.output.tensors, warmup.fed)
        # Where the graphs hand parameter gradients to autograd (tied weights, and all with
        # accumulate_grads_in_graph=False, always; at a call where DDP or a hook observes them),
        # eager replay does the same: the forward runs on stand-ins for the parameters
        # (``capture.parameters``), whose fresh gradients leave the backward through the call's
        # autograd node, so every use of one is summed before it reaches .grad, and a backward
        # asked for some of them reaches them. Parameters carrying Megatron's main_grad keep
        # the real module (Transformer Engine flags grad_added_to_main_grad on the parameter
        # its kernel wrote): only their tied ones are routed.
        # As the graphs' node, the eager one has no edge to a parameter its warmup left unused:
        # autograd would run that parameter's hooks with None, where eager code never calls them.
        self._set_params(tuple(p for i, p in enumerate(spec.params) if i not in warmup.unused_params))
        tied = [spec.params[i] for i in sorted(spec.tied_params)]
        module = spec.func if isinstance(spec.func, torch.nn.Module) else None
        # The stand-ins share their parameters' attributes: Transformer Engine flags
        # grad_added_to_main_grad on the weight its kernel accumulated into main_grad, which
        # Megatron DDP's hook reads on the parameter before it adds the .grad.
        self.routed_all = (StandIns([module], only=self.params, share_attributes=True)
                           if self.params and module is not None else None)
        self.routed_tied = StandIns([module], only=tied, share_attributes=True) if tied and module is not None else None
        self.always_routed = context.options.always_autograd
        if spec.needs_backward:  # unrouted, the real parameters take their gradients in the nested backward
            self._watch(self.params)
        self.handout = EagerOutputs(self.name, spec)
        self._route: Any = None  # the stand-ins of this call (``through_autograd``)
        self._real_observed = False  # DDP or hooks observe the real parameters at this call, unrouted
        self._shared_later = False  # graphs of a later call use one of its parameters (``share``)

    def through_autograd(self) -> bool:
        self._route, self._real_observed = self._route_now()
        return self._route is not None

    def _route_now(self) -> tuple[Any, bool]:
        """The stand-ins this call runs on (None: the real module), and whether the real
        parameters' gradients are observed (DDP, hooks, main_grad) where they are not routed."""
        if self.routed_all is None:
            return None, False
        if self.always_routed:
            return self.routed_all, False
        observed = compat.ddp_forward_active() or grads.hooked(self.accumulated)
        if any(map(grads.has_main_grad, self.accumulated)):
            return self.routed_tied, observed
        routed = observed or self.routed_tied is not None or self._shared_later
        return (self.routed_all, False) if routed else (None, False)

    def _shared(self) -> None:
        self._shared_later = True

    def extra(self, through_autograd: bool) -> tuple[torch.Tensor, ...]:
        # Real parameters observed at this call take their gradients in the nested backward,
        # hooks and all: edges to them would run their accumulators' hooks a second time.
        if not through_autograd and self._real_observed:
            return self.anchor
        return super().extra(through_autograd)

    def forward(self, inputs: tuple[torch.Tensor, ...], through_autograd: bool, with_backward: bool = True,
                is_first_microbatch: Any = None) -> tuple[Invocation, tuple]:
        spec = self.spec
        self._before_forward(inputs)
        self.precision.before_forward(self.name, is_first_microbatch)
        self._copy_inputs(inputs)
        tick = self.clock.forward(self.variant, self.shape)
        self.handout.before_call()
        args, kwargs = spec.layout.unflatten(self.static_inputs)
        if is_first_microbatch is not None and self.takes_first_microbatch:
            kwargs["is_first_microbatch"] = is_first_microbatch  # TE's weight cache, eagerly
        route = (self._route or self.routed_all) if through_autograd else None
        routed = route is not None
        self._replaying_forward()
        with torch.enable_grad() if spec.needs_backward and with_backward else torch.no_grad():
            with route.installed() if routed else contextlib.nullcontext():
                outputs = self.output.tensors_of(spec.call(*args, **kwargs))
        if self.updated:
            self._copy_back(inputs)
        # Its grads are the live backward's own tensors, never graph memory: nothing to copy.
        # Unrouted, the real parameters take their gradients where the graphs would add them in
        # the graph, unless something observed them at this forward (the graphs then go
        # through autograd): the same checks at the backward as the graphs'.
        observed = routed or self._real_observed
        invocation = Invocation(self.generation, tick, (), (), routed, outputs, False,
                                OBSERVED if observed else compat.hook_handles_made(),
                                self.idle_now(inputs) if self.idle_outputs and with_backward else ())
        invocation.route = route
        detached = self.handout.hand_out(outputs)
        return (self._issued(invocation) if with_backward else invocation), detached

    def backward(self, invocation: Invocation, grads: tuple) -> tuple:
        asked, missing = self._before_backward(invocation, grads)
        if missing is not None:
            refuse_rerun(self, missing)  # where the graphs refuse it
        self._replaying_backward()
        # The outputs the loss left out take no part, as in eager code (the graphs rerun such
        # a call's forward eagerly, ``partial_backward``; an output fed by another that got a
        # gradient gets zeros there, which leave the sum as it is).
        pairs = [(o, g) for o, g in zip(invocation.outputs, grads) if o.requires_grad and g is not None]
        outputs = [o for o, _ in pairs]
        grads_ = [g for _, g in pairs]
        if type(asked) is tuple:
            # Asked only for some tensors' gradients: the parameters asked for get theirs
            # through autograd, the others none (as eager).
            wanted = [t for t in self.static_inputs if t.requires_grad]
            params = [p for p, a in zip(self.params, asked) if a]
            with backward_retaining(self.retains_graph):
                found = iter(torch.autograd.grad(outputs, wanted + params, grads_, retain_graph=self.retains_graph,
                                                 allow_unused=True) if pairs and (wanted or params) else ())
            input_grads = tuple(next(found, None) if t.requires_grad else None for t in self.static_inputs)
            self._after_backward()
            self._reused()
            return input_grads + (None,) + tuple(next(found, None) if a else None for a in asked)
        routed = invocation.route(self.params) if asked is THROUGH_AUTOGRAD else ()
        stand_ins = [p for p in routed if p is not None]
        # Installed again: a reentrant checkpoint in the forward runs it again in this backward.
        with grads_redirected(self.spec.grad_inputs + tuple(stand_ins)), \
                invocation.route.installed() if stand_ins else contextlib.nullcontext():
            if pairs:
                with backward_retaining(self.retains_graph):
                    torch.autograd.backward(outputs, grads_, retain_graph=self.retains_graph)
            self._after_backward()
            if invocation.hooks_seen != OBSERVED and asked is IN_GRAPH:
                after_in_graph(self)
            self._reused()
            input_grads = tuple(t.grad for t in self.static_inputs)
            if asked is THROUGH_AUTOGRAD:
                return input_grads + tuple(None if s is None else s.grad for s in routed)
            return input_grads + (None,) * len(self.edges)

    def _reused(self) -> None:
        if self.borrowed:
            self.handout.after_reuse()

    def _run_wgrad(self) -> None:
        check_grads_as_captured(self.name, self.wgrad, self.spec.params)  # as the graphs check
        for module in self.wgrad.modules:
            SEAM.run_backward_dw(module)  # the module's own: its queue holds this backward's work

    def reset(self) -> None:
        self._forget_order()
        self.spec = None
        self.static_inputs = self.input_slots = ()
        self.output = None
        self.wgrad, self.has_wgrad = None, False

