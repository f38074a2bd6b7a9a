"""Warmup and capture: the algorithm, told top to bottom.

1. Save what warmup and capture will touch: RNG states, module buffers, inputs the
   callables update in place (found in the first warmup pass), Transformer Engine's FP8
   meta (``te_support``); put stand-ins in
   place of the trainable parameters (``parameters``), so autograd accumulates into them
   and no hook of a real parameter runs while we prepare the graphs.
2. Warm up (``warmup``), on the side stream later used for capture: one
   :class:`WarmupRecord` per graph (output layouts, unused inputs, random draws).
3. Plan (``plan``) from the warmup layouts: which graphs share static buffers.
4. The allocator's cache is emptied: what warmup cached on the side stream would
   otherwise stay reserved for the life of the process, beside the pool capture fills.
5. The persistent parameter-gradient buffers are allocated on the caller's stream, like
   eager ``.grad``s, and the private recompute generators (never during capture).
6. Capture, in run order, into one memory pool: each forward graph drawing from the live
   streams, then each backward graph, which runs ``torch.autograd.backward`` with input
   grads redirected and parameter grads accumulated into their persistent buffers
   (``grads``), its recompute drawing from the private generators; and, for Transformer
   Engine modules that delay their weight gradients, each weight-gradient pass, into a
   pool of its own (``wgrad``). One :class:`CapturedGraph` per graph.
7. ``finally``: parameters, buffers, RNG states, ``.grad``s and the garbage collector are
   put back, so a failed capture leaves the process and the model as they were and a
   successful one shifts no user state.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

import rng
from checkpointing.capture_hook import capture_hook_set
from checkpointing.recompute_state import cuda_stream_capturing

from . import compat, host_sync
from .te_support import FP8Capture, FP8Options, forget_stand_in_caches, fp8_replay, is_te_module
from .grads import ParamGrads, grads_redirected
from .layout import OutputLayout
from .module_state import InputUpdates, ModuleState
from .parameters import StandIns
from .plan import GraphLayout, GraphPlan, TensorMeta, plan_capture
from .recompute_rng import NO_SYNC, RecomputeRNG, TrackerSync
from .records import CapturedGraph, GraphSpec, WarmupRecord
from .resources import RESOURCES
from .schedule import FORWARD, WGRAD, Step, with_wgrad_passes_last
from .wgrad import (
    WgradReplay, check_no_queued_work, delayed_modules_in, drop_queued_work, run_backward_dw, wgrad_hooks_held,
)
from .warmup import fp8_context, grad_mode, warm_up

__all__ = ["CaptureOptions", "Prepared", "prepare_graphs"]


@dataclass(frozen=True)
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
    has_order: bool = False  # an order (TE's _order) places the weight-gradient passes
    pre_warmup_hook: Optional[Callable[[], None]] = None
    post_warmup_hook: Optional[Callable[[], None]] = None
    fp8: Optional[FP8Options] = None  # Transformer Engine's FP8 arguments, normalised


class Prepared(NamedTuple):
    """Per sample set, per graph: its warmup record, its plan, and its captured graph
    (``captured`` is None in eager replay, which plans but captures nothing); and the
    modules' Python attributes the forwards set (``ModuleState.runtime_attributes``)."""

    warmups: list[list[WarmupRecord]]
    plans: list[tuple[GraphPlan, ...]]
    captured: Optional[list[list[CapturedGraph]]]
    runtime_attributes: frozenset = frozenset()


