"""``make_graphed_callables``: the call users know from Transformer Engine and PyTorch.

This module only shapes the arguments: normalise the call forms and spellings, check
everything before anything changes, plan the run order, then hand off to ``capture``
(warmup and capture) and ``replay`` (the per-call path).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch

import rng

from . import checks
from .capture import GraphSpec, capture, make_spec
from .replay import EagerRunner, GraphedCallable, GraphRunner, install_on_module
from .schedule import plan_schedule

__all__ = ["make_graphed_callables", "eager_replay_default"]

_TE_ALIASES = {
    "_order": "order",
    "_num_layers_per_chunk": "num_layers_per_chunk",
    "_reuse_graph_input_output_buffers": "reuse_graph_input_output_buffers",
}
# Transformer Engine arguments accepted for drop-in calls, as long as FP8 stays off.
_TE_FP8_ARGS = ("fp8_enabled", "fp8_calibrating", "fp8_recipe", "fp8_group", "fp8_weight_caching", "enabled", "calibrating", "recipe", "amax_reduction_group", "cache_quantized_params")


def eager_replay_default() -> bool:
    """``TE_GRAPH_EAGER_REPLAY=1`` turns eager replay on for every call that does not say."""
    return os.environ.get("TE_GRAPH_EAGER_REPLAY", "0").strip() in ("1", "true", "True", "yes")


def make_graphed_callables(
    modules: Callable | Sequence[Callable],
    sample_args: Any,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs: Any = None,
    *,
    order: Sequence[int] | None = None,
    num_layers_per_chunk: int | Sequence[int] | None = None,
    pool: Any = None,
    retain_graph_in_backward: bool = False,
    reuse_graph_input_output_buffers: bool = False,
    accumulate_grads_in_graph: bool | None = None,
    eager_replay: bool | None = None,
    get_rng_state_tracker: Callable[[], Any] | None = None,
    **te_arguments: Any,
) -> Any:
    """Capture each callable's forward and backward as CUDA graphs; return graphed versions.

    Args:
        modules: a module or function, or a tuple/list of them (captured in that run order,
            sharing one memory pool).
        sample_args: per callable, a tuple of sample tensors (pytrees of tensors); a plain
            tuple of tensors when ``modules`` is a single callable. With ``order``, one
            tuple per (chunk, microbatch, layer), as Transformer Engine lays them out.
        num_warmup_iters: eager warmup passes before capture (at least 1).
        allow_unused_input: allow inputs that require grad but that no output depends on.
        sample_kwargs: per callable, a dict of keyword args (tensors or constants; a
            constant must have the same value at every call).
        order / num_layers_per_chunk: pipeline schedule (TE's ``_order`` and
            ``_num_layers_per_chunk``): one graph per (layer, microbatch).
        pool: memory pool handle to share with other captures.
        retain_graph_in_backward: keep the captured autograd graph so a backward can be
            replayed again (``retain_graph=True`` in training).
        reuse_graph_input_output_buffers: with ``order``, let later microbatches reuse static
            buffers of microbatches whose backward has run (an output is then valid only
            until its backward runs).
        accumulate_grads_in_graph: accumulate parameter grads inside the backward graph into
            persistent ``.grad`` buffers (default; fastest) rather than through autograd.
            Defaults to False when parameters carry a ``main_grad`` (Megatron DDP).
        eager_replay: run the same wrapper without graphs (debugging; works on CPU).
            Defaults to ``TE_GRAPH_EAGER_REPLAY``.
        get_rng_state_tracker: tracker whose streams the callables fork (default: ours).

    Returns:
        The graphed callables in the form given: modules keep their identity (their
        ``forward`` replays the graph in the training mode they were captured in and runs
        eagerly otherwise); functions become graphed functions. With ``order``, one graphed
        function per (chunk, microbatch, layer).
    """
    options = _normalise_options(
        te_arguments,
        order=order,
        num_layers_per_chunk=num_layers_per_chunk,
        reuse_graph_input_output_buffers=reuse_graph_input_output_buffers,
    )
    order = options["order"]
    if _is_pool_handle(sample_kwargs):
        # torch.cuda.make_graphed_callables takes the pool as its 5th positional argument.
        if pool is not None:
            raise TypeError("make_graphed_callables: got a pool handle positionally and pool=; pass one.")
        sample_kwargs, pool = None, sample_kwargs
    single = not isinstance(modules, (tuple, list))
    callables = (modules,) if single else tuple(modules)
    if single and order is None:
        sample_args = (sample_args,)
        sample_kwargs = (sample_kwargs,) if sample_kwargs is not None else None
    sample_args = tuple(tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in sample_args)
    sample_kwargs = tuple(dict(k or {}) for k in sample_kwargs) if sample_kwargs is not None else ({},) * len(sample_args)
    if eager_replay is None:
        eager_replay = eager_replay_default()
    if num_warmup_iters < 1:
        raise ValueError(
            f"make_graphed_callables: num_warmup_iters={num_warmup_iters}; at least 1 warmup "
            "pass is needed (it also learns which random streams each recomputed region uses)."
        )

    # -- checks: nothing has been changed yet ------------------------------------------
    checks.check_environment(eager_replay)
    checks.check_modules(callables)
    schedule = plan_schedule(len(callables), len(sample_args), order, options["num_layers_per_chunk"])
    checks.check_sample_kwargs(sample_args, sample_kwargs)
    if options["reuse_graph_input_output_buffers"] and order is None:
        raise ValueError(
            "make_graphed_callables: reuse_graph_input_output_buffers=True needs order=... "
            "(TE's _order): buffers are reused by forwards that run after an earlier "
            "microbatch's backward, and without a schedule no forward does."
        )
    grad_enabled = torch.is_grad_enabled()
    specs = [
        make_spec(
            _name(callables[slot.callable_index], slot.callable_index, slot.microbatch if order else None),
            callables[slot.callable_index],
            sample_args[slot.flat_index],
            sample_kwargs[slot.flat_index],
            grad_enabled,
            retain_graph_in_backward,
        )
        for slot in schedule.graphs
    ]
    checks.check_devices([s.func for s in specs], [s.layout for s in specs], eager_replay)
    if accumulate_grads_in_graph is None:
        accumulate_grads_in_graph = not any(hasattr(p, "main_grad") for s in specs for p in s.params)
    tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else rng.get_cuda_rng_tracker()

    # -- warmup and capture (restores everything it changes if it fails) -----------------
    capture(
        specs,
        schedule.steps,
        num_warmup_iters=num_warmup_iters,
        allow_unused_input=allow_unused_input,
        accumulate_grads_in_graph=accumulate_grads_in_graph or eager_replay,
        reuse_buffers=options["reuse_graph_input_output_buffers"] and not eager_replay,
        pool=pool,
        tracker=tracker,
        eager_replay=eager_replay,
    )

    # -- replay wrappers -----------------------------------------------------------------
    graphed = [_wrap(spec, accumulate_grads_in_graph, eager_replay) for spec in specs]
    if order is not None:
        return tuple(graphed)
    results = []
    for spec, function in zip(specs, graphed):
        if isinstance(spec.func, torch.nn.Module):
            install_on_module(spec.func, function)
            results.append(spec.func)
        else:
            results.append(function)
    return results[0] if single else tuple(results)


def _is_pool_handle(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value)


def _wrap(spec: GraphSpec, accumulate_grads_in_graph: bool, eager_replay: bool) -> GraphedCallable:
    runner = EagerRunner(spec) if eager_replay else GraphRunner(spec, accumulate_grads_in_graph)
    return GraphedCallable(runner, spec)


def _name(func: Callable, index: int, microbatch: int | None) -> str:
    kind = type(func).__name__ if isinstance(func, torch.nn.Module) else getattr(func, "__name__", "function")
    where = f"callable {index} ({kind})"
    return where if microbatch is None else f"{where}, microbatch {microbatch}"


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
