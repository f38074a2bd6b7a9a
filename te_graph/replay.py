"""The replay path: what runs on every call of a graphed callable.

One ``torch.autograd.Function`` serves every graph. Its forward copies a new input into the
static buffer only when the pointers differ, records the live streams its recompute must
start from, replays the forward graph and returns the static outputs detached. Its
backward copies the incoming grads (same pointer rule), readies the parameter gradients
(``grads``), sets the recompute generators where its own forward left the streams, and
replays the backward graph.

Each call gets an ``Invocation`` that lives on the autograd node, so the RNG record
follows the call, and a backward whose activations a later forward replay overwrote (of
the same graph, or of another shape sharing its memory) is refused instead of silently
computing wrong gradients.

The eager-replay runner goes through the same wrapper but runs the callable instead of
graphs: a debugging mirror ("is it the graph or my model?") that also runs on CPU.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .capture import GraphSpec
from .grads import ddp_forward_active, grads_redirected

_DOUBLE_BACKWARD = (
    "{name}: double backward (create_graph=True, or torch.autograd.grad(..., "
    "create_graph=True)) through a graphed callable is not supported: its backward is a "
    "replayed graph, whose gradients autograd cannot differentiate again. Compute "
    "higher-order gradients with the module's eager forward (module.forward.__wrapped__)."
)


@dataclass
class ReplayOptions:
    """How calls of one make_graphed_callables call hand out gradients."""

    always_autograd: bool = False  # parameter grads through autograd at every call
    clone_param_grads: bool = True  # copy parameter grads that autograd or hooks could keep


class Clock:
    """Shared by the graphs of one call captured for several shapes (sample sets), which
    share memory: it ticks whenever a forward of another sample set than the last one
    replays. Layers of one sample set may have different shapes from each other."""

    __slots__ = ("variant", "shape", "tick")

    def __init__(self) -> None:
        self.variant = -1
        self.shape: Any = None  # of the forward that last ticked, for error messages
        self.tick = 0

    def forward(self, variant: int, shape: Any) -> int:
        if variant != self.variant:
            self.variant = variant
            self.shape = shape
            self.tick += 1
        return self.tick


class Invocation:
    """One forward call's state, kept on its autograd node until its backward."""

    __slots__ = ("generation", "tick", "record", "copy_grads", "outputs", "backwards", "through_autograd")

    def __init__(self, generation: int, tick: int, record: tuple, copy_grads: tuple, through_autograd: bool, outputs: Any = None):
        self.backwards = 0  # how many times this call's backward ran (retain_graph)
        self.generation = generation
        self.tick = tick
        self.record = record  # live streams' (seed, offset) at this forward replay
        self.copy_grads = copy_grads  # per input: hand its grad on as a copy (_grad_copied)
        self.through_autograd = through_autograd
        self.outputs = outputs  # eager replay only: the live outputs to backprop through


