"""Dropless MoE dispatch inside the capacity graphs: one graph per token capacity from the
permuted tokens to the combined output.

The capacity graphs of ``moe_experts`` hold the experts alone; around them megatron-core's
dispatcher runs eagerly at every layer call: two chunk sorts, the alltoalls with split sizes
from the host, the padding's row indices (built on the host), the pad and gather copies, the
un-permutation, and all their backward kernels, several hundred launches per step behind the
host wait for the token counts (docs/performance.md). Once the capacity is chosen, all of
that can be static, so one graph per capacity takes the dispatcher's permuted tokens and
probabilities, its routing map and permutation mapping, and returns the layer's combined
output:

1. each permuted token's row in a padded layout of one block of ``B`` rows per expert (all
   experts, in the dispatcher's order; expert ``e``'s ``i``-th token at ``e * B + i``), from
   the routing map's counts, on the device;
2. with expert parallelism (``R`` ranks of ``L`` local experts each), an alltoall with equal
   splits sends each rank its experts' blocks, which the experts take as ``R`` blocks each
   (``R * B`` rows per expert: the capacity), and a second one brings their output back;
3. the experts on that layout, then the real rows gathered back;
4. the un-permutation, with the dispatcher's own function and mapping (fused or not).

Every rank must pick the same ``B``: the host gets the whole (rank, expert) matrix of token
counts and each rank's number of tokens (one small all-gather, then a sync point, where
megatron-core's own dispatch has one too), and the smallest capacity whose blocks hold its
largest entry serves the call on every rank alike; so do the calls megatron-core's own
methods serve (a rank routing another number of tokens than captured, or fewer than top-k
assignments). Every rank takes the same span too (:func:`agreed_refusal`).

Numerics: the chunk sorts megatron-core runs around its experts put the same tokens in the
same order per expert as the padded layout, without the padding rows, and its alltoall moves
rows without changing them; so with every expert local (``R = 1``: the chunk sorts are the
identity, the alltoall returns its input) a call equals the experts-only capacity graphs
bitwise (tests/test_megatron_path.py) wherever megatron-core's un-permutation is
deterministic: top-2 routing (its unfused ``scatter_add_`` adds two rows into zero in either
order alike) or torch's deterministic algorithms. With ``R > 1`` an expert's rows hold padding
between the ranks' tokens, so its GEMMs have other shapes than the experts-only graphs'
(other kernels may round differently). Either way a call equals te_graph's eager replay of the
same program bitwise.

What is installed on the ``MoELayer`` instance (the class is untouched, ``remove()`` undoes
it): ``dispatch`` (the counts' gather and host wait, the choice of capacity),
``routed_experts_compute`` (the capacity's graph), ``combine`` and ``postprocess`` (pass the
combined output through, add the shared experts' output). A call the graphs do not serve
(outside training, another number of tokens, inside a capture, above the largest capacity with
``overflow="eager"``) runs megatron-core's own methods.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from checkpointing.recompute_state import cuda_stream_capturing

from ... import compat
from ...api import reset
from . import helper
from .moe_experts import DroplessExperts, padded_layout

__all__ = ["DroplessDispatch", "ExpertExchange", "GroupCounts", "PaddedDispatch", "agreed_refusal", "block_rows", "capacity_shape",
           "dispatch_refusal", "dispatch_samples", "distinct_blocks", "expert_exchange", "expert_parallel_size", "functions_refusal",
           "module_of"]

_LAYER_METHODS = ("dispatch", "routed_experts_compute", "combine", "postprocess")
_WHOLE_FORWARD = ["route", "expert_compute", "postprocess"]  # MoELayer.fwd_execution_map, one call
_FUNCTIONS = ("permute", "unpermute", "all_to_all")  # the dispatcher's own, from the module of its class


def expert_parallel_size(dispatcher: Any) -> int:
    """The ranks the dispatcher's experts are split over (1 for a dispatcher without ``ep_size``)."""
    return int(getattr(dispatcher, "ep_size", 1))


