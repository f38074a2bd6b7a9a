"""The runtime verifier (``te_graph.verify``) and whole-step graphs (``te_graph.make_graphed_step``).

The verifier: no report on equal setups (graphs and eager replay, dropout and recompute,
microbatches under an order); a report naming the tensor when a guard that would have
refused a change is switched off; nothing changes in the model (its state as if only the
graph ran); off, a graphed callable keeps its class. Whole-step graphs: a step of two
microbatches with dropout, recompute and an optimizer, bitwise equal to the eager step at
every step; the refusals; a verified step finds nothing. Rows of the harness cover whole
steps with dropout, recompute (``checkpointing.checkpoint`` and torch's own checkpoint),
microbatches accumulating their gradients, the optimizer inside the graph, after it or
absent, and Transformer Engine's layers in bf16 and FP8 (GPU; TE imported only there), where a
recompute under FP8 delayed scaling is refused; on the CPU, a precision on the seam that keeps
scaling state stands for it (the refusal, and that state put back after warmup)."""
from __future__ import annotations

import contextlib
import copy
import ctypes
import importlib.util
import re
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
from torch import nn

import rng
import te_graph
from te_graph.replay.graphed import GraphedCallable
from te_graph.verify.callable import VerifiedCallable
import checkpointing
from examples.gpt import GPTBlock
from tests import harness
from tests.graph_helpers import make_blocks, weighted_loss
from tests.harness import DEVICE_MODES, EAGER, GRAPHED, Trace, refused

SHAPE = (16, 2, 64)


def _batch(device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(device)


def _train(layers, steps, device, seed=3):
    """Steps of two microbatches through ``layers``: the trace of every output, input grad and
    weight grad."""
    trace = Trace()
    params = [p for layer in layers for p in layer.parameters()]
    rng.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    for step in range(steps):
        for p in params:
            p.grad = None
        for micro in range(2):
            x = _batch(device, 100 * step + micro).requires_grad_(True)
            y = x
            for layer in layers:
                y = layer(y)[0]
            weighted_loss(y).backward()
            trace.microbatch(y, x)
        trace.step(params)
    return trace


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("device, eager_replay", DEVICE_MODES)
def test_the_verifier_finds_nothing_on_equal_setups_and_leaves_no_trace(device, eager_replay, recompute):
    blocks = make_blocks(n=2, device=device, dropout=0.1, recompute=recompute)
    reference = copy.deepcopy(blocks)
    sample = tuple((_batch(device, 0).requires_grad_(True),) for _ in blocks)
    graphed = te_graph.make_graphed_callables(tuple(blocks), sample, eager_replay=eager_replay, verify=True)
    assert all(type(b.forward) is VerifiedCallable for b in graphed)
    harness.assert_same(_train(graphed, 3, device), _train(reference, 3, device), "the verified run against eager")
    te_graph.verify(graphed, first=0)
    assert all(type(b.forward) is GraphedCallable for b in graphed), "off: the plain class again"


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale=1.0):
        return self.lin(x) * scale


@pytest.mark.parametrize("device, eager_replay", DEVICE_MODES)
def test_the_verifier_reports_what_a_switched_off_guard_lets_through(device, eager_replay, monkeypatch):
    """The constant keyword check switched off: the graph (and eager replay, on its static
    buffers) keep the constant of capture, the eager shadow takes the call's."""
    m = Scaled().to(device)
    te_graph.make_graphed_callables(m, (torch.randn(4, 8, device=device, requires_grad=True),),
                                    sample_kwargs={"scale": 2.0}, eager_replay=eager_replay)
    te_graph.verify(m, first=4)
    m(torch.randn(4, 8, device=device, requires_grad=True), scale=2.0).sum().backward()  # equal: no report
    layout = type(m.forward._single.layout)
    flatten = layout.flatten
    monkeypatch.setattr(layout, "flatten", lambda self, args, kwargs: flatten(self, args, {**kwargs, "scale": 2.0}))
    x = torch.randn(4, 8, device=device, requires_grad=True)
    with refused(RuntimeError, re.escape(
            "callable 0 (Scaled): te_graph's verifier ran this call again eagerly and its outputs differ from the "
            "graph's:\n  output 0: 32 of 32 elements differ at [0, 0]"), m, x):
        m(x, scale=3.0)


