"""``make_graphed_callables``: the call users know from Transformer Engine and PyTorch,
told as torch tells its own, in five steps: normalise the arguments (``intake``), check
them before anything changes (``intake.checks``), plan (``planning``), warm up and capture
(``capture``), wrap each graph in a callable that replays it (``replay``), with the guards
of what the graphs froze (``guards``).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar, overload

import torch

import rng
from checkpointing.checks import tracker_from

from .capture.prepare import Prepared, prepare_graphs
from .capture.session import CaptureOptions
from .extension import SEAM
from .guards.fingerprint import fingerprints
from .intake import checks
from .intake.arguments import Samples, call_form, is_mempool, pool_handle, sample_sets
from .intake.options import GraphOptions, eager_replay_default, graph_options
from .intake.specs import device_type, largest_first, make_specs
from .planning.schedule import plan_schedule
from .records import GraphSpec
from .replay.eager_runner import EagerRunner
from .replay.graph_runner import GraphRunner
from .replay.graphed import GraphedCallable, install_on_module
from .replay.order import NO_CLOCK, Clock, OrderSlot, ReplayContext, ReplayOptions, ReplayOrder, WgradBook
from .resources import RESOURCES, graphed_callable_of, graphed_callables_in
from .step.graphed_step import GraphedStep, make_graphed_step
from .verify.callable import turn_on, verify
from .verify.options import Verify, verify_options

__all__ = ["make_graphed_callables", "eager_replay_default", "Samples", "reset", "graph_pool_handle", "Verify", "verify", "make_graphed_step",
           "GraphedStep"]

M = TypeVar("M", bound=torch.nn.Module)
F = TypeVar("F", bound=Callable[..., Any])


def graph_pool_handle() -> tuple[int, int]:
    """A memory pool token to share between several ``make_graphed_callables`` calls."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "te_graph.graph_pool_handle(): CUDA is not available, and a graph memory pool "
            "lives on a CUDA device. In eager replay (eager_replay=True) no pool is needed: "
            "leave pool= unset."
        )
    return torch.cuda.graph_pool_handle()


@overload
def make_graphed_callables(modules: M, sample_args: Any, *args: Any, **kwargs: Any) -> M: ...
@overload
def make_graphed_callables(modules: F, sample_args: Any, *args: Any, **kwargs: Any) -> F: ...
@overload
def make_graphed_callables(modules: Sequence[Callable], sample_args: Any, *args: Any, **kwargs: Any) -> tuple: ...


