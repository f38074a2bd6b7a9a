"""``make_graphed_callables``: the call users know from Transformer Engine and PyTorch.

This module only shapes the arguments: normalise the call forms and spellings, check
everything before anything changes, plan the run order, then hand off to ``capture``
(warmup and capture) and ``replay`` (the per-call path).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar, overload

import torch

import rng

from . import checks
from .capture import CaptureOptions, GraphSpec, capture, make_spec
from .hooks import normalise_capture_time_hooks
from .replay import (
    LIVE_CALLABLES,
    Clock,
    EagerRunner,
    GraphedCallable,
    GraphRunner,
    ReplayOptions,
    graphed_callable_of,
    install_on_module,
)
from .schedule import plan_schedule

__all__ = ["make_graphed_callables", "eager_replay_default", "Samples", "reset", "graph_pool_handle"]

_TE_ALIASES = {
    "_order": "order",
    "_num_layers_per_chunk": "num_layers_per_chunk",
    "_reuse_graph_input_output_buffers": "reuse_graph_input_output_buffers",
}
# Transformer Engine arguments accepted for drop-in calls, as long as FP8 stays off.
_TE_FP8_ARGS = ("fp8_enabled", "fp8_calibrating", "fp8_recipe", "fp8_group", "fp8_weight_caching", "enabled", "calibrating", "recipe", "amax_reduction_group", "cache_quantized_params")
_CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")

M = TypeVar("M", bound=torch.nn.Module)
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Samples:
    """One more shape to capture (``more_shapes=``): sample args laid out like
    ``sample_args``, and optionally sample kwargs laid out like ``sample_kwargs``."""

    args: Any
    kwargs: Any = None


def eager_replay_default() -> bool:
    """``TE_GRAPH_EAGER_REPLAY=1`` turns eager replay on for every call that does not say."""
    return os.environ.get("TE_GRAPH_EAGER_REPLAY", "0").strip() in ("1", "true", "True", "yes")


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
    **te_arguments: Any,
) -> Any:
    """Capture each callable's forward and backward as CUDA graphs; return graphed versions.

    Args:
        modules: a module or function, or a tuple/list of them (captured in that run order,
            sharing one memory pool). ``callables=`` is torch's name for it.
        sample_args: per callable, a tuple of sample tensors (pytrees of tensors); a plain
            tuple of tensors when ``modules`` is a single callable. With ``order``, one
            tuple per (chunk, microbatch, layer), as Transformer Engine lays them out.
        num_warmup_iters: eager warmup passes before capture (at least 1).
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
        get_rng_state_tracker: tracker whose streams the callables fork (default: ours).

    Returns:
        The graphed callables in the form given: modules keep their identity (their
        ``forward`` replays the graph in the training mode they were captured in and runs
        eagerly otherwise; ``module.forward.reset()`` frees the graphs); functions become
        graphed functions. With ``order``, one graphed function per (chunk, microbatch,
        layer).
    """
    # -- the call forms ------------------------------------------------------------------
    if callables is not None:
        if modules is not None:
            raise TypeError("make_graphed_callables: got both modules and callables=; pass one of them.")
        modules = callables
    if modules is None or sample_args is None:
        raise TypeError("make_graphed_callables() needs the callables and their sample_args.")
    options = _normalise_options(
        te_arguments,
        order=order,
        num_layers_per_chunk=num_layers_per_chunk,
        reuse_graph_input_output_buffers=reuse_graph_input_output_buffers,
    )
    order = options["order"]
    if sample_kwargs is not None and _looks_like_pool(sample_kwargs):
        # torch.cuda.make_graphed_callables takes the pool as its 5th positional argument.
        if pool is not None:
            raise TypeError("make_graphed_callables: got a pool positionally and pool=; pass one.")
        sample_kwargs, pool = None, sample_kwargs
    if eager_replay is None:
        eager_replay = eager_replay_default()

    # -- checks: nothing has been changed yet ------------------------------------------
    pool = _pool_handle(pool, eager_replay)
    callables_ = checks.check_callables(modules)
    single = not isinstance(modules, (tuple, list))
    checks.check_warmup_iters(num_warmup_iters)
    if capture_error_mode not in _CAPTURE_ERROR_MODES:
        raise ValueError(
            f"make_graphed_callables: capture_error_mode={capture_error_mode!r}; use one of "
            f"{', '.join(map(repr, _CAPTURE_ERROR_MODES))}."
        )
    if unseen_shape not in ("error", "eager"):
        raise ValueError(f"make_graphed_callables: unseen_shape={unseen_shape!r}; use 'error' or 'eager'.")
    if order is not None and any(not isinstance(c, bool) and isinstance(c, float) and not float(c).is_integer() for c in order):
        raise NotImplementedError(
            "make_graphed_callables: order holds fractional entries (Transformer Engine's "
            "wgrad-split schedule, -c-0.5 with backward_dw()). Splitting a plain module's "
            "weight-gradient work out of its backward is not supported: autograd computes "
            "input and weight gradients in the same nodes. Use the integer order (each "
            "backward then includes its weight gradients)."
        )
    checks.check_environment(eager_replay)
    checks.check_modules(callables_)
    variants = [(sample_args, sample_kwargs)] + [_variant(v) for v in more_shapes]
    normalised = [
        _normalise_samples(a, k, single and order is None, len(callables_)) for a, k in variants
    ]
    normalised = _same_keywords(normalised, [k is None for _, k in variants])
    schedule = plan_schedule(len(callables_), len(normalised[0][0]), order, options["num_layers_per_chunk"])
    for args, kwargs in normalised[1:]:
        if len(args) != len(normalised[0][0]):
            raise ValueError(
                f"make_graphed_callables: a more_shapes entry has {len(args)} sample args but "
                f"sample_args has {len(normalised[0][0])}; lay each entry out like sample_args."
            )
    for args, kwargs in normalised:
        checks.check_sample_kwargs(args, kwargs)
    if options["reuse_graph_input_output_buffers"] and order is None:
        raise ValueError(
            "make_graphed_callables: reuse_graph_input_output_buffers=True needs order=... "
            "(TE's _order): buffers are reused by forwards that run after an earlier "
            "microbatch's backward, and without a schedule no forward does."
        )
    owners = [_name(c, i) for i, c in enumerate(callables_)]
    hooks = normalise_capture_time_hooks(capture_time_hooks, owners)
    grad_enabled = torch.is_grad_enabled()
    spec_sets = [
        [
            make_spec(
                owners[slot.callable_index] + (f", microbatch {slot.microbatch}" if order else ""),
                owners[slot.callable_index],
                callables_[slot.callable_index],
                args[slot.flat_index],
                kwargs[slot.flat_index],
                grad_enabled,
                retain_graph_in_backward,
                hooks[slot.callable_index],
            )
            for slot in schedule.graphs
        ]
        for args, kwargs in normalised
    ]
    _check_distinct_shapes(spec_sets)
    for specs in spec_sets:
        checks.check_devices([s.func for s in specs], [s.layout for s in specs], eager_replay)
    tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else rng.get_cuda_rng_tracker()
    if pool is None and not eager_replay:
        pool = torch.cuda.graph_pool_handle()

    # -- warmup and capture (restores everything it changes if it fails) ----------------
    # The largest shape first: later (smaller) captures then fit into the memory it freed.
    capture(
        sorted(spec_sets, key=_size, reverse=True),
        schedule.steps,
        CaptureOptions(
            num_warmup_iters=num_warmup_iters,
            allow_unused_input=allow_unused_input,
            reuse_buffers=options["reuse_graph_input_output_buffers"] and not eager_replay,
            chain_grads=order is None,
            pool=pool,
            tracker=tracker,
            eager_replay=eager_replay,
            capture_error_mode=capture_error_mode,
            pre_warmup_hook=pre_warmup_hook,
            post_warmup_hook=post_warmup_hook,
        ),
    )

    # -- replay wrappers -----------------------------------------------------------------
    replay = ReplayOptions(
        always_autograd=accumulate_grads_in_graph is False, clone_param_grads=clone_param_grads_on_return
    )
    clock = Clock() if len(spec_sets) > 1 else None
    runner_type = EagerRunner if eager_replay else GraphRunner
    graphed = [
        GraphedCallable(
            [runner_type(specs[i], replay, clock, variant) for variant, specs in enumerate(spec_sets)],
            spec_sets[0][i], pool, unseen_shape,
        )
        for i in range(len(spec_sets[0]))
    ]
    if order is not None:
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
    when given all it returned. With no argument, every graphed callable of the process.
    Their pool memory goes back once no graph uses it; later calls of them raise.

    Call it before ``torch.distributed.destroy_process_group()``: destroying a process
    group while graphs that captured its NCCL collectives are alive hangs both ranks
    (measured on 2 H200s, torch 2.11, NCCL 2.28).
    """
    if not graphed:
        for callable_ in list(LIVE_CALLABLES):
            callable_.reset()
        return
    for obj in graphed:
        if isinstance(obj, (tuple, list)):
            reset(*obj)
            continue
        callable_ = graphed_callable_of(obj)
        if callable_ is None:
            raise TypeError(
                f"te_graph.reset(): {type(obj).__name__} is not a graphed callable or a module "
                "graphed by make_graphed_callables."
            )
        callable_.reset()