class Gated(nn.Module):
    """Reads a float attribute and runs a submodule: what a graph freezes of a module."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gain = 1.0

    def forward(self, x):
        return self.lin(x) * self.gain


def _gain(m):
    m.gain = 3.0


def _moved(m):
    m.lin.weight.data = m.lin.weight.detach() * 2


def _hooked(m):
    m.lin.register_forward_hook(lambda module, args, out: out * 2)


_SILENT = {"attribute changed": (_gain, None), "parameter moved": (_moved, None),
           "submodule hook added": (_hooked, None), "autocast turned on": (None, "autocast")}


@pytest.mark.gpu
@pytest.mark.parametrize("change", list(_SILENT))
def test_the_verifier_reports_each_silent_class_with_its_guard_switched_off(change, monkeypatch):
    """With every per-call guard switched off, a model changed after graphing replays the
    captured program: the graph's outputs are not eager code's, and the verifier says so."""
    from te_graph.guards.fingerprint import Fingerprint

    edit, context = _SILENT[change]
    m = Gated().cuda()
    te_graph.make_graphed_callables(m, (torch.randn(4, 8, device="cuda", requires_grad=True),))
    te_graph.verify(m, first=4)
    m(torch.randn(4, 8, device="cuda", requires_grad=True)).sum().backward()  # equal: no report
    monkeypatch.setattr(Fingerprint, "check", lambda self: None)
    if edit is not None:
        edit(m)
    scope = torch.autocast("cuda", dtype=torch.bfloat16) if context else contextlib.nullcontext()
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    with scope, refused(RuntimeError, re.escape(
            "callable 0 (Gated): te_graph's verifier ran this call again eagerly and its outputs differ from the "
            "graph's:\n  output 0"), m, x):
        m(x)


def test_verify_options_are_checked():
    with refused(ValueError, re.escape("te_graph.Verify: first must be an int >= 0, got -1.")):
        te_graph.Verify(first=-1)
    with refused(TypeError, re.escape("te_graph.Verify: fraction must be a number from 0 to 1, got '0.5' (str).")):
        te_graph.Verify(fraction="0.5")
    with refused(ValueError, re.escape("te_graph.Verify: on_mismatch='ignore'; use one of 'raise', 'warn', 'eager'.")):
        te_graph.Verify(on_mismatch="ignore")
    lin, sample = nn.Linear(4, 4), torch.randn(2, 4)
    with refused(TypeError, re.escape("make_graphed_callables: verify must be True/False, an int"), lin, sample):
        te_graph.make_graphed_callables(lin, (sample,), eager_replay=True, verify="yes")


def _trained(modules, losses=()):
    """The losses of a run and what it left in ``modules``: every weight, grad and buffer."""
    trace = Trace(outputs=list(losses))
    trace.step(modules.parameters())
    trace.end(modules.parameters(), [modules])
    return trace


def _step_fn(layers, optimizer):
    def step(x0, x1):
        optimizer.zero_grad(set_to_none=False)
        losses = []
        for x in (x0, x1):
            y = x.detach().requires_grad_(True)
            for layer in layers:
                y = layer(y)[0]
            loss = weighted_loss(y)
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        return torch.stack(losses)
    return step


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("device, eager_replay", DEVICE_MODES)
def test_a_whole_step_graph_equals_the_eager_step_bitwise(device, eager_replay, recompute):
    blocks = nn.ModuleList(make_blocks(n=2, device=device, dropout=0.1, recompute=recompute))
    reference = copy.deepcopy(blocks)
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-3, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=1e-3, momentum=0.9)
    first = (_batch(device, 1), _batch(device, 2))
    for layers, optimizer in ((blocks, opt), (reference, opt_ref)):  # one eager step: the optimizer's state
        rng.model_parallel_cuda_manual_seed(5)
        torch.manual_seed(5)
        _step_fn(layers, optimizer)(*first)
    step = te_graph.make_graphed_step(_step_fn(blocks, opt), first, modules=blocks, optimizer=opt,
                                      eager_replay=eager_replay, verify=2)
    harness.assert_same(_trained(blocks), _trained(reference), "graphing left a trace")
    batches = [(_batch(device, 10 + i), _batch(device, 20 + i)) for i in range(4)]
    rng.model_parallel_cuda_manual_seed(9)
    torch.manual_seed(9)
    got = [step(*b).clone() for b in batches]
    rng.model_parallel_cuda_manual_seed(9)
    torch.manual_seed(9)
    eager = _step_fn(reference, opt_ref)
    want = [eager(*b) for b in batches]
    harness.assert_same(_trained(blocks, got), _trained(reference, want), "the graphed steps against eager")
    opt.param_groups[0]["lr"] = 2e-3
    with refused(RuntimeError, re.escape("the graphed step: since graphing, the optimizer's hyperparameters changed "
                                         "('lr' of group 0)"), blocks, *batches[0]):
        step(*batches[0])
    step.reset()


def test_a_whole_step_graph_refuses_a_replaced_optimizer_state():
    """optimizer.load_state_dict after graphing (a rollback, a resume) puts new state tensors
    in the optimizer, where the step's graph updates those of capture: the next call is
    refused before it changes anything."""
    import copy

    blocks = nn.ModuleList(make_blocks(n=1, device="cpu"))
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-3)
    batch = (_batch("cpu", 1), _batch("cpu", 2))
    step_fn = _step_fn(blocks, opt)
    step_fn(*batch)  # the optimizer's state, made eagerly
    step = te_graph.make_graphed_step(step_fn, batch, modules=blocks, optimizer=opt, eager_replay=True)
    saved = copy.deepcopy(opt.state_dict())
    step(*batch)
    opt.load_state_dict(saved)
    with refused(RuntimeError, re.escape("the graphed step: since graphing, the optimizer's state was replaced "
                                         "(optimizer.load_state_dict"), blocks, *batch):
        step(*batch)


@pytest.mark.parametrize("change", ["hook-on-the-module", "submodule-appended"])
def test_a_whole_step_graph_refuses_hooks_and_submodules_added_to_its_modules(change):
    """A step's graph ran its modules' own hooks while it was captured, and replays only those;
    a submodule appended to a module it trains (a ModuleList) is one it never ran."""
    blocks = nn.ModuleList(make_blocks(n=1, device="cpu"))
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    batch = (_batch("cpu", 1), _batch("cpu", 2))
    step = te_graph.make_graphed_step(_step_fn(blocks, opt), batch, modules=blocks, optimizer=opt, eager_replay=True)
    step(*batch)
    if change == "hook-on-the-module":
        blocks[0].register_forward_hook(lambda module, args, out: out)
        message = "forward hooks on submodule '0' changed (0 -> 1); a step's graph replays the module hooks"
    else:
        blocks.append(make_blocks(n=1, device="cpu")[0])
        message = "the module tree gained or lost a parameter, buffer or submodule ('1')"
    with refused(RuntimeError, re.escape(message), blocks, *batch):
        step(*batch)


def test_a_whole_step_without_tensor_arguments_and_one_with_a_sample_requiring_grad():
    """A step whose batch lives in a closure runs where its modules are; a sample that
    requires grad is refused (the step's graph hands no gradient back to its arguments)."""
    blocks = nn.ModuleList(make_blocks(n=1, device="cpu"))
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    batch = (_batch("cpu", 1), _batch("cpu", 2))
    step_fn = _step_fn(blocks, opt)
    step = te_graph.make_graphed_step(lambda: step_fn(*batch), (), modules=blocks, optimizer=opt, eager_replay=True)
    step()
    wanting = (batch[0].detach().requires_grad_(), batch[1])
    with refused(ValueError, re.escape("make_graphed_step: the sample positional input 0 requires grad; a step's "
                                       "graph hands no gradient back to the tensors passed to it"), blocks, *batch):
        te_graph.make_graphed_step(step_fn, wanting, modules=blocks, optimizer=opt, eager_replay=True)


def test_a_whole_step_graph_refuses_an_optimizer_without_state_and_bad_arguments():
    blocks = nn.ModuleList(make_blocks(n=1, device="cpu"))
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-3, momentum=0.9)
    batch = (_batch("cpu", 1), _batch("cpu", 2))
    with refused(ValueError, re.escape("make_graphed_step: the optimizer has no state yet for some parameters"),
                 blocks, *batch):
        te_graph.make_graphed_step(_step_fn(blocks, opt), batch, modules=blocks, optimizer=opt, eager_replay=True)
    assert not opt.state, "the refused warmup left optimizer state behind"
    # An optimizer that keeps no state (SGD without momentum) needs no eager step first.
    plain = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    te_graph.make_graphed_step(_step_fn(blocks, plain), batch, modules=blocks, optimizer=plain, eager_replay=True)
    with refused(TypeError, re.escape("make_graphed_step: step_fn must be callable"), blocks, *batch):
        te_graph.make_graphed_step(3, batch, modules=blocks, eager_replay=True)
    with refused(TypeError, re.escape("make_graphed_step: modules must be the nn.Module the step trains"), *batch):
        te_graph.make_graphed_step(lambda *b: None, batch, modules=[3], eager_replay=True)