def make_graphed_callables(
    modules: Any = None,
    sample_args: Any = None,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs: Any = None,
    *,
    callables: Any = None,
    order: Sequence[int] | None = None,
    num_layers_per_chunk: int | Sequence[int] | None = None,
    pool: Any = None,
    retain_graph_in_backward: bool = False,
    reuse_graph_input_output_buffers: bool = False,
    accumulate_grads_in_graph: bool | None = None,
    clone_param_grads_on_return: bool = True,
    capture_time_hooks: Optional[Sequence[Optional[Mapping[str, Any]]]] = None,
    pre_warmup_hook: Optional[Callable[[], None]] = None,
    post_warmup_hook: Optional[Callable[[], None]] = None,
    capture_error_mode: str = "thread_local",
    more_shapes: Sequence[Any] = (),
    unseen_shape: str = "error",
    eager_replay: bool | None = None,
    get_rng_state_tracker: Callable[[], Any] | None = None,
    verify: bool | int | Verify | None = None,
    **te_arguments: Any,
) -> Any:
    """Capture each callable's forward and backward as CUDA graphs; return graphed versions.

    Args:
        modules: a module or function, or a tuple/list of them (captured in that run order,
            sharing one memory pool). ``callables=`` is torch's name for it.
        sample_args: per callable, a tuple of sample tensors (pytrees of tensors); a plain
            tuple of tensors when ``modules`` is a single callable. With ``order``, one
            tuple per (chunk, microbatch, layer), as Transformer Engine lays them out.
        num_warmup_iters: eager warmup passes before capture (at least 1). The last of
            two or more finds the outputs each backward reads; with one, every output
            counts as read (an in-place update of any before its backward is refused).
        allow_unused_input: allow inputs that require grad but that no output depends on.
        sample_kwargs: per callable, a dict of keyword args (tensors or constants; a
            constant must have the same value at every call). torch's 5th positional
            argument, ``pool``, is recognised in this position too.
        order / num_layers_per_chunk: pipeline schedule (TE's ``_order`` and
            ``_num_layers_per_chunk``): one graph per (layer, microbatch).
        pool: memory pool to share with other captures: a ``graph_pool_handle()``, a
            ``torch.cuda.MemPool``, or a graphed callable (or graphed module) whose pool to use.
        retain_graph_in_backward: keep the captured autograd graph so a backward can be
            replayed again (``retain_graph=True`` in training).
        reuse_graph_input_output_buffers: with ``order``, let later microbatches reuse static
            buffers of microbatches whose backward has run (an output is then valid only
            until its backward runs).
        accumulate_grads_in_graph: ``None`` or ``True`` (default): parameter grads are
            accumulated inside the backward graph unless something observes them at that
            call (a DDP forward, hooks on a parameter, Megatron's ``main_grad``), where they
            go through autograd. ``False``: always through autograd.
        clone_param_grads_on_return: on the autograd path, hand autograd a copy of each
            parameter grad wherever it could be kept (TE's default). ``False`` hands over the
            graph's buffer itself (Megatron, whose hooks consume it at once).
        capture_time_hooks, pre_warmup_hook, post_warmup_hook: hooks run while graphs are
            prepared and never replayed (Transformer Engine's; see ``te_graph.hooks``).
        capture_error_mode: CUDA's stream-capture mode (torch's argument; ``thread_local``
            by default here, ``global`` in torch).
        more_shapes: more sample sets, each laid out like ``sample_args`` (or a
            ``Samples(args, kwargs)``): graphs are captured for every shape, sharing one
            pool, and each call's tensor shapes pick its graph.
        unseen_shape: ``"error"`` (default) or ``"eager"``: what a call of an uncaptured
            shape does (the eager run warns once).
        eager_replay: run the same wrapper without graphs (debugging; works on CPU).
            Defaults to ``TE_GRAPH_EAGER_REPLAY``.
        get_rng_state_tracker: tracker whose streams the callables fork. Default: the one
            the process uses (``rng.process_tracker()``: ours when seeded, else
            megatron-core's when initialised, else Transformer Engine's registry of tracker
            states, as TE's graphs find it).
        verify: the runtime verifier (``te_graph.Verify``): at chosen calls, the call runs
            again eagerly and outputs and gradients are compared with the graph's, bitwise.
            ``True``: the first 8 calls of each callable; an int N: the first N; a ``Verify``
            for every k-th call, a fraction, and what a difference does. Defaults to
            ``TE_GRAPH_VERIFY`` (a boolean word or N); off costs nothing per call.

    Returns:
        The graphed callables in the form given: modules keep their identity (their
        ``forward`` replays the graph in the training mode they were captured in and runs
        eagerly otherwise; ``module.forward.reset()`` frees the graphs); functions become
        graphed functions. With ``order``, one graphed function per (chunk, microbatch,
        layer).
    """
    # 1. Normalise: the call forms, TE's spellings, the sample sets.
    modules, sample_kwargs, pool = call_form(modules, callables, sample_args, sample_kwargs, pool)
    options = graph_options(
        te_arguments, num_warmup_iters=num_warmup_iters, allow_unused_input=allow_unused_input,
        order=order, num_layers_per_chunk=num_layers_per_chunk, pool=pool,
        retain_graph_in_backward=retain_graph_in_backward,
        reuse_graph_input_output_buffers=reuse_graph_input_output_buffers,
        accumulate_grads_in_graph=accumulate_grads_in_graph,
        clone_param_grads_on_return=clone_param_grads_on_return, capture_time_hooks=capture_time_hooks,
        pre_warmup_hook=pre_warmup_hook, post_warmup_hook=post_warmup_hook,
        capture_error_mode=capture_error_mode, more_shapes=more_shapes, unseen_shape=unseen_shape,
        eager_replay=eager_replay, get_rng_state_tracker=get_rng_state_tracker, verify=verify,
    )
    verification = verify_options(options.verify)
    pool = pool_handle(options.pool, options.eager_replay)

    # 2. Check everything before anything changes.
    callables_ = checks.check_callables(modules)
    single = not isinstance(modules, (tuple, list))
    fp8 = SEAM.precision.options(dict(options.fp8_arguments), callables_)
    checks.check_environment(options.eager_replay)
    checks.check_modules(callables_)
    if single and options.order is None:
        checks.check_not_over_nested(callables_[0], sample_args)
    sets = sample_sets(sample_args, sample_kwargs, options.more_shapes, single and options.order is None, len(callables_))
    checks.check_tensors(callables_, sets)

    # 3. Plan: the graphs and the sequence their forwards and backwards run in.
    schedule = plan_schedule(len(callables_), len(sets[0][0]), options.order, options.num_layers_per_chunk)
    spec_sets = make_specs(callables_, sets, schedule, options, fp8)
    for specs in spec_sets:
        checks.check_devices([s.func for s in specs], [s.layout for s in specs], options.eager_replay)

    # 4. Warm up and capture (restores everything it changes if it fails).
    tracker = tracker_from(options.get_rng_state_tracker, "make_graphed_callables") \
        if options.get_rng_state_tracker is not None else rng.process_tracker()
    lease = None
    if not options.eager_replay:
        given = pool is not None
        if pool is None:
            pool = torch.cuda.graph_pool_handle()
        if not is_mempool(options.pool):
            lease = RESOURCES.pool_lease(pool, given=given and graphed_callable_of(options.pool) is None)
    first = largest_first(spec_sets)
    prepared = prepare_graphs([spec_sets[i] for i in first], schedule.steps, _capture_options(options, pool, tracker, fp8))

    # 5. Wrap: one graphed callable per graph; modules keep their identity.
    graphed = _wrap(spec_sets, _in_given_order(prepared, first), options, pool, fp8, lease, tracker)
    # Weights these graphs share with graphs made before take autograd's path there too, as here
    # (``intake.specs``: tied): autograd then sums every use's gradient first, as in eager code.
    RESOURCES.share_parameters(graphed, {id(p) for specs in spec_sets for spec in specs for p in spec.params})
    if verification is not None:
        for function in graphed:
            turn_on(function, verification)
    if options.order is not None:
        return tuple(graphed)
    results = []
    for spec, function in zip(spec_sets[0], graphed):
        if isinstance(spec.func, torch.nn.Module):
            install_on_module(spec.func, function)
            results.append(spec.func)
        else:
            results.append(function)
    return results[0] if single else tuple(results)


