"""Graphing a megatron-core model's MoE layers for dropless routing: the capacities, the
span each layer takes (the experts alone, ``moe_experts``, or the dispatch around them,
``moe_dispatch``), the layer's own FP8 arguments, and what is refused before anything
changes."""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from ...api import make_graphed_callables
from ...capture import conditional
from ...extension import SEAM
from . import moe_dispatch
from .moe_dispatch import (
    agreed_refusal, block_rows, dispatch_refusal, distinct_blocks, expert_parallel_size, functions_refusal,
)
from .moe_experts import DroplessExperts, PaddedExperts, fp8_state
from .moe_switch import DeviceChosenDispatch

__all__ = ["graph_dropless_experts", "capacities_for"]


_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


_OVERFLOW_ROWS = {"padded": 128, "eager": None}  # rows per expert the overflow capacity rounds up to


_SPANS = ("auto", "experts", "dispatch")


_CHOICES = ("host", "device")


def capacities_for(tokens: int, topk: int, num_experts: int, factors: Sequence[float], multiple: int = 16) -> list[int]:
    """Token capacities per expert, ``factor`` times the even share ``tokens * topk /
    num_experts`` each, rounded up to ``multiple`` rows, at most ``tokens`` (top-k routing
    sends a token to an expert once; with expert parallelism, pass the tokens an expert's
    rank receives from all ranks)."""
    even = tokens * topk / num_experts
    return sorted({min(tokens, multiple * math.ceil(f * even / multiple)) for f in factors})


