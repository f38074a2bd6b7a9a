"""The RNG contract for recompute (DESIGN.md, "RNG under recompute"), proven in the three
modes of tests/harness.py that share one test: plain eager ``checkpoint``, te_graph's eager
replay, and CUDA graphs with the recompute inside the backward graph. The graphed and
eager-replay masks are compared with the eager run's (graphs on = graphs off);
tests/test_parity.py proves the same for whole training runs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rng
from checkpointing import checkpoint
from te_graph import make_graphed_callables
from tests import harness
from tests.graph_helpers import DuckTracker
from tests.harness import EAGER, EAGER_REPLAY, GRAPHS, Trace

P = 0.5
SHAPE = (64, 4, 32)
VARIANTS = ["default", "tracker", "both", "nested", "two_regions", "outside"]


class MaskLayer(nn.Module):
    """Dropout p=0.5 inside checkpointed regions; the zero pattern of the output is the
    mask, and so is the zero pattern of the input grad when the recompute is exact."""

    def __init__(self, variant, get_tracker, device):
        super().__init__()
        self.variant = variant
        self.get_tracker = get_tracker
        self.scale = nn.Parameter(torch.ones((), device=device))

    def _default(self, x):
        return F.dropout(x * self.scale, P)

    def _tracker(self, x):
        with self.get_tracker().fork():
            return F.dropout(x * self.scale, P)

    def _both(self, x):
        x = F.dropout(x * self.scale, P)
        with self.get_tracker().fork():
            return F.dropout(x, P)

    def _nested(self, x):
        tracker = self.get_tracker()
        with tracker.fork("model-parallel-rng"):
            x = F.dropout(x * self.scale, P)
            with tracker.fork("expert-parallel-rng"):
                x = F.dropout(x, P)
            return F.dropout(x, P)

    def _region(self, fn, x):
        return checkpoint(fn, x, get_rng_state_tracker=self.get_tracker)

    def forward(self, x):
        if self.variant == "two_regions":
            return self._region(self._tracker, self._region(self._default, x))
        if self.variant == "outside":
            return F.dropout(self._region(self._both, x), P)
        return self._region(getattr(self, "_" + self.variant), x)


def _tracker_factory(kind):
    if kind == "ours":
        return rng.get_cuda_rng_tracker
    tracker = DuckTracker("cuda")
    return lambda: tracker


def _seed(seed, get_tracker, tp_rank=0):
    """Megatron's seeding; a duck tracker is reseeded in place once it has its streams."""
    rng.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, tracker=get_tracker())


def _build(mode, device, get_tracker, variants, seed=0, tp_rank=0, **graph_kwargs):
    _seed(seed, get_tracker, tp_rank)
    layers = [MaskLayer(v, get_tracker, device) for v in variants]
    if mode == EAGER:
        return layers
    sample = tuple((torch.randn(SHAPE, device=device, requires_grad=True),) for _ in layers)
    return list(
        make_graphed_callables(
            tuple(layers), sample, eager_replay=harness.eager_replay(mode),
            get_rng_state_tracker=get_tracker, **graph_kwargs,
        )
    )


_INPUTS = torch.Generator(device="cpu")


def _step(layers, device, twice=False):
    """All forwards first, then the backwards in reverse order (the order they were
    captured in; graphs sharing a pool must replay in capture order). Each layer has its
    own positive input, drawn from a generator of its own so no live stream moves."""
    xs = [
        torch.rand(SHAPE, generator=_INPUTS).add_(0.1).to(device).requires_grad_(True)
        for _ in layers
    ]
    ys = [layer(x) for layer, x in zip(layers, xs)]
    for i in reversed(range(len(layers))):
        ys[i].sum().backward(retain_graph=twice)
        if twice:
            ys[i].sum().backward()
    return [(y.detach() == 0) for y in ys], [(x.grad == 0) for x in xs]


def _mask_contract(mode, device, tracker_kind="ours", steps=5, **kwargs):
    """Recompute masks equal the forward's at every backward, differ between layers and
    steps, and (graphs and eager replay) equal the masks of the eager run."""
    get_tracker = _tracker_factory(tracker_kind)
    graph_options = kwargs.pop("graph", {})
    eager = _build(EAGER, device, get_tracker, VARIANTS + VARIANTS[:2])
    layers = _build(mode, device, get_tracker, VARIANTS + VARIANTS[:2], **graph_options)
    previous = None
    for step in range(steps):
        state = torch.get_rng_state(), _INPUTS.get_state()
        _seed(100 + step, get_tracker)
        eager_zero, _ = _step(eager, device, **kwargs)
        torch.set_rng_state(state[0])
        _INPUTS.set_state(state[1])
        _seed(100 + step, get_tracker)
        out_zero, grad_zero = _step(layers, device, **kwargs)
        harness.assert_same(out_zero, eager_zero, f"step {step}: the masks of layers {VARIANTS + VARIANTS[:2]}")
        for i, (o, g) in enumerate(zip(out_zero, grad_zero)):
            assert o.any(), "dropout dropped nothing"
            assert torch.equal(o, g), f"step {step}, layer {i} ({VARIANTS[i % 6]}): recompute mask differs from forward mask"
        for i in range(len(out_zero)):
            for j in range(i):
                assert not torch.equal(out_zero[i], out_zero[j]), f"layers {i} and {j} share a mask"
        if previous is not None:
            for i, (a, b) in enumerate(zip(previous, out_zero)):
                assert not torch.equal(a, b), f"layer {i}: step {step} reused the previous step's mask"
        previous = out_zero


