"""The runner that replays a captured graph pair (``records.CapturedGraph``) on its static
buffers: copy-in, the random-stream record its recompute needs, the precision's steps
around the replays, and the input and parameter gradients handed back."""
from __future__ import annotations

from typing import Any, Optional

import torch

from .. import compat
from ..records import CapturedGraph, GraphSpec
from .copy_in import Slot, copy_in
from .function import ReplayBackward
from .order import ReplayContext
from .outputs import GraphOutputs
from .partial_backward import backward_recomputed, refuse_rerun, stream_positions
from .in_graph import after_in_graph
from .runner import IN_GRAPH, OBSERVED, THROUGH_AUTOGRAD, Invocation, Runner, asks_none

__all__ = ["GraphRunner"]


class GraphRunner(Runner):
    """Replays a captured forward/backward graph pair on its static buffers."""

    def __init__(self, spec: GraphSpec, graph: CapturedGraph, context: ReplayContext):
        super().__init__(spec, graph.warmup, context)
        self.graph = graph
        self.spec = spec
        draws = graph.warmup.forward_draws
        self.forward_generators = tuple(draws.used_generators().values()) if draws is not None else ()
        # Parameters to flag grad_added_to_main_grad=True after each backward replay, as
        # Transformer Engine's backward does for weights it accumulates into main_grad itself.
        self.fused_params = tuple(spec.params[i] for i in sorted(graph.warmup.fused_params))
        if graph.param_grads is not None:
            self._set_params(graph.param_grads.params)  # less those only the weight-gradient pass sets
            self._watch(self.params)
        self.static_inputs = graph.static_inputs
        self.input_slots = tuple(map(Slot, graph.static_inputs))
        self.grad_output_slots = tuple(None if g is None else Slot(g) for g in graph.static_grad_outputs)
        self.output = graph.output
        self.static_outputs = graph.output.tensors
        self.handout = GraphOutputs(self.name, self.static_outputs, spec, graph.plan.releases_buffers)
        self._take_outputs(self.static_outputs, graph.warmup.fed)
        self.always_autograd = context.options.always_autograd
        self.clone_param_grads = context.options.clone_param_grads

    def through_autograd(self) -> bool:
        """Whether this call's parameter grads must go through autograd (see ``grads``)."""
        return bool(self.params) and (
            self.always_autograd or compat.ddp_forward_active() or self.graph.param_grads.observed()
        )

    def _shared(self) -> None:
        if self.graph is not None and self.graph.param_grads is not None:
            self.graph.param_grads.tied = True  # observed from now on: through autograd, with copies

    def _grad_copied(self, t: torch.Tensor, buffer: Optional[torch.Tensor]) -> bool:
        """Whether the grad of input ``t`` leaves the backward as a copy of its static buffer.

        Uncopied, graph memory reaches whatever autograd does with the grad: a leaf's
        AccumulateGrad keeps it as ``.grad`` (also through view ops: ``leaf.view(...)``
        hands it a view), and the next replay would overwrite that ``.grad``. So the buffer
        goes on uncopied only to the backward of the graph whose output ``t`` is, which
        copies it into its own buffer before anything else runs, or, when this buffer is
        that graph's own grad-output buffer (``plan.lends_grad_buffer``), reads it in place;
        a buffer lent to one graph goes uncopied to that graph alone. A hook on ``t``
        (registered by now) gets a copy too: it may keep what it sees, and a replacement
        it returns is copied into that very buffer when the buffer is lent.
        """
        if buffer is None or not t.requires_grad:
            return False
        if t.is_leaf or t.retains_grad or compat.tensor_hooks(t):
            return True
        node = t.grad_fn
        if type(node) is not ReplayBackward or type(node.runner) is not GraphRunner:
            return True
        other = node.runner.graph
        return other is None or (self.graph.plan.lends_grad_buffer and all(g is not buffer for g in other.static_grad_outputs))

    def forward(self, inputs: tuple[torch.Tensor, ...], through_autograd: bool, with_backward: bool = True,
                is_first_microbatch: Any = None) -> tuple[Invocation, tuple]:
        graph = self.graph
        self._before_forward(inputs)
        fp8_first = graph.precision.before_forward(self.name, is_first_microbatch)
        self._copy_inputs(inputs)
        copy_grads = tuple(map(self._grad_copied, inputs, graph.static_grad_inputs)) if with_backward else ()
        moved = graph.sync_forward.before_replay(self.name)
        record = graph.rng.record() if with_backward else ()
        # Where its streams stand, for a backward that leaves an output out (``partial_backward``).
        start = stream_positions(self.forward_generators) if self.multi_output and with_backward else ()
        tick = self.clock.forward(self.variant, self.shape)
        self.handout.before_replay()
        self._replaying_forward()
        graph.precision.before_replay()
        graph.fwd_graph.replay()
        graph.precision.after_forward()
        if moved:
            graph.sync_forward.after_replay(moved)
        if self.updated:
            self._copy_back(inputs)
        outputs = self.handout.tensors()
        invocation = Invocation(self.generation, tick, record, copy_grads, through_autograd, None, fp8_first,
                                OBSERVED if through_autograd else compat.hook_handles_made(),
                                self.idle_now(inputs) if self.idle_outputs and with_backward else ())
        if start:
            invocation.start = start
        return (self._issued(invocation) if with_backward else invocation), outputs

    def backward(self, invocation: Invocation, grads: tuple) -> tuple:
        # A backward asked only for some tensors' gradients (torch.autograd.grad, or
        # backward(inputs=...)) gives the parameters it asks for theirs through autograd and
        # leaves the others' .grad alone, as eager autograd does.
        asked, missing = self._before_backward(invocation, grads)
        graph = self.graph
        if missing is not None:
            return self._backward_recomputed(invocation, grads, asked, missing)
        for slot, g in zip(self.grad_output_slots, grads):
            if slot is None:
                continue
            if g is None:
                slot.tensor.zero_()
            else:
                copy_in(slot, g)
        in_graph = asked is IN_GRAPH
        if in_graph:
            graph.param_grads.prepare_in_graph()
        elif asked is THROUGH_AUTOGRAD or any(asked):
            graph.param_grads.prepare_autograd()
        kept = [b.clone() for b in graph.param_grads.buffers] if asks_none(asked) else None
        if invocation.record:
            graph.rng.restore(invocation.record)
        moved = graph.sync_backward.before_replay(self.name)
        self._replaying_backward()
        graph.bwd_graph.replay()
        if moved:
            graph.sync_backward.after_replay(moved)
        if kept is not None:  # the graph adds into the buffers: put them back
            for buffer, value in zip(graph.param_grads.buffers, kept):
                buffer.copy_(value)
        for p in self.fused_params:
            p.grad_added_to_main_grad = True  # as Transformer Engine's backward sets it
        graph.precision.after_backward(invocation.fp8_first)
        self._after_backward()
        if in_graph and invocation.hooks_seen != OBSERVED:
            after_in_graph(self)
        if self.borrowed:
            self.handout.after_reuse()
        input_grads = tuple(
            None if g is None else (g.clone() if copy else g.detach())
            for g, copy in zip(graph.static_grad_inputs, invocation.copy_grads)
        )
        if asked is THROUGH_AUTOGRAD:
            # torch.autograd.grad keeps what it is handed: copies, never the buffers.
            captured = self.accumulators and compat.engine_captures(self.accumulators)
            return input_grads + graph.param_grads.for_autograd(self.clone_param_grads, always=captured)
        if in_graph or not any(asked):
            return input_grads + (None,) * len(self.edges)
        # Copies: torch.autograd.grad hands them to the caller, and the next replay rewrites the buffers.
        return input_grads + (None,) + tuple(b.clone() if a else None for a, b in zip(asked, graph.param_grads.buffers))

    def _backward_recomputed(self, invocation: Invocation, grads: tuple, asked: Any, missing: int) -> tuple:
        """A backward whose loss left output ``missing`` out (``partial_backward``)."""
        refuse_rerun(self, missing)
        result = backward_recomputed(self, invocation, grads, asked)
        self._after_backward()
        if asked is IN_GRAPH and invocation.hooks_seen != OBSERVED:
            after_in_graph(self)
        if self.borrowed:
            self.handout.after_reuse()
        return result

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
        self.spec = None
        self.handout = None
        self.wgrad, self.has_wgrad = None, False
        self.static_inputs = self.static_outputs = ()
        self.input_slots = self.grad_output_slots = ()
        self.output = None

