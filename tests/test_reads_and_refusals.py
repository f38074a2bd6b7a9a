"""Setups a graph could get wrong, each bitwise equal to eager or a clear refusal that changes
nothing (tests/harness.py), in graphs and eager replay alike: state the forward reads changed
after graphing, torch's own checkpoint with dropout, host randomness and reseeding, a
first-call initialisation, a loss over some of the outputs, dataclass output records,
inputs te_graph cannot graph, and bad option values; and the watched first warmup pass
leaves torch.compile'd code as it found it."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import io
import logging
import random
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rng
import te_graph
from tests import harness
from tests.harness import ALL_DEVICE_MODES, Trace, refused

H = 32


def _x(device, requires_grad=True, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(8, 2, H, generator=g).to(device).requires_grad_(requires_grad)


class Kind(enum.Enum):
    CAUSAL = 1
    PADDING = 2


@dataclasses.dataclass
class Rope:
    """A sub-config."""

    factor: float = 1.0


@dataclasses.dataclass
class Options:
    """A plain config object the module holds (Hugging Face style)."""

    shift: float = 0.0
    rope: Rope = dataclasses.field(default_factory=Rope)
    calls: int = 0
    warned: bool = False


DOUBLED = False  # a module global the forward reads
CALLS = 0  # a module global a forward counts its calls in


class Reads(nn.Module):
    """A forward that reads an activation, a dtype, an enum, an int, a buffer, a dict and a
    list of options from its module, a field of a config object it holds and of its sub-config, a
    class attribute, and a module global."""

    gain = 1.0  # read as self.gain

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.act = F.gelu
        self.out_dtype = torch.float32
        self.kind = Kind.CAUSAL
        self.register_buffer("scale", torch.ones(H))
        self.opts = {"gain": 1.0}
        self.taps = [1.0]
        self.config = Options()
        self.repeats = 1  # an int the forward reads: a mode, not a counter

    def forward(self, x):
        y = self.act(self.lin(x)) * self.scale * self.opts["gain"] * self.taps[0] * self.gain + self.config.shift
        y = y * self.config.rope.factor
        for _ in range(self.repeats - 1):
            y = y * 0.5
        if self.kind is Kind.PADDING or DOUBLED:
            y = y * 2
        return y.to(self.out_dtype)


def _set_doubled(value: bool) -> None:
    global DOUBLED
    DOUBLED = value


@dataclasses.dataclass(frozen=True)
class Change(harness.Row):
    """A change to what ``Reads``'s forward reads, made after graphing, and the end of the
    message that refuses the next call."""

    id: str
    apply: Callable[[Reads], Any]
    message: str
    undo: Callable[[], Any] = lambda: None  # what the change did outside the module


CHANGES = [
    Change("activation", lambda m: setattr(m, "act", F.silu), "attribute 'act' of the module is"),
    Change("dtype", lambda m: setattr(m, "out_dtype", torch.float64),
           "attribute 'out_dtype' of the module is torch.float64"),
    Change("enum", lambda m: setattr(m, "kind", Kind.PADDING), "attribute 'kind' of the module is <Kind.PADDING: 2>"),
    Change("int", lambda m: setattr(m, "repeats", 2), "attribute 'repeats' of the module is 2, but was 1 at capture"),
    Change("patched-forward", lambda m: setattr(m.lin, "forward", lambda x: x),
           "'lin' has an instance attribute 'forward' now, which hides what its forward read"),
    Change("buffer-data", lambda m: setattr(m.scale, "data", torch.full((H,), 2.0, device=m.scale.device)),
           "buffer 'scale' now lies at another address (b.data = ..., or the module was moved or cast)"),
    Change("dict-entry", lambda m: m.opts.update(gain=2.0),
           "attribute 'opts' of the module is {'gain': 2.0}, but was {'gain': 1.0} at capture"),
    Change("list-entry", lambda m: m.taps.__setitem__(0, 2.0),
           "attribute 'taps' of the module is [2.0], but was [1.0] at capture"),
    Change("config-field", lambda m: setattr(m.config, "shift", 0.5),
           "attribute 'shift' of the Options object it reads is 0.5, but was 0.0 at capture"),
    Change("sub-config-field", lambda m: setattr(m.config.rope, "factor", 4.0),
           "attribute 'factor' of the Rope object it reads is 4.0, but was 1.0 at capture"),
    Change("class-attribute", lambda m: setattr(Reads, "gain", 2.0),
           "class attribute Reads.gain is 2.0, but was 1.0 at capture", lambda: setattr(Reads, "gain", 1.0)),
    Change("module-global", lambda m: _set_doubled(True),
           f"global 'DOUBLED' of module {__name__} is True, but was False at capture", lambda: _set_doubled(False)),
]


@pytest.mark.parametrize("change", CHANGES, ids=str)
@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_state_the_forward_reads_changed_after_graphing_is_refused(device, eager_replay, change):
    m = Reads().to(device)
    te_graph.make_graphed_callables(m, (_x(device),), eager_replay=eager_replay)
    m(_x(device)).sum().backward()
    change.apply(m)
    x = _x(device)
    try:
        with refused(RuntimeError, re.escape("callable 0 (Reads): since graphing, " + change.message), m, x):
            m(x)
    finally:
        change.undo()


@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_an_attribute_the_forward_never_reads_may_change(device, eager_replay):
    m = Reads().to(device)
    te_graph.make_graphed_callables(m, (_x(device),), eager_replay=eager_replay)
    m.note = "logged elsewhere"
    m.lin.tag = 3.5
    m.config.unread = "changed"
    m(_x(device)).sum().backward()


def _keep(t):
    return t


@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_saved_tensor_hooks_that_may_change_values_are_refused_unless_as_at_capture(device, eager_replay):
    m = Reads().to(device)
    te_graph.make_graphed_callables(m, (_x(device),), eager_replay=eager_replay)
    x = _x(device)
    for hooks in (torch.autograd.graph.saved_tensors_hooks(_keep, _keep), torch.autograd.graph.save_on_cpu()):
        with hooks, refused(RuntimeError, re.escape(
                "callable 0 (Reads): since graphing, saved-tensor hooks are active (torch.autograd.graph."
                "saved_tensors_hooks or save_on_cpu: eager autograd would pack what it saves through them, and "
                "save_on_cpu brings back copies whose layout may change the kernels of eager's backward"), m, x):
            m(x)
    # Graphed inside a context of the user's own hooks: the calls inside one with the same
    # functions run; new functions, or none, are refused.
    n = Reads().to(device)
    with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
        te_graph.make_graphed_callables(n, (_x(device),), eager_replay=eager_replay)
    x = _x(device)
    with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
        n(x).sum().backward()
    assert x.grad is not None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, _keep), refused(RuntimeError, re.escape(
            "callable 0 (Reads): since graphing, other saved-tensor hooks are active than at capture (a "
            "saved_tensors_hooks context opened per step with new hook functions differs from the one graphing "
            "ran in): keep one context around both graphing and the calls, or pass it the same functions"), n, x):
        n(x)
    with refused(RuntimeError, re.escape(
            "callable 0 (Reads): since graphing, the saved-tensor hooks active at capture are not any more"), n, x):
        n(x)


@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_checkpoints_over_graphed_layers_only_train_as_eager(device, eager_replay):
    """A checkpoint (non-reentrant or reentrant) whose region is graphed layers, whose
    backward reads their outputs: the graphs keep their own activations, so the checkpoint
    has nothing to rebuild, and the steps train bitwise as eager's (which rebuilds)."""
    m, ref = _graphed_and_eager(lambda: nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh()),
                                device, eager_replay)

    def step_of(module, step):
        x = _x(device, seed=step)
        y = (torch.utils.checkpoint.checkpoint(module, x, use_reentrant=step % 2 == 1) if step < 2
             else module(x)).tanh()
        y.square().sum().backward()
        return y, x

    _against_eager(m, ref, step_of, 3)


