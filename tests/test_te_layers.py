"""Transformer Engine's own layers, bf16 and FP8: graphs on = graphs off, against eager TE.

Rows of tests/harness.py, as tests/test_parity.py's: each setup trains a stack of TE modules
for a few SGD steps of two microbatches (each microbatch inside ``te.autocast``), eagerly,
through te_graph's eager replay and through CUDA graphs, from the same seeds, and compares
the traces bitwise: outputs, input grads, parameter grads at every step, weights after the
steps, and the FP8 meta of every module (amax history and scales). Rows cover bf16
parameters and FP8 primary weights (``te.quantized_model_init``), whose SGD step
re-quantizes them in place. Every row of ``SETUPS``, ``WGRAD_SETUPS`` and the
gradient-accumulation fusion runs a second time verified (``-verified``,
tests/test_verify_rows.py): the runtime verifier checks every graphed call and finds nothing.

Needs a GPU, Transformer Engine (``pip install -e ".[te]"``; on this project's GPU machine,
``source .te/setup.sh``) and te_graph's integration of it; skipped otherwise. TE is imported
here only.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
from torch import nn

import checkpointing
from te_graph import make_graphed_callables

from _pipeline import interleaved_1f1b_order, run_order, with_wgrad_passes
from tests import harness
from tests.graph_helpers import main_grad_steps, megatron_ddp_hooks, require
from tests.harness import EAGER, GRAPHED, GRAPHS, Trace
from tests.test_verify_rows import and_verified, verifying

require("te_graph.integrations.transformer_engine", "Transformer Engine's integration")

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_TE, reason='needs Transformer Engine: pip install -e ".[te]" (the version the tests ran with)'),
]

H, FFN, HEADS, S, B = 128, 256, 4, 32, 2


def te():
    import transformer_engine.pytorch as te_pytorch

    return te_pytorch


def recipes() -> dict:
    from transformer_engine.common import recipe

    return {
        "delayed": lambda: recipe.DelayedScaling(),
        # megatron-core's defaults (fp8_amax_history_len=1, "most_recent"): every amax a
        # recompute leaves in the history shows in the next scale.
        "delayed-recent": lambda: recipe.DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent"),
        "current": lambda: recipe.Float8CurrentScaling(),
        "block": lambda: recipe.Float8BlockScaling(),
    }


# -- the tracker: TE's, graph-safe -----------------------------------------------------------
_TRACKER: Any = None


def tracker():
    return _TRACKER


def reseed(seed: int) -> None:
    global _TRACKER
    if _TRACKER is None:
        _TRACKER = te().distributed.CudaRNGStatesTracker()
    _TRACKER.reset()
    _TRACKER.add("model-parallel-rng", seed + 2718)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


# -- the layers ------------------------------------------------------------------------------
class Attention(nn.Module):
    """te.DotProductAttention on the hidden states as q, k and v."""

    def __init__(self, dropout: float):
        super().__init__()
        self.attn = te().DotProductAttention(HEADS, H // HEADS, attention_dropout=dropout,
                                             attn_mask_type="causal", get_rng_state_tracker=tracker)

    def forward(self, x):
        q = x.view(S, B, HEADS, H // HEADS)
        return self.attn(q, q, q).view(S, B, H)


class Grouped(nn.Module):
    """te.GroupedLinear over two halves of the tokens."""

    def __init__(self, dtype):
        super().__init__()
        self.linear = te().GroupedLinear(2, H, H, params_dtype=dtype)

    def forward(self, x):
        return self.linear(x.reshape(S * B, H), [S * B // 2, S * B // 2]).view(S, B, H)


class Recomputed(nn.Module):
    """A layer inside a checkpoint: ``checkpointing.checkpoint`` ("ours"), Transformer
    Engine's ``te.distributed.checkpoint`` ("te"), both driven by TE's tracker, or TE's
    ``checkpoint_core_attention=True`` ("core-attention")."""

    def __init__(self, layer: nn.Module, kind: str):
        super().__init__()
        self.layer = layer
        self.kind = kind

    def forward(self, x, is_first_microbatch=None):
        cache = {} if is_first_microbatch is None else {"is_first_microbatch": is_first_microbatch}
        if self.kind == "ours":
            return checkpointing.checkpoint(self.layer, x, get_rng_state_tracker=tracker, **cache)
        if self.kind == "ours-then-relu":  # a backward that reads the output: warmup's probe of it
            # fails before the recompute pops TE's stash (warmup._probed_backward puts it back)
            return torch.relu(checkpointing.checkpoint(self.layer, x, get_rng_state_tracker=tracker, **cache))
        if self.kind == "core-attention":  # TE recomputes the attention core itself
            return self.layer(x, checkpoint_core_attention=True, **cache)
        return te().distributed.checkpoint(self.layer, x, get_rng_state_tracker=tracker, **cache)


def build(kind: str, dtype: torch.dtype, dropout: float) -> nn.Module:
    t = te()
    if kind == "linear":
        return t.Linear(H, H, params_dtype=dtype)
    if kind == "layernorm_linear":
        return t.LayerNormLinear(H, H, params_dtype=dtype)
    if kind == "layernorm_mlp":
        return t.LayerNormMLP(H, FFN, params_dtype=dtype)
    if kind == "grouped_linear":
        return Grouped(dtype)
    if kind == "dpa":
        return Attention(dropout)
    if kind == "mha":
        return t.MultiheadAttention(H, HEADS, attention_dropout=dropout, params_dtype=dtype,
                                    attn_mask_type="causal", fuse_qkv_params=True, get_rng_state_tracker=tracker)
    if kind == "transformer":
        return t.TransformerLayer(H, FFN, HEADS, hidden_dropout=dropout, attention_dropout=dropout,
                                  params_dtype=dtype, self_attn_mask_type="causal", fuse_qkv_params=True,
                                  get_rng_state_tracker=tracker)
    assert kind == "ops", kind
    return t.ops.Sequential(t.ops.LayerNorm(H, dtype=dtype), t.ops.Linear(H, H, dtype=dtype))


# -- the setups ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TESetup(harness.Row):
    id: str
    module: str = "transformer"
    recipe: Optional[str] = None  # None: bf16; "delayed", "current", "block"
    dropout: float = 0.0
    recompute: str = "none"  # "none", "ours", "ours-then-relu", "te", "core-attention" (inside the layers), or
    # "around" (checkpointing.checkpoint around each graphed layer's call, as Megatron's full
    # recompute runs its per-layer graphs: the recompute replays the forward graph)
    caching: bool = False  # cache_quantized_params, is_first_microbatch at each call
    eval: bool = False  # forward-only graphs under no_grad (eval mode)
    fp8_params: bool = False  # FP8 primary weights: built inside te.quantized_model_init
    grads_like_params: bool = False  # .grad = torch.empty_like(param) first, as TE's tests do
    layers: int = 2
    eager_steps_first: int = 0  # eager steps before graphing (as Megatron's helper does): TE's
    # global amax buffers then hold the modules when graphs are made
    late_eager_layer: bool = False  # an eager TE Linear joins the autocast from the second step
    # on (after the graphs): TE's global amax buffers change after the first reductions
    recipe_per_autocast: bool = False  # a new, equal recipe object for every autocast, as
    # megatron-core's get_fp8_context makes one for every forward


SETUPS = [
    TESetup("linear-bf16", module="linear"),
    TESetup("layernorm-linear-bf16", module="layernorm_linear"),
    TESetup("layernorm-mlp-bf16", module="layernorm_mlp"),
    TESetup("grouped-linear-bf16", module="grouped_linear"),
    TESetup("dpa-bf16-dropout", module="dpa", dropout=0.1),
    TESetup("mha-bf16-dropout", module="mha", dropout=0.1),
    TESetup("transformer-bf16", module="transformer"),
    TESetup("transformer-bf16-dropout", module="transformer", dropout=0.1),
    TESetup("ops-sequential-bf16", module="ops"),
    # Its fuser, made by the eager step around the real parameters, is made again around the stand-ins.
    TESetup("ops-sequential-bf16-graphed-after-an-eager-step", module="ops", eager_steps_first=1),
    TESetup("transformer-bf16-dropout-recompute-ours", dropout=0.1, recompute="ours"),
    TESetup("transformer-bf16-dropout-recompute-te", dropout=0.1, recompute="te"),
    TESetup("transformer-bf16-dropout-core-attention-checkpoint", dropout=0.1, recompute="core-attention"),
    TESetup("transformer-fp8-delayed-dropout-recompute-ours", recipe="delayed", dropout=0.1, recompute="ours"),
    TESetup("transformer-fp8-delayed-recent-dropout-recompute-ours", recipe="delayed-recent", dropout=0.1,
            recompute="ours"),
    TESetup("transformer-fp8-delayed-recent-dropout-recompute-ours-after-an-eager-step", recipe="delayed-recent",
            dropout=0.1, recompute="ours", eager_steps_first=1),
    TESetup("transformer-fp8-delayed-recent-dropout-recompute-ours-new-recipe-per-autocast", recipe="delayed-recent",
            dropout=0.1, recompute="ours", recipe_per_autocast=True),
    TESetup("transformer-fp8-delayed-recent-dropout-recompute-te", recipe="delayed-recent", dropout=0.1,
            recompute="te"),
    # Checkpointed inside the graphed callable with weight caching: te.Linear is graphed
    # exactly (its checkpointed forward caches the columnwise copy too); layers whose forward
    # caches a rowwise-only weight are refused (test_a_checkpoint_inside_..._is_refused).
    TESetup("linear-fp8-delayed-recent-recompute-ours-weight-caching", module="linear", recipe="delayed-recent",
            recompute="ours", caching=True),
    TESetup("linear-fp8-delayed-recent-recompute-ours-output-read-by-its-backward", module="linear",
            recipe="delayed-recent", recompute="ours-then-relu"),
    # The checkpoint around the graphed call: the recompute replays the forward graph, whose
    # quantization must use the scales of the forward it recomputes (TE's recompute stash).
    TESetup("transformer-bf16-dropout-recompute-around", dropout=0.1, recompute="around"),
    TESetup("transformer-fp8-delayed-recent-dropout-recompute-around", recipe="delayed-recent", dropout=0.1,
            recompute="around"),
    TESetup("transformer-fp8-delayed-dropout-recompute-around", recipe="delayed", dropout=0.1, recompute="around"),
    TESetup("transformer-fp8-delayed-recent-dropout-recompute-around-weight-caching", recipe="delayed-recent",
            dropout=0.1, recompute="around", caching=True),
    TESetup("transformer-fp8-delayed-recent-recompute-around-after-an-eager-step", recipe="delayed-recent",
            recompute="around", eager_steps_first=1),
    TESetup("transformer-fp8-current-dropout-recompute-around", recipe="current", dropout=0.1, recompute="around"),
    TESetup("grouped-linear-fp8-delayed-recent-recompute-around", module="grouped_linear", recipe="delayed-recent",
            recompute="around"),
    TESetup("ops-sequential-fp8-delayed-recent-recompute-around", module="ops", recipe="delayed-recent",
            recompute="around"),
    TESetup("transformer-bf16-eval", eval=True),
    TESetup("linear-fp8-delayed", module="linear", recipe="delayed"),
    TESetup("linear-fp8-current", module="linear", recipe="current"),
    TESetup("linear-fp8-block", module="linear", recipe="block"),
    TESetup("layernorm-mlp-fp8-delayed", module="layernorm_mlp", recipe="delayed"),
    # GroupedLinear (megatron-core's MoE experts): TE 2.20 runs its backward amax reduction
    # without the capture guard its other modules have; an extra roll of the amax history
    # (1024 long by default) would show in the FP8 meta.
    TESetup("grouped-linear-fp8-delayed", module="grouped_linear", recipe="delayed"),
    TESetup("grouped-linear-fp8-delayed-graphed-after-an-eager-step", module="grouped_linear", recipe="delayed",
            eager_steps_first=1),
    TESetup("grouped-linear-fp8-current", module="grouped_linear", recipe="current"),
    TESetup("transformer-fp8-delayed-graphed-after-an-eager-step", recipe="delayed", eager_steps_first=1),
    TESetup("transformer-fp8-delayed", recipe="delayed"),
    TESetup("transformer-fp8-delayed-eager-layer-joins-later", recipe="delayed", late_eager_layer=True),
    TESetup("transformer-fp8-delayed-new-recipe-per-autocast", recipe="delayed", dropout=0.1, recipe_per_autocast=True),
    TESetup("transformer-fp8-current-dropout", recipe="current", dropout=0.1),
    TESetup("transformer-fp8-block", recipe="block"),
    TESetup("transformer-fp8-delayed-weight-caching", recipe="delayed", caching=True),
    TESetup("linear-fp8-current-weight-caching", module="linear", recipe="current", caching=True),
    TESetup("ops-sequential-fp8-delayed", module="ops", recipe="delayed"),
    TESetup("transformer-fp8-delayed-eval", recipe="delayed", eval=True),
    TESetup("linear-fp8-delayed-primary-weights", module="linear", recipe="delayed", fp8_params=True),
    TESetup("linear-fp8-block-primary-weights", module="linear", recipe="block", fp8_params=True),
    TESetup("layernorm-mlp-fp8-current-primary-weights", module="layernorm_mlp", recipe="current", fp8_params=True),
    TESetup("transformer-fp8-delayed-dropout-primary-weights", recipe="delayed", dropout=0.1, fp8_params=True),
    TESetup("transformer-fp8-current-primary-weights-recompute-ours", recipe="current", dropout=0.1,
            recompute="ours", fp8_params=True),
    TESetup("transformer-fp8-delayed-primary-weights-weight-caching", recipe="delayed", caching=True, fp8_params=True),
    TESetup("ops-sequential-fp8-delayed-primary-weights", module="ops", recipe="delayed", fp8_params=True),
    TESetup("transformer-fp8-delayed-primary-weights-eval", recipe="delayed", eval=True, fp8_params=True),
    # empty_like of an FP8 weight is an FP8 tensor: eager accumulates into an FP8 .grad
    TESetup("linear-fp8-delayed-primary-weights-fp8-grads", module="linear", recipe="delayed", fp8_params=True,
            grads_like_params=True),
    TESetup("transformer-fp8-current-primary-weights-fp8-grads", recipe="current", fp8_params=True,
            grads_like_params=True),
    TESetup("transformer-bf16-grads-like-params", grads_like_params=True),
]


def fp8_meta(modules) -> list:
    """Every TE module's amax history and scales (DelayedScaling keeps them)."""
    tensors = []
    for module in modules:
        for m in module.modules():
            meta = getattr(m, "fp8_meta", None)
            for key in ("scaling_fwd", "scaling_bwd"):
                state = meta.get(key) if isinstance(meta, dict) else None
                if state is not None and hasattr(state, "amax_history"):
                    tensors += [state.amax_history.clone(), state.scale.clone()]
    return tensors


