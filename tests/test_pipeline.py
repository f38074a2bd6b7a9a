"""Pipeline-parallel capture: one graph per (layer, microbatch) following ``order``,
bitwise equal to eager runs of the same schedule (dropout 0.1), with and without buffer
reuse and recompute (rows of tests/harness.py); exact dropout masks per (layer, microbatch)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import rng
from te_graph import make_graphed_callables
from tests import harness
from tests.graph_helpers import make_blocks
from tests.harness import EAGER, EAGER_REPLAY, GRAPHS, Trace
from tests.test_recompute_rng import MaskLayer

INTERLEAVED = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]  # 2 chunks, 3 microbatches
ONE_F_ONE_B = [1, 1, -1, 1, -1, 1, -1, -1]  # 1 chunk, 4 microbatches
SHAPE = (16, 2, 64)


def _layout(order, layers_per_chunk):
    chunks = max(order)
    microbatches = len(order) // (2 * chunks)
    return chunks, microbatches, layers_per_chunk


def _flat(chunk, mb, layer, microbatches, layers_per_chunk):
    return chunk * microbatches * layers_per_chunk + mb * layers_per_chunk + layer


def run_schedule(order, layers_per_chunk, call, inputs, grad_seed=0, independent=False):
    """Run one iteration of ``order`` like a pipeline would: each chunk gets a fresh leaf
    input per microbatch, and each chunk's backward is fed the next chunk's input grad.

    Outputs are recorded at their forward: with buffer reuse an output is valid only until
    its backward runs.

    ``call(chunk, mb, layer, x)`` runs one (layer, microbatch). With ``independent``
    every chunk gets its own positive input and positive grad instead (so a zero in the
    output or the input grad can only come from a dropout mask). Returns
    per (chunk, mb) the chunk output and the chunk input grad."""
    chunks, microbatches, _ = _layout(order, layers_per_chunk)
    next_fwd = [0] * chunks
    next_bwd = [0] * chunks
    live, results = {}, {}
    g = torch.Generator(device="cpu").manual_seed(grad_seed)
    for c in order:
        chunk = abs(c) - 1
        if c > 0:
            mb = next_fwd[chunk]
            next_fwd[chunk] += 1
            if independent:
                source = torch.rand(inputs[mb].shape, generator=g).add_(0.1).to(inputs[mb])
            else:
                source = inputs[mb] if chunk == 0 else live[chunk - 1, mb][2]
            x = source.detach().clone().requires_grad_(True)
            y = x
            for layer in range(layers_per_chunk):
                y = call(chunk, mb, layer, y)
            live[chunk, mb] = (x, y, y.detach().clone())
        else:
            mb = next_bwd[chunk]
            next_bwd[chunk] += 1
            x, y, y_at_forward = live[chunk, mb]
            if independent:
                grad = torch.rand(y.shape, generator=g).add_(0.1).to(y)
            elif chunk == chunks - 1:
                grad = torch.randn(y.shape, generator=g).to(y)
            else:
                grad = results[chunk + 1, mb][1]
            y.backward(grad)
            results[chunk, mb] = (y_at_forward, x.grad.clone())
    return results


def _train(order, layers_per_chunk, modules, callables, steps=2, seed=5) -> Trace:
    """SGD steps of one schedule iteration each: every (chunk, microbatch)'s output and input
    grad per step, the weights after the steps."""
    chunks, microbatches, _ = _layout(order, layers_per_chunk)
    rng.model_parallel_cuda_manual_seed(77)  # the graphed and eager runs draw the same streams
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    g = torch.Generator(device="cpu").manual_seed(seed)
    device = params[0].device
    trace = Trace()
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        inputs = [torch.randn(SHAPE, generator=g).to(device) for _ in range(microbatches)]

        def call(chunk, mb, layer, x):
            out = callables(chunk, mb, layer)(x)
            return out[0] if isinstance(out, tuple) else out

        results = run_schedule(order, layers_per_chunk, call, inputs, grad_seed=step)
        trace.outputs.append({key: output for key, (output, _) in results.items()})
        trace.input_grads.append({key: grad for key, (_, grad) in results.items()})
        opt.step()
    trace.weights = [p.detach().clone() for p in params]
    return trace


@dataclass(frozen=True)
class Schedule(harness.Row):
    """A pipeline schedule of two layers per chunk, through GPTBlocks (dropout 0.1)."""

    id: str
    order: tuple
    reuse: bool = False  # reuse_graph_input_output_buffers
    recompute: bool = False


ORDERS = {"interleaved": tuple(INTERLEAVED), "1f1b": tuple(ONE_F_ONE_B)}
SCHEDULES = [Schedule(f"{name}-{'reuse' if reuse else 'private'}-{'recompute' if recompute else 'plain'}", order,
                      reuse, recompute)
             for name, order in ORDERS.items() for reuse in (False, True) for recompute in (False, True)]
SCHEDULES_CPU = [Schedule(name, order, recompute=True) for name, order in ORDERS.items()]


def train(schedule: Schedule, mode: str, device: str, layers_per_chunk: int = 2) -> Trace:
    """``schedule`` in one of the harness's modes."""
    order = list(schedule.order)
    chunks, microbatches, _ = _layout(order, layers_per_chunk)
    blocks = make_blocks(n=chunks * layers_per_chunk, device=device, recompute=schedule.recompute, dropout=0.1)
    if mode == EAGER:
        return _train(order, layers_per_chunk, blocks, lambda chunk, mb, layer: blocks[chunk * layers_per_chunk + layer])
    sample = tuple(
        (torch.randn(SHAPE, device=device, requires_grad=True),)
        for _ in range(chunks * microbatches * layers_per_chunk)
    )
    graphed = make_graphed_callables(
        tuple(blocks), sample, order=order, num_layers_per_chunk=layers_per_chunk,
        reuse_graph_input_output_buffers=schedule.reuse, eager_replay=harness.eager_replay(mode),
    )
    assert len(graphed) == len(sample)
    return _train(order, layers_per_chunk, blocks,
                  lambda chunk, mb, layer: graphed[_flat(chunk, mb, layer, microbatches, layers_per_chunk)])


