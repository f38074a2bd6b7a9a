"""The capture of one sample set's graphs into one memory pool, in the order of ``steps``:
each forward drawing from the live random streams, each backward running
``torch.autograd.backward`` with input grads redirected and parameter grads accumulated
into their persistent buffers (``grads``), its recompute drawing from private generators
(``recompute_rng``), and each weight-gradient pass (``wgrad``) into a pool of its own.
``capturing`` is the one way te_graph captures anything: it leaves the process clean when a
capture fails."""
from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Optional, Sequence

import torch

from checkpointing.capture_hook import capture_hook_set
from checkpointing.recompute_state import cuda_stream_capturing

from .. import compat
from ..extension import SEAM
from ..grads import ParamGrads, grads_redirected
from ..layout import OutputLayout
from ..planning.buffers import TensorMeta
from ..planning.schedule import FORWARD, WGRAD, Step
from ..records import CapturedGraph, GraphPlan, GraphSpec, WarmupRecord
from . import host_sync
from .conditional.runtime import backward_retaining, capturing_into
from .recompute_rng import NO_SYNC, RecomputeRNG, TrackerSync
from .session import CaptureOptions, CaptureSession
from .passes import grad_mode, precision_context
from .wgrad import WgradReplay

__all__ = ["capture_graphs", "capturing"]


class _Forward(NamedTuple):
    """A captured forward graph, waiting for its backward's capture."""

    graph: Any
    static_inputs: tuple[torch.Tensor, ...]
    output: OutputLayout


class _Pending(NamedTuple):
    """A graph whose forward (and backward, where it has one) is captured, waiting to be
    recorded (after its weight-gradient pass, where it has one)."""

    spec: GraphSpec
    warmup: WarmupRecord
    plan: GraphPlan
    recompute: RecomputeRNG
    forward: _Forward
    bwd_graph: Any = None
    grad_outputs: tuple = ()
    grad_inputs: tuple = ()
    param_grads: Optional[ParamGrads] = None


def capture_graphs(specs: Sequence[GraphSpec], warmups: Sequence[WarmupRecord], plans: Sequence[GraphPlan],
                   param_grads: Sequence[Optional[ParamGrads]], steps: Sequence[Step], options: CaptureOptions,
                   session: CaptureSession, home_stream: Any) -> list[CapturedGraph]:
    """Capture the graphs of one sample set in ``steps`` order, as ``plans`` say."""
    device = torch.device("cuda", torch.cuda.current_device())
    rngs = [RecomputeRNG.create(w.forward_draws, w.backward_draws, device) for w in warmups]
    mempool = options.pool if options.pool is not None else torch.cuda.graph_pool_handle()
    wgrad_pool = torch.cuda.graph_pool_handle() if any(w.wgrad is not None for w in warmups) else None
    mode = options.capture_error_mode
    forwards: dict[int, _Forward] = {}
    waiting: dict[int, _Pending] = {}  # captured backwards waiting for their weight-gradient pass
    input_grads: dict[int, tuple] = {}  # per captured backward: (static inputs, their grads)
    captured: dict[int, CapturedGraph] = {}
    for step in steps:
        index = step.flat_index
        spec, plan, warmup = specs[index], plans[index], warmups[index]
        if step.kind == FORWARD:
            donor = captured[plan.donor] if plan.donor is not None else None
            static_inputs = donor.static_inputs if donor is not None else spec.static_inputs
            forwards[index] = _capture_forward(spec, static_inputs, rngs[index], mempool, mode, session)
            if not spec.needs_backward:
                captured[index] = _record(_Pending(spec, warmup, plan, rngs[index], forwards.pop(index)), options)
            continue
        if not spec.needs_backward:
            continue
        if step.kind == WGRAD:
            wgrad = _capture_wgrad(spec, warmup, param_grads[index], session, wgrad_pool, mode)
            captured[index] = _record(waiting.pop(index), options, wgrad)
            continue
        forward = forwards.pop(index)
        grad_outputs = _grad_output_buffers(forward.output, plan, captured, input_grads, home_stream)
        graph, grad_inputs = _capture_backward(
            spec, forward, grad_outputs, param_grads[index], rngs[index], mempool, mode, session
        )
        input_grads[index] = (forward.static_inputs, grad_inputs)
        pending = _Pending(spec, warmup, plan, rngs[index], forward, graph, grad_outputs, grad_inputs, param_grads[index])
        if warmup.wgrad is not None:
            waiting[index] = pending  # recorded with its weight-gradient pass
        else:
            captured[index] = _record(pending, options)
    return [captured[i] for i in range(len(specs))]