def train(setup: TESetup, mode: str, steps: int = 3, micro: int = 2) -> Trace:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.reset()
    reseed(1234)
    dtype = torch.bfloat16
    recipe = recipes()[setup.recipe]() if setup.recipe else None
    with te().quantized_model_init(enabled=setup.fp8_params, recipe=recipe):
        modules = [build(setup.module, dtype, setup.dropout).cuda() for _ in range(setup.layers)]
    if setup.recompute not in ("none", "around"):
        modules = [Recomputed(m, setup.recompute) for m in modules]
    late = [te().Linear(H, H, params_dtype=dtype).cuda()] if setup.late_eager_layer else []
    for m in modules:
        m.train(not setup.eval)
    params = [p for m in modules + late for p in m.parameters()]
    if setup.grads_like_params:
        for p in params:
            p.grad = torch.empty_like(p)  # zeroed at the first step
    opt = torch.optim.SGD(params, lr=0.01) if params else None
    data = torch.Generator(device="cuda").manual_seed(7)
    weight = torch.linspace(-1, 1, S * B * H, device="cuda").view(S, B, H)
    trace = Trace()

    def step(layers, joined: list) -> None:
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        for micro_step in range(micro):
            x = torch.randn(S, B, H, device="cuda", dtype=dtype, generator=data).requires_grad_(not setup.eval)
            with torch.no_grad() if setup.eval else torch.enable_grad():
                autocast_recipe = recipes()[setup.recipe]() if setup.recipe_per_autocast else recipe
                with te().autocast(enabled=recipe is not None, recipe=autocast_recipe):
                    h = x
                    cache = {"is_first_microbatch": micro_step == 0} if setup.caching else {}
                    for layer in layers:
                        if setup.recompute == "around":
                            h = checkpointing.checkpoint(layer, h, get_rng_state_tracker=tracker, **cache)
                        else:
                            h = layer(h, **cache)
                    for layer in joined:
                        h = layer(h)
            trace.outputs.append(h.detach().clone())
            if not setup.eval:
                (h.float() * weight).sum().backward()
                trace.input_grads.append(x.grad.clone())
        if not setup.eval:
            trace.step(params)
            if opt is not None:
                opt.step()

    reseed(76)
    for _ in range(setup.eager_steps_first):
        step(modules, [])
    layers = modules
    if mode != EAGER:
        g = torch.Generator(device="cuda").manual_seed(3)
        samples = tuple(
            (torch.randn(S, B, H, device="cuda", dtype=dtype, generator=g).requires_grad_(not setup.eval),)
            for _ in modules
        )
        with torch.no_grad() if setup.eval else torch.enable_grad():
            layers = make_graphed_callables(
                tuple(modules), samples, enabled=recipe is not None, recipe=recipe,
                cache_quantized_params=setup.caching, get_rng_state_tracker=tracker,
                eager_replay=harness.eager_replay(mode),
            )
    reseed(77)
    for i in range(steps):
        step(layers, late if i > 0 else [])
    trace.weights = [p.detach().clone() for p in params]
    trace.fp8_meta = fp8_meta(modules + late)
    return trace


