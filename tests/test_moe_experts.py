"""Dropless MoE experts in graphs, one per token capacity (``te_graph.integrations.megatron.moe_experts``).

On the CPU, through eager replay (the same wrapper without graphs), with experts laid out as
megatron-core's are called (``experts(hidden, tokens_per_expert, probs) -> (out, bias)``): each
call goes to the smallest capacity that holds every expert's tokens or, above the largest,
eagerly; no token is dropped; outputs and gradients match the experts run unpadded. The
graphs themselves, on megatron-core's TE grouped-GEMM experts, are in tests/test_megatron_path.py.
"""
from __future__ import annotations

import re
import types

import pytest
import torch
from torch import nn

import te_graph
from tests.graph_helpers import ddp_pre_hook, require
from tests.harness import refused

require("te_graph.integrations.megatron.moe", "megatron-core's integration, whose MoE code uses Transformer Engine's")

from te_graph.integrations.megatron.moe import capacities_for, graph_dropless_experts  # noqa: E402
from te_graph.integrations.megatron.moe_dispatch import distinct_blocks  # noqa: E402
from te_graph.integrations.megatron.moe_experts import skips_weight_update  # noqa: E402
from te_graph.integrations.transformer_engine.modules import keeps_weight_cache  # noqa: E402

H, E = 8, 4


class Experts(nn.Module):
    """One linear per expert, then times the token's routing probability."""

    def __init__(self):
        super().__init__()
        self.num_local_experts = E
        self.fc = nn.ModuleList(nn.Linear(H, H, bias=False, dtype=torch.float64) for _ in range(E))

    def forward(self, hidden, tokens_per_expert, probs):
        chunks = torch.split(hidden, tokens_per_expert.tolist())
        out = torch.cat([torch.tanh(fc(x)) for fc, x in zip(self.fc, chunks)])
        return out * probs.unsqueeze(-1), None


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = Experts()
        self.token_dispatcher = object()
        self.config = types.SimpleNamespace(hidden_size=H, params_dtype=torch.float64)


