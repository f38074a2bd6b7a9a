"""Dropless MoE with the capacity chosen on the device (``graph_dropless_experts(choose="device")``,
``te_graph.integrations.megatron.moe_switch``), on the CPU.

A layer shaped as megatron-core's ``MoELayer`` calls its methods (route, preprocess with the
dispatcher's ``permute``, dispatch, routed experts, combine, postprocess with its
``unpermute``) on one rank, in float64. Outside a capture the node reads its bucket on the host
and runs that bucket's padded program: a layer call equals the host-chosen capacity graphs'
eager replay bitwise, and megatron-core's own unpadded methods to float64 rounding, over
calls that take every bucket, the one holding every token included; nothing runs eagerly.
The graphs themselves (the SWITCH nodes, no host sync) are in tests/test_megatron_path.py and
tests/test_switched.py. Also what ``choose="device"`` refuses, before anything changes.
"""
from __future__ import annotations

import re
import types

import pytest
import torch
from torch import nn

from tests.graph_helpers import require
from tests.harness import assert_same, refused

require("te_graph.integrations.megatron.moe", "megatron-core's integration, whose MoE code uses Transformer Engine's")

from te_graph.integrations.megatron.moe import graph_dropless_experts  # noqa: E402
from tests.test_moe_experts import E, H, AlltoAllLike, Experts  # noqa: E402

TOKENS, TOPK = 16, 2
CAPACITIES = [8, 10]  # 1 and 1.25 times the even share; choose="device" adds 16, every token


def permute(hidden, routing_map, probs, num_out_tokens, fused, drop_and_pad=False):
    """megatron-core's ``permute``: the tokens grouped by expert, in token order."""
    by_expert = routing_map.t()
    mapping = torch.arange(routing_map.shape[0]).expand(E, -1).masked_select(by_expert)
    return hidden.index_select(0, mapping), probs.t().masked_select(by_expert), mapping, None, None


def unpermute(output, mapping, restore_shape, routing_map, fused, drop_and_pad):
    return output.new_zeros(restore_shape).index_add(0, mapping, output)


def all_to_all(group, x, output_splits=None, input_splits=None, use_nccl_stream=False):
    raise AssertionError("one rank exchanges nothing")


class Dispatcher(AlltoAllLike):
    """megatron-core's alltoall dispatcher on one rank: its state between the layer's methods."""

    num_local_experts = E

    def dispatch_preprocess(self, hidden, routing_map, probs):
        self.hidden_shape, self.routing_map = hidden.shape, routing_map
        self.tokens_per_expert = routing_map.sum(dim=0)
        permuted, permuted_probs, self.reversed_local_input_permutation_mapping, _, _ = permute(
            hidden, routing_map, probs, TOKENS * TOPK, False)
        return permuted, permuted_probs


class MoELayerLike(nn.Module):
    """megatron-core's ``MoELayer.forward`` on one rank, its methods as megatron-core's."""

    def __init__(self):
        super().__init__()
        self.experts = Experts()
        self.router = nn.Linear(H, E, bias=False, dtype=torch.float64)
        self.token_dispatcher = Dispatcher()
        self.fwd_execution_map = ["route", "expert_compute", "postprocess"]
        self.config = types.SimpleNamespace(hidden_size=H, params_dtype=torch.float64, moe_router_topk=TOPK,
                                            num_moe_experts=E, moe_permute_fusion=False)

    def forward(self, hidden):
        probs, chosen = self.router(hidden).softmax(dim=-1).topk(TOPK, dim=-1)
        routing_map = torch.zeros(hidden.shape[0], E, dtype=torch.bool).scatter_(1, chosen, True)
        dense = torch.zeros(hidden.shape[0], E, dtype=probs.dtype).scatter(1, chosen, probs)
        tokens, probs = self.token_dispatcher.dispatch_preprocess(hidden, routing_map, dense)
        tokens, probs = self.dispatch(tokens, probs)
        output, _ = self.routed_experts_compute(tokens, probs)
        return self.postprocess(self.combine(output), None)

    def dispatch(self, hidden, probs):
        return hidden, probs

    def routed_experts_compute(self, hidden, probs):
        return self.experts(hidden, self.token_dispatcher.tokens_per_expert, probs)

    def combine(self, output):
        return output

    def postprocess(self, output, shared_expert_output):
        dispatcher = self.token_dispatcher
        return unpermute(output, dispatcher.reversed_local_input_permutation_mapping,
                         dispatcher.hidden_shape, dispatcher.routing_map, False, False)


def _layers() -> dict:
    torch.manual_seed(0)
    eager = MoELayerLike()
    with torch.no_grad():
        eager.router.weight.copy_(torch.eye(E, H))  # expert e's logit: a token's feature e
    layers = {"eager": eager, "host": MoELayerLike(), "device": MoELayerLike(), "recompute": MoELayerLike()}
    for layer in layers.values():
        layer.load_state_dict(eager.state_dict())
    return layers


def _inputs() -> list:
    """Calls whose busiest expert takes 8 tokens (token t to experts t % 4 and t % 4 + 1: each
    expert as many), 10 (tokens 1 and 2 send their first choice to expert 0 instead), and all
    16 (every token's first choice)."""
    g = torch.Generator().manual_seed(1)
    calls = []
    for to_zero in ((), (1, 2), range(TOKENS)):
        x = torch.randn(TOKENS, H, dtype=torch.float64, generator=g) * 0.01
        for t in range(TOKENS):
            first, second = t % E, (t + 1) % E
            if t in to_zero:
                first, second = 0, second if second != 0 else 1
            x[t, first] += 5
            x[t, second] += 4
        calls.append(x)
    return calls


