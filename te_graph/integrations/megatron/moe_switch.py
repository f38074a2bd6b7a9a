"""Dropless MoE with the capacity chosen on the GPU: one layer call's dispatch, experts and
combine as one ``conditional.switched`` node over capacity buckets, inside the graph of the
whole layer (:func:`.moe.graph_dropless_experts` with ``choose="device"``).

The host-chosen capacity graphs (``moe_dispatch``) wait on the host for the routing counts at
every layer call, so the layer's graph must end at the router (Megatron's partial scopes) and
the rest runs behind that wait. Here nothing of the layer call reads the counts on the host:

1. on the GPU, the routing map's tokens per expert, their largest, and the smallest capacity
   whose blocks hold it: the bucket index (``searchsorted`` over the capacities);
2. a SWITCH node runs that bucket's padded program (``moe_dispatch.PaddedDispatch``: the
   padded layout, the experts' GEMMs, the gather and megatron-core's un-permutation), one body
   per bucket, and its backward a second SWITCH node on the same index;
3. the last bucket holds every token a call routes (top-k sends a token to an expert once: a
   capacity of ``tokens`` rows), so no call is dropped and none falls back to eager code.

So the whole layer (attention, router, dispatch, experts, combine) is one graph per
microbatch, forward and backward: Megatron's helper with an empty ``cuda_graph_modules``, or
``make_graphed_callables`` of the layer. Outside a capture (warmup, te_graph's eager replay, a
layer left eager) the host reads the bucket (a sync) and runs the same program: eager replay
equals the graphs bitwise. Random numbers stay out of the bodies: the experts draw none, and
the router, dropout and recompute are captured around the node.

With ``recompute`` the node's forward keeps no activations and its backward runs the
bucket's program again first: the pool holds one bucket's temporaries at a time instead of
every bucket's activations, for a second forward of the experts.

The calls each bucket served are counted on the GPU (``calls`` reads them, a sync). One rank
of experts only (expert parallelism needs the ranks to agree on the bucket and the alltoalls
outside the bodies: docs/conditional-nodes.md), and no FP8 (not proven yet): both refused by
``graph_dropless_experts``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ...capture import conditional
from .moe_dispatch import _LAYER_METHODS, DroplessDispatch, PaddedDispatch, capacity_shape

__all__ = ["DeviceChosenDispatch"]


class DeviceChosenDispatch(DroplessDispatch):
    """What ``graph_dropless_experts(choose="device")`` installed on one MoE layer: its
    ``capacities`` (rows per expert, smallest first, the last every token of a call), the
    calls each served (``calls``, counted on the GPU) and the calls megatron-core's own
    methods served (``eager_calls``: outside training, another number of tokens)."""

    span = "dispatch"
    choose = "device"

    def __init__(self, layer: torch.nn.Module, program: PaddedDispatch, capacities: Sequence[int], dtypes: tuple,
                 tokens: int, recompute: bool = False):
        # DroplessDispatch's state, without graphs of its own: the layer's graph holds the node.
        self.layer, self.experts = layer, layer.experts
        self.dispatcher = layer.token_dispatcher
        self.graphed = None
        self.tokens, self.rows = tokens, tokens * layer.config.moe_router_topk
        self.capacities = tuple(sorted(capacities))
        self.dtypes = dtypes
        self.recompute = recompute  # the node's backward runs the bucket's program again
        self.eager_calls = 0
        self._own = {name: getattr(layer, name) for name in _LAYER_METHODS}
        self._served: Optional[torch.Tensor] = None
        self._combined: Optional[torch.Tensor] = None
        device = next(layer.experts.parameters()).device
        self._bounds = torch.tensor(self.capacities, dtype=torch.long, device=device)
        self._hits = torch.zeros(len(self.capacities), dtype=torch.long, device=device)
        self._one = torch.ones(1, dtype=torch.long, device=device)
        self.programs = tuple(_bucket(program, capacity_shape(c, device)) for c in self.capacities)
        self._install()

    @property
    def calls(self) -> dict:
        """The layer calls each capacity served, replays included (read from the GPU: a sync)."""
        return dict(zip(self.capacities, self._hits.tolist()))

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor) -> tuple:
        dispatcher = self.layer.token_dispatcher
        self._served, self._combined = None, None
        # megatron-core's own methods where the node does not serve the call, or for another
        # number of tokens than the buckets were made for (both known on the host).
        if (not self.served_call() or dispatcher.routing_map.shape[0] != self.tokens
                or hidden.shape[0] != self.rows):
            self.eager_calls += 1
            return self._own["dispatch"](hidden, probs)
        self._check_dtypes(hidden, probs)
        self._served = hidden
        return hidden, probs  # the node's programs pad and un-permute the tokens themselves

    def routed_experts_compute(self, hidden: torch.Tensor, probs: torch.Tensor) -> tuple:
        served, self._served = self._served, None
        if served is None:
            return self._own["routed_experts_compute"](hidden, probs)
        if hidden is not served:
            raise RuntimeError(
                "te_graph.graph_dropless_experts: this MoE layer's routed_experts_compute got other tokens than "
                "its dispatch returned; something between them (a hook, a subclass) replaced them: graph with "
                "choose='host'.")
        dispatcher = self.layer.token_dispatcher
        dispatcher.tokens_per_expert = None  # as dispatch_postprocess leaves it
        routing_map = dispatcher.routing_map
        # The smallest capacity holding the busiest expert's tokens, on the GPU.
        busiest = routing_map.sum(dim=0).max().view(1)
        index = torch.searchsorted(self._bounds, busiest)
        self._hits.index_add_(0, index, self._one)
        inputs = (hidden, probs, routing_map, dispatcher.reversed_local_input_permutation_mapping)
        output = conditional.switched(index.view(()), self.programs, inputs, module=self.experts,
                                      recompute=self.recompute)
        self._combined = output
        return output, None


def _bucket(program: PaddedDispatch, block: torch.Tensor) -> Callable:
    """The padded program at one capacity (``block``'s rows per expert)."""

    def run(tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, mapping: torch.Tensor) -> Any:
        return program(tokens, probs, routing_map, mapping, block)

    return run