def _skip_unsupported(setup: TESetup) -> None:
    if setup.recipe is None:
        return
    from transformer_engine.pytorch.quantization import check_recipe_support

    try:
        check_recipe_support(recipes()[setup.recipe]())
    except Exception as error:  # noqa: BLE001 - TE says why this GPU cannot run it
        pytest.skip(f"{setup.recipe} scaling does not run here: {error}")


@pytest.mark.parametrize("setup, verified", and_verified([pytest.param(s, id=s.id) for s in SETUPS]))
def test_te_graphs_and_eager_replay_equal_eager_te(setup, verified, monkeypatch):
    _skip_unsupported(setup)
    with verifying(verified, monkeypatch, backward=not setup.eval):
        harness.differential(lambda mode: train(setup, mode), GRAPHED["cuda"], setup.id)


def test_the_backward_amax_reduction_replays_as_one_graph(monkeypatch):
    """Delayed scaling: the backward amax reduction after each autocast's first FP8 call is
    replayed from one graph per device (te_graph/integrations/transformer_engine/fp8_reduction.py), captured again when TE's
    buffers change (an eager layer joins at the second step) and not when only the recipe
    object does (a new, equal one for every autocast, as megatron-core makes them), and left
    to TE's own call where TE's update is unfused; the FP8 meta stays bitwise eager TE's
    either way."""
    from te_graph.integrations.transformer_engine.fp8_replay import backward_amax_reduction

    setup = TESetup("transformer-fp8-delayed-eager-layer-joins-later", recipe="delayed", late_eager_layer=True,
                    recipe_per_autocast=True)
    _skip_unsupported(setup)
    want = train(setup, EAGER)
    reduction = backward_amax_reduction()
    captures, replays = reduction.captures, reduction.replays
    harness.assert_same(train(setup, GRAPHS), want, "graphs")
    # 3 steps of 2 microbatches, each its own autocast; captured at the first step and again
    # when the eager layer registers its amaxes at the second.
    assert (reduction.captures - captures, reduction.replays - replays) == (2, 6)
    monkeypatch.setenv("NVTE_UNFUSED_FP8_UPDATE", "1")
    want = train(setup, EAGER)
    captures, replays = reduction.captures, reduction.replays
    harness.assert_same(train(setup, GRAPHS), want, "graphs, unfused update")
    assert (reduction.captures, reduction.replays) == (captures, replays)