def prepare_graphs(spec_sets: Sequence[Sequence[GraphSpec]], steps: Sequence[Step], options: CaptureOptions) -> Prepared:
    """Warm up and (unless ``options.eager_replay``) capture every spec.

    ``spec_sets`` holds one list of specs per captured shape, each following ``steps``; all
    are warmed up first (between ``pre_warmup_hook`` and ``post_warmup_hook``), then all
    are captured, in the order given, into one pool.
    """
    specs = [spec for specs in spec_sets for spec in specs]
    modules = _unique_modules(specs)
    delayed = delayed_modules_in(list(modules.values()))
    check_no_queued_work(delayed, "when graphing starts; run it first (warmup would take that work for its own)")
    state = ModuleState(modules, is_te_module)
    stand_ins = StandIns(modules.values())
    updates = InputUpdates()
    snapshot = rng.snapshot_streams(options.tracker)
    fp8 = FP8Capture(options.fp8, list(modules.values())) if options.fp8 is not None and options.fp8.on else None
    gc_enabled = gc.isenabled()
    succeeded = False
    stream = None
    home_stream = None if options.eager_replay else torch.cuda.current_stream()
    try:
        if not options.eager_replay:
            stream = RESOURCES.capture_stream()
            stream.wait_stream(home_stream)
        # A collection during capture could free a graph or tensor another capture uses,
        # so the collector is off until the end. No full collection first: it walks every
        # object of the process (64 ms of a 106 ms capture in a benchmark process), and
        # torch's own capture no longer does it either.
        gc.disable()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            with stand_ins.installed(), fp8.active() if fp8 is not None else contextlib.nullcontext():
                if options.pre_warmup_hook is not None:
                    options.pre_warmup_hook()
                # Eager replay makes one more pass where graphs capture, so that both see a
                # forward's Python side effects as often (``ModuleState``).
                passes = options.num_warmup_iters + (1 if options.eager_replay else 0)
                with stand_ins.scratch_main_grads():
                    warmups = [
                        warm_up(shape_specs, steps, passes, options.allow_unused_input,
                                options.tracker, not options.eager_replay, stand_ins, state, updates, fp8,
                                find_saved=options.num_warmup_iters >= 2)
                        for shape_specs in spec_sets
                    ]
                if options.post_warmup_hook is not None:
                    options.post_warmup_hook()
                steps = _place_wgrad(spec_sets[0], warmups[0], steps, options.has_order)
                plans = [_plan(shape_specs, records, steps, options) for shape_specs, records in zip(spec_sets, warmups)]
                if options.eager_replay:
                    succeeded = True
                    return Prepared(warmups, plans, None, state.runtime_attributes())
                # Warmup's activations, cached on the side stream, would otherwise stay
                # reserved beside the pool for the life of the process (torch's own
                # capture empties the cache too).
                torch.cuda.empty_cache()
                param_grads = _allocate_grad_buffers(spec_sets, warmups, home_stream, stream)
                captured = [
                    _capture(*per_set, steps, options, stand_ins, home_stream, fp8)
                    for per_set in zip(spec_sets, warmups, plans, param_grads)
                ]
                state.after_pass(executed=False)  # the capture ran each forward's Python once more
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        succeeded = True
        return Prepared(warmups, plans, captured, state.runtime_attributes())
    finally:
        if gc_enabled:
            gc.enable()
        rng.restore_streams(options.tracker, snapshot)
        state.restore(succeeded)
        updates.restore()
        forget_stand_in_caches(list(modules.values()))
        drop_queued_work(delayed)  # empty unless graphing failed between a backward and its pass


def _plan(specs: Sequence[GraphSpec], warmups: Sequence[WarmupRecord], steps, options: CaptureOptions) -> tuple[GraphPlan, ...]:
    layouts = [
        GraphLayout(
            tuple(map(TensorMeta.of, spec.static_inputs)),
            tuple(map(TensorMeta.of, record.output.tensors, record.output.devices)),
            record.unused,
            spec.needs_backward,
            spec.retain_graph,
        )
        for spec, record in zip(specs, warmups)
    ]
    return plan_capture(steps, layouts, reuse_buffers=options.reuse_buffers, chain_grads=options.chain_grads)


def _allocate_grad_buffers(spec_sets, warmup_sets, home_stream, side_stream) -> list[list[Optional[ParamGrads]]]:
    """The persistent parameter-gradient buffers, on the caller's stream: replays run there
    and eager code keeps its ``.grad``s there, so the side stream holds only transient
    memory (and after warmup, so that warmup does not carry them as well). Parameters whose
    gradient only a weight-gradient pass sets (``wgrad``) get none: the backward graph does
    not touch them."""

    def backward_params(spec: GraphSpec, warmup: WarmupRecord) -> list:
        split = warmup.wgrad.split_params if warmup.wgrad is not None else frozenset()
        return [p for i, p in enumerate(spec.params) if i not in split and i not in warmup.unused_params]

    with torch.cuda.stream(home_stream):
        grads = []
        for specs, warmups in zip(spec_sets, warmup_sets):
            per_set = []
            for spec, warmup in zip(specs, warmups):
                params = backward_params(spec, warmup) if spec.needs_backward else None
                per_set.append(None if params is None else ParamGrads(
                    params, [RESOURCES.grad_buffer(p) for p in params], tied=bool(spec.tied_params)))
            grads.append(per_set)
    side_stream.wait_stream(home_stream)
    return grads


