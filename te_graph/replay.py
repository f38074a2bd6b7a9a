"""The replay path: what runs on every call of a graphed callable.

One ``torch.autograd.Function`` serves every graph. Its forward copies a new input into the
static buffer only when the pointers differ, records the recompute generators' offsets,
replays the forward graph and returns the static outputs detached. Its backward copies the
incoming grads (same pointer rule), readies parameter grad buffers, sets the recompute
generators to the offsets its own forward recorded, and replays the backward graph.

Each call gets an ``Invocation`` that lives on the autograd node, so the RNG record
follows the call, and a backward whose activations a later forward replay overwrote is
refused instead of silently computing wrong gradients.

The eager-replay runner goes through the same wrapper but runs the callable instead of
graphs: a debugging switch ("is it the graph or my model?") that also runs on CPU.
"""
from __future__ import annotations

from typing import Any

import torch

from .capture import GraphSpec
from .grads import grads_redirected


class Invocation:
    """One forward call's state, kept on its autograd node until its backward."""

    __slots__ = ("generation", "record", "copy_grads", "outputs", "backwards")

    def __init__(self, generation: int, record: tuple, copy_grads: tuple, outputs: Any = None):
        self.backwards = 0  # how many times this call's backward ran (retain_graph)
        self.generation = generation
        self.record = record  # recompute generators' offsets at this forward replay
        self.copy_grads = copy_grads  # inputs whose grad autograd would keep as a .grad
        self.outputs = outputs  # eager replay only: the live outputs to backprop through


def _keeps_grad(t: torch.Tensor) -> bool:
    # A leaf's AccumulateGrad (or retain_grad) keeps the grad tensor it is handed; our
    # static grad buffer must not become a .grad that the next replay overwrites.
    return t.requires_grad and (t.is_leaf or t.retains_grad)


def _anchor(spec: GraphSpec) -> tuple[torch.Tensor, ...]:
    """A leaf requiring grad, passed to the autograd node when no input requires grad, so
    the node exists and its backward replays (and accumulates the parameters' grads)."""
    if not spec.needs_backward or any(t.requires_grad for t in spec.static_inputs):
        return ()
    device = spec.static_inputs[0].device if spec.static_inputs else None
    return (torch.empty(0, device=device, requires_grad=True),)


class GraphRunner:
    """Replays a captured forward/backward graph pair on its static buffers."""

    def __init__(self, spec: GraphSpec, accumulate_grads_in_graph: bool):
        self.name = spec.name
        self.static_inputs = spec.static_inputs
        self.static_outputs = spec.output.tensors
        self.non_differentiable = tuple(
            i for i, o in enumerate(self.static_outputs) if not o.requires_grad
        )
        self.static_grad_outputs = spec.static_grad_outputs
        self.static_grad_inputs = spec.static_grad_inputs
        self.fwd_graph = spec.fwd_graph
        self.bwd_graph = spec.bwd_graph
        self.rng = spec.rng if spec.rng is not None and spec.rng.has_regions else None
        self.param_grads = spec.param_grads
        self.retains_graph = spec.retain_graph
        # Without in-graph accumulation, parameters go through autograd like inputs do.
        self.autograd_params = () if accumulate_grads_in_graph else spec.params
        self.static_param_grads = spec.static_param_grads
        self.extra_inputs = self.autograd_params or _anchor(spec)
        self.generation = 0

    def _copy_inputs(self, inputs: tuple[torch.Tensor, ...]) -> tuple:
        for static, t in zip(self.static_inputs, inputs):
            if t.data_ptr() != static.data_ptr():
                static.copy_(t)
        self.generation += 1
        return tuple(map(_keeps_grad, inputs))

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[Invocation, tuple]:
        copy_grads = self._copy_inputs(inputs)
        record = self.rng.record() if self.rng is not None else ()
        self.fwd_graph.replay()
        outputs = tuple(o.detach() for o in self.static_outputs)
        return Invocation(self.generation, record, copy_grads), outputs

    def backward(self, invocation: Invocation, grads: tuple) -> tuple:
        self._check_fresh(invocation)
        for static, g in zip(self.static_grad_outputs, grads):
            if static is None:
                continue
            if g is None:
                static.zero_()
            elif g.data_ptr() != static.data_ptr():
                static.copy_(g)
        if self.param_grads is not None:
            self.param_grads.prepare()
        if invocation.record:
            self.rng.restore(invocation.record)
        self.bwd_graph.replay()
        input_grads = tuple(
            None if g is None else (g.clone() if copy else g.detach())
            for g, copy in zip(self.static_grad_inputs, invocation.copy_grads)
        )
        if not self.autograd_params:
            return input_grads + (None,) * len(self.extra_inputs)
        param_grads = tuple(
            g.clone() if p.grad is None else g.detach()
            for p, g in zip(self.autograd_params, self.static_param_grads)
        )
        return input_grads + param_grads

    def _check_fresh(self, invocation: Invocation) -> None:
        invocation.backwards += 1
        if invocation.backwards > 1 and not self.retains_graph:
            raise RuntimeError(
                f"{self.name}: a second backward through the same call needs the captured "
                "autograd graph, which was freed after capture. Pass "
                "retain_graph_in_backward=True to make_graphed_callables."
            )
        if invocation.generation != self.generation:
            raise RuntimeError(
                f"{self.name}: this backward belongs to a forward replay whose activations a later "
                "forward replay of the same graph has overwritten. Run each backward before the "
                "graph's next forward, or capture one graph per microbatch (order=...)."
            )