def reset(*graphed: Any) -> None:
    """Free the graphs and static buffers of graphed callables or modules (any mix, or
    tuples of them, as ``make_graphed_callables`` returned them): everything one call made,
    when given all it returned. With no argument, the process-wide teardown
    (``resources.RESOURCES.teardown()``): every graphed callable of the process, and the
    capture streams, gradient buffers and Transformer Engine amax-reduction graphs te_graph
    keeps (later captures make new ones).
    Pool memory goes back once no graph uses it; later calls of freed callables raise, and
    a graphed module gets its eager forward back (a module not graphed is left alone), so
    it can be graphed again.

    Call it before ``torch.distributed.destroy_process_group()``: destroying a process
    group while graphs that captured its NCCL collectives are alive hangs both ranks
    (measured on 2 H200s, torch 2.11, NCCL 2.28).
    """
    if not graphed:
        RESOURCES.teardown()
        return
    found = graphed_callables_in(graphed)
    for obj, callable_ in found:
        # A module not graphed (any more) is left alone: its forward is its own.
        if callable_ is None and not isinstance(obj, torch.nn.Module):
            raise TypeError(
                f"te_graph.reset(): {type(obj).__name__} is not a graphed callable or a module "
                "graphed by make_graphed_callables."
            )
    for _, callable_ in found:
        if callable_ is not None:
            callable_.reset()