def dispatch_refusal(layer: torch.nn.Module) -> Optional[str]:
    """Why the dispatch of this MoE layer cannot go into the capacity graphs (None: it can)."""
    dispatcher, config = layer.token_dispatcher, layer.config
    name = type(dispatcher).__name__
    if not hasattr(dispatcher, "_maybe_dtoh_and_synchronize") or not hasattr(dispatcher, "sort_input_by_local_experts"):
        return f"its token dispatcher ({name}) is not megatron-core's alltoall dispatcher"
    if getattr(dispatcher, "tp_size", 1) != 1:
        return (f"each expert is split over ranks (expert tensor-parallel size {dispatcher.tp_size}): the "
                "dispatcher's gather over them takes split sizes from the host")
    experts = layer.experts
    scopes = helper.scope_names(config)
    reasons = [
        (getattr(dispatcher, "drop_and_pad", False), "it routes with drop-and-pad"),
        (getattr(config, "moe_expert_capacity_factor", None) is not None,
         "it drops tokens beyond a capacity (moe_expert_capacity_factor), so the permuted tokens are not "
         "tokens x top-k rows"),
        (hasattr(layer, "_inference_token_dispatcher"),
         "it swaps in an inference dispatcher (transformer_impl='inference_optimized')"),
        (getattr(config, "cuda_graph_impl", None) == "local" and {"moe_router", "moe_preprocess"} & scopes,
         "megatron-core's own graphs (cuda_graph_impl='local') split its forward at the router"),
        (compat.module_hook_dicts(experts) or any(table for _, table in compat.global_module_hook_dicts()),
         "its experts module has hooks, which run where megatron-core calls the experts "
         "(the dispatch graphs call their forward within)"),
        (getattr(dispatcher, "shared_experts", None) is not None,
         "its shared experts overlap the dispatch (moe_shared_expert_overlap)"),
        (getattr(config, "moe_router_padding_for_quantization", False),
         "its routing map is padded for quantization (moe_router_padding_for_quantization)"),
        (getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False),
         "it overlaps the dispatch's backward with the experts' weight gradients"),
        # megatron-core's fine-grained schedule calls dispatch, the experts and combine from
        # nodes of its own, each on detached inputs.
        (getattr(config, "overlap_moe_expert_parallel_comm", False),
         "it overlaps its expert-parallel communication with computation (overlap_moe_expert_parallel_comm)"),
    ]
    for refused, why in reasons:
        if refused:
            return why
    for method in _LAYER_METHODS:
        if method in layer.__dict__:
            return f"its {method} was replaced on the instance"
    return None


@dataclass(frozen=True)
class GroupCounts:
    """One call's token counts on every rank of the expert-parallel group, on the host."""

    per_expert: tuple[tuple[int, ...], ...]  # per rank, its tokens for each expert
    tokens: tuple[int, ...]  # per rank, the tokens it routed (its routing map's rows)
    rows: tuple[int, ...]  # per rank, its permuted tokens

    def largest(self) -> int:
        """The most tokens one rank sends one expert: the block rows the call needs."""
        return max(max(row) for row in self.per_expert)


