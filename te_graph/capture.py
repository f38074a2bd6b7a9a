"""Warmup and capture: the algorithm, told top to bottom.

1. Save what warmup and capture will touch: RNG states, module buffers; put stand-ins in
   place of the trainable parameters (``parameters``), so autograd accumulates into them
   and no hook of a real parameter runs while we prepare the graphs.
2. Warmup, on the side stream later used for capture: ``num_warmup_iters`` passes over the
   graphs (each forward followed at once by its backward, so warmup needs the memory of
   one graph) so lazy initialisation (cuBLAS handles, autotuning) happens outside any
   graph. The first pass checks that nothing but the inputs and the modules' parameters
   requires grad, and for unused inputs; the last pass records which random streams each
   forward, backward and checkpointed region draws from, and where (``recompute_rng``).
3. The allocator's cache is emptied: what warmup cached on the side stream would
   otherwise stay reserved for the life of the process, beside the pool capture fills.
4. The persistent parameter-gradient buffers are allocated on the caller's stream, like
   eager ``.grad``s, and the private recompute generators (never during capture).
5. Capture, in run order, into one memory pool: each forward graph drawing from the live
   streams, then each backward graph, which runs ``torch.autograd.backward`` with input
   grads redirected and parameter grads accumulated into their persistent buffers
   (``grads``), its recompute drawing from the private generators. Without an order, a
   layer's backward reads its output grad straight from the input-grad buffer of the next
   layer's backward (``grad_output_chain``), so a stack's backward copies nothing between
   layers.
6. ``finally``: parameters, buffers, RNG states, ``.grad``s and the garbage collector are
   put back, so a failed capture leaves the process and the model as they were and a
   successful one shifts no user state.
"""
from __future__ import annotations

import contextlib
import gc
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils._pytree as pytree

import rng
from checkpointing.capture_hook import capture_hook_set

from .grads import ParamGrads, grads_redirected
from .hooks import CaptureTimeHooks
from .layout import InputLayout, OutputLayout, weak_alias
from .module_state import ModuleBuffers
from .parameters import ForeignLeaves, StandIns
from .recompute_rng import BackwardDraws, ForwardDraws, RecomputeRNG, TrackerSync
from .schedule import Step, plan_buffer_reuse


@dataclass
class GraphSpec:
    """One graph pair to capture: a callable with one set of static inputs."""

    name: str  # "callable 2 (GPTBlock)", with ", microbatch 1" under an order
    owner: str  # the callable's part of the name: "callable 2 (GPTBlock)"
    func: Callable  # what the user passed (module or function)
    call: Callable  # what runs: the function, or the module's own forward (kept if replaced)
    layout: InputLayout
    static_inputs: tuple[torch.Tensor, ...]
    params: tuple[torch.Tensor, ...]  # the real trainable parameters
    training: bool
    needs_backward: bool
    retain_graph: bool = False
    hooks: Optional[CaptureTimeHooks] = None
    # Filled by capture():
    output: OutputLayout | None = None
    fwd_graph: Any = None
    bwd_graph: Any = None
    static_grad_outputs: tuple = ()
    static_grad_inputs: tuple = ()
    param_grads: ParamGrads | None = None
    lends_grad_buffer: bool = False  # its input-grad buffer is the previous graph's grad output
    rng: RecomputeRNG | None = None
    sync_forward: TrackerSync | None = None  # duck-typed trackers: keep graphs in step
    sync_backward: TrackerSync | None = None
    draws: tuple = field(default=(), repr=False)  # (ForwardDraws, BackwardDraws | None)
    unused: list = field(default_factory=list, repr=False)  # inputs no output depends on

    @property
    def grad_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in self.static_inputs if t.requires_grad)

    def take_buffers_of(self, donor: "GraphSpec") -> None:
        """Reuse a graph's static inputs and grad-output buffers (its backward has run)."""
        self.static_inputs = donor.static_inputs
        self.static_grad_outputs = donor.static_grad_outputs

    def release_pool_buffers(self) -> None:
        """Hand the pool memory of the static outputs and input grads back to the pool for
        later captures; replay keeps non-owning aliases (valid until the backward runs)."""
        self.output.tensors = tuple(weak_alias(t) for t in self.output.tensors)
        self.output.leaves = [
            weak_alias(x) if isinstance(x, torch.Tensor) else x for x in self.output.leaves
        ]
        self.static_grad_inputs = tuple(
            None if g is None else weak_alias(g) for g in self.static_grad_inputs
        )