class GraphRunner:
    """Replays a captured forward/backward graph pair on its static buffers."""

    def __init__(self, spec: GraphSpec, options: ReplayOptions, clock: Optional[Clock] = None, variant: int = 0):
        self._bind(spec, clock, variant)
        self.static_outputs = spec.output.tensors
        self.non_differentiable = tuple(i for i, o in enumerate(self.static_outputs) if not o.requires_grad)
        self.static_grad_outputs = spec.static_grad_outputs
        self.static_grad_inputs = spec.static_grad_inputs
        self.fwd_graph = spec.fwd_graph
        self.bwd_graph = spec.bwd_graph
        self.rng = spec.rng if spec.rng is not None and spec.rng.has_regions else None
        self.sync_forward = spec.sync_forward
        self.sync_backward = spec.sync_backward
        self.param_grads = spec.param_grads
        self.lends_grad_buffer = spec.lends_grad_buffer
        self.always_autograd = options.always_autograd
        self.clone_param_grads = options.clone_param_grads

    def _bind(self, spec: GraphSpec, clock: Optional[Clock], variant: int) -> None:
        """What every runner, graphed or eager, takes from its spec."""
        self.name = spec.name
        self.variant = variant
        self.layout = spec.layout
        self.output = spec.output
        self.shape = tuple(t.shape for t in spec.layout.samples)
        self.differentiable = spec.needs_backward
        self.params = spec.params
        self.static_inputs = spec.static_inputs
        self.retains_graph = spec.retain_graph
        # A leaf requiring grad passed to the autograd node on the in-graph path, so the node
        # exists (and its backward replays, accumulating the parameters' grads) even when no
        # input requires grad.
        device = spec.static_inputs[0].device if spec.static_inputs else None
        self.anchor = (torch.empty(0, device=device, requires_grad=True),) if self.params else ()
        self.clock = clock
        self.generation = 0

    def through_autograd(self) -> bool:
        """Whether this call's parameter grads must go through autograd (see ``grads``)."""
        return self.always_autograd or ddp_forward_active() or self.param_grads.observed()

    def _copy_inputs(self, inputs: tuple[torch.Tensor, ...]) -> None:
        for static, t in zip(self.static_inputs, inputs):
            if t.data_ptr() != static.data_ptr():
                static.copy_(t)
        self.generation += 1

    def _grad_copied(self, t: torch.Tensor, buffer: Optional[torch.Tensor]) -> bool:
        """Whether the grad of input ``t`` leaves the backward as a copy of its static buffer.

        Uncopied, graph memory reaches whatever autograd does with the grad: a leaf's
        AccumulateGrad keeps it as ``.grad`` (also through view ops: ``leaf.view(...)``
        hands it a view), and the next replay would overwrite that ``.grad``. So the buffer
        goes on uncopied only to the backward of the graph whose output ``t`` is, which
        copies it into its own buffer before anything else runs, or, when this buffer is
        that graph's own grad-output buffer (``lends_grad_buffer``), reads it in place;
        a buffer lent to one graph goes uncopied to that graph alone. A hook on ``t``
        (registered by now) gets a copy too: it may keep what it sees, and a replacement
        it returns is copied into that very buffer when the buffer is lent.
        """
        if buffer is None or not t.requires_grad:
            return False
        if t.is_leaf or t.retains_grad or t._backward_hooks:
            return True
        node = t.grad_fn
        if type(node) is not _ReplayBackward or type(node.runner) is not GraphRunner:
            return True
        return self.lends_grad_buffer and all(g is not buffer for g in node.runner.static_grad_outputs)

    def forward(self, inputs: tuple[torch.Tensor, ...], through_autograd: bool, with_backward: bool = True) -> tuple[Invocation, tuple]:
        self._copy_inputs(inputs)
        copy_grads = tuple(map(self._grad_copied, inputs, self.static_grad_inputs)) if with_backward else ()
        moved = self.sync_forward.before_replay(self.name) if self.sync_forward is not None else None
        record = self.rng.record() if self.rng is not None and with_backward else ()
        tick = self.clock.forward(self.variant, self.shape) if self.clock is not None else 0
        self.fwd_graph.replay()
        if moved:
            self.sync_forward.after_replay(moved)
        outputs = tuple(o.detach() for o in self.static_outputs)
        return Invocation(self.generation, tick, record, copy_grads, through_autograd), outputs

    def backward(self, invocation: Invocation, grads: tuple) -> tuple:
        self._check_fresh(invocation)
        for static, g in zip(self.static_grad_outputs, grads):
            if static is None:
                continue
            if g is None:
                static.zero_()
            elif g.data_ptr() != static.data_ptr():
                static.copy_(g)
        through_autograd = invocation.through_autograd
        if through_autograd:
            self.param_grads.prepare_autograd()
        else:
            self.param_grads.prepare_in_graph()
        if invocation.record:
            self.rng.restore(invocation.record)
        moved = self.sync_backward.before_replay(self.name) if self.sync_backward is not None else None
        self.bwd_graph.replay()
        if moved:
            self.sync_backward.after_replay(moved)
        input_grads = tuple(
            None if g is None else (g.clone() if copy else g.detach())
            for g, copy in zip(self.static_grad_inputs, invocation.copy_grads)
        )
        if through_autograd:
            return input_grads + self.param_grads.for_autograd(self.clone_param_grads)
        return input_grads + (None,) * len(self.anchor)

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
        if self.clock is not None and invocation.tick != self.clock.tick:
            raise RuntimeError(
                f"{self.name}: this backward belongs to a forward replay of shape "
                f"{_shapes(self.shape)}, but since then graphs of another sample set (shape "
                f"{_shapes(self.clock.shape)}) replayed, and the graphs of every shape share one "
                "memory pool, so they overwrote its activations. Run the backwards of one shape "
                "before the forwards of another (one shape per step)."
            )

    def reset(self) -> None:
        """Free the graphs and drop the static buffers (their pool memory goes back)."""
        for graph in (self.fwd_graph, self.bwd_graph):
            if graph is not None and hasattr(graph, "reset"):
                graph.reset()
        self.fwd_graph = self.bwd_graph = None
        self.static_inputs = self.static_outputs = ()
        self.static_grad_outputs = self.static_grad_inputs = ()
        self.output = None
        self.rng = None
        self.param_grads = None


