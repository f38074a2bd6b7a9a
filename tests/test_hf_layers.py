"""Hugging Face ``transformers`` layers, graphed as users would graph them: each trains as
eagerly, bit for bit (losses, input gradients, weights after SGD steps), with dropout, with
its attention in the eager and the SDPA implementation, with an input that requires grad
or not, one layer per callable or two in one call, with a validation pass in eval mode in
between. A refusal here would be a false positive: these layers train exactly.

Rows of tests/harness.py (layer, attention, input grad), compared as its traces. On the CPU
the graphed side is eager replay (the graphs' mirror); on a GPU the same cases run with
graphs and with eager replay. Every case runs a second time verified (``-verified``,
tests/test_verify_rows.py): the runtime verifier checks every graphed call and finds nothing.
Skipped where ``transformers`` is not installed (``pip install -e ".[test]"`` installs it).
"""
from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import te_graph
from tests import harness
from tests.graph_helpers import weighted_loss
from tests.harness import Trace
from tests.test_verify_rows import VERIFIED, and_verified, verifying

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason='needs Hugging Face transformers: pip install -e ".[test]"')

S, B, H, HEADS = 8, 2, 32, 4
DROPOUT = 0.1
STEPS = 3


def _llama(attention: str) -> tuple[Callable[[], torch.nn.Module], Callable[[torch.device], dict]]:
    from transformers import LlamaConfig  # noqa: PLC0415
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding  # noqa: PLC0415

    config = LlamaConfig(hidden_size=H, intermediate_size=2 * H, num_attention_heads=HEADS, num_key_value_heads=2,
                         attention_dropout=DROPOUT, num_hidden_layers=2)
    config._attn_implementation = attention

    def keywords(device: torch.device) -> dict:
        # The model computes rotary embeddings once and hands every layer (cos, sin).
        rotary = LlamaRotaryEmbedding(config).to(device)
        positions = torch.arange(S, device=device)[None].expand(B, S)
        return {"position_embeddings": rotary(torch.zeros(B, S, H, device=device), positions)}

    return (lambda: LlamaDecoderLayer(config, layer_idx=0)), keywords


def _gpt2(attention: str) -> tuple[Callable[[], torch.nn.Module], Callable[[torch.device], dict]]:
    from transformers import GPT2Config  # noqa: PLC0415
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: PLC0415

    config = GPT2Config(n_embd=H, n_head=HEADS, n_layer=2, resid_pdrop=DROPOUT, attn_pdrop=DROPOUT)
    config._attn_implementation = attention
    return (lambda: GPT2Block(config, layer_idx=0)), (lambda device: {})


def _bert(attention: str) -> tuple[Callable[[], torch.nn.Module], Callable[[torch.device], dict]]:
    from transformers import BertConfig  # noqa: PLC0415
    from transformers.models.bert.modeling_bert import BertLayer  # noqa: PLC0415

    config = BertConfig(hidden_size=H, num_attention_heads=HEADS, intermediate_size=2 * H,
                        hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT)
    config._attn_implementation = attention
    return (lambda: BertLayer(config)), (lambda device: {})


LAYERS = {"llama": _llama, "gpt2": _gpt2, "bert": _bert}


@dataclass(frozen=True)
class HFRow(harness.Row):
    """A Hugging Face layer, its attention implementation, and whether its input requires grad."""

    id: str
    kind: str
    attention: str
    input_grad: bool


ROWS = [HFRow(f"{kind}-{attention}-{'input-grad' if grad else 'input-no-grad'}", kind, attention, grad)
        for kind in LAYERS for attention in ("eager", "sdpa") for grad in (True, False)]
