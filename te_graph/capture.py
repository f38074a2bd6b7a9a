"""Warmup and capture: the algorithm, told top to bottom.

1. Warmup, on the side stream later used for capture: ``num_warmup_iters`` passes of the
   schedule (forwards and backwards in run order) so lazy initialisation (cuBLAS handles,
   autotuning, allocator growth) happens outside any graph. Gradients go to throwaway
   ``.grad``s; the last pass also records which random streams each checkpointed region
   draws from (``rng.graph_streams``).
2. Recompute generators are allocated for those regions (never during capture).
3. Capture, in run order, into one memory pool: each forward graph, then each backward
   graph, which runs ``torch.autograd.backward`` with input grads redirected and
   parameter grads accumulated in place into their persistent buffers (``grads``).
4. ``finally``: RNG states, ``.grad``s and the garbage collector are put back, so a failed
   capture leaves the process and the model as they were, and a successful one shifts no
   user numerics.
"""
from __future__ import annotations

import contextlib
import gc
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

import rng
from rng import graph_streams

from .grads import ParamGrads, grads_redirected
from .layout import InputLayout, OutputLayout, weak_alias
from .schedule import Step, plan_buffer_reuse


@dataclass
class GraphSpec:
    """One graph pair to capture: a callable with one set of static inputs."""

    name: str
    func: Callable  # what the user passed (module or function)
    call: Callable  # what runs: the function, or the module's own forward (kept if replaced)
    layout: InputLayout
    static_inputs: tuple[torch.Tensor, ...]
    params: tuple[torch.Tensor, ...]
    training: bool
    needs_backward: bool
    retain_graph: bool = False
    # Filled by capture():
    output: OutputLayout | None = None
    fwd_graph: Any = None
    bwd_graph: Any = None
    static_grad_outputs: tuple = ()
    static_grad_inputs: tuple = ()
    static_param_grads: tuple = ()
    param_grads: ParamGrads | None = None
    rng: graph_streams.GraphRNG | None = None
    logs: tuple = field(default=(), repr=False)

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
    name: str, func: Callable, args: Sequence, kwargs: dict, grad_enabled: bool, retain_graph: bool
) -> GraphSpec:
    """Static inputs are detached leaves sharing the sample tensors' memory."""
    layout = InputLayout(name, args, kwargs)
    static = tuple(t.detach().requires_grad_(t.requires_grad) for t in layout.samples)
    params: tuple = ()
    training = True
    if isinstance(func, torch.nn.Module):
        params = tuple(p for p in func.parameters() if p.requires_grad)
        training = func.training
    needs_backward = (
        grad_enabled and training and (any(t.requires_grad for t in static) or bool(params))
    )
    call = func.forward if isinstance(func, torch.nn.Module) else func
    return GraphSpec(name, func, call, layout, static, params, training, needs_backward, retain_graph)


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


def capture(
    specs: Sequence[GraphSpec],
    steps: Sequence[Step],
    *,
    num_warmup_iters: int,
    allow_unused_input: bool,
    accumulate_grads_in_graph: bool,
    reuse_buffers: bool,
    pool: Any,
    tracker: Any,
    eager_replay: bool,
) -> None:
    """Warm up and (unless ``eager_replay``) capture every spec, filling it in place."""
    snapshot = rng.snapshot_streams(tracker)
    gc_enabled = gc.isenabled()
    stream = None
    try:
        if not eager_replay:
            torch.cuda.synchronize()
            gc.collect()
            stream = capture_stream()
            stream.wait_stream(torch.cuda.current_stream())
        # A collection during capture could free a graph or tensor another capture uses.
        gc.disable()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            _warmup(specs, steps, num_warmup_iters, allow_unused_input, tracker, record=not eager_replay)
            if eager_replay:
                return
            device = torch.device("cuda", torch.cuda.current_device())
            for spec in specs:
                forward_log, backward_log = spec.logs
                spec.rng = graph_streams.GraphRNG.create(
                    forward_log, backward_log, graph_streams.next_graph_ordinal(), device
                )
                spec.logs = ()
            mempool = pool if pool is not None else torch.cuda.graph_pool_handle()
            donors = plan_buffer_reuse(steps, [_signature(s) for s in specs]) if reuse_buffers else {}
            passed_on = {d for d in donors.values() if d is not None}
            for step in steps:
                spec = specs[step.flat_index]
                if step.kind == "forward":
                    donor = donors.get(step.flat_index)
                    if donor is not None:
                        spec.take_buffers_of(specs[donor])
                    _capture_forward(spec, mempool)
                elif spec.needs_backward:
                    _capture_backward(spec, mempool, accumulate_grads_in_graph)
                    if step.flat_index in passed_on:
                        spec.release_pool_buffers()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    finally:
        if gc_enabled:
            gc.enable()
        rng.restore_streams(tracker, snapshot)


