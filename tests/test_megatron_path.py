"""megatron-core's own CUDA-graph path with te_graph as the graph maker.

megatron-core's real training step: GPTModel (Transformer Engine layer spec, bf16), its DDP
(``main_grad``, gradient-accumulation fusion), its schedule (``get_forward_backward_func``
over 4 microbatches) and its ``TECudaGraphHelper`` making the graphs after one eager step,
with ``te_graph.integrations.megatron.enable()`` (examples/megatron_gpt.py). Each setup runs
eagerly, with te_graph's graphs and with te_graph's eager replay, in one fresh process, and
every step's losses, ``main_grad`` buffers and weights after the optimizer step are compared
bitwise; some setups run verified too (``VERIFIED_SETUPS``: the runtime verifier checks
every graphed call, finds nothing, and the run still trains as eager). The setups: dropout,
gradient-accumulation fusion, FP8, full and selective recompute
(both refused by Megatron with per-layer graphs; full recompute in bf16 and FP8), DDP's overlapped gradient reduction with
Megatron's optimizer, the distributed optimizer with overlapped parameter gathers (DDP's
forward pre-hooks run by the helper before each replay), megatron-core's own modules
(``transformer_impl="local"``), rotary embeddings, a hook registered on a graphed layer
(refused: the helper's replay would skip it), tensor + sequence, context and pipeline
parallel over two GPUs (``multi_gpu``), and megatron-core's MoE layers:
drop-and-pad graphed whole, dropless graphed up to token dispatch (bf16, FP8, full recompute),
dropless refused by name when graphed whole, and dropless experts in capacity graphs (bf16,
FP8 delayed and current scaling); over two GPUs (torchrun, ``multi_gpu``) the same with
expert parallelism (NCCL alltoall), and MoE under tensor + sequence parallel (expert tensor
parallel 1 and 2), context parallel and pipeline parallel, every rank bitwise. Needs a GPU, megatron-core 0.19 and
Transformer Engine 2.20; skipped otherwise.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from examples import megatron_gpt
from tests import harness
from tests.graph_helpers import require
from tests.harness import EAGER, EAGER_REPLAY, GRAPHED, GRAPHS, Trace
from tests.multi_gpu_helpers import fresh_process_env
from tests.test_verify_rows import VERIFY_EVERY_CALL, and_verified

require("te_graph.integrations.megatron", "megatron-core's integration")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core: pip install megatron-core==0.19.2"),
    pytest.mark.skipif(not HAVE_TE, reason='needs Transformer Engine: pip install -e ".[te]"'),
]

SETUPS = {
    "bf16-dropout": ["--dropout", "0.1", "--fusion", "0"],
    "bf16-dropout-fusion": ["--dropout", "0.1", "--fusion", "1"],
    "fp8-delayed-fusion": ["--dropout", "0.1", "--fusion", "1", "--fp8", "delayed"],
    "full-recompute-dropout": ["--dropout", "0.1", "--fusion", "1", "--recompute", "full"],
    "selective-recompute-dropout": ["--dropout", "0.1", "--fusion", "1", "--recompute", "selective"],
    # Full recompute replays each layer's forward graph in the backward: under delayed
    # scaling it must quantize with the scales of the forward it recomputes, and leave the
    # amax history as it found it, as TE's recompute does (the TE integration's FP8Replay).
    "fp8-delayed-full-recompute-dropout": ["--dropout", "0.1", "--fusion", "1", "--fp8", "delayed",
                                           "--recompute", "full"],
    "fp8-delayed-history-16-max-full-recompute": ["--dropout", "0.1", "--fusion", "1", "--fp8", "delayed",
                                                  "--fp8-amax-history", "16", "--fp8-amax-algo", "max",
                                                  "--recompute", "full"],
    "fp8-tensorwise-full-recompute-dropout": ["--dropout", "0.1", "--fusion", "1", "--fp8", "tensorwise",
                                              "--recompute", "full"],
    "overlap-grad-reduce-megatron-optimizer": ["--dropout", "0.1", "--fusion", "1", "--overlap-grad-reduce", "1",
                                               "--optimizer", "megatron"],
    "distributed-optimizer-overlap-param-gather": ["--dropout", "0.1", "--fusion", "1", "--dist-opt", "1",
                                                   "--overlap-grad-reduce", "1", "--overlap-param-gather", "1"],
    # megatron-core's own modules (transformer_impl="local"): no TE module in the layers, yet
    # the helper's replay passes is_first_microbatch to every graph.
    "local-spec-dropout": ["--spec", "local", "--dropout", "0.1", "--fusion", "0"],
    "local-spec-full-recompute-dropout": ["--spec", "local", "--dropout", "0.1", "--fusion", "0", "--recompute", "full"],
    # Rotary embeddings: the helper captures each layer with the model's rotary_pos_emb as an input.
    "rope-dropout": ["--rope", "1", "--dropout", "0.1", "--fusion", "1"],
    # A multi-token prediction layer (DeepSeek-V3's MTP): the helper graphs its transformer layer.
    "mtp-rope-dropout": ["--mtp", "1", "--rope", "1", "--dropout", "0.1", "--fusion", "1"],
    # The helper's delete_cuda_graphs (each graphed callable reset) and create_cudagraphs again
    # before step 3, as a loop that turns graphs off and on would; with DDP's hooks run by hand too.
    "regraph-dropout": ["--regraph-at", "3", "--dropout", "0.1", "--fusion", "1"],
    "regraph-distributed-optimizer-overlap-param-gather": ["--regraph-at", "3", "--dropout", "0.1", "--fusion", "1",
                                                          "--dist-opt", "1", "--overlap-grad-reduce", "1",
                                                          "--overlap-param-gather", "1"],
}

# megatron-core's MoE layers (4 experts, top-2, TE grouped GEMM, alltoall dispatcher, aux loss).
# Dropless routing brings the per-expert token counts to the host, so its graphs end before
# token dispatch (the helper's partial scopes) and dispatch and the experts run eagerly; a
# drop-and-pad layer (capacity factor 1) is graphed whole.
MOE = ["--experts", "4", "--topk", "2", "--moe-ffn", "512", "--dropout", "0.1", "--fusion", "1"]
PARTIAL = ["--graph-modules", "attn,moe_router,moe_preprocess"]
SETUPS.update({
    "moe-dropless-attn-router-preprocess": MOE + PARTIAL,
    "moe-dropless-attn-router": MOE + ["--graph-modules", "attn,moe_router"],
    "moe-dropless-fp8-delayed": MOE + PARTIAL + ["--fp8", "delayed"],
    "moe-dropless-full-recompute": MOE + PARTIAL + ["--recompute", "full"],
    "moe-dropless-fp8-delayed-full-recompute": MOE + PARTIAL + ["--fp8", "delayed", "--recompute", "full"],
    # TE's fused permutation: the graphs return the router's probabilities beside the permuted
    # ones, whose gradient reaches them through TE's custom permute op (warmup.outputs_fed).
    "moe-dropless-permute-fusion": MOE + PARTIAL + ["--permute-fusion", "1"],
    "moe-drop-pad-whole-layer": MOE + ["--capacity", "1.0"],
})


@dataclass(frozen=True)
class Run(harness.Row):
    """A row: examples/megatron_gpt.py with these arguments, every mode in one fresh process
    (``span``: where the capacity graphs end)."""

    id: str
    args: tuple
    span: str = "dispatch"
    gpu_only: bool = True


def rows(setups: dict) -> list:
    """The setups of a table (name -> arguments, or (arguments, span)) as the harness's rows."""
    return harness.params([Run(name, tuple(value[0]), value[1]) if isinstance(value, tuple) else Run(name, tuple(value))
                           for name, value in setups.items()], "cuda")