def _capture_options(options: GraphOptions, pool: Any, tracker: Any, fp8: Any) -> CaptureOptions:
    return CaptureOptions(
        num_warmup_iters=options.num_warmup_iters,
        allow_unused_input=options.allow_unused_input,
        reuse_buffers=options.reuse_graph_input_output_buffers,
        chain_grads=options.order is None,
        has_order=options.order is not None,
        pool=pool,
        tracker=tracker,
        eager_replay=options.eager_replay,
        capture_error_mode=options.capture_error_mode,
        pre_warmup_hook=options.pre_warmup_hook,
        post_warmup_hook=options.post_warmup_hook,
        precision=fp8,
    )


def _in_given_order(prepared: Prepared, order: list[int]) -> Prepared:
    """``prepared`` (in ``order``, largest sample set first) back in the sets' own order."""
    position = {index: n for n, index in enumerate(order)}

    def back(per_set: Optional[list]) -> Optional[list]:
        return None if per_set is None else [per_set[position[i]] for i in range(len(order))]

    return prepared._replace(warmups=back(prepared.warmups), plans=back(prepared.plans),
                             captured=back(prepared.captured))


def _wrap(spec_sets: list[list[GraphSpec]], prepared: Prepared, options: GraphOptions, pool: Any,
          fp8: Any, lease: Any, tracker: Any) -> list[GraphedCallable]:
    """One GraphedCallable per graph, holding a runner per sample set."""
    replay = ReplayOptions(
        always_autograd=options.accumulate_grads_in_graph is False,
        clone_param_grads=options.clone_param_grads_on_return,
    )
    clock = Clock() if len(spec_sets) > 1 else NO_CLOCK
    # What each graph froze, checked at every call (``guards``).
    frozen = fingerprints(spec_sets[0], device_type(spec_sets[0]), prepared.runtime_attributes, prepared.reads)
    # The weight-gradient passes waiting, over every graph of the call.
    has_wgrad = any(w.wgrad is not None for warmups in prepared.warmups for w in warmups)
    book = WgradBook(ordered=options.order is not None) if has_wgrad else None

    # The pool's graphs holding activations (``ReplayOrder``): one per pool, shared with the
    # calls that captured into it before (pool= a graphed callable, in eager replay too, or
    # the same handle).
    order = _replay_order(options.pool, pool)
    count = len(spec_sets[0])
    first = order.reserve(len(spec_sets) * count)
    # The call's other sample sets are Clock's: allowed here.
    call_bits = ((1 << (len(spec_sets) * count)) - 1) << first

    def context(variant: int, index: int) -> ReplayContext:
        plan, base = prepared.plans[variant][index], first + variant * count
        others = call_bits & ~(((1 << count) - 1) << base)
        slot = OrderSlot(order, base + index, first, (plan.activations_at_forward << base) | others,
                         (plan.activations_at_backward << base) | others, (plan.queued_at_forward << base) | others,
                         (plan.queued_at_backward << base) | others)
        return ReplayContext(replay, slot, clock, variant, book, plan.releases_buffers, tracker)

    def runner(variant: int, index: int):
        spec = spec_sets[variant][index]
        if options.eager_replay:
            warmup = prepared.warmups[variant][index]
            steps = SEAM.precision.replay(spec.fp8, fp8, warmup.framework_modules, spec.framework_modules,
                                          graphs=False)
            return EagerRunner(spec, warmup, steps, context(variant, index))
        return GraphRunner(spec, prepared.captured[variant][index], context(variant, index))

    return [
        GraphedCallable([runner(v, i) for v in range(len(spec_sets))], spec_sets[0][i], pool, frozen[i],
                        options.unseen_shape, order, lease)
        for i in range(len(spec_sets[0]))
    ]


def _replay_order(given: Any, pool: Any) -> ReplayOrder:
    """The ``ReplayOrder`` of the pool the graphs were captured into: a graphed callable's
    (``pool=`` one), the process's for a pool handle (also the one ``pool=`` names in eager
    replay, which captures nothing, so that it refuses what the graphs would), or a new one."""
    shared = graphed_callable_of(given) if given is not None else None
    if shared is not None:
        return shared.replay_order
    key = pool if pool is not None else (pool_handle(given, eager_replay=False) if given is not None else None)
    return RESOURCES.pool_state(key, ReplayOrder) if key is not None else ReplayOrder()