class Logs(nn.Module):
    """Holds a logger and logs from its forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.log = logging.getLogger("te_graph.tests.logs")

    def forward(self, x):
        self.log.debug("forward")
        return self.lin(x)


@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_a_logger_the_module_holds_is_the_process_machinery_not_watched(device, eager_replay):
    m = Logs().to(device)
    te_graph.make_graphed_callables(m, (_x(device),), eager_replay=eager_replay)
    level = m.log.level
    try:
        m.log.setLevel(logging.DEBUG)
        m(_x(device)).sum().backward()
    finally:
        m.log.setLevel(level)


class Counts(Reads):
    """Counts its calls in a module global or a field of its config; or sets a flag once."""

    def __init__(self, where):
        super().__init__()
        self.where = where

    def forward(self, x):
        global CALLS
        if self.where == "global":
            CALLS += 1
        elif self.where == "config":
            self.config.calls += 1
        elif not self.config.warned:
            self.config.warned = True  # a warn-once flag
        return super().forward(x)


@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_a_counter_outside_the_module_is_refused_and_a_set_once_flag_is_put_back(device, eager_replay):
    for where, what in (("global", f"global 'CALLS' of module {__name__}"),
                        ("config", "attribute 'calls' of the Options object it reads")):
        m, x = Counts(where).to(device), _x(device)
        before = (CALLS, m.config.calls)
        message = re.escape(f"make_graphed_callables: the forward of callable 0 (Counts) changes {what} at every "
                            "call (1 after the first warmup pass, ") + r"\d+ after the last\)"
        with refused(ValueError, message, m, x):
            te_graph.make_graphed_callables(m, (x,), eager_replay=eager_replay)
        assert (CALLS, m.config.calls) == before, "warmup's counts were left behind"
    m = Counts("flag").to(device)
    te_graph.make_graphed_callables(m, (_x(device),), eager_replay=eager_replay)
    assert m.config.warned is False, "warmup's first call set the flag for the user's first call"
    m(_x(device)).sum().backward()


class LayerDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        return self.lin(x) if random.random() < 0.5 else x * 1.0


class Reseeds(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        torch.manual_seed(0)
        return F.dropout(self.lin(x), 0.5)


class ActNorm(nn.Module):
    """Glow's data-dependent initialisation on the first batch."""

    def __init__(self):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(H))
        self.initialized = False

    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                self.loc.data.copy_(-x.mean((0, 1)))
            self.initialized = True
        return x + self.loc