# -- refused before anything changes ---------------------------------------------------------
@pytest.mark.parametrize("mode", GRAPHED["cuda"])
def test_fp8_calls_that_would_part_from_eager_te_are_refused(mode):
    from transformer_engine.common import recipe as te_recipe

    reseed(5)
    layer = te().Linear(H, H, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    captured = te_recipe.DelayedScaling()
    graphed = make_graphed_callables(layer, (x,), enabled=True, recipe=captured, eager_replay=harness.eager_replay(mode))
    with pytest.raises(RuntimeError, match=re.escape("graphed with FP8 but called outside te.autocast(enabled=True, recipe=...)")):
        graphed(x)
    with pytest.raises(RuntimeError, match=re.escape("but its graphs were captured with")):
        with te().autocast(enabled=True, recipe=te_recipe.Float8CurrentScaling()):
            graphed(x)
    cached = te().Linear(H, H, params_dtype=torch.bfloat16).cuda()
    graphed = make_graphed_callables(cached, (x,), enabled=True, recipe=captured, cache_quantized_params=True,
                                     eager_replay=harness.eager_replay(mode))
    with pytest.raises(ValueError, match=re.escape("graphed with cache_quantized_params=True, so each call needs the is_first_microbatch=True/False keyword")):
        with te().autocast(enabled=True, recipe=captured):
            graphed(x)
    plain = te().Linear(H, H, params_dtype=torch.bfloat16).cuda()
    graphed = make_graphed_callables(plain, (x,), eager_replay=harness.eager_replay(mode))
    with pytest.raises(RuntimeError, match=re.escape("called inside an FP8 te.autocast, but it was graphed without FP8")):
        with te().autocast(enabled=True, recipe=captured):
            graphed(x)


def test_a_recipe_this_gpu_cannot_run_is_refused_before_anything_changes():
    from transformer_engine.common import recipe as te_recipe
    from transformer_engine.pytorch.quantization import check_recipe_support

    mx = te_recipe.MXFP8BlockScaling()
    try:
        check_recipe_support(mx)
        pytest.skip("this GPU runs MXFP8 (Blackwell): nothing to refuse")
    except Exception as error:  # noqa: BLE001
        expected, kind = str(error), type(error)
    reseed(5)
    layer = te().Linear(H, H, params_dtype=torch.bfloat16).cuda()
    with harness.refused(kind, re.escape(expected[:60]), layer):  # TE's own error, raised by te_graph's check
        make_graphed_callables(layer, (torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True),),
                               enabled=True, recipe=mx)