@pytest.mark.parametrize("schedule", harness.params(SCHEDULES, "cuda"))
def test_schedule_bitwise_equal_to_eager(schedule):
    harness.differential(lambda mode: train(schedule, mode, "cuda"), [GRAPHS], schedule.id)


@pytest.mark.parametrize("schedule", harness.params(SCHEDULES_CPU, "cpu"))
def test_schedule_eager_replay_cpu(schedule):
    harness.differential(lambda mode: train(schedule, mode, "cpu"), [EAGER_REPLAY], schedule.id)


def test_reuse_needs_an_order():
    blocks = make_blocks(n=1, device="cpu")
    with pytest.raises(ValueError, match=r"reuse_graph_input_output_buffers=True needs order="):
        make_graphed_callables(
            tuple(blocks), ((torch.randn(SHAPE, requires_grad=True),),),
            reuse_graph_input_output_buffers=True, eager_replay=True,
        )


def _mask_schedule(device, eager_replay, reuse):
    order = INTERLEAVED
    chunks, microbatches, per_chunk = _layout(order, 1)
    rng.model_parallel_cuda_manual_seed(8)
    layers = [MaskLayer("both", rng.get_cuda_rng_tracker, device) for _ in range(chunks)]
    sample = tuple((torch.randn(SHAPE, device=device, requires_grad=True),) for _ in range(chunks * microbatches))
    graphed = make_graphed_callables(
        tuple(layers), sample, order=order, num_layers_per_chunk=1,
        reuse_graph_input_output_buffers=reuse, eager_replay=eager_replay,
    )
    seen = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for step in range(5):
        inputs = [torch.rand(SHAPE, generator=g).add_(0.1).to(device) for _ in range(microbatches)]
        outputs = {}

        def call(chunk, mb, layer, x):
            y = graphed[_flat(chunk, mb, 0, microbatches, 1)](x)
            outputs[chunk, mb] = (y != 0).clone()  # a reused output is valid until its backward
            return y

        results = run_schedule(order, 1, call, inputs, grad_seed=step, independent=True)
        for (chunk, mb), (_, x_grad) in results.items():
            assert torch.equal(outputs[chunk, mb], x_grad != 0), f"step {step}, chunk {chunk}, microbatch {mb}: recompute mask differs"
        seen.append(outputs)
    # Masks differ between (layer, microbatch) pairs and between steps.
    keys = list(seen[0])
    for i, a in enumerate(keys):
        for b in keys[:i]:
            assert not torch.equal(seen[0][a], seen[0][b]), f"{a} and {b} share a mask"
    for step in range(1, 5):
        for key in keys:
            assert not torch.equal(seen[step][key], seen[step - 1][key]), f"{key} repeated a mask"


@pytest.mark.gpu
@pytest.mark.parametrize("reuse", [False, True], ids=["private", "reuse"])
def test_schedule_masks_exact_per_layer_and_microbatch(reuse):
    _mask_schedule("cuda", eager_replay=False, reuse=reuse)


def test_schedule_masks_exact_eager_replay_cpu():
    _mask_schedule("cpu", eager_replay=True, reuse=False)


def test_order_results_run_eagerly_in_the_other_training_mode():
    """Like Transformer Engine's: the per-(layer, microbatch) functions replay the graph only
    in the training mode their module was captured in."""
    blocks = make_blocks(n=1, device="cpu", dropout=0.5)
    sample = tuple((torch.randn(SHAPE, requires_grad=True),) for _ in range(2))
    graphed = make_graphed_callables(tuple(blocks), sample, order=[1, 1, -1, -1], eager_replay=True)
    x = torch.randn(SHAPE)
    blocks[0].eval()
    y_graphed, _ = graphed[1](x)
    y_eval, _ = blocks[0].forward(x)
    assert torch.equal(y_graphed, y_eval), "eval mode ran the module's own forward"
