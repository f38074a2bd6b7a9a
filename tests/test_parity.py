"""Graphs on = graphs off over a matrix of training setups (rows of tests/harness.py).

Each setup trains a few SGD steps of accumulated microbatches in the harness's modes: eagerly,
through te_graph's eager replay (CPU and GPU) and through CUDA graphs (GPU), from the same
seeds, and its ``Trace`` is compared bitwise with the eager run's: outputs, input grads,
parameter grads at every step, weights after the optimizer steps, module buffers, what
parameter hooks saw and how often they ran, Megatron-style ``main_grad``s.

Every setup runs a second time verified (``<setup>-verified``, tests/test_verify_rows.py):
the runtime verifier checks every graphed call against its eager shadow, finds nothing, and
the run still equals eager bitwise; on the CPU and on a GPU, every row.

Adding a setup is one line in ``SETUPS``. Multi-rank setups (DDP, tensor and pipeline
parallel) run the same comparison in tests/test_multi_gpu.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import rng
from checkpointing import checkpoint
from examples.gpt import GPTBlock
from te_graph import Samples, make_graphed_callables
from tests import harness
from tests.graph_helpers import DuckTracker, Stack, weighted_loss
from tests.harness import EAGER, GRAPHED, Trace
from tests.test_verify_rows import and_verified, verifying

HIDDEN, HEADS, SEQ, BATCH = 32, 4, 16, 2


# -- layers besides GPTBlock --------------------------------------------------------------------
class BufferedBlock(nn.Module):
    """Updates buffers in place in its forward: running statistics and a step counter."""

    def __init__(self, device, dtype):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN, device=device, dtype=dtype)
        self.register_buffer("running_mean", torch.zeros(HIDDEN, device=device, dtype=dtype))
        self.register_buffer("calls", torch.zeros((), device=device, dtype=torch.long))

    def forward(self, x, attention_mask=None):
        y = self.lin(x)
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(y.mean(dim=(0, 1)), alpha=0.1)
                self.calls.add_(1)
        return torch.tanh(y), None


class ListStatsBlock(nn.Module):
    """Keeps a running statistic in a list attribute (no buffer), updated in place and read."""

    def __init__(self, device, dtype):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN, device=device, dtype=dtype)
        self.stats = [torch.zeros(HIDDEN, device=device, dtype=dtype)]

    def forward(self, x, attention_mask=None):
        y = self.lin(x)
        with torch.no_grad():
            self.stats[0].mul_(0.9).add_(y.mean(dim=(0, 1)), alpha=0.1)
        return torch.tanh(y) + self.stats[0], None


class ContainerBlock(nn.Module):
    """A reentrant checkpoint whose function returns a dict of tensors and a constant."""

    def __init__(self, device, dtype):
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN, device=device, dtype=dtype)
        self.b = nn.Linear(HIDDEN, HIDDEN, device=device, dtype=dtype)

    def _body(self, x):
        return {"main": self.a(x).relu(), "side": self.b(x).sin(), "note": "kept"}

    def forward(self, x, attention_mask=None):
        out = checkpoint(self._body, x)
        return out["main"] + out["side"], None


class SingleUseBlock(nn.Module):
    """Uses its input once. Where a layer's input also feeds other ops, autograd sums that
    input's grad from every use in eager code but from the graph's one summed grad when
    graphed: equal up to rounding only (see capture-and-replay.md). Flows that fan a
    layer's output out use this layer, so their sums have two terms and stay exact."""

    def __init__(self, device, dtype, dropout):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN, device=device, dtype=dtype)
        self.p = dropout

    def forward(self, x, attention_mask=None):
        return nn.functional.dropout(torch.tanh(self.lin(x)), self.p, self.training), None


class SpareParameterBlock(SingleUseBlock):
    """Holds a parameter its forward never reads: eager code never runs its hooks, and its
    .grad stays None."""

    def __init__(self, device, dtype, dropout):
        super().__init__(device, dtype, dropout)
        self.spare = nn.Parameter(torch.ones(HIDDEN, device=device, dtype=dtype))


class SavedOutputBlock(nn.Module):
    """Ends in tanh, whose backward reads its result: warmup, finding that the backward reads
    the output, runs its last pass again (``warmup._probed_backward``), dropout included."""

    def __init__(self, device, dtype, dropout):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN, device=device, dtype=dtype)
        self.p = dropout

    def forward(self, x, attention_mask=None):
        return torch.tanh(nn.functional.dropout(self.lin(x), self.p, self.training)), None