def test_capture_time_hooks_are_called_with_the_module_alone():
    reseed(5)
    layers = [te().Linear(H, H, params_dtype=torch.bfloat16).cuda() for _ in range(2)]
    calls = []
    hooks = [{kind: {0: (lambda m, kind=kind, i=i: calls.append((kind, i)))} for kind in
              ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")} for i in range(2)]
    samples = tuple((torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True),) for _ in layers)
    make_graphed_callables(tuple(layers), samples, num_warmup_iters=1, capture_time_hooks=hooks)
    assert calls[:4] == [("forward_pre_hooks", 0), ("forward_hooks", 0), ("backward_pre_hooks", 0), ("backward_hooks", 0)]
    assert len(calls) == 16  # one warmup pass and the capture, 4 hooks x 2 layers each


@pytest.mark.parametrize("kind", ["ours", "te"])
@pytest.mark.parametrize("mode", GRAPHED["cuda"])
def test_a_checkpoint_inside_a_graphed_layer_with_fp8_weight_caching_is_refused(kind, mode):
    """TE layers with weights, checkpointed inside the graphed callable, with weight caching:
    measured to part from eager TE after the first microbatch (te.TransformerLayer and
    te.LayerNormMLP, delayed and current scaling), so refused by name at warmup, also by the
    eager replay; the layer then trains eagerly. A te.Linear so checkpointed, the checkpoint
    around the graphed call and caching off are graphed exactly (rows of SETUPS)."""
    setup = TESetup("refused", recipe="delayed-recent", recompute=kind, caching=True)
    _skip_unsupported(setup)
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.reset()
    reseed(1234)
    recipe = recipes()[setup.recipe]()
    layer = Recomputed(build("transformer", torch.bfloat16, 0.0).cuda(), kind)
    sample = (torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True),)
    with pytest.raises(ValueError, match=re.escape("make_graphed_callables: callable 0 (Recomputed) runs Transformer "
                                                   "Engine's ") + r"\w+" + re.escape(
            " inside an activation checkpoint (te.distributed.checkpoint or checkpointing.checkpoint) with "
            "cache_quantized_params=True: its recompute caches other FP8 weights than its forward")):
        make_graphed_callables(layer, sample, enabled=True, recipe=recipe, cache_quantized_params=True,
                               get_rng_state_tracker=tracker, eager_replay=harness.eager_replay(mode))
    x = sample[0].detach().clone().requires_grad_()
    with te().autocast(enabled=True, recipe=recipe):
        y = layer(x, is_first_microbatch=True)
    y.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_our_checkpoint_recomputes_fp8_as_transformer_engines_does(recipe_name):
    """Without dropout (where TE's checkpoint is exact too), a TE layer recomputed by
    ``checkpointing.checkpoint`` trains in FP8 exactly as under ``te.distributed.checkpoint``:
    the recompute runs in the forward's FP8 autocast, with the forward's scales."""
    _skip_unsupported(TESetup("probe", recipe=recipe_name))
    ours = train(TESetup("ours", recipe=recipe_name, recompute="ours"), EAGER)
    theirs = train(TESetup("theirs", recipe=recipe_name, recompute="te"), EAGER)
    harness.assert_same(ours, theirs, "checkpointing.checkpoint against te.distributed.checkpoint",
                        reference="te.distributed.checkpoint")