# The example's name for each mode's records.
RECORDS = {EAGER: "eager", GRAPHS: "te_graph", EAGER_REPLAY: "te_graph_replay"}


def _trace(record: dict) -> Trace:
    """A mode's record as the harness's trace: each step's losses (the outputs), main_grads and
    weights after the optimizer step."""
    return Trace(outputs=record["losses"], main_grads=record["main_grads"], weights=record["weights"])


# The example verified, in its process: every call of te_graph's graphed callables checked
# against its eager shadow (TE_GRAPH_VERIFY in the environment; a difference raises), and the
# number of verified forwards and backwards printed.
_VERIFIED = """
import sys
from examples import megatron_gpt
from tests.test_verify_rows import shadows_counted

with shadows_counted() as counts:
    megatron_gpt.main(sys.argv[1:])
print("VERIFIED", counts["forwards"], counts["backwards"])
"""


def _example(tmp_path, setup: list[str], graphs: str = "eager,te_graph,te_graph_replay",
             ranks: int = 1, verified: bool = False) -> subprocess.CompletedProcess:
    """The example in a fresh process on this worker's GPU, or under torchrun on ``ranks``
    GPUs; ``verified``: one process, every graphed call verified (``_VERIFIED``)."""
    arguments = ["--graphs", graphs, "--steps", "4", "--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128",
                 *setup, "--out", str(tmp_path / "records.pt")]
    env = fresh_process_env(ranks)
    command = megatron_gpt.command(arguments, ranks)
    if verified:
        assert ranks == 1, "the verified example runs in one process"
        env["TE_GRAPH_VERIFY"] = VERIFY_EVERY_CALL
        command = [sys.executable, "-c", _VERIFIED, *arguments]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _run(tmp_path, setup: list[str], ranks: int = 1, graphs: str = "eager,te_graph,te_graph_replay",
         verified: bool = False) -> list[dict]:
    """Each rank's records (one entry per rank); ``verified``: after verified forwards and
    backwards, none of which differed."""
    os.makedirs(tmp_path, exist_ok=True)
    done = _example(tmp_path, setup, graphs, ranks=ranks, verified=verified)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    if verified:
        counts = re.search(r"^VERIFIED (\d+) (\d+)$", done.stdout, re.MULTILINE)
        assert counts and int(counts.group(1)) > 0 and int(counts.group(2)) > 0, done.stdout[-2000:]
    return [torch.load(megatron_gpt.rank_path(str(tmp_path / "records.pt"), rank, ranks)) for rank in range(ranks)]


