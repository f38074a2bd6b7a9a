"""What a forward reaches beyond its module's parameters, in graphs and eager replay alike,
against eager, bitwise (tests/harness.py): a tensor outside the modules that it adds into
(warmup adds nothing to it), a random generator of its own (refused before anything
changes, its stream untouched), a TorchScript submodule, torch's modules with a no-grad
fast path, attention weights the loss leaves out, the SDPA backends allowed at call time
(refused where they differ from capture), and an error of the forward on its sample
(told as the forward's)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import te_graph
from tests import harness
from tests.harness import ALL_DEVICE_MODES, EAGER, GRAPHED, Trace, refused

H = 32
TOTAL = {}  # per device: a process-global tensor the forward adds into (an aux-loss tracker)


def _x(device: str, seed: int, requires_grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, H, generator=g).to(device).requires_grad_(requires_grad)


class AddsToTotal(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        y = self.lin(x)
        TOTAL[y.device.type].add_((y * y).mean().detach())
        return y


class Scripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.jit.script(nn.Linear(H, H))

    def forward(self, x):
        return F.gelu(self.lin(x))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(H, 4, 64, dropout=0.1, batch_first=True)

    def forward(self, x):
        return self.layer(x)


class Attention(nn.Module):
    """``nn.MultiheadAttention`` returning its weights, which the loss leaves out."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(H, 4, dropout=0.1, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=True)


@dataclass(frozen=True)
class Setup(harness.Row):
    """A module trained for three steps, eagerly or graphed; ``no_grad_every``: every such
    step runs under ``torch.no_grad()`` in eval mode instead."""

    id: str
    build: Callable[[], nn.Module]
    no_grad_every: int = 0


SETUPS = [
    Setup("adds-to-a-global-tensor", AddsToTotal),
    Setup("torchscript-submodule", Scripted),
    Setup("encoder-layer-with-no-grad-evaluation", Encoder, no_grad_every=2),
    Setup("attention-weights-left-out-of-the-loss", Attention),
]


def train(setup: Setup, mode: str, device: str) -> Trace:
    torch.manual_seed(0)
    module = setup.build().to(device)
    TOTAL[device] = torch.zeros((), device=device)
    if mode != EAGER:
        te_graph.make_graphed_callables(module, (_x(device, 99),), eager_replay=harness.eager_replay(mode))
    trace = Trace()
    trace.buffers.append(TOTAL[device].clone())  # warmup added nothing
    torch.manual_seed(7)
    for step in range(3):
        x = _x(device, step)
        if setup.no_grad_every and step % setup.no_grad_every == 1:
            module.eval()
            with torch.no_grad():
                trace.microbatch(module(x.detach()))
            module.train()
            continue
        out = module(x)
        y = out[0] if isinstance(out, tuple) else out
        (y * y).sum().backward()
        trace.microbatch(y, x)
        trace.step(module.parameters())
    trace.buffers.append(TOTAL[device].clone())
    return trace


@pytest.mark.parametrize("setup", harness.params(SETUPS, "cpu"))
def test_equal_to_eager_cpu(setup):
    harness.differential(lambda mode: train(setup, mode, "cpu"), GRAPHED["cpu"], setup.id)


@pytest.mark.parametrize("setup", harness.params(SETUPS, "cuda"))
def test_equal_to_eager_gpu(setup):
    harness.differential(lambda mode: train(setup, mode, "cuda"), GRAPHED["cuda"], setup.id)


class OwnGenerator(nn.Module):
    """Draws its dropout mask from a generator it owns."""

    def __init__(self, device: str):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.gen = torch.Generator(device=device).manual_seed(5)

    def forward(self, x):
        keep = torch.rand(x.shape, generator=self.gen, device=x.device) > 0.5
        return self.lin(x) * keep


@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_a_generator_of_its_own_is_refused_and_its_stream_untouched(device, eager_replay):
    m = OwnGenerator(device).to(device)
    state = m.gen.get_state()
    x = _x(device, 0)
    message = ("make_graphed_callables: the forward of callable 0 (OwnGenerator) draws from a torch.Generator of its "
               "own (generator=...)")
    with refused(ValueError, re.escape(message), m, x):
        te_graph.make_graphed_callables(m, (x,), eager_replay=eager_replay)
    assert torch.equal(m.gen.get_state(), state), "warmup advanced the module's own generator"


class Attends(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)

    def forward(self, x):
        q, k, v = (t.view(2, 8, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 8, H)


@pytest.mark.parametrize("device, eager_replay", ALL_DEVICE_MODES)
def test_another_sdpa_backend_at_call_time_is_refused(device, eager_replay):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = Attends().to(device)
    te_graph.make_graphed_callables(m, (_x(device, 0),), eager_replay=eager_replay)
    m(_x(device, 1)).sum().backward()
    x = _x(device, 2)
    message = ("callable 0 (Attends): since graphing, the flash SDPA backend is not allowed "
               "(torch.nn.attention.sdpa_kernel), but was at capture, and the forward calls scaled-dot-product attention")
    with sdpa_kernel(SDPBackend.MATH), refused(RuntimeError, re.escape(message), m, x):
        m(x)
    m(x).sum().backward()  # the backends of capture again: it trains


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="exception notes need Python >= 3.11")
def test_an_error_of_the_forward_on_its_sample_is_told_as_the_forwards():
    m = nn.Linear(H, H).to(torch.bfloat16)
    x = _x("cpu", 0)
    with refused(RuntimeError, "must have the same dtype", m, x) as info:
        te_graph.make_graphed_callables(m, (x,), eager_replay=True)
    assert info.value.__notes__ == [
        "(te_graph: raised by the forward of callable 0 (Linear) on its sample inputs, in the first warmup pass of "
        "make_graphed_callables; the same call would raise eagerly)"]


class ForksItsOwnTracker(nn.Module):
    """Dropout under a tracker of its own (Transformer Engine's examples build one)."""

    def __init__(self, tracker):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.tracker = tracker

    def forward(self, x):
        with self.tracker.fork("own"):
            return F.dropout(self.lin(x), 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("eager_replay", [False, True], ids=["graphs", "eager-replay"])
def test_a_tracker_not_passed_is_refused_and_passed_it_trains_exactly(eager_replay):
    import rng

    def build():
        torch.manual_seed(0)
        tracker = rng.CudaRNGStatesTracker()
        tracker.add("own", 98765)
        return ForksItsOwnTracker(tracker).cuda()

    m, x = build(), _x("cuda", 0)
    own = m.tracker.get_states()["own"].get_state()
    message = ("make_graphed_callables: the forward of callable 0 (ForksItsOwnTracker) draws from a random stream "
               "that is neither the default generator nor a stream of the RNG tracker given (or found) for this call")
    with refused(ValueError, re.escape(message), m, x):
        te_graph.make_graphed_callables(m, (x,), eager_replay=eager_replay)
    assert torch.equal(m.tracker.get_states()["own"].get_state(), own), "warmup advanced the tracker's own stream"

    def run(graphed: bool) -> Trace:
        m = build()
        if graphed:
            te_graph.make_graphed_callables(m, (_x("cuda", 99),), eager_replay=eager_replay,
                                            get_rng_state_tracker=lambda: m.tracker)
        trace = Trace()
        for step in range(3):
            x = _x("cuda", step)
            y = m(x)
            (y * y).sum().backward()
            trace.microbatch(y, x)
            trace.step(m.parameters())
        return trace

    harness.assert_same(run(True), run(False), "the tracker passed as get_rng_state_tracker")
