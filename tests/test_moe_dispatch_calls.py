"""The dispatch span's calls, one by one, on a real megatron-core ``MoELayer`` (TE spec, 4
experts, top-2, alltoall dispatcher) used on its own, without Megatron's graph helper, as a
user would call a layer: in training, with a router that sends a token to fewer than top-k
experts (a router of one's own: megatron-core 0.19's dropless dispatch fails on it, and the
graphed layers must fail alike and go on working), in eval under ``no_grad``, at another
sequence length, and in training again.

Three copies of the layer, made alike, take the same calls: megatron-core's own (eager),
te_graph's capacity graphs with the dispatch inside (``span="dispatch"``) and their eager
replay. A call the graphs serve equals the replay bitwise (output, input gradient, every
parameter gradient accumulated so far); a call they hand to megatron-core's own methods
equals the eager layer bitwise, and is counted in ``eager_calls``; parameter gradients are
compared call by call (set to None before each). Each parametrisation runs
in a fresh process (NCCL group, Megatron's parallel state). Needs a GPU, megatron-core 0.19
and Transformer Engine 2.20.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests import harness
from tests.graph_helpers import require
from tests.multi_gpu_helpers import fresh_process_env

require("te_graph.integrations.megatron.moe", "megatron-core's integration, whose MoE code uses Transformer Engine's")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core: pip install megatron-core==0.19.2"),
    pytest.mark.skipif(not HAVE_TE, reason='needs Transformer Engine: pip install -e ".[te]"'),
]

SEQ, BATCH, HIDDEN, EXPERTS, TOPK = 64, 2, 256, 4, 2
# (call, sequence length, served by the graphs): every call but the first and last goes to
# megatron-core's own methods; None: megatron-core's own methods fail (its dropless dispatch
# takes top-k assignments per token), and the graphed layers fail alike, and go on working.
CALLS = [("train", SEQ, True), ("router sends fewer than top-k", SEQ, None), ("eval", SEQ, False),
         ("another sequence length", SEQ // 2, False), ("train again", SEQ, True)]


@pytest.mark.parametrize("permute_fusion", [False, True], ids=["unfused-permute", "fused-permute"])
def test_each_call_is_served_exactly_or_handed_to_megatron_core(permute_fusion):
    done = subprocess.run([sys.executable, os.path.abspath(__file__), str(int(permute_fusion))], cwd=ROOT,
                          env=fresh_process_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "all calls checked" in done.stdout, done.stdout[-2000:]
    print(done.stdout)


def _layers(permute_fusion: bool) -> list:
    """Three MoE layers made alike (same seeds): eager, graphed, replayed."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, bf16=True, params_dtype=torch.bfloat16,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none", moe_ffn_hidden_size=512, moe_permute_fusion=permute_fusion,
        gradient_accumulation_fusion=False)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=EXPERTS, moe_grouped_gemm=True).submodules.mlp
    layers = []
    for _ in range(3):
        model_parallel_cuda_manual_seed(1234, te_rng_tracker=True, force_reset_rng=True)
        torch.manual_seed(1234)
        layers.append(spec(config=config, layer_number=1).cuda())  # the spec's MoELayer (a partial)
    return layers


def _call(layer, x, grad, training: bool):
    """One call and its backward (training), from leaf copies of ``x``: output, input grad."""
    x = x.detach().clone().requires_grad_(training)
    layer.train(training)
    with torch.enable_grad() if training else torch.no_grad():
        output, bias = layer(x)
        assert bias is None
        if training:
            output.backward(grad)
    return output.detach(), x.grad


def main(permute_fusion: bool) -> None:
    from examples.megatron_gpt import setup_process
    from te_graph.integrations.megatron.moe import capacities_for, graph_dropless_experts

    setup_process()
    eager, graphed, replayed = _layers(permute_fusion)
    tokens = SEQ * BATCH
    # Up to every token per expert: no call above the largest capacity.
    capacities = capacities_for(tokens, TOPK, EXPERTS, [1.0, EXPERTS / TOPK])
    (graphs,) = graph_dropless_experts(graphed, capacities, tokens=tokens, span="dispatch")
    (replay,) = graph_dropless_experts(replayed, capacities, tokens=tokens, span="dispatch", eager_replay=True)
    assert graphs.span == replay.span == "dispatch"
    g = torch.Generator(device="cuda").manual_seed(7)
    for name, seq, served in CALLS:
        x = torch.randn(seq, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        grad = torch.randn(seq, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        hooks = []
        if name == "router sends fewer than top-k":
            # A router of one's own: the first token goes to no expert.
            def drop_first(module, args, output):
                return output[0], output[1].clone().index_fill_(0, torch.tensor([0], device="cuda"), False)
            hooks = [layer.router.register_forward_hook(drop_first) for layer in (eager, graphed, replayed)]
        before = (graphs.eager_calls, replay.eager_calls)
        for layer in (eager, graphed, replayed):
            layer.zero_grad(set_to_none=True)  # each call's parameter gradients alone
        results, errors = {}, {}
        for kind, layer in (("eager", eager), ("graphed", graphed), ("replayed", replayed)):
            try:
                results[kind] = _call(layer, x, grad, name != "eval")
            except RuntimeError as error:
                errors[kind] = str(error)
        for hook in hooks:
            hook.remove()
        if served is None:
            assert len(errors) == 3 and len(set(errors.values())) == 1, f"{name}: {errors}"
            print(f"{name}: fails alike eagerly and graphed: {errors['eager'][:120]}", flush=True)
            continue
        assert not errors, f"{name}: {errors}"
        want = "replayed" if served else "eager"
        harness.assert_same(results["graphed"][0], results[want][0], f"{name}: output vs {want}", reference=want)
        harness.assert_same(results["graphed"][1], results[want][1], f"{name}: input grad vs {want}", reference=want)
        harness.assert_same(results["graphed"][0], results["replayed"][0], f"{name}: output vs replayed", reference="replayed")
        for (pname, p), q, r in zip(graphed.named_parameters(), eager.parameters(), replayed.parameters()):
            harness.assert_same(p.grad, (r if served else q).grad, f"{name}: grad of {pname} vs {want}",
                                reference=want)
        handed = (graphs.eager_calls - before[0], replay.eager_calls - before[1])
        assert handed == ((0, 0) if served else (1, 1)), f"{name}: calls handed to megatron-core {handed}"
        difference = (results["graphed"][0].float() - results["eager"][0].float()).abs().max().item()
        print(f"{name}: {'served by the graphs' if served else 'megatron-core own methods'}; output vs eager "
              f"max difference {difference:.3g}", flush=True)
    print("all calls checked", flush=True)


if __name__ == "__main__":  # launched with the repository root on PYTHONPATH (fresh_process_env)
    main(bool(int(sys.argv[1])))