def graph_dropless_experts(
    model: torch.nn.Module,
    capacities: Sequence[int],
    *,
    tokens: Optional[int] = None,
    span: str = "auto",
    probs_dtype: Optional[torch.dtype] = None,
    overflow: str = "padded",
    choose: str = "host",
    recompute: bool = False,
    eager_replay: Optional[bool] = None,
    **graph_options: Any,
) -> list[DroplessExperts]:
    """Graph the routed experts of every megatron-core ``MoELayer`` in ``model`` for the
    token ``capacities`` (rows per local expert; see :func:`capacities_for`); the graphs of
    one layer share a pool (one capacity is in flight at a time), each layer has its own.
    Call it outside a training step, on a model in training mode; ``graph_options`` go to
    ``make_graphed_callables`` (``num_warmup_iters``; FP8 arguments, by default the layer's
    own: see :func:`_fp8_arguments`). Layers trained in FP4 are refused.

    ``span``: ``"experts"`` graphs the experts alone (any expert parallelism); ``"dispatch"``
    graphs from the dispatcher's permuted tokens to the combined output, the expert-parallel
    alltoalls included (:mod:`.moe_dispatch`: whole experts on each rank, ``tokens`` given,
    or it is refused, saying why); ``"auto"`` (default) takes ``"dispatch"`` for each layer
    that allows it and ``"experts"`` for the others. ``tokens``: the tokens one layer call routes (sequence x
    micro-batch); a call with another number runs megatron-core's own dispatch and experts.
    With the dispatch span over ``R`` expert-parallel ranks, a capacity is ``R`` blocks of
    ``ceil(capacity / R)`` rows per expert, one per rank, and serves a call whose every
    (rank, expert) share fits its block.
    ``probs_dtype``: the routing probabilities' dtype, by default megatron-core's
    ``moe_router_dtype`` where set, else the parameters' dtype. ``overflow``: a call above
    the largest capacity runs the padded program eagerly at a capacity rounded up to 128 rows
    ("padded": a few GEMM shapes that cuBLASLt has met before, where the counts' own shapes
    would cost a host-side algorithm search per GEMM at every call; more GEMM rows), or the
    experts' own forward ("eager": the unpadded GEMMs).
    ``choose``: ``"host"`` (default) picks the capacity's graph on the host from the routing
    counts (a sync per layer call); ``"device"`` makes no graphs of its own: each layer call
    runs one conditional node that picks the capacity on the GPU (:mod:`.moe_switch`), with
    ``tokens`` as the last capacity (nothing overflows), for the layer to be graphed whole
    after this call (Megatron's helper with an empty ``cuda_graph_modules``). It takes the
    dispatch span, one expert-parallel rank and no FP8; ``overflow``, ``eager_replay`` and
    ``graph_options`` belong to the layer's graphs then and are refused here. ``recompute``
    (with ``"device"`` only): the node's forward keeps no activations and its backward runs
    the bucket's program again first, so the pool holds one bucket's temporaries at a time
    instead of every bucket's activations, for a second forward of the experts.
    Returns one :class:`DroplessExperts` per layer (``remove()`` undoes it)."""
    if choose not in _CHOICES:
        raise ValueError(f"te_graph.graph_dropless_experts: choose={choose!r}; use 'host' or 'device'.")
    if not isinstance(recompute, bool):
        raise TypeError(f"te_graph.graph_dropless_experts: recompute must be a bool, not {type(recompute).__name__}.")
    if not capacities or any(int(c) <= 0 for c in capacities):
        raise ValueError(f"te_graph.graph_dropless_experts: capacities must be positive row counts, got {list(capacities)}.")
    if choose == "device":
        return _device_chosen(model, capacities, tokens, span, probs_dtype, overflow, recompute, eager_replay,
                              graph_options)
    if recompute:
        raise ValueError("te_graph.graph_dropless_experts: recompute=True runs the capacity's program again in "
                         "the backward of the node choose='device' makes; the host-chosen graphs do not take it.")
    layers = _moe_layers(model)
    if overflow not in _OVERFLOW_ROWS:
        raise ValueError(f"te_graph.graph_dropless_experts: overflow={overflow!r}; use 'padded' or 'eager'.")
    if span not in _SPANS:
        raise ValueError(f"te_graph.graph_dropless_experts: span={span!r}; use 'auto', 'experts' or 'dispatch'.")
    if tokens is not None and int(tokens) <= 0:
        raise ValueError(f"te_graph.graph_dropless_experts: tokens must be a positive count, got {tokens}.")
    if "pool" in graph_options:
        raise ValueError("te_graph.graph_dropless_experts: each layer's experts get a pool of their own (their "
                         "graphs replay in another order than they would be captured in across layers); leave "
                         "pool= unset.")
    wanted = sorted({int(c) for c in capacities}, reverse=True)
    plans = [_span_of(layer, span, tokens, wanted) for layer in layers]  # every refusal before anything is graphed
    # megatron-core DDP's forward pre-hooks, told apart by the code of one its wrapper makes
    # (megatron-core's helper makes its manual hooks so), else by the helper's manual hooks
    # of the layer holding each MoE layer as its MLP.
    make_hook = getattr(model, "_make_forward_pre_hook", None)
    ddp_hook = make_hook() if callable(make_hook) else None
    owners = {id(m.mlp): m for m in model.modules() if isinstance(getattr(m, "mlp", None), torch.nn.Module)}
    installed: list[DroplessExperts] = []
    try:
        for layer, (layer_span, layer_capacities) in zip(layers, plans):
            installed.append(_install(layer, owners.get(id(layer)), ddp_hook, layer_span, layer_capacities, tokens,
                                      probs_dtype, _OVERFLOW_ROWS[overflow], eager_replay, graph_options))
    except BaseException:
        for done in installed:  # a failure leaves the model as it was
            done.remove()
        raise
    return installed


def _moe_layers(model: torch.nn.Module) -> list:
    layers = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "token_dispatcher")]
    if not layers:
        raise ValueError("te_graph.graph_dropless_experts: the model holds no megatron-core MoELayer (a module "
                         "with .experts and .token_dispatcher).")
    return layers