def _record(pending: _Pending, options: CaptureOptions, wgrad: Optional[WgradReplay] = None) -> CapturedGraph:
    spec, warmup, plan = pending.spec, pending.warmup, pending.plan
    output, grad_inputs = pending.forward.output, pending.grad_inputs
    if plan.releases_buffers:
        # Hand the pool memory of the outputs and input grads back to the pool for later
        # captures; replay keeps non-owning aliases (valid until this graph's backward runs,
        # which is when the graph that takes its buffers over may overwrite them).
        output = output.with_tensors([compat.weak_alias(t) for t in output.tensors])
        grad_inputs = tuple(None if g is None else compat.weak_alias(g) for g in grad_inputs)
    tracker = options.tracker
    return CapturedGraph(
        fwd_graph=pending.forward.graph,
        bwd_graph=pending.bwd_graph,
        warmup=warmup,
        plan=plan,
        static_inputs=pending.forward.static_inputs,
        output=output,
        static_grad_outputs=pending.grad_outputs,
        static_grad_inputs=grad_inputs,
        param_grads=pending.param_grads,
        rng=pending.recompute.for_replay(),
        sync_forward=TrackerSync.needed(tracker, warmup.forward_draws.used_generators()),
        sync_backward=(
            TrackerSync.needed(tracker, warmup.backward_draws.used_generators())
            if warmup.backward_draws is not None else NO_SYNC
        ),
        precision=SEAM.precision.replay(spec.fp8, options.precision, warmup.framework_modules,
                                        spec.framework_modules, graphs=True),
        wgrad=wgrad,
    )


def _grad_output_buffers(output: OutputLayout, plan: GraphPlan, captured: dict[int, CapturedGraph],
                         input_grads: dict[int, tuple], home_stream: Any) -> tuple:
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
            with host_sync.waits_refused(name), capturing_into(mempool):  # for conditional nodes within
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
                     session: CaptureSession) -> _Forward:
    graph = torch.cuda.CUDAGraph()
    args, kwargs = spec.layout.unflatten(static_inputs)
    regions = recompute.capture_hook()
    if spec.hooks is not None:
        spec.hooks.run("forward_pre_hooks", spec.func)
    with capturing(spec.name, graph, mempool, recompute.forward_generators, mode):
        with capture_hook_set(regions), grad_mode(spec), precision_context(session.precision, spec):
            outputs = spec.call(*args, **kwargs)
    regions.check_complete()
    if spec.hooks is not None:
        spec.hooks.run("forward_hooks", spec.func)
    return _Forward(graph, static_inputs, OutputLayout(spec.name, outputs))


def _capture_backward(spec: GraphSpec, forward: _Forward, grad_outputs: tuple, param_grads: ParamGrads,
                      recompute: RecomputeRNG, mempool: Any, mode: str, session: CaptureSession) -> tuple[Any, tuple]:
    differentiable = [o for o in forward.output.tensors if o.requires_grad]
    grads = [g for g in grad_outputs if g is not None]
    inputs = forward.static_inputs
    stand = session.stand_ins(param_grads.params)
    graph = torch.cuda.CUDAGraph()
    if spec.hooks is not None:
        spec.hooks.run("backward_pre_hooks", spec.func)
    with grads_redirected([t for t in inputs if t.requires_grad], stand, param_grads.buffers):
        with capturing(spec.name, graph, mempool, recompute.backward_generators, mode):
            if differentiable:
                with backward_retaining(spec.retain_graph):
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


def _capture_wgrad(spec: GraphSpec, warmup: WarmupRecord, param_grads: ParamGrads, session: CaptureSession,
                   mempool: Any, mode: str) -> WgradReplay:
    """The weight-gradient pass (``wgrad``): each delaying module's ``backward_dw()``,
    captured with the gradients it sets None and the others in their buffers (as at an
    in-graph replay), into the weight-gradient passes' own pool; what it sets are the
    graph's static outputs, handed back to that pool (``wgrad``)."""
    learned = warmup.wgrad
    stand_ins = session.stand_ins
    split = stand_ins(tuple(spec.params[i] for i in sorted(learned.split_params)))
    graph = torch.cuda.CUDAGraph()
    with grads_redirected(split, stand_ins(param_grads.params), param_grads.buffers):
        with SEAM.wgrad_hooks_held(learned.modules), capturing(spec.name, graph, mempool, (), mode):
            for module in learned.modules:
                SEAM.run_backward_dw(module)
        stand = stand_ins(spec.params)
        outputs = tuple(tuple(stand[i].grad for i, _ in per_module) for per_module in learned.sets)
    if any(out is None for per_module in outputs for out in per_module):
        raise RuntimeError(
            f"make_graphed_callables: backward_dw() of {spec.name} set no gradient of a parameter "
            "during capture that it set during warmup; its weight-gradient pass cannot be graphed."
        )
    aliases = tuple(tuple(compat.weak_alias(out) for out in per_module) for per_module in outputs)
    return WgradReplay(spec.name, learned, spec.params, graph, aliases)