# Setups that also run verified (``-verified``, tests/test_verify_rows.py): gradient-accumulation
# fusion into DDP's main_grad, FP8 delayed scaling with full recompute, DDP's overlapped
# reduction with Megatron's optimizer, the distributed optimizer's parameter gathers,
# megatron-core's own modules, rotary embeddings, and MoE graphed up to token dispatch.
VERIFIED_SETUPS = {"bf16-dropout-fusion", "fp8-delayed-full-recompute-dropout",
                   "overlap-grad-reduce-megatron-optimizer", "distributed-optimizer-overlap-param-gather",
                   "local-spec-dropout", "rope-dropout", "moe-dropless-attn-router-preprocess"}


@pytest.mark.parametrize("setup, verified", and_verified(rows(SETUPS), only=VERIFIED_SETUPS))
def test_megatron_helper_with_te_graph_trains_as_eager(tmp_path, setup, verified):
    _assert_trains_as_eager(_run(tmp_path, list(setup.args), verified=verified)[0], setup.id)


def _assert_trains_as_eager(records: dict, setup: str) -> None:
    graphed, eager = records[RECORDS[GRAPHS]], records[RECORDS[EAGER]]
    assert graphed["graphed_with"].startswith("te_graph"), graphed["graphed_with"]
    assert len(graphed["losses"]) == len(eager["losses"]) == 4
    for mode in GRAPHED["cuda"]:
        harness.assert_same(_trace(records[RECORDS[mode]]), _trace(eager), f"{setup}, te_graph's {mode}")