# -- whole steps as rows of the harness ----------------------------------------------------------
@dataclass(frozen=True)
class StepSetup(harness.Row):
    """A whole step of two layers: each microbatch's forward, loss and backward (the
    gradients accumulate), then the optimizer's step where it is inside the graph."""

    id: str
    dropout: float = 0.1
    recompute: str = "none"  # "none", "ours" (checkpointing.checkpoint), "torch" (torch.utils.checkpoint)
    microbatches: int = 1
    optimizer: str = "inside"  # inside the graph, "outside" (eager, after each call) or "none"
    te: Optional[str] = None  # Transformer Engine's TransformerLayer: "bf16" or "fp8" (delayed scaling)
    gpu_only: bool = False
    refused: str = ""  # graphing is refused with this ValueError, exactly; the step then runs eagerly


# FP8 delayed scaling with checkpointing.checkpoint inside the whole step is refused: graphed, the
# first replay's loss differed from eager's (TE 2.20.2 on an H200, 2026-11-29), while FP8 without
# recompute and bf16 with it are exact.
_FP8_RECOMPUTE = (
    "make_graphed_step: the step recomputes a checkpointed region (checkpointing.checkpoint or "
    "torch.utils.checkpoint) under FP8 that keeps scaling state from step to step (Transformer Engine's FP8 "
    "autocast with the DelayedScaling recipe); such a step graphed whole is not proven equal to eager (the loss "
    "of its first replay differs from eager's). Graph its layers with make_graphed_callables instead (exact "
    "with FP8 and recompute), or graph the step without recompute, or in bf16."
)