def _shapes(shape: Any) -> str:
    return ", ".join(str(tuple(s)) for s in shape) if shape else "()"


class EagerRunner(GraphRunner):
    """Same wrapper, no graphs: runs the callable on the static buffers at every call."""

    def __init__(self, spec: GraphSpec, options: ReplayOptions, clock: Optional[Clock] = None, variant: int = 0):
        self._bind(spec, clock, variant)
        self.spec = spec
        self.non_differentiable = ()
        self.always_autograd = False

    def through_autograd(self) -> bool:
        return False  # the real module runs: its parameters' hooks see autograd as usual

    def forward(self, inputs, through_autograd, with_backward=True):
        spec = self.spec
        self._copy_inputs(inputs)
        tick = self.clock.forward(self.variant, self.shape) if self.clock is not None else 0
        args, kwargs = spec.layout.unflatten(self.static_inputs)
        with torch.enable_grad() if spec.needs_backward and with_backward else torch.no_grad():
            outputs = spec.output.tensors_of(spec.call(*args, **kwargs))
        # Its grads are the live backward's own tensors, never graph memory: nothing to copy.
        invocation = Invocation(self.generation, tick, (), (), False, outputs)
        return invocation, tuple(o.detach() for o in outputs)

    def backward(self, invocation, grads):
        self._check_fresh(invocation)
        pairs = [(o, g) for o, g in zip(invocation.outputs, grads) if o.requires_grad]
        with grads_redirected(self.spec.grad_inputs):
            if pairs:
                torch.autograd.backward(
                    [o for o, _ in pairs],
                    [torch.zeros_like(o) if g is None else g for o, g in pairs],
                    retain_graph=self.retains_graph,
                )
            return tuple(t.grad for t in self.static_inputs) + (None,) * len(self.anchor)

    def reset(self) -> None:
        self.spec = None
        self.static_inputs = ()
        self.output = None


class _Replay(torch.autograd.Function):
    """The autograd node of one call of a graphed callable."""

    @staticmethod
    def forward(ctx, runner: GraphRunner, through_autograd: bool, *inputs: torch.Tensor) -> tuple:
        tensors = inputs[: len(runner.static_inputs)]
        invocation, outputs = runner.forward(tensors, through_autograd)
        ctx.runner = runner
        ctx.invocation = invocation
        ctx.set_materialize_grads(False)
        if runner.non_differentiable:
            ctx.mark_non_differentiable(*(outputs[i] for i in runner.non_differentiable))
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        if torch.is_grad_enabled():
            raise RuntimeError(_DOUBLE_BACKWARD.format(name=ctx.runner.name))
        return (None, None) + ctx.runner.backward(ctx.invocation, grads)


_ReplayBackward = _Replay._backward_cls  # the autograd node class of every graphed call

# Function.apply's Python wrapper unwraps functorch wrappers on every call (microseconds
# per layer); with no functorch transform active the C implementation is called directly.
_apply_directly = super(torch.autograd.function._SingleLevelFunction, _Replay).apply
_functorch_active = torch._C._are_functorch_transforms_active


def _forward_only_error(runner: GraphRunner) -> ValueError:
    return ValueError(
        f"{runner.name}: called with grad enabled where its result would require grad (an "
        "input requires grad, or the module has trainable parameters), but it was graphed "
        "without a backward (under torch.no_grad(), or with nothing requiring grad). Call it "
        "under torch.no_grad(), or graph it with grad enabled and samples whose "
        "requires_grad matches the real inputs."
    )