def _step(layer, x) -> tuple:
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def test_each_call_runs_the_bucket_chosen_from_its_counts_and_trains_as_unpadded():
    layers = _layers()
    (host,) = graph_dropless_experts(layers["host"], CAPACITIES, tokens=TOKENS, probs_dtype=torch.float64,
                                     eager_replay=True)
    (device,) = graph_dropless_experts(layers["device"], CAPACITIES, tokens=TOKENS, choose="device",
                                       probs_dtype=torch.float64)
    (recomputed,) = graph_dropless_experts(layers["recompute"], CAPACITIES, tokens=TOKENS, choose="device",
                                           recompute=True, probs_dtype=torch.float64)
    assert device.capacities == (8, 10, 16) and device.choose == "device"
    for x in _inputs():
        want = _step(layers["eager"], x)
        got = _step(layers["device"], x)
        assert_same(_step(layers["recompute"], x), got, "the bucket's program run again in the backward")
        for a, b in zip(want[:2] + tuple(want[2]), got[:2] + tuple(got[2])):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
        busiest = int(layers["device"].token_dispatcher.routing_map.sum(dim=0).max())
        if busiest <= max(CAPACITIES):  # the host-chosen graphs serve it too: the same padded program
            assert_same(got, _step(layers["host"], x), f"busiest expert {busiest}: device vs host choice")
    assert device.calls == recomputed.calls == {8: 1, 10: 1, 16: 1} and device.eager_calls == 0
    assert host.calls == {8: 1, 10: 1} and host.eager_calls == 0
    device.remove()
    assert not {"dispatch", "routed_experts_compute", "combine", "postprocess"} & set(layers["device"].__dict__)


def test_outside_training_megatron_cores_own_methods_run():
    layers = _layers()
    (device,) = graph_dropless_experts(layers["device"], CAPACITIES, tokens=TOKENS, choose="device",
                                       probs_dtype=torch.float64)
    x = _inputs()[1]
    for layer in layers.values():
        layer.eval()
    with torch.no_grad():
        assert_same(layers["device"](x), layers["eager"](x))
    assert device.calls == {8: 0, 10: 0, 16: 0} and device.eager_calls == 1


DEVICE = "(choose='device'): "


@pytest.mark.parametrize("change, options, message", [
    ("ep2", {}, DEVICE + "the experts are split over 2 expert-parallel ranks; the ranks would have to agree on the "
                "capacity on the GPU and exchange tokens outside the node's bodies, which is not built. Use "
                "choose='host'."),
    ("fp8", {}, DEVICE + "the layers train in FP8 or FP4, not yet proven with the capacity chosen on the GPU. Use "
                "choose='host'."),
    (None, {"span": "experts"}, DEVICE + "the node holds the dispatch, experts and combine (span='dispatch'); "
                                         "span='experts' is not supported."),
    (None, {"tokens": None}, DEVICE + "tokens= (the tokens one layer call routes, a positive count) is needed: the "
                                      "last capacity holds all of them."),
    (None, {"overflow": "eager", "eager_replay": True, "num_warmup_iters": 2},
     DEVICE + "overflow, eager_replay, num_warmup_iters belong to the graphs of the whole layer, which this call "
     "does not make; pass them where the layer is graphed."),
    ("hooked", {}, ": span='dispatch' cannot graph this layer's dispatch: its experts module has hooks, which run "
                   "where megatron-core calls the experts (the dispatch graphs call their forward within). "
                   "Use choose='host'."),
])
def test_what_the_device_choice_cannot_serve_is_refused_before_anything_changes(change, options, message):
    layer = MoELayerLike()
    if change == "ep2":
        layer.token_dispatcher.ep_size = 2
    elif change == "fp8":
        layer.config.fp8 = "hybrid"
    elif change == "hooked":
        layer.experts.register_forward_hook(lambda module, args, output: None)
    arguments = {"tokens": TOKENS, "choose": "device", **options}
    with refused(ValueError, re.escape(f"te_graph.graph_dropless_experts{message}"), layer):
        graph_dropless_experts(layer, CAPACITIES, **arguments)
    assert not {"dispatch", "routed_experts_compute"} & set(layer.__dict__)


def test_an_unknown_choice_and_recompute_without_the_device_choice_are_refused():
    layer = MoELayerLike()
    with refused(ValueError, re.escape("te_graph.graph_dropless_experts: choose='gpu'; use 'host' or 'device'."),
                 layer):
        graph_dropless_experts(layer, CAPACITIES, tokens=TOKENS, choose="gpu")
    with refused(ValueError, re.escape(
            "te_graph.graph_dropless_experts: recompute=True runs the capacity's program again in the backward of "
            "the node choose='device' makes; the host-chosen graphs do not take it."), layer):
        graph_dropless_experts(layer, CAPACITIES, tokens=TOKENS, recompute=True)
    with refused(TypeError, re.escape("te_graph.graph_dropless_experts: recompute must be a bool, not str."), layer):
        graph_dropless_experts(layer, CAPACITIES, tokens=TOKENS, choose="device", recompute="no")