class ActNormPlaceholder(nn.Module):
    """As ``ActNorm``, its scale a plain tensor attribute whose placeholder the first call
    replaces by a statistic of the batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.scale = torch.ones(H)
        self.ready = False

    def forward(self, x):
        if not self.ready:
            self.scale = x.detach().std((0, 1)).to(x.device)
            self.ready = True
        return self.lin(x) * self.scale


class LazyCache(nn.Module):
    """Makes a tensor attribute at its first call (a rotary cache, from constants): no
    initialisation from the data."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.cached = False

    def forward(self, x):
        if not self.cached:
            self.cos = torch.cos(torch.arange(H, dtype=x.dtype, device=x.device))
            self.cached = True
        return self.lin(x) * self.cos


@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_a_lazy_cache_made_at_the_first_call_is_no_initialisation(device, eager_replay):
    m, eager = _graphed_and_eager(LazyCache, device, eager_replay)
    _against_eager(m, eager, _plain_step(device), steps=2)


def _plain_step(device: str, state=None):
    """A ``step_of`` for ``_against_eager``: a fresh input per step (and ``state(module)``
    passed beside it), the sum's backward."""
    def step_of(module, step):
        x = _x(device, seed=step)
        out = module(x) if state is None else module(x, state(module))
        out.sum().backward()
        return out, x
    return step_of


@dataclasses.dataclass(frozen=True)
class Unwatchable(harness.Row):
    """A forward whose first warmup pass shows it cannot be graphed, and why."""

    id: str
    module: type
    message: str


REFUSED_AT_GRAPHING = [
    Unwatchable("python-random", LayerDrop,
                "make_graphed_callables: the forward of callable 0 (LayerDrop) draws from Python's random module"),
    Unwatchable("manual-seed", Reseeds,
                "make_graphed_callables: the forward of callable 0 (Reseeds) calls torch.manual_seed"),
    Unwatchable("first-call-init", ActNorm,
                "make_graphed_callables: the forward of callable 0 (ActNorm) initialises 'the module' from its "
                "first call"),
    Unwatchable("first-call-init-of-a-tensor-attribute", ActNormPlaceholder,
                "make_graphed_callables: the forward of callable 0 (ActNormPlaceholder) initialises 'the module' "
                "from its first call"),
]


@pytest.mark.parametrize("case", REFUSED_AT_GRAPHING, ids=str)
@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_host_randomness_reseeding_and_first_call_initialisation_are_refused_and_nothing_changed(device, eager_replay, case):
    """The refusal leaves the module (parameters, forward) and the torch random streams as they
    were (the harness's Snapshot), and Python's random stream too."""
    m = case.module().to(device)
    sample = _x(device)
    python_state = random.getstate()
    with refused(ValueError, re.escape(case.message), m, sample):
        te_graph.make_graphed_callables(m, (sample,), eager_replay=eager_replay)
    assert random.getstate() == python_state, "warmup advanced the user's Python random stream"