STEP_SETUPS = [
    StepSetup("plain", dropout=0.0),
    StepSetup("dropout"),
    StepSetup("recompute-ours", recompute="ours"),
    StepSetup("recompute-torch", recompute="torch"),
    StepSetup("microbatches-accumulate", microbatches=3),
    StepSetup("microbatches-recompute-ours", microbatches=3, recompute="ours"),
    StepSetup("microbatches-recompute-torch", microbatches=2, recompute="torch"),
    StepSetup("optimizer-outside", microbatches=2, recompute="ours", optimizer="outside"),
    StepSetup("no-optimizer", microbatches=2, optimizer="none"),
    StepSetup("te-bf16", te="bf16", microbatches=2, gpu_only=True),
    StepSetup("te-bf16-recompute-ours", te="bf16", microbatches=2, recompute="ours", gpu_only=True),
    StepSetup("te-bf16-optimizer-outside", te="bf16", microbatches=2, optimizer="outside", gpu_only=True),
    StepSetup("te-fp8-delayed", te="fp8", microbatches=2, gpu_only=True),
    StepSetup("te-fp8-delayed-recompute-ours", te="fp8", microbatches=2, recompute="ours", gpu_only=True,
              refused=_FP8_RECOMPUTE),
]


class _NoFork:
    """A tracker without streams: attention dropout draws from the default generator, the
    only stream torch's checkpoint preserves."""

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        yield


class TorchCheckpointed(nn.Module):
    """A block inside torch's own checkpoint (non-reentrant, preserve_rng_state=True)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


class _TE:
    """Transformer Engine's layers, tracker and autocast for a row (imported only here)."""

    def __init__(self, setup: StepSetup):
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        FP8GlobalStateManager.reset()
        self.te, self.recipe = te, recipe.DelayedScaling() if setup.te == "fp8" else None
        self.tracker = te.distributed.CudaRNGStatesTracker()
        self.tracker.add("model-parallel-rng", 1234 + 2718)
        torch.manual_seed(1234)
        torch.cuda.manual_seed(1234)
        self.layers = [te.TransformerLayer(SHAPE[2], 2 * SHAPE[2], 4, hidden_dropout=setup.dropout,
                                           attention_dropout=setup.dropout, params_dtype=torch.bfloat16,
                                           self_attn_mask_type="causal", get_rng_state_tracker=lambda: self.tracker)
                       for _ in range(2)]
        if setup.recompute == "ours":
            self.layers = [_Recomputed(m, lambda: self.tracker) for m in self.layers]

    def autocast(self):
        return self.te.autocast(enabled=self.recipe is not None, recipe=self.recipe)

    def streams(self) -> dict:
        """The tracker's streams and the default CUDA generator, as byte states (copies)."""
        found = {k: rng.to_byte_state(v) for k, v in self.tracker.get_states().items()}
        return {**found, "the default CUDA generator": torch.cuda.get_rng_state()}

    @staticmethod
    def fp8_meta(layers) -> list:
        """Every module's amax history and scales (delayed scaling keeps them)."""
        from tests.test_te_layers import fp8_meta

        return fp8_meta([layers])