def _place_wgrad(specs: Sequence[GraphSpec], warmups: Sequence[WarmupRecord], steps: Sequence[Step],
                 has_order: bool) -> tuple[Step, ...]:
    """The steps with each weight-gradient pass where it runs: where the order puts it, or,
    without an order, after every backward (``wgrad``). A graph whose modules cannot split
    their weight gradients out has no such pass to give."""
    placed = {step.flat_index for step in steps if step.kind == WGRAD}
    needed = {i for i, w in enumerate(warmups) if w.wgrad is not None}
    owners: dict[int, str] = {}
    for i in sorted(needed):
        for module in warmups[i].wgrad.modules:
            owner = owners.setdefault(id(module), specs[i].owner)
            if owner != specs[i].owner:
                raise NotImplementedError(
                    f"make_graphed_callables: {type(module).__name__} (delay_wgrad_compute=True) runs "
                    f"in both {owner} and {specs[i].owner}; Transformer Engine keeps one queue of "
                    "weight-gradient work per module, so which backward_dw() takes which backward's "
                    "work depends on both callables' calls. Give each callable its own modules."
                )
    unsplit = sorted(placed - needed)
    if unsplit and not specs[unsplit[0]].needs_backward:
        raise ValueError(
            f"make_graphed_callables: the order gives {specs[unsplit[0]].name} a weight-gradient "
            "pass (-c-0.5), but it is graphed without a backward (no_grad, or nothing requires "
            "grad); backward_dw() needs a training graph."
        )
    if unsplit:
        index = unsplit[0]
        raise NotImplementedError(
            f"make_graphed_callables: the order gives {specs[index].name} a weight-gradient pass "
            "(-c-0.5), but none of its modules delays its weight gradients: autograd computes "
            "input and weight gradients in the same nodes of a plain module, so they cannot be "
            "split. Only Transformer Engine modules built with delay_wgrad_compute=True split "
            "them; use -c alone for this chunk."
        )
    missing = sorted(needed - placed)
    if missing and has_order:
        raise ValueError(
            f"make_graphed_callables: {specs[missing[0]].name} holds Transformer Engine modules "
            "built with delay_wgrad_compute=True, whose backward leaves the weight gradients to "
            "backward_dw(), but the order gives it no weight-gradient pass; add -c-0.5 after "
            "each backward -c of its chunk (one layer per chunk, as TE requires)."
        )
    return with_wgrad_passes_last(steps, set(missing)) if missing else tuple(steps)


def _unique_modules(specs: Sequence[GraphSpec]) -> dict[str, torch.nn.Module]:
    modules: dict[str, torch.nn.Module] = {}
    seen: set[int] = set()
    for spec in specs:
        if isinstance(spec.func, torch.nn.Module) and id(spec.func) not in seen:
            seen.add(id(spec.func))
            modules[spec.owner] = spec.func
    return modules


# -- capture --------------------------------------------------------------------------------
class _Forward(NamedTuple):
    """A captured forward graph, waiting for its backward's capture."""

    graph: Any
    static_inputs: tuple[torch.Tensor, ...]
    output: OutputLayout


def _capture(
    specs: Sequence[GraphSpec],
    warmups: Sequence[WarmupRecord],
    plans: Sequence[GraphPlan],
    param_grads: Sequence[Optional[ParamGrads]],
    steps: Sequence[Step],
    options: CaptureOptions,
    stand_ins: StandIns,
    home_stream,
    fp8: Optional[FP8Capture],
) -> list[CapturedGraph]:
    """Capture the graphs of one sample set in ``steps`` order, as ``plans`` say."""
    device = torch.device("cuda", torch.cuda.current_device())
    rngs = [RecomputeRNG.create(w.forward_draws, w.backward_draws, device) for w in warmups]
    mempool = options.pool if options.pool is not None else torch.cuda.graph_pool_handle()
    wgrad_pool = torch.cuda.graph_pool_handle() if any(w.wgrad is not None for w in warmups) else None
    mode = options.capture_error_mode
    forwards: dict[int, _Forward] = {}
    backwards: dict[int, tuple] = {}  # captured backwards waiting for their weight-gradient pass
    input_grads: dict[int, tuple] = {}  # per captured backward: (static inputs, their grads)
    captured: dict[int, CapturedGraph] = {}
    for step in steps:
        index = step.flat_index
        spec, plan, warmup = specs[index], plans[index], warmups[index]
        if step.kind == FORWARD:
            donor = captured[plan.donor] if plan.donor is not None else None
            static_inputs = donor.static_inputs if donor is not None else spec.static_inputs
            forwards[index] = _capture_forward(spec, static_inputs, rngs[index], mempool, mode, fp8)
            if not spec.needs_backward:
                captured[index] = _record(spec, forwards.pop(index), None, (), (), None, rngs[index], warmup, plan, options)
            continue
        if not spec.needs_backward:
            continue
        if step.kind == WGRAD:
            wgrad = _capture_wgrad(spec, warmup, param_grads[index], stand_ins, wgrad_pool, mode)
            captured[index] = _record(*backwards.pop(index), wgrad=wgrad)
            continue
        forward = forwards.pop(index)
        grad_outputs = _grad_output_buffers(forward.output, plan, captured, input_grads, home_stream)
        graph, grad_inputs = _capture_backward(
            spec, forward, grad_outputs, param_grads[index], rngs[index], mempool, mode, stand_ins
        )
        input_grads[index] = (forward.static_inputs, grad_inputs)
        parts = (spec, forward, graph, grad_outputs, grad_inputs, param_grads[index], rngs[index], warmup, plan, options)
        if warmup.wgrad is not None:
            backwards[index] = parts  # recorded with its weight-gradient pass
        else:
            captured[index] = _record(*parts)
    return [captured[i] for i in range(len(specs))]