class Entropy(nn.Module):
    """Returns (hidden, entropy): the loss uses the hidden states only."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        h = self.lin(x)
        p = torch.softmax(h, -1)
        return F.dropout(h, 0.2), -(p * p.log()).sum(-1)


def test_the_watched_first_pass_leaves_compiled_code_as_it_was():
    """The first warmup pass watches the forward through torch function and dispatch modes; a
    torch.compile'd function it calls runs eagerly there and is neither compiled again nor
    left to run eagerly afterwards (Transformer Engine's fused kernels)."""
    from torch._dynamo.utils import counters

    @torch.compile(backend="eager")
    def fused(x, bias):
        return F.gelu(x + bias)

    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(H, H)

        def forward(self, x):
            return fused(self.lin(x), self.lin.bias)

    m = Fused()
    m(_x("cpu")).sum().backward()
    compiled = counters["frames"]["total"]
    te_graph.make_graphed_callables(m, (_x("cpu"),), eager_replay=True)
    m(_x("cpu")).sum().backward()
    assert counters["frames"]["total"] == compiled, "dynamo compiled the function again under te_graph's watch"


def test_graphing_under_a_profiler_leaves_it_running():
    """A profiler set from C (cProfile on Python < 3.12) can be neither chained nor put back
    from Python: graphing leaves it running and warns that module globals go unwatched; one
    on sys.monitoring (Python >= 3.12) leaves sys.setprofile free, and nothing is said."""
    import cProfile
    import sys
    import warnings

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        installed = sys.getprofile()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            graphed = te_graph.make_graphed_callables(nn.Linear(H, H), (_x("cpu"),), eager_replay=True)
        assert sys.getprofile() is installed, "graphing replaced the running profiler"
        graphed(_x("cpu")).sum().backward()
    finally:
        profiler.disable()
    text = "is running while graphing: the module globals the forward reads are not learnt"
    warned = [w for w in said if text in str(w.message)]
    assert len(warned) == (0 if installed is None or callable(installed) else 1), [str(w.message) for w in said]
    assert profiler.getstats(), "the profiler saw nothing after graphing"


def test_a_batch_norm_a_function_closes_over_keeps_its_statistics_through_graphing():
    """The batch-norm ops update running_mean and running_var without saying so in their
    schema: warmup's passes through a function closing over a BatchNorm leave them as they
    were, and the calls after update them as eager code does."""
    bn = nn.BatchNorm1d(H, affine=False)
    reference = copy.deepcopy(bn)
    graphed = te_graph.make_graphed_callables(lambda x: bn(x) * 2, (_x("cpu")[0],), eager_replay=True)
    harness.assert_same(list(bn.buffers()), list(reference.buffers()), "the statistics after graphing")
    for seed in range(3):
        x = _x("cpu", seed=seed)[0]
        graphed(x).sum().backward()
        (reference(x) * 2).sum().backward()
    harness.assert_same(list(bn.buffers()), list(reference.buffers()), "the statistics after three calls")


def _graphed_and_eager(make: Callable[[], nn.Module], device: str, eager_replay: bool, samples=None) -> tuple:
    """``make()`` from seed 0 on ``device``, graphed on ``samples(module)`` (default: one
    ``_x``), and an eager copy of it made before graphing: (graphed, eager)."""
    torch.manual_seed(0)
    m = make().to(device)
    eager = copy.deepcopy(m)
    te_graph.make_graphed_callables(m, samples(m) if samples else (_x(device),), eager_replay=eager_replay)
    return m, eager


def _against_eager(m, ref, step_of, steps):
    """``step_of(module, step)`` (returns the output and input to record) on the graphed module
    and on its eager copy, a step each in turn; the two traces bitwise equal: outputs, input
    grads and every parameter's grad at every step."""
    got, want = Trace(), Trace()
    for step in range(steps):
        for module, trace in ((m, got), (ref, want)):
            trace.microbatch(*step_of(module, step))
            trace.step(module.parameters())
    harness.assert_same(got, want, "the graphed module against its eager copy")


@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_a_loss_over_some_outputs_trains_exactly(device, eager_replay):
    m, ref = _graphed_and_eager(Entropy, device, eager_replay)

    def step_of(module, step):
        x = _x(device, seed=step)
        torch.manual_seed(10 + step)
        y, _ = module(x)
        (y * y).sum().backward()
        return y, x

    _against_eager(m, ref, step_of, 3)


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    aux: torch.Tensor
    note: str = "stats"


class Record(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        h = self.lin(x)
        return Out(h, (h * h).mean())


@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_outputs_in_a_dataclass_record_are_fresh_every_call_and_train(device, eager_replay):
    m = Record().to(device)
    ref = copy.deepcopy(m)
    te_graph.make_graphed_callables(m, (_x(device),), eager_replay=eager_replay)

    def step_of(module, step):
        x = _x(device, seed=step)
        out = module(x)
        assert isinstance(out, Out) and out.note == "stats"
        (out.hidden.sum() + out.aux).backward()
        return torch.cat([out.hidden.flatten(), out.aux.reshape(1)]), x

    _against_eager(m, ref, step_of, 2)


class CheckpointedDropout(nn.Module):
    """Hugging Face's gradient checkpointing: torch's own checkpoint, non-reentrant, with
    its default preserve_rng_state=True, around a block with dropout."""

    def __init__(self, reentrant):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.reentrant = reentrant

    def block(self, x):
        return F.dropout(F.gelu(self.lin(x)), 0.3)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_torchs_own_checkpoint_with_dropout_recomputes_the_forwards_masks(device, eager_replay, reentrant):
    m, ref = _graphed_and_eager(lambda: CheckpointedDropout(reentrant), device, eager_replay)

    def step_of(module, step):
        x = _x(device, seed=step)
        torch.manual_seed(20 + step)
        y = module(x)
        (y * y).sum().backward()
        return y, x

    _against_eager(m, ref, step_of, 3)


@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_a_graphed_module_saved_whole_loads_as_an_eager_one(device, eager_replay):
    m = nn.Sequential(nn.Linear(H, H)).to(device)
    te_graph.make_graphed_callables(m, (_x(device),), eager_replay=eager_replay)
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = _x(device, requires_grad=False)
    harness.assert_same(loaded(x), m(x), "the loaded module against the graphed one")
    te_graph.make_graphed_callables(loaded, (_x(device),), eager_replay=eager_replay)  # graphable again


class InplaceInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1, inplace=True)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.drop(x))