class CacheBlock(nn.Module):
    """Takes a second input without grad that its forward updates in place (a running
    state passed in, like a KV cache or a counter) and reads."""

    def __init__(self, device, dtype):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN, device=device, dtype=dtype)

    def forward(self, x, cache):
        y = self.lin(x) + cache
        with torch.no_grad():
            cache.mul_(0.5).add_(y.mean(dim=0))
        return torch.tanh(y), None


class SavedCacheBlock(nn.Module):
    """Updates its running-state input in place, then multiplies by it (the product saves it
    for the backward): called with the very tensor it was graphed with, the update lands in
    the graph's own input buffer."""

    def __init__(self, device, dtype):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN, device=device, dtype=dtype)

    def forward(self, x, cache):
        with torch.no_grad():
            cache.mul_(0.5).add_(1.0)
        return torch.tanh(self.lin(x) * cache), None


class ScaledParameter(nn.Parameter):
    """A parameter stored scaled down: a module reading one multiplies it back by ``factor``
    (kept in a slot, no part of the attribute dict)."""

    __slots__ = ("factor",)


class SubclassParameterBlock(nn.Module):
    """One of its parameters is a ``Parameter`` subclass, on whose class its forward dispatches."""

    def __init__(self, device, dtype):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN, device=device, dtype=dtype)
        self.scale = ScaledParameter(torch.full((HIDDEN,), 0.25, device=device, dtype=dtype))
        self.scale.factor = 4.0

    def forward(self, x, attention_mask=None):
        scale = self.scale * self.scale.factor if isinstance(self.scale, ScaledParameter) else self.scale
        return torch.tanh(self.lin(x) * scale), None


# -- the setups ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup(harness.Row):
    """One training setup; every field has the plain default."""

    id: str
    # "gpt", "buffers", "containers", "single-use", "spare-parameter", "saved-output", "cache",
    # "saved-cache" (its running state the tensor it was graphed with), "subclass", "list-stats"
    layer: str = "gpt"
    blocks: int = 3
    dropout: float = 0.0
    recompute: str = "none"  # "none", "reentrant", "non-reentrant"
    dtype: torch.dtype = torch.float32
    stack: bool = False  # graph the blocks as one module
    tracker: str = "ours"  # "ours", "duck" (Megatron-style)
    input_grad: bool = True  # the real first input requires grad
    eval: bool = False  # train in eval mode (no dropout), grads still flow
    hooks: tuple = ()  # "tensor", "post_accumulate", "main_grad"
    hooks_first: bool = False  # register the hooks before graphing (else after)
    set_to_none: bool = False  # zero_grad(set_to_none=True)
    seq_lengths: tuple = (SEQ,)  # several: graphed for each (more_shapes), steps cycle
    new_stream_objects: bool = False  # reseed a duck tracker the Megatron way (new objects)
    options: tuple = ()  # extra make_graphed_callables keyword arguments, as pairs
    flow: str = "chain"  # how activations go from layer to layer: see _run_layers
    input_from: str = "fresh"  # the first input: "fresh" tensors, or views of the first
    # sample's buffer: "buffer-strided" (the sample's address, other strides) or
    # "buffer-overlap" (another address, overlapping the sample)
    gpu_only: bool = False

    def runs_on(self, device: str) -> bool:
        return super().runs_on(device) and (device == "cuda" or self.dtype != torch.bfloat16)