# -- split weight gradients: delay_wgrad_compute=True, backward_dw() -------------------------
class DropoutBlock(nn.Module):
    """te.LayerNormLinear, then dropout drawn from TE's tracker (exact masks on recompute)."""

    def __init__(self, dtype):
        super().__init__()
        self.linear = te().LayerNormLinear(H, H, params_dtype=dtype, delay_wgrad_compute=True)

    def forward(self, x):
        h = self.linear(x)
        with tracker().fork():
            return torch.nn.functional.dropout(h, 0.1, self.training)

    def backward_dw(self):  # what a caller of an eager block calls
        self.linear.backward_dw()


class DelayedGrouped(Grouped):
    def __init__(self, dtype):
        nn.Module.__init__(self)
        self.linear = te().GroupedLinear(2, H, H, params_dtype=dtype, delay_wgrad_compute=True)

    def backward_dw(self):
        self.linear.backward_dw()


class RecomputedBlock(Recomputed):
    def backward_dw(self):
        self.layer.backward_dw()


def build_delayed(kind: str, dtype: torch.dtype) -> nn.Module:
    t = te()
    if kind == "linear":
        return t.Linear(H, H, params_dtype=dtype, delay_wgrad_compute=True)
    if kind == "layernorm_linear":
        return t.LayerNormLinear(H, H, params_dtype=dtype, delay_wgrad_compute=True)
    if kind == "layernorm_mlp":
        return t.LayerNormMLP(H, FFN, params_dtype=dtype, delay_wgrad_compute=True)
    if kind == "grouped_linear":
        return DelayedGrouped(dtype)
    assert kind == "dropout_block", kind
    return DropoutBlock(dtype)


@dataclass(frozen=True)
class WgradSetup(harness.Row):
    id: str
    module: str = "linear"
    recipe: Optional[str] = None
    # "after", "deferred"; "no-order": two layers, plain schedule, backward_dw() last layer
    # first ("no-order-first-layer-first": the other way round)
    placement: str = "after"
    reuse: bool = False
    recompute: bool = False
    hooks: bool = True  # Megatron-style wgrad hooks move each .grad into an accumulator


WGRAD_SETUPS = [
    WgradSetup("linear-bf16"),
    WgradSetup("linear-bf16-deferred-reuse", placement="deferred", reuse=True),
    WgradSetup("layernorm-linear-bf16-reuse-plain-grads", module="layernorm_linear", reuse=True, hooks=False),
    WgradSetup("layernorm-mlp-bf16", module="layernorm_mlp"),
    WgradSetup("layernorm-mlp-bf16-plain-grads", module="layernorm_mlp", hooks=False),
    WgradSetup("grouped-linear-bf16", module="grouped_linear"),
    WgradSetup("dropout-block-bf16-recompute-reuse", module="dropout_block", recompute=True, reuse=True),
    WgradSetup("linear-fp8-delayed-reuse", recipe="delayed", reuse=True),
    WgradSetup("layernorm-mlp-fp8-current-reuse", module="layernorm_mlp", recipe="current", reuse=True),
    WgradSetup("linear-bf16-no-order", placement="no-order"),
    WgradSetup("layernorm-linear-bf16-no-order-plain-grads", module="layernorm_linear", placement="no-order", hooks=False),
    WgradSetup("layernorm-mlp-bf16-no-order-first-layer-first", module="layernorm_mlp",
               placement="no-order-first-layer-first"),
]


