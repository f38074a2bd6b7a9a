"""Dropless mixture-of-experts experts inside graphs: one graph per token capacity.

With dropless routing, how many tokens each expert gets is known only after routing, on the
host (megatron-core's dispatcher brings the counts there), so the experts' computation has no
static shape, and peers run it eagerly or drop tokens beyond a fixed capacity. Here it is
captured for a few token capacities instead: per expert ``C`` rows, the real tokens first and
zero rows after them (largest capacity first, one pool per layer). At each call the counts pick the
smallest capacity that holds every expert's tokens; the tokens are laid out ``C`` rows per
expert, that graph replays and the real rows are gathered back. No token is ever dropped:
above the largest capacity the same padded program runs eagerly (``overflow``), as it does
while an earlier call of the layer still waits for its backward (several microbatches in
flight, a pipeline schedule: the graphs of a layer share their buffers), and outside
training the experts' own forward runs.

Numerics: a call equals te_graph's eager replay of the same program bitwise (the padded
layout, run without graphs). Against the unpadded eager experts, the real rows see other GEMM
shapes (``C`` rows per expert instead of the count), so cuBLAS may pick other kernels and
round differently; benchmarks/bench_moe.py and tests/test_megatron_path.py report by how much.

FP8 (megatron-core's ``fp8`` config, any recipe TE graphs): the graphs are made with the
layer's recipe and amax reduction group, as Megatron's own autocast uses them, and each call
does around its replay the per-call Python state the eager TE wrappers would have changed
(the weight-cache flag, ``is_first_microbatch``): see :meth:`DroplessExperts._replay`.

The graphs can hold the dispatcher's work around the experts too (the padding's row indices,
the pad and gather, with expert parallelism the alltoalls, the un-permutation, and their
backward): ``span="dispatch"``, in :mod:`.moe_dispatch`, taken by default where a layer
allows it (megatron-core's alltoall dispatcher, whole experts on each rank).

The experts module keeps its identity, parameters and names: only its ``forward`` (the
dispatch span: three ``MoELayer`` methods) is replaced on the instance, and
:meth:`DroplessExperts.remove` puts it back.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from checkpointing.recompute_state import cuda_stream_capturing

from .. import compat
from ..graphed import graphed_callable_of
from ..te_support import FP8_ARGUMENTS, keeps_weight_cache
from . import megatron

__all__ = ["DroplessExperts", "graph_dropless_experts", "capacities_for", "padded_layout", "skips_weight_update"]

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
_OVERFLOW_ROWS = {"padded": 128, "eager": None}  # rows per expert the overflow capacity rounds up to
_SPANS = ("auto", "experts", "dispatch")


class _Padded(torch.nn.Module):
    """The experts on a padded layout: ``hidden`` holds ``C`` rows per local expert.
    ``ddp_hook``: a forward pre-hook made by the megatron-core DDP wrapping the model (its
    code tells DDP's hooks apart), else None; then ``owner``, the megatron-core layer holding
    the experts (or None), tells them apart by its helper's manual hooks."""

    # Graphed alone (span "experts"), these graphs replay inside the experts module's own
    # forward, which megatron-core calls through nn.Module.__call__: hooks on that module run
    # around the replay as they run around its eager forward (``frozen.hooks_outside_graphs``).
    # Inside the dispatch span's graphs the experts are not called at all: there this does
    # not apply (it is read of the graphed module only).
    _hooks_run_around = ("experts",)

    def __init__(self, experts: torch.nn.Module, forward: Callable, num_experts: int,
                 owner: Optional[torch.nn.Module] = None, ddp_hook: Optional[Callable] = None):
        super().__init__()
        self.experts = experts
        self._forward = forward  # the class's forward, bound (the instance's is replaced)
        self.num_experts = num_experts
        self._by_hand = _DDPHooksByHand(owner, ddp_hook, modules_with_parameters(experts))

    @property
    def cuda_graph_manual_hooks(self) -> Optional[list]:
        """The forward pre-hooks of megatron-core's DDP these graphs run by hand
        (:class:`_DDPHooksByHand`), as megatron-core's helper lists its own."""
        return self._by_hand.listed()

    def forward(self, hidden: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        capacity = hidden.shape[0] // self.num_experts
        counts = torch.full((self.num_experts,), capacity, dtype=torch.long)  # on the host, as dispatch gives it
        output, bias = self._forward(hidden, counts, probs)
        if bias is not None:
            raise ValueError("te_graph.graph_dropless_experts: the experts return a bias; only experts without "
                             "one (add_bias_linear=False, as megatron-core's alltoall dispatcher requires) are graphed.")
        return output


class _DDPHooksByHand:
    """The forward pre-hooks of megatron-core's DDP (``overlap_param_gather``) that the
    capacity graphs run by hand before each replay (:meth:`DroplessExperts._run_ddp_pre_hooks`),
    listed as megatron-core's helper lists its own (``cuda_graph_manual_hooks``): DDP's hook with
    each of the experts' submodules with parameters of their own, so that DDP's hooks there
    pass the per-call check (``integrations.megatron.hooks_run_by_hand``). DDP's hook is one
    made by the DDP wrapping the model (``ddp_hook``), else one the helper of the layer
    holding the experts (``owner``) runs; no list without either. One list object per hook:
    the per-call check goes by its identity."""

    def __init__(self, owner: Optional[torch.nn.Module], ddp_hook: Optional[Callable], modules: list):
        self.owner, self.ddp_hook, self.modules = owner, ddp_hook, modules
        self._listed: Optional[list] = None

    def listed(self) -> Optional[list]:
        hook = self.ddp_hook
        if hook is None:
            owners = megatron.manual_hooks(self.owner)
            hook = owners[0][0] if owners else None
        if hook is None:
            return None
        if self._listed is None or (self._listed and self._listed[0][0] is not hook):
            self._listed = [(hook, (m,)) for m in self.modules]
        return self._listed


class DroplessExperts:
    """What :func:`graph_dropless_experts` installed on one MoE layer: its capacity graphs
    (``graphed``), the count of calls served by each capacity's graph (``calls``) and
    eagerly (``eager_calls``), and ``span``: ``"experts"`` (the experts' forward replays a
    graph of the experts alone) or ``"dispatch"`` (:class:`moe_dispatch.DroplessDispatch`:
    from the permuted tokens to the combined output)."""

    span = "experts"

    def __init__(self, experts: torch.nn.Module, graphed: torch.nn.Module, padded: Callable,
                 capacities: Sequence[int], num_experts: int, dtypes: tuple, fp8: bool, overflow_rows: Optional[int]):
        self.experts = experts
        self.graphed = graphed
        self.padded = padded  # the padded program, run eagerly (above the largest capacity)
        self.overflow_rows = overflow_rows  # None: the experts' own forward there
        self.capacities = tuple(sorted(capacities))
        self.num_experts = num_experts
        self.dtypes = dtypes  # (tokens, probabilities) as captured
        self.fp8 = fp8  # graphed with FP8: each replay sets TE's weight-cache flag
        self.calls = {c: 0 for c in self.capacities}
        self.eager_calls = 0
        # megatron-core's TE wrappers keep an ``is_first_microbatch`` flag that their eager
        # forward clears (``TEGroupedLinear.forward``) and that Megatron sets again at each
        # step's first microbatch under FP8 (``MegatronModule.set_is_first_microbatch``).
        self._first_microbatch_flags = [m for m in experts.modules() if hasattr(m, "is_first_microbatch")]
        self._install()

    def _install(self) -> None:
        self.experts.forward = self.forward

    def forward(self, hidden: torch.Tensor, tokens_per_expert: Any, probs: torch.Tensor, **kwargs: Any) -> tuple:
        counts = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else list(tokens_per_expert)
        capacity = self._capacity(max(counts, default=0))
        # The experts' own forward: outside training, with keywords the graphs do not take,
        # inside another capture (a graph cannot replay inside a capture), above the largest
        # capacity where overflow="eager", and for rows the counts do not add up to (a router
        # of one's own sending fewer than top-k assignments, where megatron-core 0.19 permutes
        # tokens x top-k rows): the experts fail on those as they do eagerly, where the padded
        # layout would index past the last expert (on a GPU, a device-side assert).
        if (kwargs or not self.experts.training or cuda_stream_capturing()
                or (capacity is None and self.overflow_rows is None) or sum(counts) != hidden.shape[0]):
            self.eager_calls += 1
            return type(self.experts).forward(self.experts, hidden, tokens_per_expert, probs, **kwargs)
        self._check_call(counts, hidden, probs)
        run, capacity = self._runner(capacity, max(counts))
        on_device = torch.tensor(counts, dtype=torch.long).to(hidden.device, non_blocking=True)
        padded, padded_probs, rows = padded_layout(hidden, probs, on_device, capacity)
        return self._replay(run, padded, padded_probs).index_select(0, rows), None

    def block_rows(self, capacity: int) -> int:
        """The rows of one block of the padded layout at ``capacity`` (rows per local expert):
        each expert's block here (the dispatch span with expert parallelism overrides it)."""
        return capacity

    def _capacity(self, largest: int) -> Optional[int]:
        """The smallest capacity whose blocks hold ``largest`` tokens, the most of any block of
        this call (None: above the largest capacity)."""
        return next((c for c in self.capacities if self.block_rows(c) >= largest), None)

    def _check_call(self, counts: Sequence[int], hidden: torch.Tensor, probs: torch.Tensor) -> None:
        if len(counts) != self.num_experts:
            raise ValueError(
                f"te_graph.graph_dropless_experts: the experts got token counts for {len(counts)} experts, but "
                f"they hold {self.num_experts} local experts (their graphs lay the tokens out that many blocks "
                "of rows): pass one count per local expert, as megatron-core's dispatcher does.")
        self._check_dtypes(hidden, probs)

    def _check_dtypes(self, hidden: torch.Tensor, probs: torch.Tensor) -> None:
        if hidden.dtype != self.dtypes[0]:
            raise ValueError(
                f"te_graph.graph_dropless_experts: the experts got tokens in {hidden.dtype}, but their graphs "
                f"were captured for {self.dtypes[0]}, their parameters' dtype at graphing: graph them after the "
                "model is cast (megatron-core's Float16Module, .to(dtype)), then call them in that dtype.")
        if probs.dtype != self.dtypes[1]:
            raise ValueError(
                f"te_graph.graph_dropless_experts: the experts got tokens in {hidden.dtype} and routing "
                f"probabilities in {probs.dtype}, but their graphs were captured for {self.dtypes[0]} and "
                f"{self.dtypes[1]}: pass probs_dtype={probs.dtype} to graph_dropless_experts (the "
                "probabilities' dtype is megatron-core's moe_router_dtype where set).")

    def _runner(self, capacity: Optional[int], largest: int) -> tuple[Callable, int]:
        """The capacity's graph and its block rows, or the same padded program run eagerly:
        above the largest capacity at blocks of ``largest`` rows (the most tokens of any block)
        rounded up to overflow_rows, so that such calls repeat a few
        GEMM shapes (a GEMM shape new to cuBLASLt costs a host-side algorithm search at every
        call); and while an earlier call of this layer still waits for its backward (several
        microbatches in flight: pipeline schedules), whose activations a replay would
        overwrite (the graphs of one layer share their buffers). Counted."""
        if capacity is None:
            self.eager_calls += 1
            return self.padded, self.overflow_rows * math.ceil(largest / self.overflow_rows)
        graphed = graphed_callable_of(self.graphed)  # None after te_graph.reset(): the eager program runs
        # Not in a backward: a recompute there (a checkpoint around the experts) must repeat the
        # forward it recomputes, which the graphs' own refusal names.
        if graphed is not None and graphed.awaits_backward() and not compat.in_backward():
            self.eager_calls += 1
            return self.padded, self.block_rows(capacity)
        self.calls[capacity] += 1
        return self.graphed, self.block_rows(capacity)

    def _replay(self, run: Callable, *inputs: torch.Tensor) -> torch.Tensor:
        """``run(*inputs)`` with the per-call Python state the eager TE wrappers keep."""
        flags = self._first_microbatch_flags
        if run is self.graphed:
            self._run_ddp_pre_hooks()
        if self.fp8 and run is self.graphed:
            # The captured weight casts read TE's device flag "skip the weight update": set it
            # as the eager wrappers would decide, whoever else set it last (one fill kernel).
            _fp8_state().set_skip_fp8_weight_update_tensor(skips_weight_update(flags))
        output = run(*inputs)
        # A replay runs no Python: clear the flag as the eager forward does, so that a later
        # eager call of this step does not take itself for the step's first. Under FP8 that
        # call would overwrite main_grad instead of adding to it (megatron-core sets the flag
        # again at each step's first microbatch, MegatronModule.set_is_first_microbatch).
        for module in flags:
            module.is_first_microbatch = False
        return output

    def _run_ddp_pre_hooks(self) -> None:
        """megatron-core DDP's forward pre-hooks on the experts' submodules with parameters
        (``overlap_param_gather``: each waits for its parameters' all-gather), which a replay
        would skip: run by hand before it, as megatron-core's helper runs those of the layer's
        own graphs (told apart by their code, ``integrations.megatron.hooks_run_by_hand``:
        where the helper runs none, none is run here, and the per-call check refuses them)."""
        codes = megatron.hooks_run_by_hand(self.graphed)
        for _, modules in megatron.manual_hooks(self.graphed) or ():  # the experts' modules with parameters
            for module in modules:
                for hook in tuple(module._forward_pre_hooks.values()):
                    if getattr(hook, "__code__", None) in codes:
                        hook(module, ())

    def remove(self) -> None:
        """Put the experts' own forward back and free the graphs."""
        import te_graph  # noqa: PLC0415

        self.experts.__dict__.pop("forward", None)
        te_graph.reset(self.graphed)


def modules_with_parameters(module: torch.nn.Module) -> list:
    """``module`` and its submodules that hold parameters of their own."""
    return [m for m in module.modules() if next(m.parameters(recurse=False), None) is not None]


def skips_weight_update(wrappers: Sequence[Any]) -> bool:
    """Whether a replay may reuse the FP8 weights cached at the step's first microbatch, as
    megatron-core's TE wrappers decide from ``is_first_microbatch`` (False: reuse; True:
    quantize again). They pass None, and TE quantizes at every call, where they keep no
    weight cache (``disable_parameter_transpose_cache``) or there is no such wrapper."""
    return bool(wrappers) and keeps_weight_cache(wrappers) and wrappers[0].is_first_microbatch is False


def padded_layout(tokens: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor, capacity: int) -> tuple:
    """Tokens grouped by expert (``counts`` per expert, a tensor on their device) laid out
    ``capacity`` rows per expert: expert ``e``'s ``i``-th token at row ``e * capacity + i``,
    zero rows after the real ones. Returns the padded tokens and probabilities and each
    token's row (to gather the real rows back)."""
    ends = counts.cumsum(dim=0)
    position = torch.arange(tokens.shape[0], device=tokens.device)
    # Position j belongs to the first expert whose group ends after it.
    expert = torch.searchsorted(ends, position, right=True)
    rows = expert * capacity + position - (ends - counts).index_select(0, expert)
    size = counts.shape[0] * capacity
    padded = tokens.new_zeros(size, tokens.shape[-1]).index_copy(0, rows, tokens)
    padded_probs = probs.new_zeros(size, *probs.shape[1:]).index_copy(0, rows, probs)
    return padded, padded_probs, rows


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
    Returns one :class:`DroplessExperts` per layer (``remove()`` undoes it)."""
    if not capacities or any(int(c) <= 0 for c in capacities):
        raise ValueError(f"te_graph.graph_dropless_experts: capacities must be positive row counts, got {list(capacities)}.")
    layers = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "token_dispatcher")]
    if not layers:
        raise ValueError("te_graph.graph_dropless_experts: the model holds no megatron-core MoELayer (a module "
                         "with .experts and .token_dispatcher).")
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


def _span_of(layer: torch.nn.Module, span: str, tokens: Optional[int], largest_first: list[int]) -> tuple[str, list]:
    """The span graphed for this layer and its capacities, or the refusal (ValueError) of
    what was asked."""
    from .moe_dispatch import (  # noqa: PLC0415  (it builds on this module)
        agreed_refusal, block_rows, dispatch_refusal, distinct_blocks, expert_parallel_size, functions_refusal)

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
                         f"{why}. Use span='experts' (or 'auto').")
    return "experts", largest_first


def _install(layer: torch.nn.Module, owner: Optional[torch.nn.Module], ddp_hook: Optional[Callable], span: str,
             largest_first: list[int], tokens: Optional[int], probs_dtype: Optional[torch.dtype],
             overflow_rows: Optional[int], eager_replay: Optional[bool], graph_options: dict) -> DroplessExperts:
    import te_graph  # noqa: PLC0415

    from . import moe_dispatch  # noqa: PLC0415  (moe_dispatch builds on this module)

    experts = layer.experts
    num_experts = experts.num_local_experts
    hidden_size = layer.config.hidden_size
    params = list(experts.parameters())
    # The tokens come in the parameters' dtype (megatron-core's Float16Module casts the
    # parameters, whatever config.params_dtype says).
    device, dtype = params[0].device, params[0].dtype
    # The router computes in moe_router_dtype where set, else in the activations' dtype,
    # and dispatch permutes its probabilities as they are.
    probs = probs_dtype or _ROUTER_DTYPES.get(getattr(layer.config, "moe_router_dtype", None), dtype)
    padded = _Padded(experts, type(experts).forward.__get__(experts), num_experts, owner, ddp_hook)
    if span == "dispatch":
        exchange = moe_dispatch.expert_exchange(layer)
        program: torch.nn.Module = moe_dispatch.PaddedDispatch(
            padded, moe_dispatch.module_of(layer.token_dispatcher).unpermute, bool(layer.config.moe_permute_fusion),
            exchange)
        samples = moe_dispatch.dispatch_samples(layer, tokens, (dtype, probs), largest_first)
    else:
        program = padded
        samples = [(torch.zeros(num_experts * c, hidden_size, device=device, dtype=dtype, requires_grad=True),
                    torch.zeros(num_experts * c, device=device, dtype=probs, requires_grad=True)) for c in largest_first]
    fp8 = _fp8_arguments(layer) if not any(name in graph_options for name in FP8_ARGUMENTS) else {}
    graphed = te_graph.make_graphed_callables(program, samples[0], more_shapes=samples[1:], eager_replay=eager_replay,
                                              **fp8, **graph_options)
    enabled = bool(fp8.get("enabled", graph_options.get("enabled", graph_options.get("fp8_enabled", False))))
    # The program without graphs (graphing put the graphed callable on the instance).
    eager_program = type(program).forward.__get__(program)
    if span == "dispatch":
        return moe_dispatch.DroplessDispatch(layer, graphed, eager_program, largest_first, (dtype, probs), enabled,
                                             overflow_rows, tokens, exchange)
    return DroplessExperts(experts, graphed, eager_program, largest_first, num_experts, (dtype, probs), enabled,
                           overflow_rows)


def _fp8_state() -> Any:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: PLC0415

    return FP8GlobalStateManager


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
    if _fp8_state().get_skip_fp8_weight_update_tensor() is None:
        _fp8_state().set_skip_fp8_weight_update_tensor(False)
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