class EagerRunner(GraphRunner):
    """Same wrapper, no graphs: runs the callable on the static buffers at every call."""

    def __init__(self, spec: GraphSpec):
        self.spec = spec
        self.name = spec.name
        self.static_inputs = spec.static_inputs
        self.autograd_params = ()
        self.extra_inputs = _anchor(spec)
        self.retains_graph = spec.retain_graph
        self.non_differentiable = ()
        self.generation = 0

    def forward(self, inputs):
        spec = self.spec
        copy_grads = self._copy_inputs(inputs)
        args, kwargs = spec.layout.unflatten(self.static_inputs)
        with torch.enable_grad() if spec.needs_backward else torch.no_grad():
            outputs = spec.output.tensors_of(spec.call(*args, **kwargs))
        invocation = Invocation(self.generation, (), copy_grads, outputs)
        return invocation, tuple(o.detach() for o in outputs)

    def backward(self, invocation, grads):
        self._check_fresh(invocation)
        pairs = [(o, g) for o, g in zip(invocation.outputs, grads) if o.requires_grad]
        with grads_redirected(self.spec.grad_inputs):
            torch.autograd.backward(
                [o for o, _ in pairs],
                [torch.zeros_like(o) if g is None else g for o, g in pairs],
                retain_graph=self.retains_graph,
            )
            return tuple(t.grad for t in self.static_inputs) + (None,) * len(self.extra_inputs)


class _Replay(torch.autograd.Function):
    """The autograd node of one call of a graphed callable."""

    @staticmethod
    def forward(ctx, runner: GraphRunner, *inputs: torch.Tensor) -> tuple:
        invocation, outputs = runner.forward(inputs)
        ctx.runner = runner
        ctx.invocation = invocation
        ctx.set_materialize_grads(False)
        if runner.non_differentiable:
            ctx.mark_non_differentiable(*(outputs[i] for i in runner.non_differentiable))
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        return (None,) + ctx.runner.backward(ctx.invocation, grads)


# Function.apply's Python wrapper unwraps functorch wrappers on every call (microseconds
# per layer); with no functorch transform active the C implementation is called directly.
_apply_directly = super(torch.autograd.function._SingleLevelFunction, _Replay).apply
_functorch_active = torch._C._are_functorch_transforms_active


class GraphedCallable:
    """What make_graphed_callables returns for one graph: call it like the original.

    For a module, the graph runs only in the training mode it was captured in; in the other
    mode the module's own forward runs eagerly.
    """

    def __init__(self, runner: GraphRunner, spec: GraphSpec):
        self._runner = runner
        self._layout = spec.layout
        self._output = spec.output
        self._extra = runner.extra_inputs
        self._differentiable = spec.needs_backward
        self._module = spec.func if isinstance(spec.func, torch.nn.Module) else None
        self._training = spec.training
        self._eager = spec.call
        self.__name__ = spec.name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._module is not None and self._module.training != self._training:
            return self._eager(*args, **kwargs)
        tensors = self._layout.flatten(args, kwargs)
        if self._differentiable:
            apply = _Replay.apply if _functorch_active() else _apply_directly
            outputs = apply(self._runner, *tensors, *self._extra)
        else:
            _, outputs = self._runner.forward(tuple(tensors))
        return self._output.build(outputs)

    def __repr__(self) -> str:
        return f"<graphed {self.__name__}>"


def install_on_module(module: torch.nn.Module, graphed: GraphedCallable) -> None:
    """Replace ``module.forward`` with the graphed callable (it keeps the original reachable
    as ``module.forward.__wrapped__`` and runs it in the other training mode)."""
    graphed.__wrapped__ = module.forward  # type: ignore[attr-defined]
    module.forward = graphed