def train_wgrad(setup: WgradSetup, mode: str, steps: int = 3) -> Trace:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.reset()
    reseed(4321)
    dtype = torch.bfloat16
    recipe = recipes()[setup.recipe]() if setup.recipe else None
    modules = [build_delayed(setup.module, dtype).cuda() for _ in range(2)]
    if setup.recompute:
        modules = [RecomputedBlock(m, "ours") for m in modules]
    params = [p for m in modules for p in m.parameters()]
    accumulated = {id(p): torch.zeros_like(p) for p in params}
    if setup.hooks:  # Megatron's way: each backward_dw hands its .grads to an accumulator
        def hand_over(module):
            def hook():
                for p in module.parameters():
                    if p.grad is not None and getattr(p, "skip_backward_post_hook", False):
                        accumulated[id(p)] += p.grad
                        p.grad = None
            return hook
        for m in modules:
            for sub in m.modules():
                if hasattr(sub, "register_wgrad_accumulation_and_reduce_hooks"):
                    sub.register_wgrad_accumulation_and_reduce_hooks(hand_over(sub))
    plain = setup.placement.startswith("no-order")
    micro = 1 if plain else 4
    # pipeline rank 0 of 2, interleaved 1F1B over 2 chunks of one layer x 4 microbatches
    order = None if plain else with_wgrad_passes(interleaved_1f1b_order(2, 4, 2), setup.placement)
    layers, dw = modules, [m.backward_dw for m in modules]
    if mode != EAGER:
        g = torch.Generator(device="cuda").manual_seed(3)
        samples = tuple((torch.randn(S, B, H, device="cuda", dtype=dtype, generator=g).requires_grad_(),)
                        for _ in range(len(modules) * micro))
        graphed = make_graphed_callables(
            tuple(modules), samples, enabled=recipe is not None, recipe=recipe, get_rng_state_tracker=tracker,
            eager_replay=harness.eager_replay(mode), _order=order, _num_layers_per_chunk=[1, 1] if order else None,
            _reuse_graph_input_output_buffers=setup.reuse,
        )
        layers = list(graphed)
        dw = [g.backward_dw for g in graphed] if order else [m.backward_dw for m in graphed]
    opt = torch.optim.SGD(params, lr=0.01)
    data = torch.Generator(device="cuda").manual_seed(7)
    reseed(77)
    trace = Trace()
    for _ in range(steps):
        for p in params:
            p.grad = None
        for acc in accumulated.values():
            acc.zero_()
        inputs = [torch.randn(S, B, H, device="cuda", dtype=dtype, generator=data) for _ in range(micro)]

        per_graph = order is not None and mode != EAGER  # one graphed callable per (chunk, microbatch)

        def call(chunk, mb, x):
            with te().autocast(enabled=recipe is not None, recipe=recipe):
                return layers[chunk * micro + mb if per_graph else chunk](x)

        if order:
            losses, input_grads = run_order(order, call, inputs, lambda c, mb: dw[c * micro + mb if per_graph else c]())
        else:  # the plain schedule: forwards, one backward, then each layer's backward_dw
            losses, input_grads = run_order([1, 2, -2, -1], call, inputs)
            for fn in dw if setup.placement == "no-order-first-layer-first" else reversed(dw):
                fn()
        trace.outputs += losses
        trace.input_grads += input_grads
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        trace.param_grads.append(grads + [accumulated[id(p)].clone() for p in params])
        for p, grad in zip(params, grads):
            p.grad = grad + accumulated[id(p)]
        opt.step()
    trace.weights = [p.detach().clone() for p in params]
    trace.fp8_meta = fp8_meta(modules)
    return trace


@pytest.mark.parametrize("setup, verified", and_verified([pytest.param(s, id=s.id) for s in WGRAD_SETUPS]))
def test_split_weight_gradients_equal_eager_te_by_hand(setup, verified, monkeypatch):
    _skip_unsupported(TESetup("probe", recipe=setup.recipe))
    with verifying(verified, monkeypatch):
        harness.differential(lambda mode: train_wgrad(setup, mode), GRAPHED["cuda"], setup.id)


@pytest.mark.parametrize("mode", GRAPHED["cuda"])
def test_a_forward_captured_after_a_weight_gradient_pass_waits_for_it(mode):
    """Order F B W F B W: microbatch 1's forward was captured after microbatch 0's
    weight-gradient pass had freed what that pass reads (TE's queued inputs and grads), so
    it is refused while the pass still waits; in the captured order the calls go on."""
    reseed(5)
    layer = te().Linear(H, H, params_dtype=torch.bfloat16, delay_wgrad_compute=True).cuda()
    samples = tuple((torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True),) for _ in range(2))
    mb0, mb1 = make_graphed_callables((layer,), samples, _order=[1, -1, -1.5, 1, -1, -1.5], _num_layers_per_chunk=[1],
                                      eager_replay=harness.eager_replay(mode))
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mb0(x).sum().backward()
    with pytest.raises(RuntimeError, match=re.escape(
            "callable 0 (Linear), microbatch 1: its forward replays while callable 0 (Linear), microbatch 0 still "
            "waits for its backward_dw(), but when this forward was captured that graph did not hold what its "
            "backward_dw() reads")):
        mb1(x)
    mb0.backward_dw()
    mb1(x).sum().backward()
    mb1.backward_dw()


@pytest.mark.parametrize("mode", GRAPHED["cuda"])
def test_backward_dw_calls_that_would_part_from_eager_te_are_refused(mode):
    reseed(5)
    layer = te().Linear(H, H, params_dtype=torch.bfloat16, delay_wgrad_compute=True).cuda()
    samples = tuple((torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True),) for _ in range(2))
    # Both backwards before the passes: with F F B W B W, microbatch 1's backward, captured
    # after microbatch 0's pass had run, would be refused while that pass waits (replay.ReplayOrder).
    mb0, mb1 = make_graphed_callables((layer,), samples, _order=[1, 1, -1, -1, -1.5, -1.5], _num_layers_per_chunk=[1],
                                      eager_replay=harness.eager_replay(mode))
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError, match=re.escape("backward_dw() without a backward waiting for it")):
        mb0.backward_dw()
    y0, y1 = mb0(x), mb1(x)
    y0.sum().backward()
    y1.sum().backward()
    with pytest.raises(RuntimeError, match=re.escape("backward_dw() out of order: the backward of callable 0 (Linear), microbatch 0 ran before this one's")):
        mb1.backward_dw()
    with pytest.raises(RuntimeError, match=re.escape("forward while the backward_dw() of its last backward has not run")):
        mb0(x)
    mb0.backward_dw()
    mb1.backward_dw()
    layer.wgrad_store.disable_delay_wgrad_compute()
    with pytest.raises(RuntimeError, match=re.escape("Linear no longer delays its weight gradients (delay_wgrad_compute was switched off after graphing)")):
        mb0(x)
    layer.wgrad_store.enable_delay_wgrad_compute()
    mb0(x).sum().backward()  # the queue is free again


