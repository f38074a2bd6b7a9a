"""Dropless MoE dispatch inside the capacity graphs: one graph per token capacity from the
permuted tokens to the combined output.

The capacity graphs of ``moe_experts`` hold the experts alone; around them megatron-core's
dispatcher runs eagerly at every layer call: two chunk sorts, the padding's row indices
(built on the host), the pad and gather copies, the un-permutation, and all their backward
kernels, several hundred launches per step behind the host wait for the token counts
(docs/performance.md). Where every expert is local (expert- and expert-tensor-parallel size
1), all of that is static once the capacity is chosen, so one graph per capacity takes the
dispatcher's permuted tokens and probabilities, its routing map and permutation mapping, and
returns the layer's combined output:

1. per expert counts from the routing map (on the device), and each permuted token's row in
   the padded layout (expert ``e``'s ``i``-th token at ``e * C + i``, as ``moe_experts``);
2. pad, run the experts on ``C`` rows per expert, gather the real rows back;
3. un-permute with the dispatcher's own function and mapping (fused or not, as configured).

The chunk sorts the dispatcher would run around the experts are the identity permutation
when every expert is local (``sort_input_by_local_experts`` is ``0, 1, ..., E-1``), and its
alltoall over one rank returns its input, so leaving them out changes no bit: a call equals
the experts-only capacity graphs, and te_graph's eager replay of the same program, bitwise
(tests/test_megatron_path.py), wherever megatron-core's own un-permutation is
deterministic: with top-2 routing (its unfused ``scatter_add_`` adds two rows into zero in
either order alike) or under torch's deterministic algorithms (the tests route top-2, with
the unfused and TE's fused un-permutation).

What is installed on the ``MoELayer`` instance (the class is untouched, ``remove()`` undoes
it): ``routed_experts_compute`` (the host wait for the counts, the capacity's graph),
``combine`` and ``postprocess`` (pass the combined output through, add the shared experts'
output). A call the graphs do not serve (outside training, another number of tokens, inside
a capture, above the largest capacity with ``overflow="eager"``) runs megatron-core's own
methods.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Sequence

import torch

from checkpointing.recompute_state import cuda_stream_capturing

from .. import compat
from . import megatron
from .moe_experts import DroplessExperts, padded_layout

__all__ = ["DroplessDispatch", "PaddedDispatch", "capacity_shape", "dispatch_refusal", "dispatch_samples",
           "functions_refusal", "module_of"]

_LAYER_METHODS = ("routed_experts_compute", "combine", "postprocess")
_WHOLE_FORWARD = ["route", "expert_compute", "postprocess"]  # MoELayer.fwd_execution_map, one call


def dispatch_refusal(layer: torch.nn.Module) -> Optional[str]:
    """Why the dispatch of this MoE layer cannot go into the capacity graphs (None: it can)."""
    dispatcher, config = layer.token_dispatcher, layer.config
    name = type(dispatcher).__name__
    if not hasattr(dispatcher, "_maybe_dtoh_and_synchronize") or not hasattr(dispatcher, "sort_input_by_local_experts"):
        return f"its token dispatcher ({name}) is not megatron-core's alltoall dispatcher"
    if getattr(dispatcher, "ep_size", 1) != 1 or getattr(dispatcher, "tp_size", 1) != 1:
        return (f"its experts are split over ranks (expert-parallel size {dispatcher.ep_size}, expert "
                f"tensor-parallel size {dispatcher.tp_size}): the alltoall's split sizes come from the host")
    experts = layer.experts
    scopes = megatron.scope_names(config)
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
    ]
    for refused, why in reasons:
        if refused:
            return why
    for method in _LAYER_METHODS:
        if method in layer.__dict__:
            return f"its {method} was replaced on the instance"
    return None


class PaddedDispatch(torch.nn.Module):
    """From the dispatcher's permuted tokens to the combined output, on the padded layout of
    ``padded_experts`` (a ``moe_experts._Padded``); ``capacity`` is an empty tensor whose row
    count is the capacity, so that each capacity is a captured shape of one graphed callable
    (whose checks then cover calls of several capacities in flight)."""

    def __init__(self, padded_experts: torch.nn.Module, unpermute: Callable, fused: bool):
        super().__init__()
        self.padded_experts = padded_experts
        self._unpermute = unpermute  # the dispatcher's own (megatron-core's moe_utils.unpermute)
        self.fused = fused

    @property
    def cuda_graph_manual_hooks(self) -> list:
        """The padded experts' (``moe_experts._Padded.cuda_graph_manual_hooks``)."""
        return self.padded_experts.cuda_graph_manual_hooks

    def forward(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                mapping: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
        # The permuted tokens are grouped by expert, in token order; the dispatcher counts them
        # from the routing map as this does.
        padded, padded_probs, rows = padded_layout(tokens, probs, routing_map.sum(dim=0), capacity.shape[0])
        output = self.padded_experts(padded, padded_probs).index_select(0, rows)
        return self._unpermute(output, mapping, restore_shape=torch.Size((routing_map.shape[0], tokens.shape[-1])),
                               routing_map=routing_map, fused=self.fused, drop_and_pad=False)


def functions_refusal(layer: torch.nn.Module) -> Optional[str]:
    """Why the graphs could not call the dispatcher's own ``permute`` and ``unpermute`` (the
    module its class is defined in must hold them, as megatron-core's does)."""
    module = module_of(layer.token_dispatcher)
    if not all(callable(getattr(module, name, None)) for name in ("permute", "unpermute")):
        return f"the module of its dispatcher's class ({module.__name__}) has no permute and unpermute"
    return None


def dispatch_samples(layer: torch.nn.Module, tokens: int, dtypes: tuple, capacities: Sequence[int]) -> list[tuple]:
    """One sample set per capacity (largest first) for :class:`PaddedDispatch`: a routing of
    ``tokens`` tokens that sends each to ``topk`` experts in turn (every expert's count at most
    the even share rounded up, which each capacity holds), permuted by the dispatcher's own
    ``permute`` (its mapping is what the graphs un-permute with)."""
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
    return [(permuted.detach().requires_grad_(), probs.detach().requires_grad_(), routing_map, mapping,
             capacity_shape(c, device)) for c in capacities]


def capacity_shape(capacity: int, device: torch.device) -> torch.Tensor:
    """The empty tensor whose row count tells a ``PaddedDispatch`` its capacity."""
    return torch.empty(capacity, 0, device=device, dtype=torch.uint8)


class DroplessDispatch(DroplessExperts):
    """The capacity graphs of one MoE layer's dispatch, experts and combine (``span ==
    "dispatch"``); ``tokens``: the tokens a layer call routes, as captured."""

    span = "dispatch"

    def __init__(self, layer: torch.nn.Module, graphed: torch.nn.Module, padded: Callable,
                 capacities: Sequence[int], dtypes: tuple, fp8: bool, overflow_rows: Optional[int], tokens: int):
        self.layer = layer
        self.dispatcher = layer.token_dispatcher  # the one vetted (dispatch_refusal)
        self.tokens = tokens
        self.rows = tokens * layer.config.moe_router_topk  # permuted tokens per call
        self._own = {name: getattr(layer, name) for name in _LAYER_METHODS}  # megatron-core's, bound
        self._capacity_shapes: dict[int, torch.Tensor] = {}
        self._combined: Optional[torch.Tensor] = None  # this call's output, until postprocess takes it
        super().__init__(layer.experts, graphed, padded, capacities, layer.experts.num_local_experts, dtypes, fp8,
                         overflow_rows)

    def _install(self) -> None:
        for name in _LAYER_METHODS:
            setattr(self.layer, name, getattr(self, name))

    def routed_experts_compute(self, hidden: torch.Tensor, probs: torch.Tensor) -> tuple:
        layer, dispatcher = self.layer, self.layer.token_dispatcher
        self._combined = None
        # megatron-core's own methods where the graphs do not serve the call: outside
        # training, inside another capture, another dispatcher swapped in, a forward split
        # into separate calls (megatron-core's own graphs), another number of tokens.
        if (not layer.training or cuda_stream_capturing() or dispatcher is not self.dispatcher
                or getattr(layer, "fwd_execution_map", None) != _WHOLE_FORWARD or hidden.shape[0] != self.rows):
            self.eager_calls += 1
            return self._own["routed_experts_compute"](hidden, probs)
        # The dispatcher's own host copy of the counts, at the points its dispatch_postprocess
        # takes them (megatron-core 0.19's alltoall dispatcher): a sync point, the host waits
        # for the router.
        counts = dispatcher._maybe_dtoh_and_synchronize("before_permutation_2", dispatcher.tokens_per_expert)
        counts = dispatcher._maybe_dtoh_and_synchronize("before_finish", counts)
        listed = counts.tolist()
        capacity = self._capacity(listed)
        # Every token sent to top-k experts is what the graphs' row map assumes (a router of
        # one's own may send fewer): megatron-core's own methods otherwise, as above the
        # largest capacity with overflow="eager" (megatron-core 0.19's then fail as eagerly).
        if sum(listed) != self.rows or (capacity is None and self.overflow_rows is None):
            self.eager_calls += 1
            dispatcher.tokens_per_expert = counts
            return self._own["routed_experts_compute"](hidden, probs)
        self._check_call(listed, hidden, probs)
        dispatcher.tokens_per_expert = None  # as dispatch_postprocess leaves it
        run, capacity = self._runner(capacity, listed)
        output = self._replay(run, hidden, probs, dispatcher.routing_map,
                              dispatcher.reversed_local_input_permutation_mapping, self._capacity_shape(capacity, hidden))
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

    def _capacity_shape(self, capacity: int, like: torch.Tensor) -> torch.Tensor:
        shape = self._capacity_shapes.get(capacity)
        if shape is None:
            shape = self._capacity_shapes[capacity] = capacity_shape(capacity, like.device)
        return shape

    def remove(self) -> None:
        """Put megatron-core's methods back and free the graphs."""
        import te_graph  # noqa: PLC0415

        for name in _LAYER_METHODS:
            self.layer.__dict__.pop(name, None)
        self._combined = None
        te_graph.reset(self.graphed)


def module_of(dispatcher: Any) -> Any:
    """The module the dispatcher's class is defined in (its ``permute`` and ``unpermute``)."""
    return sys.modules[type(dispatcher).__module__]
