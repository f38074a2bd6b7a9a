"""megatron-core's layers under the per-call check (``te_graph.guards.frozen``), as its
integration (``te_graph.integrations.megatron``) describes them to the engine: which
submodules a layer's graphs leave to run eagerly, hooks on a layer that replays from its own
``__call__``, and DDP's forward pre-hooks that megatron-core's helper runs by hand before each
replay. megatron-core itself is not needed (its layers and hooks are imitated); skipped where
the integration does not import."""
from __future__ import annotations

import types

import pytest
from torch import nn

from tests.graph_helpers import ddp_pre_hook, require
from tests.test_frozen import Net, _graphed, _refused, _x

require("te_graph.integrations.megatron", "megatron-core's integration")


def test_hooks_on_a_module_whose_class_replays_from_its_own_call_are_refused():
    """megatron-core's layers replay the graphs from their own ``__call__``, before
    ``nn.Module.__call__`` runs the layer's hooks (``routed``; the Megatron GPU tests graph such
    layers through the helper): there hooks on the module itself are refused too, while DDP's
    forward pre-hooks the helper runs by hand still pass."""
    from te_graph.guards.frozen import FrozenModule  # noqa: PLC0415

    m = Net()
    frozen = FrozenModule(m, frozenset(), lambda module: False, routed=True)
    plain = FrozenModule(m, frozenset(), lambda module: False)  # a module whose hooks run around the call
    m.cuda_graph_manual_hooks = [(ddp_pre_hook(), (m.lin1,))]
    handle = m.register_forward_pre_hook(ddp_pre_hook())  # DDP's, on the layer itself
    assert not frozen.matches() and frozen.changes() == [] and frozen.matches()
    handle.remove()
    m.register_forward_hook(lambda *_: None)
    assert not frozen.matches()
    assert frozen.changes() == [
        "forward hooks on the module changed (0 -> 1); megatron-core's __call__ replays this layer's graphs without "
        "nn.Module.__call__, so hooks on the layer itself never run at replay, while an eager run would run them; "
        "remove the hook (a hook that must run belongs outside the graphed layer, on the module that calls it)"]
    assert plain.matches() and plain.changes() == []


class MegatronLayerLike(nn.Module):
    """The submodules of a megatron-core 0.19 TransformerLayer (an MoE one with ``moe=True``)
    and the attributes by which ``submodules_run_eagerly`` reads its helper's scopes."""

    def __init__(self, scopes, moe=False, shared_overlap=False):
        super().__init__()
        self.config = types.SimpleNamespace(cuda_graph_modules=scopes, moe_shared_expert_overlap=shared_overlap)
        self.is_moe_layer = moe
        for name in ("input_layernorm", "self_attention", "pre_cross_attn_layernorm", "cross_attention",
                     "cross_attn_bda", "pre_mlp_layernorm", "mlp_bda"):
            setattr(self, name, nn.Identity())
        self.mlp = nn.Module()
        for name in ("router", "experts", "shared_experts", "fc1_latent_proj", "fc2_latent_proj") if moe else ("fc1",):
            setattr(self.mlp, name, nn.Linear(2, 2))

    def _te_cuda_graph_capture(self, *args):
        return args


ATTENTION_SIDE = {"input_layernorm", "self_attention", "pre_cross_attn_layernorm", "cross_attention", "cross_attn_bda"}