class _Recomputed(nn.Module):
    def __init__(self, layer: nn.Module, tracker: Any):
        super().__init__()
        self.layer, self.tracker = layer, tracker

    def forward(self, x):
        return checkpointing.checkpoint(self.layer, x, get_rng_state_tracker=self.tracker)


def _step_layers(setup: StepSetup, device: str) -> tuple[nn.ModuleList, Optional[_TE]]:
    if setup.te:
        made = _TE(setup)
        return nn.ModuleList(made.layers), made
    if setup.recompute == "torch":
        rng.model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
        blocks = [GPTBlock(SHAPE[2], 4, setup.dropout, get_rng_tracker=_NoFork, device=device) for _ in range(2)]
        return nn.ModuleList(TorchCheckpointed(b) for b in blocks), None
    return nn.ModuleList(make_blocks(n=2, device=device, dropout=setup.dropout,
                                     recompute=setup.recompute == "ours")), None


def _run_steps(setup: StepSetup, device: str, mode: str, steps: int = 3) -> Trace:
    """One eager step (the optimizer's state), then ``steps`` steps eagerly or through
    ``make_graphed_step`` in ``mode``: the losses, the gradients and FP8 meta of every step,
    the weights and buffers after. A refused row's graphing must leave everything as it was
    (the FP8 meta and random streams too): its steps then run eagerly, equal to eager's."""
    layers, te = _step_layers(setup, device)
    params = list(layers.parameters())
    opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9) if setup.optimizer != "none" else None
    dtype = torch.bfloat16 if te else torch.float32
    batches = [tuple(_batch(device, 10 * i + m).to(dtype) for m in range(setup.microbatches)) for i in range(steps + 1)]

    def step(*xs):
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        losses = []
        for x in xs:
            y = x.detach().requires_grad_(True)
            with te.autocast() if te else contextlib.nullcontext():
                for layer in layers:
                    out = layer(y)
                    y = out[0] if isinstance(out, tuple) else out
            loss = weighted_loss(y)
            loss.backward()
            losses.append(loss.detach())
        if setup.optimizer == "inside":
            opt.step()
        return torch.stack(losses)

    trace = Trace()
    rng.model_parallel_cuda_manual_seed(5)
    torch.manual_seed(5)

    def record(losses):
        trace.outputs.append(losses.clone())
        trace.step(params)
        if setup.optimizer == "outside":
            opt.step()
        if te:
            trace.fp8_meta.append(te.fp8_meta(layers))

    record(step(*batches[0]))
    run = step

    def graphed():
        return te_graph.make_graphed_step(step, batches[0], modules=layers, eager_replay=harness.eager_replay(mode),
                                          optimizer=opt if setup.optimizer == "inside" else None,
                                          get_rng_state_tracker=(lambda: te.tracker) if te else None)

    if mode != EAGER and setup.refused:
        kept = [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        fp8_meta, streams = (te.fp8_meta(layers), te.streams()) if te else (None, None)
        with refused(ValueError, f"^{re.escape(setup.refused)}$", layers, *kept):
            graphed()
        if te:
            harness.assert_same(te.fp8_meta(layers), fp8_meta, "the refusal changed the FP8 meta")
            harness.assert_same(te.streams(), streams, "the refusal changed TE's tracker streams")
    elif mode != EAGER:
        run = graphed()
    for batch in batches[1:]:
        record(run(*batch))
    trace.end(params, [layers])
    if run is not step:
        run.reset()
    return trace


class _KeepsScaling(te_graph.extension.Precision):
    """A precision on the engine's seam that keeps scaling state from step to step (``state``,
    put back by ``kept``) and quantizes with it inside its ``autocast()``, as FP8 delayed
    scaling does: what the whole step asks of the seam, answered without FP8, on the CPU."""

    def __init__(self):
        self.on = False
        self.state = torch.zeros(4)  # its scaling state, kept from step to step

    def scaling_state_in_use(self):
        return "a precision of this test" if self.on else None

    @contextlib.contextmanager
    def kept(self, modules):
        saved = self.state.clone()
        try:
            yield
        finally:
            self.state.copy_(saved)

    @contextlib.contextmanager
    def autocast(self):
        self.on = True
        try:
            yield
        finally:
            self.on = False


@pytest.mark.parametrize("recompute", ["ours", "torch"])
def test_a_whole_step_refuses_a_recompute_under_a_precision_that_keeps_scaling_state(recompute, monkeypatch):
    """Refused in the first warmup pass where a checkpointed region (ours, or torch's routed
    through ours) starts under the precision, with everything as before; a step whose
    regions run outside it, or that recomputes nothing under it, is graphed."""
    precision = _KeepsScaling()
    monkeypatch.setattr(te_graph.extension.SEAM, "precision", precision)
    layers, _ = _step_layers(StepSetup("cpu", recompute=recompute), "cpu")
    plain, _ = _step_layers(StepSetup("cpu"), "cpu")
    batch = (_batch("cpu", 1), _batch("cpu", 2))

    def step_of(modules, around_layers):
        opt = torch.optim.SGD(modules.parameters(), lr=1e-2, momentum=0.9)
        inner = _step_fn(modules, opt)

        def step(x0, x1):
            with precision.autocast() if around_layers else contextlib.nullcontext():
                return inner(x0, x1)

        step(*batch)  # the optimizer's state
        return step, opt

    step, opt = step_of(layers, around_layers=True)
    kept = [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    message = _FP8_RECOMPUTE.replace("Transformer Engine's FP8 autocast with the DelayedScaling recipe",
                                     "a precision of this test")
    with refused(ValueError, f"^{re.escape(message)}$", layers, *batch, *kept):
        te_graph.make_graphed_step(step, batch, modules=layers, optimizer=opt, eager_replay=True)
    assert not precision.on
    for modules, around_layers in ((layers, False), (plain, True)):
        step, opt = step_of(modules, around_layers)
        te_graph.make_graphed_step(step, batch, modules=modules, optimizer=opt, eager_replay=True)(*batch)


def test_a_whole_step_puts_the_precisions_state_back_last(monkeypatch):
    """The precision's state as before warmup, though each step updates it unseen by torch's
    dispatcher first (as an extension's kernel does) and in place through torch after: the
    host watcher keeps the value of that in-place update, the precision the one before warmup."""
    precision = _KeepsScaling()
    monkeypatch.setattr(te_graph.extension.SEAM, "precision", precision)
    layers, _ = _step_layers(StepSetup("cpu"), "cpu")
    opt = torch.optim.SGD(layers.parameters(), lr=1e-2, momentum=0.9)
    inner = _step_fn(layers, opt)
    batch = (_batch("cpu", 1), _batch("cpu", 2))
    ones = torch.ones_like(precision.state)

    def step(x0, x1):
        # Written as an extension's kernel writes, not through torch's dispatcher; then in place.
        ctypes.memmove(precision.state.data_ptr(), ones.data_ptr(), ones.nbytes)
        with torch.no_grad():
            precision.state.mul_(2)
        return inner(x0, x1)

    step(*batch)
    before = precision.state.clone()
    te_graph.make_graphed_step(step, batch, modules=layers, optimizer=opt, eager_replay=True)
    harness.assert_same(precision.state, before, "the precision's state after graphing")


def _check_step_row(setup: StepSetup, device: str) -> None:
    if setup.te and importlib.util.find_spec("transformer_engine") is None:
        pytest.skip('needs Transformer Engine: pip install -e ".[te]"')
    harness.differential(lambda mode: _run_steps(setup, device, mode), GRAPHED[device], f"whole step {setup.id}")


@pytest.mark.parametrize("setup", harness.params(STEP_SETUPS, "cpu"))
def test_whole_step_rows_on_cpu(setup):
    _check_step_row(setup, "cpu")


@pytest.mark.parametrize("setup", harness.params(STEP_SETUPS, "cuda"))
def test_whole_step_rows_on_gpu(setup):
    _check_step_row(setup, "cuda")