# -- argument shaping -------------------------------------------------------------------
def _variant(entry: Any) -> tuple[Any, Any]:
    return (entry.args, entry.kwargs) if isinstance(entry, Samples) else (entry, None)


def _normalise_samples(sample_args: Any, sample_kwargs: Any, single: bool, num_callables: int) -> tuple[tuple, tuple]:
    """Per graph, a tuple of sample args and a dict of sample kwargs."""
    if isinstance(sample_args, torch.Tensor) and not single:
        raise TypeError(
            f"make_graphed_callables: sample_args is a single tensor for {num_callables} "
            "callables; give a tuple with one tuple of sample tensors per callable, e.g. "
            "tuple((x,) for _ in modules)."
        )
    if single:
        sample_args = (sample_args,)
        sample_kwargs = (sample_kwargs,) if sample_kwargs is not None else None
    elif isinstance(sample_kwargs, Mapping):
        raise TypeError(
            "make_graphed_callables: sample_kwargs is one dict, but several callables were "
            "given; pass a tuple with one dict per callable (the same layout as sample_args)."
        )
    if not isinstance(sample_args, (tuple, list)):
        raise TypeError(
            f"make_graphed_callables: sample_args is a {type(sample_args).__name__}; give a "
            "tuple with one tuple of sample tensors per callable."
        )
    args = tuple(tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in sample_args)
    if sample_kwargs is None:
        return args, ({},) * len(args)
    if not isinstance(sample_kwargs, (tuple, list)):
        raise TypeError(
            f"make_graphed_callables: sample_kwargs is a {type(sample_kwargs).__name__}; give a "
            "tuple with one dict per callable."
        )
    return args, tuple(dict(k or {}) for k in sample_kwargs)