def test_masks_exact_eager_checkpoint_cpu():
    _mask_contract(EAGER, "cpu")


def test_masks_exact_eager_replay_cpu():
    _mask_contract(EAGER_REPLAY, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [pytest.param(EAGER, id="eager"), pytest.param(EAGER_REPLAY, id="eager_replay"),
                                  pytest.param(GRAPHS, id="graph")])
@pytest.mark.parametrize("tracker_kind", ["ours", "megatron-style"])
def test_masks_exact_gpu(mode, tracker_kind):
    _mask_contract(mode, "cuda", tracker_kind)


@pytest.mark.gpu
def test_masks_exact_with_all_forwards_before_the_backwards():
    """Eight graphed layers run all their forwards, then their backwards in reverse: each
    backward recompute uses the record of its own forward."""
    _mask_contract(GRAPHS, "cuda", steps=6)


@pytest.mark.gpu
def test_masks_exact_with_retain_graph_second_backward():
    _mask_contract(GRAPHS, "cuda", twice=True, graph={"retain_graph_in_backward": True})


@pytest.mark.gpu
@pytest.mark.parametrize("variants", [["both", "nested"], ["outside", "two_regions"]], ids=["regions-only", "draws-outside-too"])
def test_live_streams_move_exactly_as_eager(variants):
    """Graphed steps advance every live stream (default and tracker) exactly as an eager
    step does: forwards draw from them as eager code does, and the recompute draws from
    private generators, consuming nothing."""
    get_tracker = _tracker_factory("ours")
    offsets = []
    for mode in (EAGER, GRAPHS):
        layers = _build(mode, "cuda", get_tracker, variants)
        _seed(5, get_tracker)
        _step(layers, "cuda")
        states = rng.get_cuda_rng_tracker().get_states()
        offsets.append((rng.get_rng_state("cuda").get_offset(), {k: v.get_offset() for k, v in states.items()}))
    assert offsets[0] == offsets[1]
    assert offsets[0][0] > 0 and offsets[0][1][rng.MODEL_PARALLEL_RNG] > 0, "the step drew from both"


@pytest.mark.gpu
def test_tensor_parallel_meaning():
    """Default-stream dropout is identical on TP ranks, model-parallel-rng dropout differs."""
    masks = {}
    for rank in (0, 1):
        layers = _build(GRAPHS, "cuda", rng.get_cuda_rng_tracker, ["default", "tracker"], seed=5, tp_rank=rank)
        torch.manual_seed(11)
        masks[rank] = [_step(layers, "cuda")[0] for _ in range(2)]
    for step in range(2):
        assert torch.equal(masks[0][step][0], masks[1][step][0]), "default stream differs across TP ranks"
        assert not torch.equal(masks[0][step][1], masks[1][step][1]), "model-parallel-rng equal across TP ranks"


@pytest.mark.gpu
def test_kept_fraction_and_fresh_masks_over_20_steps():
    layer = MaskLayer("default", rng.get_cuda_rng_tracker, "cuda")
    rng.model_parallel_cuda_manual_seed(3)
    x0 = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    graphed = make_graphed_callables(layer, (x0,))
    previous = None
    for step in range(20):
        x = torch.ones(1024, 1024, device="cuda", requires_grad=True)
        y = graphed(x)
        y.sum().backward()
        kept = (y != 0).float().mean().item()
        assert abs(kept - (1 - P)) < 0.01 * (1 - P), f"step {step}: kept fraction {kept}"
        assert torch.equal(y != 0, x.grad != 0), f"step {step}: recompute mask differs"
        if previous is not None:
            assert not torch.equal(previous, y != 0), f"step {step} repeated the previous mask"
        previous = y != 0


def _gpt_run(seed) -> Trace:
    from tests.graph_helpers import make_blocks, run_layers

    blocks = make_blocks(n=3, dropout=0.1, recompute=True, device="cuda", seed=seed)
    sample = tuple((torch.randn(16, 2, 64, device="cuda", requires_grad=True),) for _ in blocks)
    graphed = make_graphed_callables(tuple(blocks), sample)
    params = [p for b in graphed for p in b.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    g = torch.Generator(device="cpu").manual_seed(1)
    trace = Trace()  # each step's loss (as its output) and parameter grads
    for _ in range(5):
        opt.zero_grad(set_to_none=False)
        x = torch.randn(16, 2, 64, generator=g).cuda().requires_grad_(True)
        loss = run_layers(graphed, x).square().mean()
        loss.backward()
        trace.outputs.append(loss.detach())
        trace.param_grads.append(torch.cat([p.grad.flatten() for p in params]).clone())
        opt.step()
    return trace


@pytest.mark.gpu
def test_same_seed_same_program_bitwise():
    a, b = _gpt_run(21), _gpt_run(21)
    harness.assert_same(b, a, "the same seed again", reference="the first run")
    c = _gpt_run(22)
    assert not torch.equal(a.outputs[0], c.outputs[0]), "another seed gives another run"