def _device_chosen(model: torch.nn.Module, capacities: Sequence[int], tokens: Optional[int], span: str,
                   probs_dtype: Optional[torch.dtype], overflow: str, recompute: bool, eager_replay: Optional[bool],
                   graph_options: dict) -> list[DroplessExperts]:
    """``choose="device"``: every refusal first, then one :class:`DeviceChosenDispatch` per layer."""
    where = "te_graph.graph_dropless_experts(choose='device')"
    given = [name for name, value in (("overflow", overflow != "padded"), ("eager_replay", eager_replay is not None),
                                      *((n, True) for n in graph_options)) if value]
    if given:
        raise ValueError(f"{where}: {', '.join(given)} belong to the graphs of the whole layer, which this call "
                         "does not make; pass them where the layer is graphed.")
    if span not in ("auto", "dispatch"):
        raise ValueError(f"{where}: the node holds the dispatch, experts and combine (span='dispatch'); "
                         f"span={span!r} is not supported.")
    if tokens is None or int(tokens) <= 0:
        raise ValueError(f"{where}: tokens= (the tokens one layer call routes, a positive count) is needed: the "
                         "last capacity holds all of them.")
    layers = _moe_layers(model)
    for layer in layers:
        ranks = expert_parallel_size(layer.token_dispatcher)
        if ranks > 1:
            raise ValueError(f"{where}: the experts are split over {ranks} expert-parallel ranks; the ranks would "
                             "have to agree on the capacity on the GPU and exchange tokens outside the node's "
                             "bodies, which is not built. Use choose='host'.")
        if getattr(layer.config, "fp8", None) or getattr(layer.config, "fp4", None):
            raise ValueError(f"{where}: the layers train in FP8 or FP4, not yet proven with the capacity chosen on "
                             "the GPU. Use choose='host'.")
    largest_first = sorted({min(int(c), int(tokens)) for c in capacities} | {int(tokens)}, reverse=True)
    plans = [_span_of(layer, "dispatch", int(tokens), largest_first, "Use choose='host'") for layer in layers]
    for device in {next(layer.experts.parameters()).device for layer in layers}:
        if device.type == "cuda":  # outside any capture: the set kernel and the body stream
            conditional.prepare(device.index)
    installed: list[DroplessExperts] = []
    try:
        for layer, (_, fitting) in zip(layers, plans):
            program = _padded_dispatch(layer, _padded_experts(layer), moe_dispatch.expert_exchange(layer))
            installed.append(DeviceChosenDispatch(layer, program, fitting, _dtypes(layer, probs_dtype), int(tokens),
                                                  recompute))
    except BaseException:
        for done in installed:
            done.remove()
        raise
    return installed


def _span_of(layer: torch.nn.Module, span: str, tokens: Optional[int], largest_first: list[int],
             way_out: str = "Use span='experts' (or 'auto')") -> tuple[str, list]:
    """The span graphed for this layer and its capacities, or the refusal (ValueError) of
    what was asked."""
    _check_layer(layer)
    if span == "experts":
        return span, largest_first
    why, fitting, left_out = dispatch_refusal(layer), largest_first, []
    if why is None and tokens is None:
        why = "tokens= (the tokens one layer call routes) was not given"
    if why is None:
        # The busiest expert gets at least the even share of a rank's tokens from that rank: a
        # capacity whose blocks (rows per expert per rank of the expert-parallel group) are
        # smaller never holds a call (and no sample routing fits it). Left out, not refused.
        config = layer.config
        ranks = expert_parallel_size(layer.token_dispatcher)
        even = math.ceil(tokens * config.moe_router_topk / config.num_moe_experts)
        fitting = [c for c in largest_first if block_rows(c, ranks) >= even]
        share = (f"the even share of {even} rows per expert ({tokens} tokens, top-{config.moe_router_topk} of "
                 f"{config.num_moe_experts} experts)")
        if ranks > 1:
            share += f" from each of {ranks} expert-parallel ranks, {ranks * even} rows in all"
        if not fitting:
            why = f"every capacity is below {share}, which no routing fits"
        elif len(fitting) < len(largest_first):
            left_out.append(f"capacities {sorted(set(largest_first) - set(fitting))} are below {share}, so no "
                            "call fits them")
        fitting, merged = distinct_blocks(fitting, ranks)
        if merged:
            left_out.append(f"capacities {sorted(merged)} take the blocks of a smaller one over {ranks} "
                            f"expert-parallel ranks (capacity / {ranks} rows per rank, rounded up), whose graph "
                            "serves their calls")
    if why is None:
        why = functions_refusal(layer)
    why = agreed_refusal(layer, why)  # the same span on every rank of the expert-parallel group
    if why is None:
        for what in left_out:
            warnings.warn(f"te_graph.graph_dropless_experts: {what}: they are not graphed.", stacklevel=3)
        return "dispatch", fitting
    if span == "dispatch":
        raise ValueError(f"te_graph.graph_dropless_experts: span='dispatch' cannot graph this layer's dispatch: "
                         f"{why}. {way_out}.")
    return "experts", largest_first