def _same_keywords(normalised: list[tuple[tuple, tuple]], plain: list[bool]) -> list[tuple[tuple, tuple]]:
    """Every sample set has the keywords of ``sample_kwargs``: a ``more_shapes`` entry
    without kwargs takes them when they hold no tensor (tensors change shape with the
    sample set); keys and constants must match, since a call's keywords pick no graph."""
    base_args, base_kwargs = normalised[0]
    result = [normalised[0]]
    for number, ((args, kwargs), no_kwargs) in enumerate(zip(normalised[1:], plain[1:]), start=1):
        if no_kwargs and any(base_kwargs):
            if any(isinstance(v, torch.Tensor) for k in base_kwargs for v in k.values()):
                raise ValueError(
                    f"make_graphed_callables: more_shapes entry {number - 1} has no sample kwargs, "
                    "but sample_kwargs holds tensors, whose shapes follow the sample set; give "
                    "that entry as te_graph.Samples(args, kwargs)."
                )
            kwargs = base_kwargs
        for slot, (mine, base) in enumerate(zip(kwargs, base_kwargs)):
            constants = {k: v for k, v in base.items() if not isinstance(v, torch.Tensor)}
            same_constants = all(
                key in mine and not isinstance(mine[key], torch.Tensor) and mine[key] == value
                for key, value in constants.items()
            )
            if mine.keys() != base.keys() or not same_constants:
                raise ValueError(
                    f"make_graphed_callables: the sample kwargs of more_shapes entry {number - 1} "
                    f"(graph {slot}) have keys {sorted(mine)} and constants "
                    f"{ {k: v for k, v in mine.items() if not isinstance(v, torch.Tensor)} }, but "
                    f"sample_kwargs has {sorted(base)} and {constants}; every shape must take the "
                    "same keywords and the same constant values (only tensor shapes may differ)."
                )
        result.append((args, kwargs))
    return result