def _record(spec: GraphSpec, forward: _Forward, bwd_graph, grad_outputs, grad_inputs, param_grads, recompute: RecomputeRNG,
            warmup: WarmupRecord, plan: GraphPlan, options: CaptureOptions, wgrad: Optional[WgradReplay] = None) -> CapturedGraph:
    output = forward.output
    if plan.releases_buffers:
        # Hand the pool memory of the outputs and input grads back to the pool for later
        # captures; replay keeps non-owning aliases (valid until this graph's backward runs,
        # which is when the graph that takes its buffers over may overwrite them).
        output = output.with_tensors([compat.weak_alias(t) for t in output.tensors])
        grad_inputs = tuple(None if g is None else compat.weak_alias(g) for g in grad_inputs)
    tracker = options.tracker
    return CapturedGraph(
        fwd_graph=forward.graph,
        bwd_graph=bwd_graph,
        static_inputs=forward.static_inputs,
        output=output,
        static_grad_outputs=grad_outputs,
        static_grad_inputs=grad_inputs,
        param_grads=param_grads,
        rng=recompute.for_replay(),
        sync_forward=TrackerSync.needed(tracker, warmup.forward_draws.used_generators()),
        sync_backward=(
            TrackerSync.needed(tracker, warmup.backward_draws.used_generators())
            if warmup.backward_draws is not None else NO_SYNC
        ),
        lends_grad_buffer=plan.lends_grad_buffer,
        updated_inputs=warmup.updated,
        fp8=fp8_replay(spec.fp8, options.fp8, warmup.te_modules, spec.has_te, graphs=True),
        wgrad=wgrad,
        fused_params=tuple(spec.params[i] for i in sorted(warmup.fused_params)),
        fed=warmup.fed,
        saved=warmup.saved,
        idle_calls=warmup.idle_calls,
        idle_outputs=warmup.idle_outputs,
        borrowed_outputs=plan.releases_buffers,
    )


def _grad_output_buffers(output: OutputLayout, plan: GraphPlan, captured: dict[int, CapturedGraph],
                         input_grads: dict[int, tuple], home_stream) -> tuple:
    """The buffers the backward graph reads its output grads from: a buffer donor's, the
    lender's input-grad buffer (gradient chaining, when its layout is the output's), or new
    ones on the caller's stream."""
    if plan.donor is not None and captured[plan.donor].static_grad_outputs:
        return captured[plan.donor].static_grad_outputs
    if plan.grad_output_from is not None:
        static_inputs, grads = input_grads[plan.grad_output_from]
        grad = next(g for t, g in zip(static_inputs, grads) if t.requires_grad)
        out = next(o for o in output.tensors if o.requires_grad)
        if TensorMeta.of(grad).same_layout(TensorMeta.of(out)):
            return tuple(grad if o is out else None for o in output.tensors)
    with torch.cuda.stream(home_stream):
        return tuple(torch.empty_like(o) if o.requires_grad else None for o in output.tensors)