MODES = [pytest.param("cpu", harness.EAGER_REPLAY, id="cpu-eager-replay"),
         pytest.param("cuda", harness.GRAPHS, id="cuda-graphs", marks=pytest.mark.gpu),
         pytest.param("cuda", harness.EAGER_REPLAY, id="cuda-eager-replay", marks=pytest.mark.gpu)]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _train(layer: torch.nn.Module, call: Callable, keywords: dict, inputs: list[torch.Tensor]) -> Trace:
    """SGD steps from one seed: every step's loss (as its output) and input gradient, the
    weights after."""
    torch.manual_seed(7)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
    trace = Trace()
    for x in inputs:
        x = x.detach().clone().requires_grad_(x.requires_grad)
        loss = weighted_loss(_first(call(x, **keywords)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trace.microbatch(loss, x)
    trace.weights = [p.detach().clone() for p in layer.parameters()]
    return trace


@pytest.mark.parametrize("device, mode", MODES)
@pytest.mark.parametrize("row, verified", and_verified([pytest.param(row, id=row.id) for row in ROWS]))
def test_hf_layer_trains_as_eager(row, verified, device, mode, monkeypatch):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with verifying(verified, monkeypatch):
        _layer_trains_as_eager(row, device, mode)


def _layer_trains_as_eager(row: HFRow, device: str, mode: str) -> None:
    device = torch.device(device)
    kind, input_grad = row.kind, row.input_grad
    make, keywords_for = LAYERS[kind](row.attention)
    torch.manual_seed(0)
    eager = make().to(device).train()
    graphed_layer = copy.deepcopy(eager)
    keywords = keywords_for(device)
    generator = torch.Generator(device=device).manual_seed(1)
    inputs = [torch.randn(B, S, H, device=device, generator=generator).requires_grad_(input_grad) for _ in range(STEPS)]
    sample = torch.randn(B, S, H, device=device).requires_grad_(input_grad)
    graphed = te_graph.make_graphed_callables(graphed_layer, (sample,), sample_kwargs=keywords,
                                              eager_replay=harness.eager_replay(mode))

    harness.assert_same(_train(graphed_layer, graphed, keywords, inputs), _train(eager, eager, keywords, inputs), kind)
    # A validation pass in eval mode (dropout off, no grad) runs eagerly, then training goes on.
    for layer in (eager, graphed_layer):
        layer.eval()
    with torch.no_grad():
        assert torch.equal(_first(graphed(inputs[0], **keywords)), _first(eager(inputs[0], **keywords)))
    for layer in (eager, graphed_layer):
        layer.train()
    harness.assert_same(_train(graphed_layer, graphed, keywords, inputs), _train(eager, eager, keywords, inputs),
                        f"{kind}, after the validation pass")


@pytest.mark.parametrize("verified", VERIFIED)
@pytest.mark.parametrize("device, mode", MODES)
def test_hf_layers_graphed_together_train_as_eager(device, mode, verified, monkeypatch):
    """Two Llama decoder layers as two callables of one make_graphed_callables call (one
    pool), chained as a model chains them, each with the model's rotary embeddings."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with verifying(verified, monkeypatch):
        _graphed_together_train_as_eager(device, mode)


def _graphed_together_train_as_eager(device: str, mode: str) -> None:
    device = torch.device(device)
    make, keywords_for = _llama("sdpa")
    torch.manual_seed(0)
    eager = torch.nn.ModuleList([make(), make()]).to(device).train()
    graphed_layers = copy.deepcopy(eager)
    keywords = keywords_for(device)
    generator = torch.Generator(device=device).manual_seed(1)
    inputs = [torch.randn(B, S, H, device=device, generator=generator, requires_grad=True) for _ in range(STEPS)]
    samples = tuple((torch.randn(B, S, H, device=device, requires_grad=True),) for _ in range(2))
    graphed = te_graph.make_graphed_callables(tuple(graphed_layers), samples, sample_kwargs=(keywords, keywords),
                                              eager_replay=harness.eager_replay(mode))

    def chain(layers):
        def call(x, **kw):
            for layer in layers:
                x = _first(layer(x, **kw))
            return x
        return call

    harness.assert_same(_train(graphed_layers, chain(graphed), keywords, inputs),
                        _train(eager, chain(eager), keywords, inputs), "two llama layers")


def _model(kind: str):
    """A two-layer Hugging Face model (no dropout), its layers, and how to call it: BertModel
    and GPT2Model call each layer with a positional None (``layer(h, mask, None, ...)``)."""
    import transformers  # noqa: PLC0415

    if kind == "bert":
        config = transformers.BertConfig(vocab_size=50, hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
                                         intermediate_size=2 * H, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        model = transformers.BertModel(config)
        return model, model.encoder.layer, lambda m, ids: m(ids).last_hidden_state
    config = transformers.GPT2Config(vocab_size=50, n_embd=H, n_layer=2, n_head=HEADS, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2Model(config)
    return model, model.h, lambda m, ids: m(ids, use_cache=False).last_hidden_state


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
@pytest.mark.parametrize("device, mode", MODES)
def test_layers_a_model_calls_with_a_positional_none_train_as_eager(kind, device, mode):
    """The layers graphed in place with the arguments their model passes them (seen by a
    forward pre-hook on an eager call), the whole model trained: losses and weights after
    AdamW steps as eager's, bitwise."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    model, layers, run = _model(kind)
    model = model.to(device)
    eager = copy.deepcopy(model)
    seen: list = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)), with_kwargs=True)
             for layer in layers]
    ids = torch.randint(0, 50, (B, S), device=device)
    run(model, ids)
    for hook in hooks:
        hook.remove()
    assert any(a is None for args, _ in seen for a in args), "the model no longer passes a positional None"

    def detached(value, grad=False):
        return value.detach().clone().requires_grad_(grad) if isinstance(value, torch.Tensor) else value

    samples = tuple(tuple(detached(a, i == 0) for i, a in enumerate(args)) for args, _ in seen)
    keywords = tuple({k: detached(v) for k, v in kw.items()} for _, kw in seen)
    te_graph.make_graphed_callables(tuple(layers), samples, sample_kwargs=keywords,
                                    eager_replay=harness.eager_replay(mode))
    traces = []
    for m in (model, eager):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(3)
        trace = Trace()
        for _ in range(STEPS):
            loss = weighted_loss(run(m, torch.randint(0, 50, (B, S), generator=generator).to(device)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            trace.microbatch(loss, None)
        trace.weights = [p.detach().clone() for p in m.parameters()]
        traces.append(trace)
    harness.assert_same(traces[0], traces[1], f"{kind} model, its layers graphed")