def _install(layer: torch.nn.Module, owner: Optional[torch.nn.Module], ddp_hook: Optional[Callable], span: str,
             largest_first: list[int], tokens: Optional[int], probs_dtype: Optional[torch.dtype],
             overflow_rows: Optional[int], eager_replay: Optional[bool], graph_options: dict) -> DroplessExperts:
    experts = layer.experts
    num_experts = experts.num_local_experts
    hidden_size = layer.config.hidden_size
    device = next(experts.parameters()).device
    dtype, probs = _dtypes(layer, probs_dtype)
    padded = _padded_experts(layer, owner, ddp_hook)
    if span == "dispatch":
        exchange = moe_dispatch.expert_exchange(layer)
        program: torch.nn.Module = _padded_dispatch(layer, padded, exchange)
        samples = moe_dispatch.dispatch_samples(layer, tokens, (dtype, probs), largest_first)
    else:
        program = padded
        samples = [(torch.zeros(num_experts * c, hidden_size, device=device, dtype=dtype, requires_grad=True),
                    torch.zeros(num_experts * c, device=device, dtype=probs, requires_grad=True)) for c in largest_first]
    fp8 = _fp8_arguments(layer) if not any(name in graph_options for name in SEAM.precision.argument_names) else {}
    graphed = make_graphed_callables(program, samples[0], more_shapes=samples[1:], eager_replay=eager_replay,
                                              **fp8, **graph_options)
    enabled = bool(fp8.get("enabled", graph_options.get("enabled", graph_options.get("fp8_enabled", False))))
    # The program without graphs (graphing put the graphed callable on the instance).
    eager_program = type(program).forward.__get__(program)
    if span == "dispatch":
        return moe_dispatch.DroplessDispatch(layer, graphed, eager_program, largest_first, (dtype, probs), enabled,
                                             overflow_rows, tokens, exchange)
    return DroplessExperts(experts, graphed, eager_program, largest_first, num_experts, (dtype, probs), enabled,
                           overflow_rows)


def _dtypes(layer: torch.nn.Module, probs_dtype: Optional[torch.dtype]) -> tuple:
    """The (tokens, routing probabilities) dtypes of the layer's calls."""
    # The tokens come in the parameters' dtype (megatron-core's Float16Module casts the
    # parameters, whatever config.params_dtype says).
    dtype = next(layer.experts.parameters()).dtype
    # The router computes in moe_router_dtype where set, else in the activations' dtype,
    # and dispatch permutes its probabilities as they are.
    return dtype, probs_dtype or _ROUTER_DTYPES.get(getattr(layer.config, "moe_router_dtype", None), dtype)


def _padded_experts(layer: torch.nn.Module, owner: Optional[torch.nn.Module] = None,
                    ddp_hook: Optional[Callable] = None) -> PaddedExperts:
    """The layer's experts on the padded layout, through their class's forward."""
    experts = layer.experts
    return PaddedExperts(experts, type(experts).forward.__get__(experts), experts.num_local_experts, owner, ddp_hook)