def _check_distinct_shapes(spec_sets: list[list[GraphSpec]]) -> None:
    for i in range(len(spec_sets[0])):
        shapes = [tuple(t.shape for t in specs[i].layout.samples) for specs in spec_sets]
        if len(set(shapes)) != len(shapes):
            raise ValueError(
                f"make_graphed_callables: more_shapes repeats the sample shapes of "
                f"{spec_sets[0][i].name}; each sample set must have its own shapes (the shapes "
                "pick the graph at call time)."
            )


def _size(specs: list[GraphSpec]) -> int:
    return sum(t.numel() for s in specs for t in s.layout.samples)


def _looks_like_pool(value: Any) -> bool:
    return (
        _is_handle(value)
        or _is_mempool(value)
        or graphed_callable_of(value) is not None
    )


def _is_handle(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value)


def _is_mempool(value: Any) -> bool:
    mempool = getattr(torch.cuda, "MemPool", None)
    return mempool is not None and isinstance(value, mempool)


def _pool_handle(pool: Any, eager_replay: bool) -> Optional[tuple[int, int]]:
    """A capture pool handle from anything ``pool=`` accepts (None in eager replay)."""
    if pool is None or _is_handle(pool):
        return None if eager_replay else pool
    if _is_mempool(pool):
        return None if eager_replay else pool.id
    graphed = graphed_callable_of(pool)
    if graphed is not None:
        if eager_replay:
            return None
        if graphed.pool is None:
            raise ValueError(
                "make_graphed_callables: pool= names a graphed callable made in eager replay, "
                "which has no memory pool; pass a graph_pool_handle() instead."
            )
        return graphed.pool
    raise TypeError(
        f"make_graphed_callables: pool is a {type(pool).__name__}; pass te_graph.graph_pool_handle(), "
        "a torch.cuda.MemPool, or a graphed callable whose pool to share."
    )


def _name(func: Callable, index: int) -> str:
    kind = type(func).__name__ if isinstance(func, torch.nn.Module) else getattr(func, "__name__", "function")
    return f"callable {index} ({kind})"


def _normalise_options(te_arguments: dict, **ours: Any) -> dict:
    """Accept Transformer Engine's spellings (``_order`` etc.) for the same options."""
    options = dict(ours)
    for name, value in te_arguments.items():
        if name in _TE_ALIASES:
            target = _TE_ALIASES[name]
            if options[target] not in (None, False) and value not in (None, False):
                raise TypeError(
                    f"make_graphed_callables: got both {target}= and {name}=; pass one of them."
                )
            if value not in (None, False):
                options[target] = value
        elif name in _TE_FP8_ARGS:
            if value not in (None, False):
                raise NotImplementedError(
                    f"make_graphed_callables: FP8 capture is not supported ({name}={value!r}); "
                    "call Transformer Engine's make_graphed_callables for FP8 layers, or leave "
                    "the fp8 arguments off."
                )
        else:
            raise TypeError(f"make_graphed_callables() got an unexpected keyword argument {name!r}")
    return options