@contextlib.contextmanager
def capturing(name: str, graph: Any, mempool: Any, generators: Sequence[torch.Generator], mode: str):
    """Capture into ``graph``; if the capture fails (its begin, the body or its end), end it
    and take every generator the graph registered out of capture mode
    (``compat.end_generator_capture``): torch runs their capture prologue in
    ``capture_begin`` and their epilogue only in a ``capture_end`` that succeeds, and a
    generator left capturing fails every later random draw of the process. A host wait in
    the body is refused by name (``host_sync``): before CUDA sees it where torch lets
    te_graph see it first, else told from CUDA's capture error."""
    compat.register_generators(graph, generators)
    begun = False
    try:
        graph.capture_begin(pool=mempool, capture_error_mode=mode)
        begun = True
        try:
            with host_sync.waits_refused(name):
                yield
        except BaseException as error:
            refusal = host_sync.refusal_of(name, error)
            if refusal is None or refusal is error:
                raise
            raise refusal from error
        graph.capture_end()
    except BaseException:
        if begun:  # a capture_begin that failed began nothing to end (it may sit inside another capture)
            with contextlib.suppress(Exception):
                graph.capture_end()
        if not cuda_stream_capturing():  # an empty capture cannot start inside one; the error says why
            with contextlib.suppress(Exception):
                compat.end_generator_capture(generators)
        raise


def _capture_forward(spec: GraphSpec, static_inputs: tuple, recompute: RecomputeRNG, mempool: Any, mode: str,
                     fp8: Optional[FP8Capture]) -> _Forward:
    graph = torch.cuda.CUDAGraph()
    args, kwargs = spec.layout.unflatten(static_inputs)
    regions = recompute.capture_hook()
    if spec.hooks is not None:
        spec.hooks.run("forward_pre_hooks", spec.func)
    with capturing(spec.name, graph, mempool, recompute.forward_generators, mode):
        with capture_hook_set(regions), grad_mode(spec), fp8_context(fp8, spec):
            outputs = spec.call(*args, **kwargs)
    regions.check_complete()
    if spec.hooks is not None:
        spec.hooks.run("forward_hooks", spec.func)
    return _Forward(graph, static_inputs, OutputLayout(spec.name, outputs))


def _capture_backward(spec: GraphSpec, forward: _Forward, grad_outputs: tuple, param_grads: ParamGrads,
                      recompute: RecomputeRNG, mempool: Any, mode: str, stand_ins: StandIns) -> tuple[Any, tuple]:
    differentiable = [o for o in forward.output.tensors if o.requires_grad]
    grads = [g for g in grad_outputs if g is not None]
    inputs = forward.static_inputs
    stand = stand_ins(param_grads.params)
    graph = torch.cuda.CUDAGraph()
    if spec.hooks is not None:
        spec.hooks.run("backward_pre_hooks", spec.func)
    with grads_redirected([t for t in inputs if t.requires_grad], stand, param_grads.buffers):
        with capturing(spec.name, graph, mempool, recompute.backward_generators, mode):
            if differentiable:
                torch.autograd.backward(differentiable, grads, retain_graph=spec.retain_graph)
        grad_inputs = tuple(t.grad if t.requires_grad else None for t in inputs)
        for p, b in zip(stand, param_grads.buffers):
            if p.grad is not b:
                raise RuntimeError(
                    f"make_graphed_callables: autograd replaced the gradient of a parameter of "
                    f"{spec.name} instead of accumulating into it during capture (a sparse or "
                    "differently laid out gradient?); such a parameter cannot be graphed."
                )
    if spec.hooks is not None:
        spec.hooks.run("backward_hooks", spec.func)
    return graph, grad_inputs


def _capture_wgrad(spec: GraphSpec, warmup: WarmupRecord, param_grads: ParamGrads, stand_ins: StandIns,
                   mempool: Any, mode: str) -> WgradReplay:
    """The weight-gradient pass (``wgrad``): each delaying module's ``backward_dw()``,
    captured with the gradients it sets None and the others in their buffers (as at an
    in-graph replay), into the weight-gradient passes' own pool; what it sets are the
    graph's static outputs, handed back to that pool (``wgrad``)."""
    learned = warmup.wgrad
    split = stand_ins(tuple(spec.params[i] for i in sorted(learned.split_params)))
    graph = torch.cuda.CUDAGraph()
    with grads_redirected(split, stand_ins(param_grads.params), param_grads.buffers):
        with wgrad_hooks_held(learned.modules), capturing(spec.name, graph, mempool, (), mode):
            for module in learned.modules:
                run_backward_dw(module)
        stand = stand_ins(spec.params)
        outputs = tuple(tuple(stand[i].grad for i, _ in per_module) for per_module in learned.sets)
    if any(out is None for per_module in outputs for out in per_module):
        raise RuntimeError(
            f"make_graphed_callables: backward_dw() of {spec.name} set no gradient of a parameter "
            "during capture that it set during warmup; its weight-gradient pass cannot be graphed."
        )
    aliases = tuple(tuple(compat.weak_alias(out) for out in per_module) for per_module in outputs)
    return WgradReplay(spec.name, learned, spec.params, graph, aliases)