# Hooks on megatron-core layers the helper graphs. On the layer itself, registered after the
# helper made its graphs: megatron-core's __call__ replays the graphs without
# nn.Module.__call__, so the hook would never run. On an MoE layer's experts behind the
# router's graph (registered before graphing): they run eagerly after the replay, hooks and all.
_HOOKED = """
import sys
import torch
from examples import megatron_gpt
from megatron.core.transformer import cuda_graphs

graphs, kind, target = sys.argv[1:]
seen = []

def hook(*args):
    out = args[-1] if kind == "forward_hook" else args[1]
    seen.append(float(out[0].float().sum()) if isinstance(out, tuple) else len(args))

def register(model):
    layer = model[0].module.module.decoder.layers[0]
    getattr(layer.mlp.experts if target == "experts" else layer, "register_" + kind)(hook)

if target == "experts":  # before graphing, in every run
    build = megatron_gpt._build
    megatron_gpt._build = lambda cfg: (lambda built: (register(built[0]), built)[1])(build(cfg))
    extra = dict(experts=4, topk=2, moe_ffn=512, graph_modules="attn,moe_router,moe_preprocess")
else:  # after the helper made the graphs
    made = cuda_graphs.TECudaGraphHelper.create_cudagraphs
    cuda_graphs.TECudaGraphHelper.create_cudagraphs = lambda helper: (made(helper), register(helper.model))
    extra = {}
cfg = megatron_gpt.RunConfig(graphs=graphs, layers=2, hidden=256, heads=4, seq=128, steps=3, dropout=0.1, **extra)
megatron_gpt.setup_process()
try:
    record = megatron_gpt.train(cfg)
except RuntimeError as error:
    print("REFUSED", seen, error)
else:
    print("TRAINED", seen, [loss.tolist() for loss in record["losses"]])
"""


def _hooked(graphs: str, kind: str, target: str) -> str:
    done = subprocess.run([sys.executable, "-c", _HOOKED, graphs, kind, target], cwd=ROOT, env=fresh_process_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook", "full_backward_hook"])
@pytest.mark.parametrize("graphs", ["te_graph", "te_graph_replay"])
def test_a_hook_on_a_graphed_megatron_layer_is_refused_at_the_next_call(graphs, kind):
    """Eager Megatron runs a hook registered on a layer; its graphed replay (and te_graph's eager
    replay) would skip it, so the next call is refused, naming the hook, before the hook was
    ever skipped."""
    table = kind.replace("full_", "").replace("_", " ") + "s"
    out = _hooked(graphs, kind, "layer")
    assert re.search(
        rf"REFUSED \[\] callable \d+ \(TransformerLayer\), microbatch \d+: since graphing, {table} on the module changed "
        r"\(0 -> 1\); megatron-core's __call__ replays this layer's graphs without nn\.Module\.__call__, so hooks on "
        r"the layer itself never run at replay", out), out[-3000:]


def test_hooks_on_experts_behind_the_routers_graph_run_as_in_eager():
    """The experts of an MoE layer graphed up to token dispatch run eagerly after the replay:
    their hooks (here on every call, from before graphing) are accepted and see what eager
    megatron-core shows them, and the run trains as eager."""
    runs = {graphs: _hooked(graphs, "forward_hook", "experts").strip().splitlines()[-1]
            for graphs in ("eager", "te_graph", "te_graph_replay")}
    assert runs["eager"].startswith("TRAINED [") and runs["eager"].count(",") > 10, runs["eager"]
    assert runs["te_graph"] == runs["eager"] and runs["te_graph_replay"] == runs["eager"], runs


def test_a_dropless_moe_layer_graphed_whole_is_refused_naming_the_host_wait(tmp_path):
    """Dropless routing waits on the host for the per-expert token counts (the alltoall
    dispatcher's event): graphed whole, the layer is refused by name, with the way out."""
    done = _example(tmp_path, MOE, graphs="te_graph")
    assert done.returncode != 0
    assert re.search(
        r"HostSyncError: make_graphed_callables: callable \d+ \(TransformerLayer\), microbatch \d+ waits for the "
        r"GPU from the host while it is captured: torch\.cuda\.Event\.synchronize\(\) at \S*megatron/core/"
        r"transformer/moe/token_dispatcher\.py:\d+ \(`self\.d2h_event\.synchronize\(\)`\)", done.stderr), done.stderr[-3000:]
    assert "cuda_graph_modules=['attn', 'moe_router', 'moe_preprocess']" in done.stderr


def _max_difference(got: dict, want: dict) -> float:
    pairs = [(a, b) for name in ("main_grads", "weights") for step_a, step_b in zip(got[name], want[name])
             for a, b in zip(step_a, step_b)]
    pairs += list(zip(got["losses"], want["losses"]))  # none on a pipeline stage before the last
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs if a.numel())