@pytest.mark.parametrize("scopes, moe, shared_overlap, eager", [
    ([], False, False, set()),  # the whole layer in the graph
    (["attn", "mlp"], False, False, set()),
    (["attn"], False, False, {"pre_mlp_layernorm", "mlp", "mlp.fc1", "mlp_bda"}),
    (["mlp"], False, False, ATTENTION_SIDE),
    (["attn", "moe_router", "moe_preprocess"], True, False, {"mlp.experts", "mlp.fc2_latent_proj"}),
    (["attn", "moe_router", "moe_preprocess"], True, True, {"mlp.experts", "mlp.fc2_latent_proj"}),
    (["attn", "moe_router"], True, True, {"mlp.experts", "mlp.fc2_latent_proj", "mlp.fc1_latent_proj",
                                          "mlp.shared_experts"}),
    (["attn", "moe"], True, False, set()),
    (["attn"], True, False, {"pre_mlp_layernorm", "mlp", "mlp_bda"} | {f"mlp.{n}" for n in (
        "router", "experts", "shared_experts", "fc1_latent_proj", "fc2_latent_proj")}),
])
def test_the_submodules_a_megatron_layers_graphs_leave_to_run_eagerly(scopes, moe, shared_overlap, eager):
    """As megatron-core 0.19's _te_cuda_graph_capture and _te_cuda_graph_replay split a layer
    by its helper's scopes: hooks on these run eagerly, exactly; the MLP itself under the
    router's scope is in the graph (its forward returns early there) and is never listed."""
    from te_graph.integrations.megatron import submodules_run_eagerly  # noqa: PLC0415

    assert submodules_run_eagerly(MegatronLayerLike(scopes, moe, shared_overlap)) == eager


def test_ddp_pre_hooks_megatrons_helper_runs_by_hand_pass_in_any_order_and_others_are_refused():
    """megatron-core with ``overlap_param_gather``: DDP's forward pre-hooks go on every
    submodule after capture, the helper's ``cuda_graph_manual_hooks`` runs those of the
    submodules with parameters under the graph's scopes before each replay (here lin1 and
    lin2), and those of modules without parameters of their own do nothing; Megatron-LM
    turns them off and on. One on a submodule with parameters that the helper does not run
    would be skipped: refused."""
    m = _graphed()
    m.cuda_graph_manual_hooks = [(ddp_pre_hook(), (m.lin1,)), (ddp_pre_hook(), (m.lin2,))]
    for _ in range(2):  # DDP's enable_forward_pre_hook / disable_forward_pre_hook, twice
        handles = [sub.register_forward_pre_hook(ddp_pre_hook()) for sub in m.modules()]
        m(_x()).sum().backward()
        for handle in handles:
            handle.remove()
        m(_x()).sum().backward()
    handles = [sub.register_forward_pre_hook(ddp_pre_hook()) for sub in m.modules()]
    m(_x()).sum().backward()
    manual, m.cuda_graph_manual_hooks = m.cuda_graph_manual_hooks, []  # the helper stops running them
    _refused(m, "callable 0 (Net): since graphing, forward pre hooks on submodule 'lin1' changed (0 -> 1); ")
    m.cuda_graph_manual_hooks = manual[:1]  # ... or runs lin1's alone: lin2's all-gather wait would be skipped
    _refused(m, "callable 0 (Net): since graphing, forward pre hooks on submodule 'lin2' changed (0 -> 1); ")
    m.cuda_graph_manual_hooks = manual
    for handle in handles:
        handle.remove()
    m.drop.register_forward_pre_hook(ddp_pre_hook())  # DDP's, on a module without parameters
    m.drop.register_forward_pre_hook(lambda *_: None)  # the user's
    _refused(m, "callable 0 (Net): since graphing, forward pre hooks on submodule 'drop' changed (0 -> 2); ")


def test_a_hook_swapped_for_another_keeps_the_count_and_is_still_refused():
    """After an accepted change the fast path knows the new hooks: a DDP hook later swapped
    for a user's (same count per table) is refused."""
    m = _graphed()
    m.cuda_graph_manual_hooks = [(ddp_pre_hook(), (m.lin1,))]
    handle = m.lin1.register_forward_pre_hook(ddp_pre_hook())
    m(_x()).sum().backward()  # accepted: the helper runs it by hand
    handle.remove()
    m.lin1.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    _refused(m, "callable 0 (Net): since graphing, forward pre hooks on submodule 'lin1' changed "
                "(0 -> 1); ")