# Every graphed callable alive in the process, for ``te_graph.reset()`` with no argument
# (teardown before ``destroy_process_group``). Weak: it keeps nothing alive.
LIVE_CALLABLES: "weakref.WeakSet[GraphedCallable]" = weakref.WeakSet()


class GraphedCallable:
    """What make_graphed_callables returns for one callable: call it like the original.

    For a module, the graph runs only in the training mode it was captured in; in the other
    mode the module's own forward runs eagerly. With several captured shapes, the shape of
    the call's tensors picks the graph (one dict lookup); an unseen shape raises, or runs
    eagerly when graphed with ``unseen_shape="eager"``.
    """

    def __init__(self, runners: list[GraphRunner], spec: GraphSpec, pool: Any, unseen_shape: str = "error"):
        self._runners = {r.shape: r for r in runners}
        # One shape and no eager fallback: the call's checks alone pick the graph.
        self._single = runners[0] if len(runners) == 1 and unseen_shape == "error" else None
        self._layout = spec.layout
        self._module = spec.func if isinstance(spec.func, torch.nn.Module) else None
        self._training = spec.training
        self._eager = spec.call
        self._unseen_shape = unseen_shape
        self._warned = False
        self._reset = False
        self.pool = pool
        self.__name__ = spec.name
        LIVE_CALLABLES.add(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._module is not None and self._module.training != self._training:
            return self._eager(*args, **kwargs)
        runner = self._single
        if runner is None:
            return self._dispatch(args, kwargs)
        tensors = runner.layout.flatten(args, kwargs)
        return runner.output.build(_run(runner, tensors))

    def _dispatch(self, args: tuple, kwargs: dict) -> Any:
        if self._reset:
            raise RuntimeError(
                f"{self.__name__}: this graphed callable was reset(), which freed its graphs and "
                "buffers. Graph it again with make_graphed_callables; for a module, "
                "`del module.forward` brings back its eager forward."
            )
        tensors = self._layout.gather(args, kwargs)
        runner = self._runners.get(tuple(getattr(t, "shape", None) for t in tensors))
        if runner is None:
            return self._unseen(args, kwargs, tensors)
        runner.layout.check(tensors)
        return runner.output.build(_run(runner, tensors))

    def _unseen(self, args: tuple, kwargs: dict, tensors: list) -> Any:
        captured = "; ".join(_shapes(shape) for shape in self._runners)
        got = _shapes(tuple(getattr(t, "shape", ()) for t in tensors))
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

    def reset(self) -> None:
        """Free this callable's graphs and static buffers; later calls raise (TE's reset())."""
        for runner in self._runners.values():
            runner.reset()
        self._runners = {}
        self._single = None
        self._reset = True

    def __repr__(self) -> str:
        return f"<graphed {self.__name__}>"


def _run(runner: GraphRunner, tensors: list) -> tuple:
    """Replay ``runner`` for one call: an autograd node when a backward may follow."""
    if not runner.differentiable:
        if torch.is_grad_enabled() and (runner.params or any(t.requires_grad for t in tensors)):
            raise _forward_only_error(runner)
        return runner.forward(tuple(tensors), False, with_backward=False)[1]
    if not torch.is_grad_enabled():
        return runner.forward(tuple(tensors), False, with_backward=False)[1]
    through_autograd = runner.through_autograd()
    extra = runner.params if through_autograd else runner.anchor
    apply = _Replay.apply if _functorch_active() else _apply_directly
    return apply(runner, through_autograd, *tensors, *extra)


def install_on_module(module: torch.nn.Module, graphed: GraphedCallable) -> None:
    """Replace ``module.forward`` with the graphed callable (it keeps the original reachable
    as ``module.forward.__wrapped__`` and runs it in the other training mode), and give the
    module TE's ``reset()`` where it has no attribute of that name."""
    graphed.__wrapped__ = module.forward  # type: ignore[attr-defined]
    module.forward = graphed
    if not hasattr(module, "reset"):
        module.reset = graphed.reset


def graphed_callable_of(obj: Any) -> Optional[GraphedCallable]:
    """The GraphedCallable behind ``obj`` (itself, or a module whose forward it is)."""
    if isinstance(obj, GraphedCallable):
        return obj
    if isinstance(obj, torch.nn.Module):
        forward = obj.__dict__.get("forward")
        if isinstance(forward, GraphedCallable):
            return forward
    return None