# The capacity graphs' setups (1 and 1.25 times the even share: about half the calls overflow
# into the eager experts, some after a step's first microbatch, where a stale
# is_first_microbatch would overwrite main_grad): bf16, FP8 delayed and current scaling, and a
# delayed-scaling history long enough to show an amax reduction run twice (1 hides it). With
# one GPU every expert is local, so the graphs hold the dispatch too (span "dispatch"); the
# experts alone, TE's fused permutation, whole-layer recompute and overflow into megatron-core's
# own experts are rows of their own.
CAPACITY_SETUPS = {
    "bf16": ["--buckets", "1.0,1.25"],
    "bf16-experts-span": ["--buckets", "1.0,1.25", "--moe-span", "experts"],
    "bf16-permute-fusion": ["--buckets", "1.0,1.25", "--permute-fusion", "1"],
    "bf16-full-recompute": ["--buckets", "1.0,1.25", "--recompute", "full"],
    # Delayed scaling, recomputed: the replays swap in the scales of the forward they
    # recompute, as TE's eager modules do (the TE integration's FP8Replay).
    "fp8-delayed-full-recompute": ["--buckets", "1.0,1.25", "--fp8", "delayed", "--recompute", "full"],
    "bf16-overflow-eager": ["--buckets", "1.0,1.25", "--overflow", "eager"],
    # The distributed optimizer with overlapped parameter all-gathers: DDP's forward pre-hooks
    # on the experts' submodules, which the replays would skip, run by hand before each.
    "bf16-dist-opt-overlap-param-gather": ["--buckets", "1.0,1.25", "--dist-opt", "1", "--overlap-grad-reduce", "1",
                                           "--overlap-param-gather", "1"],
    # The capacity graphs removed and made again with the helper's (step 3 on).
    "bf16-regraph": ["--buckets", "1.0,1.25", "--regraph-at", "3"],
    "fp8-delayed": ["--buckets", "1.0,1.25", "--fp8", "delayed"],
    "fp8-tensorwise": ["--buckets", "1.0,1.25", "--fp8", "tensorwise"],
    "fp8-delayed-history-16-max": ["--buckets", "1.0,1.25", "--fp8", "delayed", "--fp8-amax-history", "16",
                                   "--fp8-amax-algo", "max"],
}


@pytest.mark.parametrize("setup", rows(CAPACITY_SETUPS))
def test_dropless_experts_in_capacity_graphs_equal_their_eager_replay(tmp_path, setup):
    """Dropless routing with the experts in graphs, one per token capacity (a call beyond the
    largest runs eagerly): bitwise equal to te_graph's eager replay of the same padded program
    (losses, main_grad and weights at every step); against the unpadded eager experts, the
    difference is reported (other GEMM shapes, other rounding) and bounded."""
    records = _run(tmp_path, MOE + PARTIAL + list(setup.args))[0]
    _assert_capacity_graphs_equal_their_replay(records, setup.id, "experts" if "experts-span" in setup.id else "dispatch")


def test_the_dispatch_in_capacity_graphs_changes_no_bit_of_the_experts_only_graphs(tmp_path):
    """The graphs holding the dispatch (pad, gather, un-permutation; the chunk sorts and the
    one-rank alltoall they leave out are identities) train bitwise as the graphs of the experts
    alone, and as their eager replays."""
    runs = {span: _run(tmp_path / span, MOE + PARTIAL + ["--buckets", "1.0,1.25", "--moe-span", span],
                       graphs="te_graph,te_graph_replay")[0]
            for span in ("dispatch", "experts")}
    for kind in ("te_graph", "te_graph_replay"):
        assert runs["dispatch"][kind]["expert_calls"]["spans"] == ["dispatch"]
        assert runs["experts"][kind]["expert_calls"]["spans"] == ["experts"]
        harness.assert_same(_trace(runs["dispatch"][kind]), _trace(runs["experts"][kind]),
                            f"{kind}: dispatch span vs experts span", reference="experts span")