SETUPS = [
    Setup("plain"),
    Setup("stack", stack=True),
    Setup("bf16", dtype=torch.bfloat16),
    Setup("dropout", dropout=0.1),
    Setup("dropout-stack", dropout=0.1, stack=True),
    Setup("recompute", dropout=0.1, recompute="reentrant"),
    Setup("recompute-non-reentrant", dropout=0.1, recompute="non-reentrant"),
    Setup("recompute-stack-bf16", dropout=0.1, recompute="reentrant", stack=True, dtype=torch.bfloat16),
    Setup("recompute-bf16-non-reentrant", dropout=0.1, recompute="non-reentrant", dtype=torch.bfloat16),
    Setup("recompute-duck-tracker", dropout=0.1, recompute="reentrant", tracker="duck"),
    Setup("duck-tracker-reseeded-with-new-objects", dropout=0.1, recompute="reentrant", tracker="duck", new_stream_objects=True),
    Setup("input-without-grad", dropout=0.1, input_grad=False),
    Setup("input-without-grad-recompute", dropout=0.1, recompute="non-reentrant", input_grad=False),
    Setup("eval-mode-with-grad", dropout=0.1, eval=True),
    Setup("tensor-hooks", hooks=("tensor",)),
    Setup("tensor-hooks-first", hooks=("tensor",), hooks_first=True, dropout=0.1, recompute="reentrant"),
    Setup("post-accumulate-hooks", hooks=("post_accumulate",)),
    # Hooks, each kind, on a parameter the forward never reads: never run, as in eager code.
    Setup("hooks-on-a-spare-parameter", layer="spare-parameter",
          hooks=("tensor", "post_accumulate", "main_grad")),
    # A Parameter subclass keeps its class where the capture stands in for it.
    Setup("parameter-subclass", layer="subclass", hooks=("tensor",)),
    Setup("megatron-main-grad", hooks=("main_grad",), hooks_first=True, dropout=0.1, recompute="reentrant"),
    Setup("megatron-main-grad-after-graphing", hooks=("main_grad",), dropout=0.1),
    Setup("main-grad-uncloned", hooks=("main_grad",), hooks_first=True, options=(("clone_param_grads_on_return", False),)),
    Setup("grads-through-autograd", options=(("accumulate_grads_in_graph", False),)),
    Setup("set-to-none", set_to_none=True, dropout=0.1),
    Setup("buffers", layer="buffers"),
    Setup("running-statistic-in-a-list", layer="list-stats"),
    Setup("containers", layer="containers"),
    Setup("output-read-by-its-backward", layer="saved-output", dropout=0.1),
    Setup("output-read-by-its-backward-stack", layer="saved-output", dropout=0.1, stack=True),
    Setup("retain-graph-option", dropout=0.1, recompute="reentrant", options=(("retain_graph_in_backward", True),)),
    Setup("seq-buckets", dropout=0.1, recompute="reentrant", seq_lengths=(16, 8, 4)),
    Setup("seq-buckets-stack", dropout=0.1, recompute="non-reentrant", stack=True, seq_lengths=(8, 16)),
    # Where input grads go between graphs (a grad buffer handed on uncopied must reach only
    # a graph's backward; a layer reads the next layer's buffer in place only when fed by it).
    Setup("leaf-view-input-accumulates", dropout=0.1, flow="leaf-view"),
    Setup("op-between-layers", dropout=0.1, flow="op-between"),
    Setup("branches", layer="single-use", dropout=0.1, flow="branches"),
    Setup("fan-out", layer="single-use", dropout=0.1, flow="fan-out"),
    Setup("skip-connection-outside", layer="single-use", flow="skip"),
    Setup("hook-on-graphed-output", layer="single-use", flow="output-hook"),
    # Inputs the callable updates in place, and inputs sharing a static buffer's memory.
    Setup("input-updated-in-place", layer="cache", dropout=0.1),
    Setup("input-updated-in-place-is-the-sample", layer="saved-cache"),
    Setup("input-at-the-sample-address-other-strides", dropout=0.1, input_from="buffer-strided"),
    Setup("input-overlapping-the-sample", dropout=0.1, input_from="buffer-overlap"),
]


# -- one run ------------------------------------------------------------------------------------
def _tracker(setup: Setup, device: str):
    if setup.tracker == "ours":
        return rng.get_cuda_rng_tracker()
    return _DUCKS.setdefault(device, DuckTracker(device))


_DUCKS: dict[str, DuckTracker] = {}


def _seed(setup: Setup, device: str, seed: int, new_objects: bool = False) -> None:
    tracker = _tracker(setup, device)
    if new_objects:  # Megatron's own seeding: reset() and add() make new generators
        tracker.reset()
    rng.model_parallel_cuda_manual_seed(seed, tracker=tracker)
    if setup.tracker != "ours":
        rng.model_parallel_cuda_manual_seed(seed)  # our tracker too (the default generator)
    torch.manual_seed(seed)