@dataclasses.dataclass(frozen=True)
class Unsupported(harness.Row):
    """A module and samples make_graphed_callables refuses (under ``context``), with the
    exception class and message."""

    id: str
    build: Callable[[], tuple]  # () -> (module, samples)
    error: type
    message: str
    context: Callable = contextlib.nullcontext


UNSUPPORTED = [
    Unsupported("inference-mode", lambda: (nn.Linear(4, 4), (torch.randn(2, 4),)), RuntimeError,
                "make_graphed_callables: called under torch.inference_mode()", torch.inference_mode),
    Unsupported("sparse-sample", lambda: (nn.Linear(4, 4), (torch.randn(2, 4).to_sparse(),)), ValueError,
                "make_graphed_callables: a sample is a torch.sparse_coo tensor"),
    Unsupported("meta-parameter", lambda: (nn.Linear(4, 4, device="meta"), (torch.randn(2, 4),)), ValueError,
                "make_graphed_callables: a parameter is on the meta device"),
    Unsupported("sparse-gradient", lambda: (nn.Embedding(10, 4, sparse=True), (torch.tensor([1, 2]),)), ValueError,
                "make_graphed_callables: the backward of callable 0 (Embedding) gives a parameter (shape (10, 4)) a "
                "torch.sparse_coo gradient"),
    Unsupported("lazy-module", lambda: (nn.Sequential(nn.LazyLinear(4)), (torch.randn(2, 4),)), ValueError,
                "make_graphed_callables: submodule '0' of callable 0 (LazyLinear) is a lazy module whose parameters "
                "are not made yet"),
    Unsupported("inplace-input", lambda: (InplaceInput(), (torch.randn(2, 4, requires_grad=True),)), ValueError,
                "make_graphed_callables: the forward of callable 0 (InplaceInput) updates an input that requires "
                "grad in place"),
]