# The capacity chosen on the GPU (choose="device"): each layer graphed whole, its dispatch,
# experts and combine one conditional node over the buckets (1 and 1.25 times the even share,
# and every token), so no call runs eagerly and none waits for the counts on the host.
DEVICE_CHOSEN_SETUPS = {
    "bf16": ["--buckets", "1.0,1.25", "--choose", "device"],
    "bf16-permute-fusion": ["--buckets", "1.0,1.25", "--choose", "device", "--permute-fusion", "1"],
    # The node keeps no activations; its backward runs the bucket's experts again.
    "bf16-recompute": ["--buckets", "1.0,1.25", "--choose", "device", "--switch-recompute", "1"],
}


@pytest.mark.parametrize("setup", rows(DEVICE_CHOSEN_SETUPS))
def test_dropless_layers_graphed_whole_with_the_capacity_chosen_on_the_device(tmp_path, setup):
    """Bitwise equal to te_graph's eager replay (which reads the bucket on the host and runs the
    same padded program); against megatron-core's unpadded eager dropless run, the difference
    is reported and the losses bounded (the GEMMs see padded shapes)."""
    records = _run(tmp_path, MOE + list(setup.args))[0]
    graphed, replay, eager = records["te_graph"], records["te_graph_replay"], records["eager"]
    calls = graphed["expert_calls"]
    assert calls["eager"] == 0 and calls["spans"] == ["dispatch"], calls
    assert sum(calls["graphed"].values()) > 0, calls
    assert replay["expert_calls"]["graphed"] == calls["graphed"], (replay["expert_calls"], calls)
    harness.assert_same(_trace(graphed), _trace(replay), f"{setup.id}: device-chosen capacity vs its eager replay",
                        reference="eager replay")
    print(f"{setup.id}: device-chosen capacity vs unpadded eager: max difference "
          f"{_max_difference(graphed, eager):.3g}; calls {calls}")
    for a, b in zip(graphed["losses"], eager["losses"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_graphed_steps_with_the_capacity_chosen_on_the_device_make_no_host_sync(tmp_path):
    """Megatron's schedule over the graphed layers under ``set_sync_debug_mode("error")``: no
    host sync in a whole step's forward and backward with the capacity chosen on the device,
    where the host choice (its counts read per layer call) fails the same check by name."""
    _run(tmp_path / "device", MOE + DEVICE_CHOSEN_SETUPS["bf16"] + ["--sync-check", "1"], graphs="te_graph")
    (tmp_path / "host").mkdir()
    host = _example(tmp_path / "host", MOE + PARTIAL + ["--buckets", "1.0,1.25", "--sync-check", "1"],
                    graphs="te_graph")
    assert host.returncode != 0
    assert "called a synchronizing CUDA operation" in host.stderr, host.stderr[-3000:]


def test_the_capacity_chosen_on_the_device_refuses_fp8_by_name(tmp_path):
    done = _example(tmp_path, MOE + ["--buckets", "1.0,1.25", "--choose", "device", "--fp8", "delayed"],
                    graphs="te_graph")
    assert done.returncode != 0
    assert ("ValueError: te_graph.graph_dropless_experts(choose='device'): the layers train in FP8 or FP4, not yet "
            "proven with the capacity chosen on the GPU. Use choose='host'.") in done.stderr, done.stderr[-3000:]


def _assert_capacity_graphs_equal_their_replay(records: dict, setup: str, span: str) -> None:
    graphed, replay, eager = records["te_graph"], records["te_graph_replay"], records["eager"]
    calls = graphed["expert_calls"]
    assert calls["spans"] == [span], calls
    assert sum(calls["graphed"].values()) > 0, calls
    if setup.startswith("fp8"):
        assert calls["eager"] > 0, calls
    assert replay["expert_calls"] == calls
    harness.assert_same(_trace(graphed), _trace(replay), f"{setup}: capacity graphs vs their eager replay",
                        reference="eager replay")
    difference = _max_difference(graphed, eager)
    print(f"{setup}: capacity graphs vs unpadded eager: max difference {difference:.3g}; calls {calls}")
    for a, b in zip(graphed["losses"], eager["losses"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


# Expert parallelism over 2 GPUs (torchrun, NCCL; data parallel, each rank its own batches):
# the 4 experts split 2 per rank, tokens exchanged by the alltoall dispatcher. Dropless, the
# graphs end before dispatch and the alltoall runs eagerly; drop-and-pad, the whole layer
# is graphed, alltoall included (NCCL captured in the graph); the capacity graphs hold an
# expert rank's tokens from both ranks.
EXPERT_PARALLEL = MOE + ["--expert-parallel", "2"]
EXPERT_PARALLEL_SETUPS = {
    "ep2-dropless-attn-router-preprocess": EXPERT_PARALLEL + PARTIAL,
    "ep2-dropless-full-recompute": EXPERT_PARALLEL + PARTIAL + ["--recompute", "full"],
    "ep2-drop-pad-whole-layer": EXPERT_PARALLEL + ["--capacity", "1.0"],
    "ep2-dropless-fp8-delayed": EXPERT_PARALLEL + PARTIAL + ["--fp8", "delayed"],
}


# Tensor parallel (with sequence parallel: TE's all-gathers and reduce-scatters inside the
# graphs) and pipeline parallel (the helper captures each stage's layers in its 1F1B order,
# interleaved over model chunks with a virtual pipeline, with te_graph's order=) over 2 GPUs, each rank bitwise against its own eager run.
MODEL_PARALLEL_SETUPS = {
    "tp2-sp-dropout": ["--tensor-parallel", "2", "--sequence-parallel", "1", "--dropout", "0.1", "--fusion", "1"],
    "tp2-sp-rope-fp8-delayed-full-recompute": ["--tensor-parallel", "2", "--sequence-parallel", "1", "--rope", "1",
                                               "--dropout", "0.1", "--fusion", "1", "--fp8", "delayed",
                                               "--recompute", "full"],
    "pp2-dropout": ["--pipeline-parallel", "2", "--dropout", "0.1", "--fusion", "1"],
    "pp2-rope-full-recompute": ["--pipeline-parallel", "2", "--rope", "1", "--dropout", "0.1", "--fusion", "1",
                                "--recompute", "full"],
    # Interleaved 1F1B: 2 chunks of one layer per stage, graphs captured in the interleaved order
    # (and deleted and made again before step 3).
    "pp2-vpp2-dropout": ["--pipeline-parallel", "2", "--virtual-pipeline", "2", "--layers", "4", "--dropout", "0.1",
                         "--fusion", "1"],
    "pp2-vpp2-regraph-dropout": ["--pipeline-parallel", "2", "--virtual-pipeline", "2", "--layers", "4",
                                 "--regraph-at", "3", "--dropout", "0.1", "--fusion", "1"],
    # FP8 across stages: each stage's amax reductions and scale updates, per its own graphs.
    "pp2-fp8-delayed-dropout": ["--pipeline-parallel", "2", "--dropout", "0.1", "--fusion", "1", "--fp8", "delayed"],
    # Context parallel: each rank half the sequence (zigzag), TE's attention passing keys and
    # values around the ring (send/recv on a side stream, inside the graphs), attention dropout
    # drawn per ring step.
    "cp2-dropout": ["--context-parallel", "2", "--dropout", "0.1", "--fusion", "1"],
    "cp2-rope-fp8-delayed-full-recompute": ["--context-parallel", "2", "--rope", "1", "--dropout", "0.1",
                                            "--fusion", "1", "--fp8", "delayed", "--recompute", "full"],
    # MoE under tensor + sequence parallel: each rank routes its sequence share to whole
    # experts of its own (expert tensor parallel 1), or the dispatcher gathers the shares and
    # splits each expert's GEMMs over both ranks (expert tensor parallel 2, biases off).
    "tp2-sp-moe-dropless-attn-router-preprocess": MOE + PARTIAL + ["--tensor-parallel", "2",
                                                                   "--sequence-parallel", "1"],
    "tp2-sp-etp2-moe-dropless-attn-router-preprocess": MOE + PARTIAL + ["--tensor-parallel", "2",
                                                                        "--sequence-parallel", "1",
                                                                        "--expert-tensor-parallel", "2"],
    "cp2-moe-dropless-attn-router-preprocess": MOE + PARTIAL + ["--context-parallel", "2"],
}


PARALLEL_SETUPS = {**EXPERT_PARALLEL_SETUPS, **MODEL_PARALLEL_SETUPS}


@pytest.mark.multi_gpu
@pytest.mark.parametrize("row", rows(PARALLEL_SETUPS))
def test_parallel_layers_train_as_eager_on_two_gpus(tmp_path, row):
    setup = row.id
    ranks = _run(tmp_path, list(row.args), ranks=2)
    for rank, records in enumerate(ranks):
        _assert_trains_as_eager(records, f"{setup}, rank {rank}")
    # The losses live on the last pipeline stage (on every rank without pipeline parallelism).
    assert ranks[-1]["eager"]["losses"][0].numel() == 4
    first, last = (ranks[r]["eager"]["losses"][0] for r in (0, 1))
    if setup.startswith("ep2"):  # data parallel for real: each rank trained on batches of its own
        assert not torch.equal(first, last)
    elif setup.startswith("cp2"):  # one replica, each rank the loss over its share of the sequence
        assert not torch.equal(first, last)
    elif setup.startswith("tp2"):  # one model replica: both ranks computed the same losses
        assert torch.equal(first, last)
    else:  # pipeline parallel: only the last stage has a loss
        assert first.numel() == 0


# The capacity graphs over two GPUs: with expert parallelism (the graphs hold the dispatch,
# its two alltoalls with equal splits of padded blocks; or, span "experts", the experts alone
# behind megatron-core's eager alltoalls), and with pipeline parallelism (one MoE layer per
# stage, every expert local: the graphs hold the dispatch too; microbatches of 1F1B in flight
# at once).
PARALLEL_CAPACITY_SETUPS = {
    "ep2-bf16": (EXPERT_PARALLEL + PARTIAL + CAPACITY_SETUPS["bf16"], "dispatch"),
    "ep2-bf16-full-recompute": (EXPERT_PARALLEL + PARTIAL + CAPACITY_SETUPS["bf16-full-recompute"], "dispatch"),
    "ep2-bf16-experts-span": (EXPERT_PARALLEL + PARTIAL + CAPACITY_SETUPS["bf16-experts-span"], "experts"),
    "ep2-fp8-delayed": (EXPERT_PARALLEL + PARTIAL + CAPACITY_SETUPS["fp8-delayed"], "dispatch"),
    "pp2-bf16": (MOE + PARTIAL + CAPACITY_SETUPS["bf16"] + ["--pipeline-parallel", "2"], "dispatch"),
    # Tensor + sequence parallel: with whole experts on each rank every expert is local (the
    # graphs hold the dispatch); with each expert split over both ranks the dispatch gathers
    # over them (host-side split sizes), so the graphs hold the experts alone.
    "tp2-sp-bf16": (MOE + PARTIAL + CAPACITY_SETUPS["bf16"] + ["--tensor-parallel", "2", "--sequence-parallel", "1"],
                    "dispatch"),
    "tp2-sp-etp2-bf16": (MOE + PARTIAL + CAPACITY_SETUPS["bf16"] + ["--tensor-parallel", "2", "--sequence-parallel",
                                                                    "1", "--expert-tensor-parallel", "2"], "experts"),
    # Context parallel: each rank routes its half of the sequence, every expert local.
    "cp2-bf16": (MOE + PARTIAL + CAPACITY_SETUPS["bf16"] + ["--context-parallel", "2"], "dispatch"),
}


@pytest.mark.multi_gpu
@pytest.mark.parametrize("row", rows(PARALLEL_CAPACITY_SETUPS))
def test_capacity_graphs_equal_their_eager_replay_on_two_gpus(tmp_path, row):
    setup, arguments, span = row.id, list(row.args), row.span
    ranks = _run(tmp_path, arguments, ranks=2)
    for rank, records in enumerate(ranks):
        _assert_capacity_graphs_equal_their_replay(records, f"capacity graphs, {setup}, rank {rank}", span)