def _warmup(specs, steps, iters: int, allow_unused_input: bool, tracker: Any, record: bool) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if record else None
    for iteration in range(iters):
        recording = record and iteration == iters - 1
        outputs: dict[int, Any] = {}
        logs: dict[tuple[str, int], Any] = {}
        for step in steps:
            kind, index = step.kind, step.flat_index
            spec = specs[index]
            if kind == "forward":
                args, kwargs = spec.layout.unflatten(spec.static_inputs)
                with _recording(recording, tracker, device) as log, _grad_mode(spec):
                    outputs[index] = spec.call(*args, **kwargs)
                logs[kind, index] = log
                if spec.output is None:
                    spec.output = OutputLayout(outputs[index])  # the capture replaces it
                continue
            if not spec.needs_backward:
                continue
            out = _differentiable(outputs.pop(index))
            with grads_redirected(spec.grad_inputs, spec.params):
                with _recording(recording, tracker, device) as log:
                    if out:
                        torch.autograd.backward(out, [torch.empty_like(o) for o in out])
                if iteration == 0:
                    _check_unused(spec, allow_unused_input)
            logs[kind, index] = log
        if recording:
            for index, spec in enumerate(specs):
                no_backward = graph_streams.RegionLog({})
                spec.logs = (logs["forward", index], logs.get(("backward", index), no_backward))


@contextlib.contextmanager
def _recording(enabled: bool, tracker: Any, device):
    if not enabled:
        yield None
        return
    with graph_streams.recording_regions(tracker, device) as log:
        yield log


def _grad_mode(spec: GraphSpec):
    return contextlib.nullcontext() if spec.needs_backward else torch.no_grad()


def _check_unused(spec: GraphSpec, allow_unused_input: bool) -> None:
    if allow_unused_input:
        return
    for index, t in enumerate(spec.static_inputs):
        if t.requires_grad and t.grad is None:
            raise ValueError(
                f"make_graphed_callables: input {index} of {spec.name} requires grad, but no "
                "output depends on it. Pass allow_unused_input=True, or pass it with "
                "requires_grad=False."
            )


def _register_generators(graph: Any, generators: Sequence[torch.Generator]) -> None:
    if generators and rng.generator_registration_required():
        for generator in generators:
            graph.register_generator_state(generator)


@contextlib.contextmanager
def _capturing(graph: Any, mempool: Any, generators: Sequence[torch.Generator]):
    """Capture into ``graph``; if the body fails, end the capture and take every generator
    the graph registered out of capture mode (torch skips that when capture_end fails,
    which would break every later random draw in the process)."""
    _register_generators(graph, generators)
    graph.capture_begin(pool=mempool, capture_error_mode="thread_local")
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


def _capture_forward(spec: GraphSpec, mempool: Any) -> None:
    graph = torch.cuda.CUDAGraph()
    args, kwargs = spec.layout.unflatten(spec.static_inputs)
    with _capturing(graph, mempool, spec.rng.generators_to_register("forward")):
        with spec.rng.capturing_forward(), _grad_mode(spec):
            outputs = spec.call(*args, **kwargs)
    spec.output = OutputLayout(outputs)
    spec.fwd_graph = graph


def _capture_backward(spec: GraphSpec, mempool: Any, in_graph: bool) -> None:
    outputs = spec.output.tensors
    if not spec.static_grad_outputs:  # else taken over from a buffer donor
        spec.static_grad_outputs = tuple(
            torch.empty_like(o) if o.requires_grad else None for o in outputs
        )
    differentiable = [o for o in outputs if o.requires_grad]
    grads = [g for g in spec.static_grad_outputs if g is not None]
    if in_graph:
        spec.param_grads = ParamGrads(spec.params)
        buffers = spec.param_grads.buffers
    else:
        buffers = None
    graph = torch.cuda.CUDAGraph()
    with grads_redirected(spec.grad_inputs, spec.params, buffers):
        with _capturing(graph, mempool, spec.rng.generators_to_register("backward")):
            if differentiable:
                torch.autograd.backward(differentiable, grads, retain_graph=spec.retain_graph)
        spec.static_grad_inputs = tuple(t.grad if t.requires_grad else None for t in spec.static_inputs)
        if in_graph:
            for p, b in zip(spec.params, buffers):
                if p.grad is not b:
                    raise RuntimeError(
                        f"make_graphed_callables: autograd replaced the gradient of a parameter of "
                        f"{spec.name} instead of accumulating into it during capture. Pass "
                        "accumulate_grads_in_graph=False."
                    )
        else:
            spec.static_param_grads = tuple(p.grad for p in spec.params)
    spec.bwd_graph = graph