def _build(setup: Setup, device: str) -> list[nn.Module]:
    _seed(setup, device, 1234)
    tracker = _tracker(setup, device)
    blocks = []
    for _ in range(setup.blocks):
        if setup.layer == "gpt":
            blocks.append(GPTBlock(
                HIDDEN, HEADS, setup.dropout, recompute=setup.recompute != "none",
                use_reentrant=setup.recompute != "non-reentrant", get_rng_tracker=lambda: tracker,
                device=device, dtype=setup.dtype,
            ))
        elif setup.layer == "buffers":
            blocks.append(BufferedBlock(device, setup.dtype))
        elif setup.layer == "single-use":
            blocks.append(SingleUseBlock(device, setup.dtype, setup.dropout))
        elif setup.layer == "spare-parameter":
            blocks.append(SpareParameterBlock(device, setup.dtype, setup.dropout))
        elif setup.layer == "saved-output":
            blocks.append(SavedOutputBlock(device, setup.dtype, setup.dropout))
        elif setup.layer == "cache":
            blocks.append(CacheBlock(device, setup.dtype))
        elif setup.layer == "list-stats":
            blocks.append(ListStatsBlock(device, setup.dtype))
        elif setup.layer == "saved-cache":
            blocks.append(SavedCacheBlock(device, setup.dtype))
        elif setup.layer == "subclass":
            blocks.append(SubclassParameterBlock(device, setup.dtype))
        else:
            blocks.append(ContainerBlock(device, setup.dtype))
    for block in blocks:
        block.train(not setup.eval)
    return blocks


def _samples(setup: Setup, layers: list, device: str, seq: int, buffer=None) -> tuple:
    g = torch.Generator().manual_seed(seq)
    samples = [
        (torch.randn(seq, BATCH, HIDDEN, generator=g).to(device, setup.dtype).requires_grad_(True),)
        for _ in layers
    ]
    if setup.layer in ("cache", "saved-cache"):  # the cache sample (with "cache" not the cache trained with)
        samples = [x + (torch.randn(BATCH, HIDDEN, generator=g).to(device, setup.dtype),) for x in samples]
    if buffer is not None:  # the first layer's sample lies at the start of a bigger buffer
        samples[0] = (buffer[:seq].requires_grad_(True),)
    return tuple(samples)


def _first_input(setup: Setup, buffer, data, seq: int, device: str):
    """The first layer's input of one microbatch (a fresh tensor, or a view of the buffer
    the first sample lies in, refilled with fresh numbers)."""
    fresh = torch.randn(2 * seq if buffer is not None else seq, BATCH, HIDDEN, generator=data).to(device, setup.dtype)
    if buffer is None:
        return fresh
    with torch.no_grad():
        buffer.copy_(fresh)
    if setup.input_from == "buffer-strided":  # the sample's address, every other row
        return buffer.view(seq, 2, BATCH, HIDDEN)[:, 0]
    return buffer[seq // 2: seq // 2 + seq]  # "buffer-overlap"


def _graph(setup: Setup, layers: list, device: str, mode: str, samples: tuple) -> list:
    _, *rest = setup.seq_lengths
    more = [Samples(_samples(setup, layers, device, s)) for s in rest]
    graphed = make_graphed_callables(
        tuple(layers), samples, more_shapes=more,
        eager_replay=harness.eager_replay(mode), get_rng_state_tracker=lambda: _tracker(setup, device),
        **dict(setup.options),
    )
    return list(graphed)


def _install_hooks(setup: Setup, params: list, trace: Trace) -> list:
    keep = []
    for kind in setup.hooks:
        trace.hook_calls[kind] = 0
        for i, p in enumerate(params):
            seen = trace.hook_grads.setdefault((kind, i), [])
            if kind == "tensor":
                def hook(g, kind=kind, seen=seen):
                    trace.hook_calls[kind] += 1
                    seen.append(g.clone())
                keep.append(p.register_hook(hook))
            elif kind == "post_accumulate":
                def hook(param, kind=kind, seen=seen):
                    trace.hook_calls[kind] += 1
                    seen.append(param.grad.clone())
                keep.append(p.register_post_accumulate_grad_hook(hook))
            else:  # Megatron's DDP: accumulate into main_grad from the grad accumulator
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]

                def hook(*_, p=p, kind=kind):
                    trace.hook_calls[kind] += 1
                    p.main_grad.add_(p.grad)
                    p.grad = None
                accumulator.register_hook(hook)
                keep.append(accumulator)
    return keep


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _run_layers(flow: str, layers: list, x: torch.Tensor, seen: list) -> torch.Tensor:
    """The forward of one microbatch. Forwards always run in the graphed order (the pool's
    rule); what differs is which output feeds which layer. A hook may append to ``seen``."""
    if flow in ("chain", "leaf-view"):
        y = x
        for layer in layers:
            y = _first(layer(y))
        return y
    if flow == "op-between":  # a non-graphed op between layers: their grads get copied
        y = _first(layers[0](x))
        for layer in layers[1:]:
            y = _first(layer(y * 0.5))
        return y
    a, b, c = layers
    h = _first(a(x))
    if flow == "branches":  # c takes a's output, not b's: b's backward runs between
        side = _first(b(x * 0.5))
        return side + _first(c(h))
    if flow == "fan-out":  # two layers take a's output
        return _first(b(h)) + _first(c(h))
    if flow == "output-hook":  # keeps the grad it sees (checked after the backward), scales it
        h.register_hook(lambda g: (seen.append(g), g * 3)[1])
        return _first(c(_first(b(h))))
    assert flow == "skip", flow  # a's output kept by the caller past later layers
    return _first(c(_first(b(h)))) + h