def make_spec(
    name: str,
    owner: str,
    func: Callable,
    args: Sequence,
    kwargs: dict,
    grad_enabled: bool,
    retain_graph: bool,
    hooks: Optional[CaptureTimeHooks] = None,
) -> GraphSpec:
    """Static inputs are detached leaves sharing the sample tensors' memory.

    A backward graph is captured when grad is enabled and something requires grad (an
    input or a parameter), in train and in eval mode alike, as eager autograd would
    differentiate either; graphing under ``torch.no_grad()`` makes forward-only graphs.
    """
    layout = InputLayout(name, args, kwargs)
    params: tuple = ()
    training = True
    if isinstance(func, torch.nn.Module):
        params = tuple(p for p in func.parameters() if p.requires_grad)
        training = func.training
    needs_backward = grad_enabled and (any(t.requires_grad for t in layout.samples) or bool(params))
    static = tuple(t.detach().requires_grad_(t.requires_grad and needs_backward) for t in layout.samples)
    call = func.forward if isinstance(func, torch.nn.Module) else func
    return GraphSpec(name, owner, func, call, layout, static, params, training, needs_backward, retain_graph, hooks)


def _signature(spec: GraphSpec) -> tuple:
    """What must match for one graph to take over another's static buffers."""
    def meta(t: torch.Tensor) -> tuple:
        return (tuple(t.shape), t.stride(), t.dtype, t.requires_grad)

    outputs = spec.output.tensors if spec.output is not None else ()
    return (tuple(map(meta, spec.static_inputs)), tuple(map(meta, outputs)))


def _differentiable(outputs: Any) -> list[torch.Tensor]:
    return [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]


_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> "torch.cuda.Stream":
    """One side stream per device for every warmup and capture in the process.

    cuBLAS and cuBLASLt keep a workspace per (handle, stream) for the life of the process
    (tens of MiB on Hopper), and captured graphs bake in its address; a new stream per call
    would add a set of workspaces for every make_graphed_callables call.
    """
    device = torch.cuda.current_device()
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream(device)
    return _capture_streams[device]


@dataclass
class CaptureOptions:
    """How to warm up and capture (everything but the specs and their schedule)."""

    num_warmup_iters: int
    allow_unused_input: bool
    reuse_buffers: bool
    pool: Any
    tracker: Any
    eager_replay: bool
    capture_error_mode: str = "thread_local"
    chain_grads: bool = False  # plain schedule: layer i reads layer i+1's input-grad buffer
    pre_warmup_hook: Optional[Callable[[], None]] = None
    post_warmup_hook: Optional[Callable[[], None]] = None