class ExpertExchange:
    """How the padded layout travels between the ranks of the expert-parallel group (the
    dispatcher's ``ep_group``, ``ranks`` of them, ``local_experts`` each): by the dispatcher's
    own differentiable ``all_to_all``, with equal splits, which a graph can hold. With one
    rank, nothing travels."""

    def __init__(self, dispatcher: Any, all_to_all: Callable):
        self.ranks = expert_parallel_size(dispatcher)
        self.local_experts = int(dispatcher.num_local_experts)
        self.group = getattr(dispatcher, "ep_group", None)
        self.use_nccl_stream = bool(getattr(dispatcher, "use_nccl_stream", False))
        self._all_to_all = all_to_all

    def counts(self, routing_map: torch.Tensor, rows: int) -> "GroupCounts":
        """This call's token counts on every rank of the group, on the host (``rows``: this
        rank's permuted tokens). A sync point, with several ranks after one all-gather."""
        sizes = routing_map.new_tensor([routing_map.shape[0], rows], dtype=torch.long)
        local = torch.cat([routing_map.sum(dim=0), sizes])
        if self.ranks == 1:
            table = [local.tolist()]
        else:
            gathered = [torch.empty_like(local) for _ in range(self.ranks)]
            torch.distributed.all_gather(gathered, local, group=self.group)
            table = torch.stack(gathered).tolist()
        return GroupCounts(tuple(tuple(row[:-2]) for row in table), tuple(row[-2] for row in table),
                           tuple(row[-1] for row in table))

    def to_experts(self, rows: torch.Tensor) -> torch.Tensor:
        """Blocks of every expert in order ([rank][local expert][block]) to this rank's experts'
        blocks from every rank, grouped by expert ([local expert][rank][block])."""
        if self.ranks == 1:
            return rows
        received = self._all_to_all(self.group, rows, None, None, self.use_nccl_stream)
        return received.unflatten(0, (self.ranks, self.local_experts, -1)).transpose(0, 1).flatten(0, 2)

    def from_experts(self, rows: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_experts`."""
        if self.ranks == 1:
            return rows
        sent = rows.unflatten(0, (self.local_experts, self.ranks, -1)).transpose(0, 1).flatten(0, 2)
        return self._all_to_all(self.group, sent, None, None, self.use_nccl_stream)


class PaddedDispatch(torch.nn.Module):
    """From the dispatcher's permuted tokens to the combined output, on the padded layout of
    ``padded_experts`` (a ``moe_experts.PaddedExperts``), moved between the ranks by ``exchange``;
    ``block`` is an empty tensor whose row count is the block rows (rows per expert per rank),
    so that each capacity is a captured shape of one graphed callable (whose checks then cover
    calls of several capacities in flight)."""

    def __init__(self, padded_experts: torch.nn.Module, unpermute: Callable, fused: bool, exchange: ExpertExchange):
        super().__init__()
        self.padded_experts = padded_experts
        self._unpermute = unpermute  # the dispatcher's own (megatron-core's moe_utils.unpermute)
        self.fused = fused
        self.exchange = exchange

    @property
    def cuda_graph_manual_hooks(self) -> list:
        """The padded experts' (``moe_experts.PaddedExperts.cuda_graph_manual_hooks``)."""
        return self.padded_experts.cuda_graph_manual_hooks

    def forward(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                mapping: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        # The permuted tokens are grouped by expert, in token order; the dispatcher counts them
        # from the routing map as this does.
        padded, padded_probs, rows = padded_layout(tokens, probs, routing_map.sum(dim=0), block.shape[0])
        exchange = self.exchange
        output = exchange.from_experts(self.padded_experts(exchange.to_experts(padded),
                                                           exchange.to_experts(padded_probs)))
        return self._unpermute(output.index_select(0, rows), mapping,
                               restore_shape=torch.Size((routing_map.shape[0], tokens.shape[-1])),
                               routing_map=routing_map, fused=self.fused, drop_and_pad=False)


def agreed_refusal(layer: torch.nn.Module, refusal: Optional[str]) -> Optional[str]:
    """``refusal`` (why this rank cannot take the dispatch span, or None), unless another rank
    of the layer's expert-parallel group refuses it (hooks on one rank's experts): every rank
    must take the same span, since the dispatch span's graphs exchange tokens by collectives.
    One all-reduce over the group, at graphing; none with one rank."""
    dispatcher = layer.token_dispatcher
    if expert_parallel_size(dispatcher) == 1 or not torch.distributed.is_initialized():
        return refusal  # (without a process group no rank exchanges tokens at all)
    flag = torch.tensor([int(refusal is not None)], device=next(layer.experts.parameters()).device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=dispatcher.ep_group)
    if refusal is None and flag.item():
        return ("another rank of its expert-parallel group cannot take it (the reason is given there), "
                "and every rank must take the same span")
    return refusal


def functions_refusal(layer: torch.nn.Module) -> Optional[str]:
    """Why the graphs could not call the dispatcher's own ``permute``, ``unpermute`` and
    ``all_to_all`` (the module its class is defined in must hold them, as megatron-core's does)."""
    module = module_of(layer.token_dispatcher)
    missing = [name for name in _FUNCTIONS if not callable(getattr(module, name, None))]
    if missing:
        listed = " and ".join([", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)
        return f"the module of its dispatcher's class ({module.__name__}) has no {listed}"
    return None


def expert_exchange(layer: torch.nn.Module) -> ExpertExchange:
    """The :class:`ExpertExchange` of this layer's dispatcher."""
    return ExpertExchange(layer.token_dispatcher, module_of(layer.token_dispatcher).all_to_all)


def block_rows(capacity: int, ranks: int) -> int:
    """Rows per (rank, expert) block for ``capacity`` rows per local expert over ``ranks``
    ranks: rounded up, so that the blocks hold at least the capacity."""
    return math.ceil(capacity / ranks)


def distinct_blocks(largest_first: Sequence[int], ranks: int) -> tuple[list[int], list[int]]:
    """The capacities to graph, largest first, one per block size (the smallest capacity of
    those sharing one: a call takes the smallest whose blocks hold it, and one graph serves
    them all), and those left out."""
    kept: dict[int, int] = {}
    for capacity in largest_first:
        kept[block_rows(capacity, ranks)] = capacity  # smaller ones come later
    chosen = sorted(kept.values(), reverse=True)
    return chosen, [c for c in largest_first if c not in chosen]


def dispatch_samples(layer: torch.nn.Module, tokens: int, dtypes: tuple, capacities: Sequence[int]) -> list[tuple]:
    """One sample set per capacity (largest first) for :class:`PaddedDispatch`: a routing of
    ``tokens`` tokens that sends each to ``topk`` experts in turn (every expert's count at most
    the even share rounded up, which each capacity's blocks hold), permuted by the dispatcher's
    own ``permute`` (its mapping is what the graphs un-permute with)."""
    config, dispatcher = layer.config, layer.token_dispatcher
    experts, topk = config.num_moe_experts, config.moe_router_topk
    device = next(layer.experts.parameters()).device
    chosen = (torch.arange(tokens, device=device).unsqueeze(1) * topk + torch.arange(topk, device=device)) % experts
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=device).scatter_(1, chosen, True)
    hidden = torch.zeros(tokens, config.hidden_size, device=device, dtype=dtypes[0])
    dense_probs = torch.zeros(tokens, experts, device=device, dtype=dtypes[1])
    with torch.no_grad():
        permuted, probs, mapping, *_ = module_of(dispatcher).permute(
            hidden, routing_map, probs=dense_probs, num_out_tokens=tokens * topk, fused=config.moe_permute_fusion)
    ranks = expert_parallel_size(dispatcher)
    return [(permuted.detach().requires_grad_(), probs.detach().requires_grad_(), routing_map, mapping,
             capacity_shape(block_rows(c, ranks), device)) for c in capacities]


def capacity_shape(rows: int, device: torch.device) -> torch.Tensor:
    """The empty tensor whose row count tells a ``PaddedDispatch`` its block rows."""
    return torch.empty(rows, 0, device=device, dtype=torch.uint8)


class DroplessDispatch(DroplessExperts):
    """The capacity graphs of one MoE layer's dispatch, experts and combine (``span ==
    "dispatch"``); ``tokens``: the tokens a layer call routes, as captured."""

    span = "dispatch"

    def __init__(self, layer: torch.nn.Module, graphed: torch.nn.Module, padded: Callable,
                 capacities: Sequence[int], dtypes: tuple, fp8: bool, overflow_rows: Optional[int], tokens: int,
                 exchange: ExpertExchange):
        self.layer = layer
        self.dispatcher = layer.token_dispatcher  # the one vetted (dispatch_refusal)
        self.exchange = exchange
        self.tokens = tokens
        self.rows = tokens * layer.config.moe_router_topk  # permuted tokens per call
        self._own = {name: getattr(layer, name) for name in _LAYER_METHODS}  # megatron-core's, bound
        self._capacity_shapes: dict[int, torch.Tensor] = {}
        self._served: Optional[tuple] = None  # (tokens, capacity, largest block) the dispatch took
        self._combined: Optional[torch.Tensor] = None  # this call's output, until postprocess takes it
        super().__init__(layer.experts, graphed, padded, capacities, layer.experts.num_local_experts, dtypes, fp8,
                         overflow_rows)

    def _install(self) -> None:
        for name in _LAYER_METHODS:
            setattr(self.layer, name, getattr(self, name))

    def block_rows(self, capacity: int) -> int:
        return block_rows(capacity, self.exchange.ranks)

    def served_call(self) -> bool:
        """Whether this layer call is one these methods may serve, as far as the layer says:
        in training, with the dispatcher they vetted, its forward one call (not split by
        megatron-core's own graphs). The ranks of an expert-parallel group run the same
        program in the same mode, so they decide this alike."""
        layer = self.layer
        return (layer.training and layer.token_dispatcher is self.dispatcher
                and getattr(layer, "fwd_execution_map", None) == _WHOLE_FORWARD)

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor) -> tuple:
        dispatcher = self.layer.token_dispatcher
        self._served, self._combined = None, None
        # megatron-core's own methods where the graphs do not serve the call, or inside
        # another capture (a graph cannot replay inside one).
        if not self.served_call() or cuda_stream_capturing():
            self.eager_calls += 1
            return self._own["dispatch"](hidden, probs)
        # A sync point: the host waits for the router (and the group's all-gather).
        counts = self.exchange.counts(dispatcher.routing_map, hidden.shape[0])
        largest = counts.largest()
        capacity = self._capacity(largest)
        # The graphs take the tokens they were captured for, every one sent to top-k experts
        # (a router of one's own may send fewer), on every rank: megatron-core's own methods
        # otherwise (ranks may route different numbers of tokens), as above the largest
        # capacity with overflow="eager" (megatron-core 0.19's then fail as eagerly). Every
        # rank reads the same counts, so all take the same way.
        if (any(tokens != self.tokens for tokens in counts.tokens) or any(rows != self.rows for rows in counts.rows)
                or any(sum(row) != self.rows for row in counts.per_expert)
                or (capacity is None and self.overflow_rows is None)):
            self.eager_calls += 1
            return self._own["dispatch"](hidden, probs)
        self._check_dtypes(hidden, probs)
        self._served = (hidden, capacity, largest)
        return hidden, probs  # the graphs exchange the tokens themselves

    def routed_experts_compute(self, hidden: torch.Tensor, probs: torch.Tensor) -> tuple:
        served, self._served = self._served, None
        if served is None:
            return self._own["routed_experts_compute"](hidden, probs)
        if hidden is not served[0]:
            raise RuntimeError(
                "te_graph.graph_dropless_experts: this MoE layer's routed_experts_compute got other tokens than "
                "its dispatch returned, which left them for the dispatch graphs to exchange; megatron-core's "
                "experts would take them for exchanged ones. Something between them (a hook, a subclass) "
                "replaced the tokens: graph with span='experts'.")
        dispatcher = self.layer.token_dispatcher
        dispatcher.tokens_per_expert = None  # as dispatch_postprocess leaves it
        run, rows = self._runner(served[1], served[2])
        output = self._replay(run, hidden, probs, dispatcher.routing_map,
                              dispatcher.reversed_local_input_permutation_mapping, self._capacity_shape(rows, hidden))
        self._combined = output
        return output, None

    def combine(self, output: torch.Tensor) -> torch.Tensor:
        return output if output is self._combined else self._own["combine"](output)

    def postprocess(self, output: torch.Tensor, shared_expert_output: Optional[torch.Tensor]) -> torch.Tensor:
        if output is not self._combined:
            if self._combined is not None:
                raise RuntimeError(
                    "te_graph.graph_dropless_experts: this MoE layer's postprocess got another tensor than its "
                    "routed_experts_compute returned, which was combined already (the dispatch graphs "
                    "un-permute); megatron-core's postprocess would un-permute it again. Something between them "
                    "(a hook, a subclass) replaced the output: graph with span='experts'.")
            return self._own["postprocess"](output, shared_expert_output)
        self._combined = None
        output = output.view(self.layer.token_dispatcher.hidden_shape)
        return output if shared_expert_output is None else output + shared_expert_output

    def _capacity_shape(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        shape = self._capacity_shapes.get(rows)
        if shape is None:
            shape = self._capacity_shapes[rows] = capacity_shape(rows, like.device)
        return shape

    def remove(self) -> None:
        """Put megatron-core's methods back and free the graphs."""
        for name in _LAYER_METHODS:
            self.layer.__dict__.pop(name, None)
        self._served, self._combined = None, None
        if self.graphed is not None:  # the device choice's node lives in the layer's own graphs
            reset(self.graphed)


def module_of(dispatcher: Any) -> Any:
    """The module the dispatcher's class is defined in (its ``permute``, ``unpermute`` and
    ``all_to_all``)."""
    return sys.modules[type(dispatcher).__module__]