def _call(experts, counts, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(counts)
    hidden = torch.randn(total, H, dtype=torch.float64, generator=g, requires_grad=True)
    probs = torch.rand(total, dtype=torch.float64, generator=g, requires_grad=True)
    out, bias = experts(hidden, torch.tensor(counts), probs)
    (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
    return out.detach(), hidden.grad, probs.grad, [p.grad.clone() for p in experts.parameters()]


def test_replays_reuse_the_cached_fp8_weights_only_where_the_eager_wrappers_would():
    """megatron-core's TE wrappers pass is_first_microbatch to TE (False: reuse the weights
    quantized at the step's first microbatch), or None where they keep no weight cache
    (disable_parameter_transpose_cache: quantize at every call)."""
    def wrapper(first, cache_off=False):
        return types.SimpleNamespace(is_first_microbatch=first, disable_parameter_transpose_cache=cache_off)

    assert skips_weight_update([wrapper(False)]) is True
    assert skips_weight_update([wrapper(True)]) is False
    assert skips_weight_update([wrapper(False, cache_off=True)]) is False
    assert skips_weight_update([]) is False
    # The same decision for te_graph's FP8 graphs of whole layers (the TE integration's FP8Replay).
    assert keeps_weight_cache([object(), wrapper(False)]) is True
    assert keeps_weight_cache([object(), wrapper(False, cache_off=True)]) is False


def test_capacities_are_multiples_of_the_even_share_rounded_up_to_16_rows():
    assert capacities_for(2048, 2, 8, [1.0, 1.25, 2.0]) == [512, 640, 1024]
    assert capacities_for(100, 2, 8, [1.1]) == [32]
    assert capacities_for(10, 1, 2, [4.0]) == [10]  # never more than every assignment on one expert


@pytest.mark.parametrize("overflow", ["padded", "eager"])
def test_each_call_takes_the_smallest_capacity_that_holds_it_and_trains_as_unpadded(overflow):
    """Above the largest capacity (17 tokens on one expert) the padded program runs eagerly
    at 128 rows per expert, or the experts' own forward: either way as unpadded."""
    torch.manual_seed(0)
    eager, graphed = Layer(), Layer()
    graphed.load_state_dict(eager.state_dict())
    installed = graph_dropless_experts(graphed, [16, 8], probs_dtype=torch.float64, overflow=overflow,
                                       eager_replay=True)
    assert [d.capacities for d in installed] == [(8, 16)]
    for seed, counts in enumerate([[3, 8, 0, 5], [9, 2, 2, 16], [17, 1, 1, 1], [0, 0, 0, 1]]):
        for p in list(eager.parameters()) + list(graphed.parameters()):
            p.grad = None
        want = _call(eager.experts, counts, seed)
        got = _call(graphed.experts, counts, seed)
        for a, b in zip(want[:3], got[:3]):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
        for a, b in zip(want[3], got[3]):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    d = installed[0]
    assert d.calls == {8: 2, 16: 1} and d.eager_calls == 1
    # Outside training the experts run as they were.
    graphed.eval()
    _call(graphed.experts, [1, 2, 3, 4], 9)
    assert d.eager_calls == 2
    d.remove()
    assert "forward" not in graphed.experts.__dict__


def test_hooks_on_the_experts_module_run_around_each_call_and_hooks_inside_it_are_refused():
    """megatron-core calls the experts module through nn.Module.__call__, and the capacity graphs
    of the experts alone replay inside its forward: its own hooks run around each call as around
    its eager forward, registered before graphing or after. A hook on a submodule would run only
    while the graphs are captured: refused at graphing, or at the next call."""
    torch.manual_seed(0)
    eager, graphed = Layer(), Layer()
    graphed.load_state_dict(eager.state_dict())
    seen: dict = {"eager": [], "graphed": []}

    def hook(name):
        return lambda module, args, out: seen[name].append(out[0].detach().clone())

    eager.experts.register_forward_hook(hook("eager"))
    graphed.experts.register_forward_hook(hook("graphed"))
    installed = graph_dropless_experts(graphed, [16, 8], probs_dtype=torch.float64, eager_replay=True)
    scale = lambda module, args: (args[0] * 2, *args[1:])  # noqa: E731  (registered after graphing)
    eager.experts.register_forward_pre_hook(scale)
    graphed.experts.register_forward_pre_hook(scale)
    for seed, counts in enumerate([[3, 8, 0, 5], [9, 2, 2, 16]]):
        want, got = _call(eager.experts, counts, seed), _call(graphed.experts, counts, seed)
        for a, b in zip(want[:3] + tuple(want[3]), got[:3] + tuple(got[3])):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    assert installed[0].calls == {8: 1, 16: 1}
    assert len(seen["graphed"]) == len(seen["eager"]) == 2
    for a, b in zip(seen["eager"], seen["graphed"]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    graphed.experts.fc[0].register_forward_hook(lambda *_: None)
    with pytest.raises(RuntimeError, match=re.escape("forward hooks on submodule 'experts.fc.0' changed (0 -> 1); "
                                                     "hooks on a submodule run only while a graph is captured")):
        _call(graphed.experts, [1, 2, 3, 0], 3)
    installed[0].remove()
    with pytest.raises(ValueError, match=re.escape("submodule 'experts.fc.0' of callable 0 has hooks registered")):
        graph_dropless_experts(graphed, [8], probs_dtype=torch.float64, eager_replay=True)


def test_a_call_while_an_earlier_one_waits_for_its_backward_runs_the_padded_program_eagerly():
    """Several microbatches in flight (a pipeline schedule's forwards before their backwards):
    the graphs of a layer share their buffers, so a call while an earlier one still waits for
    its backward runs the same padded program eagerly; every call trains as unpadded."""
    torch.manual_seed(0)
    eager, graphed = Layer(), Layer()
    graphed.load_state_dict(eager.state_dict())
    (installed,) = graph_dropless_experts(graphed, [16, 8], probs_dtype=torch.float64, eager_replay=True)
    results = {}
    for name, layer in (("eager", eager), ("graphed", graphed)):
        outs, leaves = [], []
        for seed, counts in enumerate([[3, 8, 0, 5], [9, 2, 2, 16], [1, 1, 1, 1]]):  # three in flight
            g = torch.Generator().manual_seed(seed)
            hidden = torch.randn(sum(counts), H, dtype=torch.float64, generator=g, requires_grad=True)
            probs = torch.rand(sum(counts), dtype=torch.float64, generator=g, requires_grad=True)
            outs.append(layer.experts(hidden, torch.tensor(counts), probs)[0])
            leaves += [hidden, probs]
        for out in reversed(outs):  # backwards in the reverse order, as a pipeline's cool-down
            out.square().sum().backward()
        results[name] = [o.detach() for o in outs] + [t.grad for t in leaves] + [p.grad for p in layer.parameters()]
    for a, b in zip(results["eager"], results["graphed"]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    assert installed.calls == {8: 1, 16: 0} and installed.eager_calls == 2
    # One at a time again: the graphs serve every call.
    _call(graphed.experts, [1, 2, 3, 4], 7)
    assert installed.calls == {8: 2, 16: 0}
    # A recompute inside the backward (a non-reentrant checkpoint around the experts) must repeat
    # the forward it recomputes: the graphs' own refusal, not the eager program.
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(4, H, dtype=torch.float64, generator=g, requires_grad=True)
    probs = torch.rand(4, dtype=torch.float64, generator=g, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(lambda h, p: graphed.experts(h, torch.tensor([1, 1, 1, 1]), p)[0],
                                            hidden, probs, use_reentrant=False)
    with pytest.raises(RuntimeError, match="called again while the backward of its previous call has not run"):
        out.sum().backward()


def test_capacity_graphs_freed_by_te_graph_reset_leave_the_padded_program_eager():
    """te_graph.reset() frees every graph, these too: later calls run the padded program
    eagerly (as the module it was graphed from now does), until remove()."""
    torch.manual_seed(0)
    eager, graphed = Layer(), Layer()
    graphed.load_state_dict(eager.state_dict())
    (installed,) = graph_dropless_experts(graphed, [8], probs_dtype=torch.float64, eager_replay=True)
    te_graph.reset()
    want, got = _call(eager.experts, [3, 1, 0, 2], 0), _call(graphed.experts, [3, 1, 0, 2], 0)
    for a, b in zip(want[:3] + tuple(want[3]), got[:3] + tuple(got[3])):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    installed.remove()


def test_bad_requests_are_refused_before_anything_changes():
    layer, linear = Layer(), nn.Linear(2, 2)
    with refused(ValueError, re.escape(
            "te_graph.graph_dropless_experts: capacities must be positive row counts, got [0]."), layer):
        graph_dropless_experts(layer, [0], eager_replay=True)
    with refused(ValueError, re.escape(
            "te_graph.graph_dropless_experts: the model holds no megatron-core MoELayer"), linear):
        graph_dropless_experts(linear, [8], eager_replay=True)
    with refused(ValueError, re.escape(
            "te_graph.graph_dropless_experts: overflow='drop'; use 'padded' or 'eager'."), layer):
        graph_dropless_experts(layer, [8], overflow="drop", eager_replay=True)
    with refused(ValueError, re.escape(
            "te_graph.graph_dropless_experts: each layer's experts get a pool of their own"), layer):
        graph_dropless_experts(layer, [8], eager_replay=True, pool=object())
    assert "forward" not in layer.experts.__dict__
    graph_dropless_experts(layer, [8], probs_dtype=torch.float64, eager_replay=True)
    with refused(ValueError, re.escape("these experts are graphed already; remove() first."), layer):
        graph_dropless_experts(layer, [8], probs_dtype=torch.float64, eager_replay=True)


def test_token_counts_for_another_number_of_experts_are_refused_at_the_call():
    layer = Layer()
    graph_dropless_experts(layer, [8], probs_dtype=torch.float64, eager_replay=True)
    hidden = torch.randn(10, H, dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape(
            "te_graph.graph_dropless_experts: the experts got token counts for 3 experts, but they hold 4 local "
            "experts (their graphs lay the tokens out that many blocks of rows): pass one count per local expert, "
            "as megatron-core's dispatcher does.")):
        layer.experts(hidden, torch.tensor([3, 2, 5]), torch.rand(10, dtype=torch.float64))


def test_probabilities_of_another_dtype_than_captured_are_refused_at_the_call():
    layer = Layer()
    graph_dropless_experts(layer, [8], eager_replay=True)  # the parameters' dtype: float64
    hidden = torch.randn(3, H, dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape(
            "te_graph.graph_dropless_experts: the experts got tokens in torch.float64 and routing probabilities "
            "in torch.float32, but their graphs were captured for torch.float64 and torch.float64: pass "
            "probs_dtype=torch.float32 to graph_dropless_experts")):
        layer.experts(hidden, torch.tensor([1, 1, 1, 0]), torch.rand(3))


def test_rows_the_counts_do_not_add_up_to_fail_in_the_experts_own_forward_as_eagerly():
    """A router of one's own sending fewer than top-k assignments: megatron-core permutes
    tokens x top-k rows all the same, and its experts fail on the counts' sum; the graphed
    experts hand such a call to the experts' own forward (the padded layout would index past
    the last expert: on a GPU, a device-side assert) and serve the next call."""
    eager, graphed = Layer(), Layer()
    graphed.load_state_dict(eager.state_dict())
    (installed,) = graph_dropless_experts(graphed, [8], probs_dtype=torch.float64, eager_replay=True)
    hidden, probs = torch.randn(10, H, dtype=torch.float64), torch.rand(10, dtype=torch.float64)
    counts = torch.tensor([3, 2, 2, 1])  # 8 of 10 rows
    with pytest.raises(RuntimeError) as want:
        eager.experts(hidden, counts, probs)
    with pytest.raises(RuntimeError) as got:
        graphed.experts(hidden, counts, probs)
    assert str(got.value) == str(want.value) and "split_with_sizes" in str(got.value)
    assert installed.eager_calls == 1 and installed.calls == {8: 0}
    want = _call(eager.experts, [3, 2, 2, 3], 1)
    got = _call(graphed.experts, [3, 2, 2, 3], 1)
    for a, b in zip(want[:3], got[:3]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    assert installed.calls == {8: 1}


def test_the_graphs_take_the_parameters_dtype_and_a_token_dtype_mismatch_is_named():
    """megatron-core's Float16Module casts the parameters whatever config.params_dtype says:
    the graphs take the tokens in the parameters' dtype; tokens in another dtype are refused
    at the call, naming the tokens (not the probabilities)."""
    layer = Layer()
    layer.config.params_dtype = torch.float32  # stale: the parameters are float64
    (installed,) = graph_dropless_experts(layer, [8], probs_dtype=torch.float64, eager_replay=True)
    assert installed.dtypes == (torch.float64, torch.float64)
    _call(layer.experts, [1, 2, 3, 4], 0)
    assert installed.calls == {8: 1}
    with pytest.raises(ValueError, match=re.escape(
            "te_graph.graph_dropless_experts: the experts got tokens in torch.float32, but their graphs were "
            "captured for torch.float64, their parameters' dtype at graphing: graph them after the model is cast "
            "(megatron-core's Float16Module, .to(dtype)), then call them in that dtype.")):
        layer.experts(torch.randn(3, H), torch.tensor([1, 1, 1, 0]), torch.rand(3, dtype=torch.float64))


class TransformerLayerLike(nn.Module):
    """A megatron-core layer holding the MoE layer as its MLP, with the helper's manual
    hooks (``cuda_graph_set_manual_hooks``) for a submodule of its own graphed part."""

    def __init__(self, calls: list):
        super().__init__()
        self.mlp = Layer()
        self.cuda_graph_manual_hooks = [(ddp_pre_hook(calls), (self.mlp,))]


def test_ddp_pre_hooks_on_the_experts_run_before_each_replay_and_other_hooks_are_refused():
    """megatron-core DDP's forward pre-hooks (``overlap_param_gather``), which it puts on every
    submodule after the graphs are made: those of the experts' submodules with parameters wait
    for the parameters' all-gather, so they run by hand before each replay (eager replay also
    runs them as the experts call their submodules), where the layer's helper runs DDP's hooks
    by hand; any other hook on a submodule is refused at the next call."""
    calls: list = []
    owner = TransformerLayerLike(calls)
    installed = graph_dropless_experts(owner, [8], probs_dtype=torch.float64, eager_replay=True)
    experts = owner.mlp.experts
    handles = [m.register_forward_pre_hook(ddp_pre_hook(calls)) for m in owner.modules()]
    _call(experts, [1, 2, 3, 0], 0)
    assert installed[0].calls == {8: 1}
    assert calls[0] is experts  # its own, around its call (megatron-core calls the experts module)
    assert calls[1:1 + E] == list(experts.fc), "by hand, before the replay: each submodule with parameters, once"
    assert calls[1 + E:] == list(experts.fc), "then as the experts call them (eager replay)"
    owner.cuda_graph_manual_hooks = []  # a helper that runs no hook by hand: nothing to take them for
    with pytest.raises(RuntimeError, match=re.escape("forward pre hooks on submodule 'experts.fc.0' changed (0 -> 1)")):
        _call(experts, [1, 2, 3, 0], 1)
    for handle in handles:
        handle.remove()
    owner.cuda_graph_manual_hooks = [(ddp_pre_hook(calls), (owner.mlp,))]
    experts.fc[1].register_forward_pre_hook(lambda *_: None)  # the user's
    with pytest.raises(RuntimeError, match=re.escape("forward pre hooks on submodule 'experts.fc.1' changed (0 -> 1)")):
        _call(experts, [1, 2, 3, 0], 2)


class Broken(Experts):
    def forward(self, hidden, tokens_per_expert, probs):
        raise RuntimeError("broken experts")


def test_a_failure_on_a_later_layer_leaves_every_layer_as_it_was():
    model = nn.ModuleList([Layer(), Layer()])
    model[1].experts = Broken()
    with refused(RuntimeError, "broken experts", model):
        graph_dropless_experts(model, [8], probs_dtype=torch.float64, eager_replay=True)
    assert all("forward" not in layer.experts.__dict__ for layer in model)


@pytest.mark.parametrize("setup, message", [
    ("instance-forward", "the Experts module has a forward of its own, set on the instance"),
    ("fp4", "the layers train in FP4 (fp4_recipe='nvfp4')"),
    ("drop-and-pad", "the layers route with a capacity factor (drop-and-pad)"),
    ("delayed-wgrad", "the experts delay their weight gradients (delay_wgrad_compute)"),
])
def test_layers_it_cannot_serve_exactly_are_refused_before_any_is_graphed(setup, message):
    model = nn.ModuleList([Layer(), Layer()])
    last = model[1]
    if setup == "instance-forward":
        last.experts.forward = last.experts.forward  # a bound method set on the instance
    elif setup == "fp4":
        last.config.fp4, last.config.fp4_recipe = "e2m1", "nvfp4"
    elif setup == "drop-and-pad":
        last.config.moe_expert_capacity_factor, last.config.moe_pad_expert_input_to_capacity = 1.0, True
    else:
        last.config.delay_wgrad_compute = True
    with refused(ValueError, re.escape(f"te_graph.graph_dropless_experts: {message}"), model):
        graph_dropless_experts(model, [8], probs_dtype=torch.float64, eager_replay=True)
    assert "forward" not in model[0].experts.__dict__


class AlltoAllLike:
    """The attributes by which a dispatcher is taken for megatron-core's alltoall dispatcher
    (duck-typed, as for a fork of it): what the dispatch span's refusals read."""

    def __init__(self, ep_size=1, tp_size=1, drop_and_pad=False):
        self.ep_size, self.tp_size, self.drop_and_pad, self.shared_experts = ep_size, tp_size, drop_and_pad, None
        self.sort_input_by_local_experts = torch.arange(E)

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        return tokens_per_expert


@pytest.mark.parametrize("dispatcher, tokens, capacities, why", [
    (object(), 16, [8], "its token dispatcher (object) is not megatron-core's alltoall dispatcher"),
    (AlltoAllLike(tp_size=2), 16, [8], "each expert is split over ranks (expert tensor-parallel size 2): the "
                                       "dispatcher's gather over them takes split sizes from the host"),
    (AlltoAllLike(drop_and_pad=True), 16, [8], "it routes with drop-and-pad"),
    (AlltoAllLike(), None, [8], "tokens= (the tokens one layer call routes) was not given"),
    (AlltoAllLike(), 16, [7, 6], "every capacity is below the even share of 8 rows per expert (16 tokens, top-2 "
                                 "of 4 experts), which no routing fits"),
    # Over 2 expert-parallel ranks a capacity of 14 rows per expert takes blocks of 7 rows per rank.
    (AlltoAllLike(ep_size=2), 16, [14], "every capacity is below the even share of 8 rows per expert (16 tokens, "
                                        "top-2 of 4 experts) from each of 2 expert-parallel ranks, 16 rows in all, "
                                        "which no routing fits"),
    (AlltoAllLike(), 16, [8],
     f"the module of its dispatcher's class ({__name__}) has no permute, unpermute and all_to_all"),
    ("forward-hooked", 16, [8], "its experts module has hooks, which run where megatron-core calls the experts "
                                "(the dispatch graphs call their forward within)"),
    ("backward-hooked", 16, [8], "its experts module has hooks, which run where megatron-core calls the experts "
                                 "(the dispatch graphs call their forward within)"),
])
def test_a_dispatch_span_the_layer_cannot_take_is_refused_by_name_and_auto_graphs_the_experts(
        dispatcher, tokens, capacities, why):
    layer = Layer()
    if dispatcher == "forward-hooked":
        layer.experts.register_forward_hook(lambda module, args, output: None)
    elif dispatcher == "backward-hooked":
        layer.experts.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    if isinstance(dispatcher, str):
        dispatcher = AlltoAllLike()
    layer.token_dispatcher = dispatcher
    layer.config.moe_router_topk, layer.config.num_moe_experts = 2, E
    with refused(ValueError, re.escape(
            f"te_graph.graph_dropless_experts: span='dispatch' cannot graph this layer's dispatch: {why}. "
            "Use span='experts' (or 'auto')."), layer):
        graph_dropless_experts(layer, capacities, tokens=tokens, span="dispatch", probs_dtype=torch.float64,
                               eager_replay=True)
    assert "forward" not in layer.experts.__dict__ and "routed_experts_compute" not in layer.__dict__
    # "auto" graphs the experts alone (hooks on the experts module run around those graphs).
    (installed,) = graph_dropless_experts(layer, capacities, tokens=tokens, probs_dtype=torch.float64,
                                          eager_replay=True)
    assert installed.span == "experts" and isinstance(layer.experts.__dict__["forward"].__self__, type(installed))


def test_a_capacity_factor_without_padding_is_graphed_as_dropless_experts_and_its_dispatch_refused():
    """Tokens beyond the capacity are dropped, but the experts' counts stay dynamic (at most
    the capacity): the experts span serves them as dropless calls; the dispatch span, built
    for tokens x top-k permuted rows, is refused by name."""
    eager, graphed = Layer(), Layer()
    graphed.load_state_dict(eager.state_dict())
    for layer in (eager, graphed):
        layer.config.moe_expert_capacity_factor = 1.0  # moe_pad_expert_input_to_capacity unset
        layer.token_dispatcher = AlltoAllLike()
        layer.config.moe_router_topk, layer.config.num_moe_experts = 2, E
    with refused(ValueError, re.escape(
            "te_graph.graph_dropless_experts: span='dispatch' cannot graph this layer's dispatch: it drops tokens "
            "beyond a capacity (moe_expert_capacity_factor), so the permuted tokens are not tokens x top-k rows. "
            "Use span='experts' (or 'auto')."), graphed):
        graph_dropless_experts(graphed, [8], tokens=16, span="dispatch", probs_dtype=torch.float64,
                               eager_replay=True)
    (installed,) = graph_dropless_experts(graphed, [8], tokens=16, probs_dtype=torch.float64, eager_replay=True)
    assert installed.span == "experts"
    want = _call(eager.experts, [8, 3, 0, 8], 2)
    got = _call(graphed.experts, [8, 3, 0, 8], 2)
    for a, b in zip(want[:3] + tuple(want[3]), got[:3] + tuple(got[3])):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    assert installed.calls == {8: 1} and installed.eager_calls == 0


def test_capacities_sharing_a_block_size_over_expert_parallel_ranks_are_graphed_once():
    """Over R ranks a capacity takes blocks of ceil(capacity / R) rows per rank; of capacities
    with one block size the smallest is graphed (a call takes the smallest that holds it)."""
    assert distinct_blocks([48, 40, 32, 16], 16) == ([40, 32, 16], [48])
    assert distinct_blocks([16, 15], 2) == ([15], [16])
    assert distinct_blocks([32, 16], 1) == ([32, 16], [])


def test_bad_spans_and_token_counts_are_refused():
    layer = Layer()
    with refused(ValueError, re.escape(
            "te_graph.graph_dropless_experts: span='layer'; use 'auto', 'experts' or 'dispatch'."), layer):
        graph_dropless_experts(layer, [8], span="layer", eager_replay=True)
    with refused(ValueError, re.escape(
            "te_graph.graph_dropless_experts: tokens must be a positive count, got 0."), layer):
        graph_dropless_experts(layer, [8], tokens=0, eager_replay=True)
    assert "forward" not in layer.experts.__dict__