def capture(spec_sets: Sequence[Sequence[GraphSpec]], steps: Sequence[Step], options: CaptureOptions) -> None:
    """Warm up and (unless ``options.eager_replay``) capture every spec, filling it in place.

    ``spec_sets`` holds one list of specs per captured shape, each following ``steps``; all
    are warmed up first (between ``pre_warmup_hook`` and ``post_warmup_hook``), then all
    are captured, in the order given, into one pool.
    """
    specs = [spec for specs in spec_sets for spec in specs]
    modules = _unique_modules(specs)
    buffers = ModuleBuffers(modules.values(), modules.keys())
    stand_ins = StandIns(modules.values())
    snapshot = rng.snapshot_streams(options.tracker)
    gc_enabled = gc.isenabled()
    stream = None
    home_stream = None if options.eager_replay else torch.cuda.current_stream()
    try:
        if not options.eager_replay:
            stream = capture_stream()
            stream.wait_stream(home_stream)
        # A collection during capture could free a graph or tensor another capture uses,
        # so the collector is off until the end. No full collection first: it walks every
        # object of the process (64 ms of a 106 ms capture in a benchmark process), and
        # torch's own capture no longer does it either.
        gc.disable()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            with stand_ins.installed():
                if options.pre_warmup_hook is not None:
                    options.pre_warmup_hook()
                for shape_specs in spec_sets:
                    _warmup(shape_specs, steps, options, stand_ins, buffers)
                if options.post_warmup_hook is not None:
                    options.post_warmup_hook()
                if options.eager_replay:
                    return
                # Warmup's activations, cached on the side stream, would otherwise stay
                # reserved beside the pool for the life of the process (torch's own
                # capture empties the cache too).
                torch.cuda.empty_cache()
                _allocate_grad_buffers(specs, home_stream, stream)
                for shape_specs in spec_sets:
                    _capture_graphs(shape_specs, steps, options, stand_ins, home_stream)
                buffers.check_not_reassigned()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    finally:
        if gc_enabled:
            gc.enable()
        rng.restore_streams(options.tracker, snapshot)
        buffers.restore()


def _allocate_grad_buffers(specs: Sequence[GraphSpec], home_stream, side_stream) -> None:
    """The persistent parameter-gradient buffers, on the caller's stream: replays run there
    and eager code keeps its ``.grad``s there, so the side stream holds only transient
    memory (and after warmup, so that warmup does not carry them as well)."""
    with torch.cuda.stream(home_stream):
        for spec in specs:
            if spec.needs_backward:
                spec.param_grads = ParamGrads(spec.params)
    side_stream.wait_stream(home_stream)


def _unique_modules(specs: Sequence[GraphSpec]) -> dict[str, torch.nn.Module]:
    modules: dict[str, torch.nn.Module] = {}
    seen: set[int] = set()
    for spec in specs:
        if isinstance(spec.func, torch.nn.Module) and id(spec.func) not in seen:
            seen.add(id(spec.func))
            modules[spec.owner] = spec.func
    return modules


# -- warmup ---------------------------------------------------------------------------------
def _warmup(specs, steps, options: CaptureOptions, stand_ins: StandIns, buffers: ModuleBuffers) -> None:
    record = not options.eager_replay
    device = torch.device("cuda", torch.cuda.current_device()) if record else None
    # Each graph's forward is followed at once by its backward (as torch's own warmup does):
    # only one graph's activations are alive at a time, so warmup leaves little in the
    # allocator's cache and capture starts from about the memory a step needs.
    forwards = [specs[step.flat_index] for step in steps if step.kind == "forward"]
    for iteration in range(options.num_warmup_iters):
        last = iteration == options.num_warmup_iters - 1
        for spec in forwards:
            outputs = _warmup_forward(spec, stand_ins, iteration == 0, last and record, device, options.tracker)
            buffers.check_not_reassigned()
            if spec.needs_backward:
                _warmup_backward(spec, stand_ins, outputs, last and record, device, options.tracker)
                if iteration == 0:
                    _check_unused(spec, options.allow_unused_input)
            del outputs


def _warmup_forward(spec: GraphSpec, stand_ins: StandIns, first: bool, record: bool, device, tracker) -> Any:
    args, kwargs = spec.layout.unflatten(spec.static_inputs)
    draws = ForwardDraws(rng.live_stream_generators(tracker, device)) if record else None
    # In the first pass, before any backward could accumulate into a foreign leaf.
    watcher = ForeignLeaves(spec.static_inputs + stand_ins(spec.params)) if first else None
    hooks = spec.hooks
    if hooks is not None:
        hooks.forward_pre(spec.func, args, kwargs)
    with capture_hook_set(draws), watcher if watcher is not None else contextlib.nullcontext(), _grad_mode(spec):
        outputs = spec.call(*args, **kwargs)
    if hooks is not None:
        hooks.forward(spec.func, args, kwargs, outputs)
    if watcher is not None:
        watcher.raise_if_any(spec.name)
    if draws is not None:
        draws.close()
        spec.draws = (draws, None)
    if spec.output is None:
        spec.output = OutputLayout(spec.name, outputs).forget_memory()  # capture replaces it
    return outputs


