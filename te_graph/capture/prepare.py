"""Warmup and capture: the algorithm, told top to bottom.

1. Save what warmup and capture will touch: RNG states, module buffers, inputs the
   callables update in place (found in the first warmup pass), the registered precision's
   state (Transformer Engine's FP8 meta); put stand-ins in
   place of the trainable parameters (``parameters``), so autograd accumulates into them
   and no hook of a real parameter runs while we prepare the graphs.
2. Warm up (``warmup``), on the side stream later used for capture: one
   ``WarmupRecord`` per graph (output layouts, unused inputs, random draws).
3. Plan (``planning.buffers``) from the warmup layouts: which graphs share static buffers.
4. The allocator's cache is emptied: what warmup cached on the side stream would
   otherwise stay reserved for the life of the process, beside the pool capture fills.
5. The persistent parameter-gradient buffers are allocated on the caller's stream, like
   eager ``.grad``s, and the private recompute generators (never during capture).
6. Capture (``graphs``), in run order, into one memory pool: one ``CapturedGraph`` per
   graph, carrying its warmup record and its plan whole.
7. ``finally``: parameters, buffers, RNG states, ``.grad``s and the garbage collector are
   put back, so a failed capture leaves the process and the model as they were and a
   successful one shifts no user state.
"""
from __future__ import annotations

import contextlib
import gc
from typing import NamedTuple, Optional, Sequence

import torch

import rng
from checkpointing.torch_routing import torch_checkpoint_routed

from ..extension import SEAM
from ..guards.settings import hooks_off_if_exact
from ..grads import ParamGrads
from ..intake.specs import device_type
from ..planning.buffers import GraphLayout, TensorMeta, plan_capture
from ..planning.schedule import WGRAD, Step, with_wgrad_passes_last
from ..records import CapturedGraph, GraphPlan, GraphSpec, WarmupRecord
from ..resources import RESOURCES
from .graphs import capture_graphs
from .host_state import HostState
from .input_updates import InputUpdates
from .module_state import ModuleState
from .parameters import StandIns
from .session import CaptureOptions, CaptureSession
from .warmup import warm_up
from .wgrad import check_no_queued_work, delayed_modules_in, drop_queued_work

__all__ = ["CaptureOptions", "Prepared", "prepare_graphs"]


class Prepared(NamedTuple):
    """Per sample set, per graph: its warmup record, its plan, and its captured graph
    (``captured`` is None in eager replay, which plans but captures nothing); the modules'
    Python attributes the forwards set (``ModuleState.runtime_attributes``) and what the
    forwards read (per callable)."""

    warmups: list[list[WarmupRecord]]
    plans: list[tuple[GraphPlan, ...]]
    captured: Optional[list[list[CapturedGraph]]]
    runtime_attributes: frozenset = frozenset()
    reads: dict = {}  # per callable (owner): what its forwards read (``guards.reads.ForwardReads``)


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
    session = CaptureSession(StandIns(modules.values()), ModuleState(modules, SEAM.keeps_own_state), InputUpdates(),
                             HostState(device_type(specs)),
                             SEAM.precision.capture(options.precision, list(modules.values())))
    state, stand_ins = session.state, session.stand_ins
    snapshot = rng.snapshot_streams(options.tracker)
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
            precision = session.precision
            # torch's own checkpoint recomputes with exact random streams inside the graphs
            # (``checkpointing.torch_routing``); eager replay runs it as it is, exact eagerly.
            routed = torch_checkpoint_routed() if not options.eager_replay else contextlib.nullcontext()
            # Exact saved-tensor hooks around graphing (a checkpoint's) are off while
            # it runs, as at each call (``replay.function``): the graphs keep their own activations.
            with stand_ins.installed(), precision.active() if precision is not None else contextlib.nullcontext(), \
                    routed, hooks_off_if_exact():
                if options.pre_warmup_hook is not None:
                    options.pre_warmup_hook()
                with stand_ins.scratch_main_grads():
                    warmups = [warm_up(shape_specs, steps, options, session) for shape_specs in spec_sets]
                if options.post_warmup_hook is not None:
                    options.post_warmup_hook()
                for owner, reads in session.reads.items():
                    reads.check_per_call(owner)
                steps = _place_wgrad(spec_sets[0], warmups[0], steps, options.has_order)
                plans = [_plan(shape_specs, records, steps, options) for shape_specs, records in zip(spec_sets, warmups)]
                if options.eager_replay:
                    succeeded = True
                    return Prepared(warmups, plans, None, state.runtime_attributes(), session.reads)
                # Warmup's activations, cached on the side stream, would otherwise stay
                # reserved beside the pool for the life of the process (torch's own
                # capture empties the cache too).
                torch.cuda.empty_cache()
                param_grads = _allocate_grad_buffers(spec_sets, warmups, home_stream, stream)
                captured = [
                    capture_graphs(*per_set, steps, options, session, home_stream)
                    for per_set in zip(spec_sets, warmups, plans, param_grads)
                ]
                state.after_pass(executed=False)  # the capture ran each forward's Python once more
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        succeeded = True
        return Prepared(warmups, plans, captured, state.runtime_attributes(), session.reads)
    finally:
        if gc_enabled:
            gc.enable()
        rng.restore_streams(options.tracker, snapshot)
        state.restore(succeeded)
        session.updates.restore()
        session.host.restore()
        for reads in session.reads.values():
            reads.put_back()
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


def _device_type(specs: Sequence[GraphSpec]) -> str:
    """The device type the callables run on (their inputs' or parameters')."""
    for spec in specs:
        for t in spec.static_inputs + spec.params:
            return t.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _unique_modules(specs: Sequence[GraphSpec]) -> dict[str, torch.nn.Module]:
    modules: dict[str, torch.nn.Module] = {}
    seen: set[int] = set()
    for spec in specs:
        if isinstance(spec.func, torch.nn.Module) and id(spec.func) not in seen:
            seen.add(id(spec.func))
            modules[spec.owner] = spec.func
    return modules