@pytest.mark.parametrize("case", UNSUPPORTED, ids=str)
def test_clear_refusals_before_anything_changes(case):
    """Refused with the exact class and message; the module (its forward included) and the
    random streams as they were."""
    module, samples = case.build()
    with case.context(), refused(case.error, re.escape(case.message), module, *samples):
        te_graph.make_graphed_callables(module, samples, eager_replay=True)


@pytest.mark.parametrize("value", ["false", "True", 1, 0.0])
def test_option_values_of_the_wrong_type_are_refused(value):
    lin, sample = nn.Linear(4, 4), torch.randn(2, 4)
    with refused(TypeError, re.escape(f"make_graphed_callables: eager_replay must be True or False, got {value!r}"),
                 lin, sample):
        te_graph.make_graphed_callables(lin, (sample,), eager_replay=value)


@pytest.mark.parametrize("value", ["2", "maybe", "onn"])
def test_environment_flags_with_odd_values_are_refused(monkeypatch, value):
    monkeypatch.setenv("TE_GRAPH_EAGER_REPLAY", value)
    lin, sample = nn.Linear(4, 4), torch.randn(2, 4)
    with refused(ValueError, re.escape(f"environment variable TE_GRAPH_EAGER_REPLAY={value!r} is not a boolean"),
                 lin, sample):
        te_graph.make_graphed_callables(lin, (sample,))


@pytest.mark.parametrize("value", ["on", "YES", "1", "true"])
def test_environment_flags_accept_the_boolean_words(monkeypatch, value):
    monkeypatch.setenv("TE_GRAPH_EAGER_REPLAY", value)
    m = nn.Linear(4, 4)
    te_graph.make_graphed_callables(m, (torch.randn(2, 4, requires_grad=True),))  # eager replay: runs on the CPU
    assert rng.env_flag("TE_GRAPH_EAGER_REPLAY") is True


class RunningState(nn.Module):
    """A running state in a buffer, and a second input: ``updates`` says which of the two the
    forward updates in place (the other it reads)."""

    def __init__(self, updates: str):
        super().__init__()
        self.updates = updates
        self.lin = nn.Linear(H, H)
        self.register_buffer("running", torch.ones(H))
        self.register_buffer("mask", torch.ones(H))

    def forward(self, x, state):
        with torch.no_grad():
            (self.running if self.updates == "buffer" else state).mul_(0.5).add_(1.0)
        return torch.tanh(self.lin(x)) * state * self.running


@pytest.mark.parametrize("updates", ["buffer", "input"])
@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_an_input_sharing_memory_with_state_the_forward_updates_is_refused(device, eager_replay, updates):
    """The graph reads each input from a buffer of its own, so neither would see the update
    that eager code sees through the shared memory: refused before anything changes. A
    buffer the forward only reads, passed in, trains as eager."""
    m = RunningState(updates).to(device)
    te_graph.make_graphed_callables(m, (_x(device), torch.ones(H, device=device)), eager_replay=eager_replay)
    x = _x(device)
    with refused(RuntimeError, re.escape(
            "callable 0 (RunningState): input 1 shares memory with a tensor of its module (a buffer or a tensor "
            "attribute), and the forward updates one of the two in place before it reads the other; eager code "
            "would see the update through the shared memory, but the graph reads each input from a buffer of its "
            "own. Pass a copy (.clone()), or read that state from the module inside the forward."), m, x):
        m(x, m.running)
    if updates == "buffer":
        eager = RunningState(updates).to(device)
        eager.load_state_dict(m.state_dict())
        _against_eager(m, eager, _plain_step(device, lambda net: net.mask), steps=2)
        harness.assert_same(list(m.buffers()), list(eager.buffers()))


@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_a_checkpoint_whose_region_saves_a_graphed_layers_outputs(device, eager_replay):
    """A non-reentrant checkpoint over a graphed layer and an eager op that saves the layer's
    output runs the layer again in the backward, while that call's backward waits: refused,
    saying so (a known false refusal). Over graphed layers only, it trains as eager (above)."""
    m = nn.Sequential(nn.Linear(H, H), nn.Tanh()).to(device)
    te_graph.make_graphed_callables(m, (_x(device),), eager_replay=eager_replay)
    with pytest.raises(RuntimeError, match=re.escape(
            "It is called during a backward: a non-reentrant checkpoint around it runs its region again to "
            "rebuild what the region's eager operations saved, which calls this layer while its backward waits. "
            "Checkpoint a region of graphed layers only (they keep their own activations), use a reentrant "
            "checkpoint (use_reentrant=True), or checkpoint inside the graphed layer.")):
        torch.utils.checkpoint.checkpoint(lambda x: m(x).square(), _x(device), use_reentrant=False).sum().backward()