def _warmup_backward(spec: GraphSpec, stand_ins: StandIns, outputs: Any, record: bool, device, tracker) -> None:
    out = _differentiable(outputs)
    grads = [torch.zeros_like(o) for o in out]
    draws = BackwardDraws(rng.live_stream_generators(tracker, device)) if record else None
    if spec.hooks is not None:
        spec.hooks.backward_pre(spec.func, tuple(grads))
    with grads_redirected(spec.grad_inputs):
        if out:
            torch.autograd.backward(out, grads)
        grad_inputs = tuple(t.grad for t in spec.grad_inputs)
        # Unused-input check reads the .grads before they are put back.
        spec.unused = [i for i, t in enumerate(spec.static_inputs) if t.requires_grad and t.grad is None]
    if spec.hooks is not None:
        spec.hooks.backward(spec.func, grad_inputs, tuple(grads))
    for p in stand_ins(spec.params):
        p.grad = None  # throwaway: the next pass starts clean
    if draws is not None:
        draws.close()
        spec.draws = (spec.draws[0], draws)


def _grad_mode(spec: GraphSpec):
    return contextlib.nullcontext() if spec.needs_backward else torch.no_grad()


def _check_unused(spec: GraphSpec, allow_unused_input: bool) -> None:
    if allow_unused_input or not spec.unused:
        return
    raise ValueError(
        f"make_graphed_callables: input {spec.unused[0]} of {spec.name} requires grad, but no "
        "output depends on it. Pass allow_unused_input=True, or pass it with "
        "requires_grad=False."
    )


# -- capture --------------------------------------------------------------------------------
def _capture_graphs(specs, steps, options: CaptureOptions, stand_ins: StandIns, home_stream) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    for spec in specs:
        forward, backward = spec.draws
        spec.rng = RecomputeRNG.create(forward, backward, device)
        spec.sync_forward = TrackerSync.needed(options.tracker, {k: forward.streams[k] for k in forward.used})
        if backward is not None:
            spec.sync_backward = TrackerSync.needed(options.tracker, {k: backward.streams[k] for k in backward.used})
        spec.draws = ()
    mempool = options.pool if options.pool is not None else torch.cuda.graph_pool_handle()
    donors = plan_buffer_reuse(steps, [_signature(s) for s in specs]) if options.reuse_buffers else {}
    passed_on = {d for d in donors.values() if d is not None}
    for step in steps:
        spec = specs[step.flat_index]
        if step.kind == "forward":
            donor = donors.get(step.flat_index)
            if donor is not None:
                spec.take_buffers_of(specs[donor])
            _capture_forward(spec, mempool, options.capture_error_mode)
        elif spec.needs_backward:
            if not spec.static_grad_outputs:  # else taken over from a buffer donor
                following = specs[step.flat_index + 1] if step.flat_index + 1 < len(specs) else None
                chained = grad_output_chain(spec, following) if options.chain_grads else None
                if chained:
                    following.lends_grad_buffer = True
                with torch.cuda.stream(home_stream):
                    spec.static_grad_outputs = chained or tuple(
                        torch.empty_like(o) if o.requires_grad else None for o in spec.output.tensors
                    )
            _capture_backward(spec, mempool, options.capture_error_mode, stand_ins)
            if step.flat_index in passed_on:
                spec.release_pool_buffers()