def _padded_dispatch(layer: torch.nn.Module, padded: PaddedExperts,
                     exchange: moe_dispatch.ExpertExchange) -> moe_dispatch.PaddedDispatch:
    """From the dispatcher's permuted tokens to the combined output, with its own un-permutation."""
    return moe_dispatch.PaddedDispatch(padded, moe_dispatch.module_of(layer.token_dispatcher).unpermute,
                                       bool(layer.config.moe_permute_fusion), exchange)


def _fp8_arguments(layer: torch.nn.Module) -> dict:
    """The FP8 arguments of the layer's experts' graphs: what megatron-core's own autocast
    around the layer uses (``fp8_utils.get_fp8_context``: the config's recipe, the amax
    reduction group, bf16 for the first and last layers where asked); empty without FP8."""
    config = layer.config
    if not getattr(config, "fp8", None):
        return {}
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.fp8_utils import get_fp8_recipe, is_first_last_bf16_layer  # noqa: PLC0415

    number = getattr(layer, "layer_number", None)
    if is_first_last_bf16_layer(config, number - 1 if number is not None else -1):
        return {"enabled": False}
    group = None
    if parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_amax_reduction_group(
            with_context_parallel=True, tp_only_amax_red=getattr(config, "tp_only_amax_red", False))
    # The captured weight casts read TE's "skip the weight update" device flag only where it
    # exists at capture (TE 2.20 GroupedLinear.forward); without it they would keep the FP8
    # weights of capture time. Create it (False: quantize), as TE's graphs with weight
    # caching do; each call sets it (DroplessExperts.forward).
    if fp8_state().get_skip_fp8_weight_update_tensor() is None:
        fp8_state().set_skip_fp8_weight_update_tensor(False)
    return {"enabled": True, "recipe": get_fp8_recipe(config), "amax_reduction_group": group}


def _check_layer(layer: torch.nn.Module) -> None:
    """What graph_dropless_experts refuses, with the reason (before anything changes)."""
    experts, config = layer.experts, layer.config
    name = type(experts).__name__
    if any(isinstance(getattr(method, "__self__", None), DroplessExperts)
           for method in (experts.forward, getattr(layer, "routed_experts_compute", None))):
        raise ValueError("te_graph.graph_dropless_experts: these experts are graphed already; remove() first.")
    if "forward" in experts.__dict__:
        raise ValueError(
            f"te_graph.graph_dropless_experts: the {name} module has a forward of its own, set on the instance "
            "(torch.compile, an adapter, a wrapper); its graphs would run the class's forward and its eager calls "
            "that one. Graph the experts before replacing their forward, or leave them eager.")
    if getattr(experts, "num_local_experts", None) is None or next(experts.parameters(), None) is None:
        raise ValueError(f"te_graph.graph_dropless_experts: {name} is not a megatron-core experts module "
                         "(no num_local_experts or no parameters).")
    unsupported = [
        (getattr(config, "fp4", None),
         # FP4 needs a Blackwell GPU; its padding and recipe were never run here.
         f"the layers train in FP4 (fp4_recipe={getattr(config, 'fp4_recipe', None)!r}), which was never tried "
         "with capacity graphs. Leave the experts eager (the layers' graphs up to token dispatch support it)"),
        # A capacity factor without padding drops tokens but leaves the counts dynamic (at
        # most the capacity): the capacity graphs serve those calls as dropless ones.
        (getattr(config, "moe_expert_capacity_factor", None) is not None
         and getattr(config, "moe_pad_expert_input_to_capacity", False),
         "the layers route with a capacity factor (drop-and-pad), whose experts already get static shapes: "
         "graph the whole layer instead (an empty cuda_graph_modules)"),
        (getattr(config, "delay_wgrad_compute", False),
         "the experts delay their weight gradients (delay_wgrad_compute): Megatron's experts.backward_dw() "
         "would find no queued work after a replay"),
        (getattr(config, "moe_latent_size", None),
         "the experts work in a latent width (moe_latent_size), which is not supported yet"),
    ]
    for refused, why in unsupported:
        if refused:
            raise ValueError(f"te_graph.graph_dropless_experts: {why}.")