class _WithState(nn.Module):
    """A linear layer and one buffer of two rows, ``name`` (``value``: its fill)."""

    def __init__(self, name: str, value: float):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.register_buffer(name, torch.full((2, H), value))


class Ring(_WithState):
    """Two slots of one buffer: the forward writes slot 1 and reads the input (slot 0)."""

    def __init__(self):
        super().__init__("mem", 1.0)

    def forward(self, x, slot):
        with torch.no_grad():
            self.mem[1].mul_(0.5).add_(1.0)
        return torch.tanh(self.lin(x)) * slot * self.mem[1]


class Streaming(_WithState):
    """A streaming cache passed in: read first, then overwritten with the newest rows."""

    def __init__(self):
        super().__init__("tail", 0.0)

    def forward(self, x, tail):
        y = torch.tanh(self.lin(torch.cat([tail, x.flatten(0, 1)])))
        with torch.no_grad():
            self.tail.copy_(y[-2:])
        return y


class KVSlot(_WithState):
    """One slot of a cache it holds but does not read, passed in and updated in place."""

    def __init__(self):
        super().__init__("cache", 0.0)

    def forward(self, x, slot):
        y = torch.tanh(self.lin(x))
        with torch.no_grad():
            slot.add_(y.mean(dim=(0, 1)))
        return y * 2


@pytest.mark.parametrize("make, state", [(Ring, lambda m: m.mem[0]), (Streaming, lambda m: m.tail),
                                         (KVSlot, lambda m: m.cache[1])], ids=["ring", "streaming", "kv-slot"])
@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_state_passed_in_where_no_write_shows_through_trains_as_eager(device, eager_replay, make, state):
    """The first pass orders the forward's reads and writes: a slice the forward does not
    write, state read before it is overwritten, and an updated slot of a cache the forward
    does not read are no refusal, and train bitwise as eager."""
    m, eager = _graphed_and_eager(make, device, eager_replay, lambda m: (_x(device), state(m).clone()))
    _against_eager(m, eager, _plain_step(device, state), steps=3)
    harness.assert_same(list(m.buffers()), list(eager.buffers()))


class Writes(_WithState):
    """Writes its state ``mem`` by ``how`` (an ``out=`` argument, a ``_foreach_`` list), then
    reads the input."""

    def __init__(self, how: str):
        super().__init__("mem", 1.0)
        self.how = how

    def forward(self, x, state):
        with torch.no_grad():
            if self.how == "out":
                torch.mul(self.mem, 0.5, out=self.mem)
            else:
                torch._foreach_mul_([self.mem], 0.5)
        return torch.tanh(self.lin(x)) * state[0]


@pytest.mark.parametrize("how", ["out", "foreach"])
@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_state_written_through_out_or_a_tensor_list_is_seen(device, eager_replay, how):
    m = Writes(how).to(device)
    te_graph.make_graphed_callables(m, (_x(device), torch.ones(2, H, device=device)), eager_replay=eager_replay)
    x = _x(device)
    with refused(RuntimeError, re.escape("callable 0 (Writes): input 1 shares memory with a tensor of its module"),
                 m, x):
        m(x, m.mem)


@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_a_sample_that_is_the_modules_state_takes_only_itself(device, eager_replay):
    """The sample is the graph's input buffer: a call with that very tensor trains as eager;
    with another it would copy into the module's state: refused."""
    m, eager = _graphed_and_eager(lambda: RunningState("buffer"), device, eager_replay,
                                  lambda m: (_x(device), m.mask))
    _against_eager(m, eager, _plain_step(device, lambda net: net.mask), steps=2)
    harness.assert_same(list(m.buffers()), list(eager.buffers()))
    x = _x(device)
    with refused(RuntimeError, re.escape(
            "callable 0 (RunningState): input 1 was graphed with a tensor of its module as its sample (a buffer or "
            "a tensor attribute), which is the graph's input buffer: this call, with another tensor, would copy "
            "into the module's state. Graph it with a copy as the sample (.clone()), or pass that tensor at every "
            "call."), m, x):
        m(x, torch.ones(H, device=device))