def grad_output_chain(spec: GraphSpec, following: Optional[GraphSpec]) -> Optional[tuple]:
    """``spec``'s static grad outputs as the input-grad buffer of ``following``'s backward,
    or None where that is not a plain hand-over.

    In a stack, layer i's output is layer i+1's input, and the gradient autograd hands layer
    i's backward is the one layer i+1's backward just wrote: reading it where it lies saves
    a copy and a buffer per layer. It needs one differentiable output meeting one input
    that takes a grad, with the same layout, and ``following``'s backward captured first
    (the plain schedule). Replay keeps it exact: the buffer is handed on uncopied only to
    this graph (``GraphRunner``), and any other grad is copied in, as into a buffer of its own.
    """
    if following is None or not following.needs_backward or following.bwd_graph is None:
        return None
    outputs = [o for o in spec.output.tensors if o.requires_grad]
    takers = [g for t, g in zip(following.static_inputs, following.static_grad_inputs) if t.requires_grad]
    if len(outputs) != 1 or len(takers) != 1 or takers[0] is None:
        return None
    out, grad = outputs[0], takers[0]
    if (grad.shape, grad.stride(), grad.dtype, grad.device) != (out.shape, out.stride(), out.dtype, out.device):
        return None
    return tuple(grad if o is out else None for o in spec.output.tensors)


def _register_generators(graph: Any, generators: Sequence[torch.Generator]) -> None:
    if generators and rng.generator_registration_required():
        for generator in generators:
            graph.register_generator_state(generator)


@contextlib.contextmanager
def _capturing(graph: Any, mempool: Any, generators: Sequence[torch.Generator], mode: str):
    """Capture into ``graph``; if the body fails, end the capture and take every generator
    the graph registered out of capture mode (torch skips that when capture_end fails,
    which would break every later random draw in the process)."""
    _register_generators(graph, generators)
    graph.capture_begin(pool=mempool, capture_error_mode=mode)
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            graph.capture_end()
        _end_generator_capture(generators)
        raise
    graph.capture_end()


def _end_generator_capture(generators: Sequence[torch.Generator]) -> None:
    # An empty capture registering the same generators runs their capture epilogue.
    graph = torch.cuda.CUDAGraph()
    _register_generators(graph, generators)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
        graph.capture_begin(capture_error_mode="thread_local")
        graph.capture_end()


def _capture_forward(spec: GraphSpec, mempool: Any, mode: str) -> None:
    graph = torch.cuda.CUDAGraph()
    args, kwargs = spec.layout.unflatten(spec.static_inputs)
    regions = spec.rng.capture_hook()
    if spec.hooks is not None:
        spec.hooks.forward_pre(spec.func, args, kwargs)
    with _capturing(graph, mempool, spec.rng.forward_generators, mode):
        with capture_hook_set(regions), _grad_mode(spec):
            outputs = spec.call(*args, **kwargs)
    regions.check_complete()
    if spec.hooks is not None:
        spec.hooks.forward(spec.func, args, kwargs, outputs)
    spec.output = OutputLayout(spec.name, outputs)
    spec.fwd_graph = graph


def _capture_backward(spec: GraphSpec, mempool: Any, mode: str, stand_ins: StandIns) -> None:
    differentiable = [o for o in spec.output.tensors if o.requires_grad]
    grads = [g for g in spec.static_grad_outputs if g is not None]
    stand = stand_ins(spec.params)
    graph = torch.cuda.CUDAGraph()
    if spec.hooks is not None:
        spec.hooks.backward_pre(spec.func, tuple(grads))
    with grads_redirected(spec.grad_inputs, stand, spec.param_grads.buffers):
        with _capturing(graph, mempool, spec.rng.backward_generators, mode):
            if differentiable:
                torch.autograd.backward(differentiable, grads, retain_graph=spec.retain_graph)
        spec.static_grad_inputs = tuple(t.grad if t.requires_grad else None for t in spec.static_inputs)
        for p, b in zip(stand, spec.param_grads.buffers):
            if p.grad is not b:
                raise RuntimeError(
                    f"make_graphed_callables: autograd replaced the gradient of a parameter of "
                    f"{spec.name} instead of accumulating into it during capture (a sparse or "
                    "differently laid out gradient?); such a parameter cannot be graphed."
                )
    if spec.hooks is not None:
        spec.hooks.backward(spec.func, tuple(g for g in spec.static_grad_inputs if g is not None), tuple(grads))
    spec.bwd_graph = graph