def test_without_an_order_every_pass_runs_before_the_next_forward():
    reseed(5)
    layers = [te().Linear(H, H, params_dtype=torch.bfloat16, delay_wgrad_compute=True).cuda() for _ in range(2)]
    samples = tuple((torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True),) for _ in layers)
    first, second = make_graphed_callables(tuple(layers), samples)
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    second(first(x)).sum().backward()
    second.backward_dw()
    with pytest.raises(RuntimeError, match=re.escape("forward while the backward_dw() of callable 0 (Linear) has not run; without an order, run every waiting backward_dw() before the next forward")):
        second(x)
    first.backward_dw()
    second(first(x)).sum().backward()  # free again


def test_te_state_that_graphing_would_take_or_shift_is_refused():
    reseed(5)
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    busy = te().Linear(H, H, params_dtype=torch.bfloat16, delay_wgrad_compute=True).cuda()
    busy(x).sum().backward()  # its backward_dw() not run yet
    with pytest.raises(RuntimeError, match=re.escape("Linear (built with delay_wgrad_compute=True) holds 1 backward(s) waiting for backward_dw() when graphing starts")):
        make_graphed_callables(busy, (x,))
    busy.backward_dw()
    fused = te().Linear(H, H, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True).cuda()
    with pytest.raises(ValueError, match=re.escape(
            "callable 0 (Linear) is built with fuse_wgrad_accumulation=True, but its weight 'weight' has no main_grad")):
        make_graphed_callables(fused, (x,))
    both = te().Linear(H, H, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True, delay_wgrad_compute=True).cuda()
    both.weight.main_grad = torch.zeros(H, H, device="cuda")
    with pytest.raises(NotImplementedError, match=re.escape(
            "callable 0 (Linear) is built with both fuse_wgrad_accumulation=True and delay_wgrad_compute=True")):
        make_graphed_callables(both, (x,))
    shared = te().Linear(H, H, params_dtype=torch.bfloat16, delay_wgrad_compute=True).cuda()
    twice = (nn.Sequential(shared), nn.Sequential(shared))
    with pytest.raises(NotImplementedError, match=re.escape("Linear (delay_wgrad_compute=True) runs in both callable 0 (Sequential) and callable 1 (Sequential)")):
        make_graphed_callables(twice, ((x,), (x.detach().clone().requires_grad_(),)))
    assert all(p.grad is None for p in shared.parameters())


def test_delayed_weight_gradients_need_their_passes_in_the_order():
    reseed(5)
    layer = te().Linear(H, H, params_dtype=torch.bfloat16, delay_wgrad_compute=True).cuda()
    samples = ((torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True),),)
    with harness.refused(ValueError, re.escape("built with delay_wgrad_compute=True, whose backward leaves the weight gradients to backward_dw(), but the order gives it no weight-gradient pass; add -c-0.5"),
                         layer):
        make_graphed_callables((layer,), samples, _order=[1, -1], _num_layers_per_chunk=[1])


# -- gradient-accumulation fusion (fuse_wgrad_accumulation=True, Megatron's main_grad) -------------
def _fused_run(kind: str, mode: str) -> Trace:
    reseed(11)
    t = te()
    layers = [t.LayerNormLinear(H, H, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True) if kind == "ln_linear"
              else t.LayerNormMLP(H, FFN, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True) for _ in range(2)]
    layers = [m.cuda() for m in layers]
    params = [p for m in layers for p in m.parameters()]
    keep = megatron_ddp_hooks(params)
    if mode != EAGER:
        g = torch.Generator(device="cuda").manual_seed(3)
        samples = tuple((torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True),)
                        for _ in layers)
        layers = list(make_graphed_callables(tuple(layers), samples, eager_replay=harness.eager_replay(mode)))
    trace = Trace()
    trace.main_grads.append([p.main_grad.clone() for p in params])  # graphing leaves main_grad as it was
    main_grad_steps(layers, params, lambda data: torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16,
                                                             generator=data, requires_grad=True), trace)
    del keep
    return trace


@pytest.mark.parametrize("mode", GRAPHED["cuda"])
@pytest.mark.parametrize("kind, verified", and_verified([pytest.param(k, id=k) for k in ("ln_linear", "ln_mlp")]))
def test_gradient_accumulation_fusion_equals_eager_te(kind, verified, mode, monkeypatch):
    """TE modules that accumulate weight gradients into main_grad inside their kernels, under
    a Megatron-DDP-style hook: main_grad, the flag, input grads and weights after SGD steps
    bitwise as eager TE's; warmup leaves main_grad as it was (and, verified, the shadows)."""
    with verifying(verified, monkeypatch):
        want, got = _fused_run(kind, EAGER), _fused_run(kind, mode)
    harness.assert_same(got, want, f"{kind} {mode}")