def train(setup: Setup, mode: str, device: str, steps: int = 3, micro: int = 2) -> Trace:
    """Train ``setup`` in one of the harness's modes; return its trace."""
    trace = Trace()
    layers = _build(setup, device)
    params = [p for layer in layers for p in layer.parameters()]
    keep = _install_hooks(setup, params, trace) if setup.hooks_first else []
    if setup.stack:
        layers = [Stack(layers)]
    modules = layers
    buffer = None
    if setup.input_from != "fresh":  # the buffer the first sample lies in, and the inputs too
        seq = setup.seq_lengths[0]
        buffer = torch.randn(2 * seq, BATCH, HIDDEN, generator=torch.Generator().manual_seed(3)).to(device, setup.dtype)
    samples = _samples(setup, layers, device, setup.seq_lengths[0], buffer)
    if mode != EAGER:
        layers = _graph(setup, layers, device, mode, samples)
    caches = []
    if setup.layer in ("cache", "saved-cache"):  # each layer's running state, updated in place by its calls
        caches = [torch.zeros(BATCH, HIDDEN, device=device, dtype=setup.dtype) for _ in layers]
        if setup.layer == "saved-cache":  # the very tensors the layers were graphed with
            caches = [sample[1] for sample in samples]
        layers = [lambda h, layer=layer, cache=cache: layer(h, cache) for layer, cache in zip(layers, caches)]
    if not setup.hooks_first:
        keep = _install_hooks(setup, params, trace)
    opt = torch.optim.SGD(params, lr=0.1)
    data = torch.Generator().manual_seed(7)
    _seed(setup, device, 77, setup.new_stream_objects)  # both runs draw the same streams from here
    for step in range(steps):
        opt.zero_grad(set_to_none=setup.set_to_none)
        seq = setup.seq_lengths[step % len(setup.seq_lengths)]
        # "leaf-view": one leaf per step, fed as a view, its grad accumulating over the
        # microbatches (autograd keeps a view's grad as the leaf's .grad as it is).
        shared = (torch.randn(seq, BATCH, HIDDEN, generator=data).to(device, setup.dtype).requires_grad_()
                  if setup.flow == "leaf-view" else None)
        for _ in range(micro):
            if setup.flow == "leaf-view":
                x, first = shared, shared.view_as(shared)
            else:
                x = first = _first_input(setup, buffer, data, seq, device)
                x.requires_grad_(setup.input_grad)
            seen: list = []
            y = _run_layers(setup.flow, layers, first, seen)
            weighted_loss(y).backward()
            trace.activation_grads += [g.clone() for g in seen]  # cloned after the backward
            trace.microbatch(y, x if setup.input_grad else None)
        trace.step(params)
        opt.step()
    trace.end(params, modules)
    trace.updated_inputs = [c.clone() for c in caches]
    del keep
    return trace


@pytest.mark.parametrize("setup, verified", and_verified(harness.params(SETUPS, "cpu")))
def test_eager_replay_equals_eager_cpu(setup, verified, monkeypatch):
    with verifying(verified, monkeypatch):
        harness.differential(lambda mode: train(setup, mode, "cpu"), GRAPHED["cpu"], setup.id)


@pytest.mark.parametrize("setup, verified", and_verified(harness.params(SETUPS, "cuda")))
def test_graphs_and_eager_replay_equal_eager_gpu(setup, verified, monkeypatch):
    with verifying(verified, monkeypatch):
        harness.differential(lambda mode: train(setup, mode, "cuda"), GRAPHED["cuda"], setup.id)


def test_every_setup_differs_from_plain():
    """Each row changes something (a typo'd field would silently test the plain setup)."""
    plain = Setup("plain")
    for setup in SETUPS[1:]:
        assert dataclasses.replace(setup, id="plain") != plain, setup.id

