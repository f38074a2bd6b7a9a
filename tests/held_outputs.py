"""Tensors te_graph hands out stay valid memory while they are held, the way Transformer
Engine's own CUDA-graph tests hold them: the last output, parameters and gradients of a
graphed run are kept while the graphs are reset, further models are graphed into the same
pool and another, the graphed modules of one run are collected without a reset, and the
allocator's cache is emptied and refilled. They must then equal an eager run of the same
training, bit for bit; an earlier output that a later replay overwrote must raise the
documented error, never read other values.

On a GPU this runs in a process of its own (``python -m tests.held_outputs LAYERS MODE``,
printing one JSON line), so that an illegal memory access fails its test, not the pytest
worker. ``tests/test_held_outputs.py`` asserts on what it prints.
"""
from __future__ import annotations

import gc
import json
import sys
from dataclasses import dataclass

import torch
from torch import nn

import te_graph
from tests import harness
from tests.graph_helpers import weighted_loss
from tests.harness import EAGER, GRAPHS

S, B, H = 16, 2, 64
OVERWRITTEN = "this output was overwritten by a later call of the same graph"
REUSED = "this output lived in a buffer that other graphs reuse once its backward has run"


def _layers(kind: str, device: str, seed: int) -> tuple[list[nn.Module], torch.dtype]:
    torch.manual_seed(seed)
    if kind == "torch":
        return [nn.Sequential(nn.LayerNorm(H), nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H)).to(device)
                for _ in range(3)], torch.float32
    import transformer_engine.pytorch as te  # noqa: PLC0415 - TE only where the GPU rows run

    dtype = torch.bfloat16
    return [te.LayerNormLinear(H, H, params_dtype=dtype), te.Linear(H, H, params_dtype=dtype),
            te.LayerNormMLP(H, 4 * H, params_dtype=dtype)], dtype


@dataclass
class Run:
    layers: list
    outputs: list  # every call's last-layer output, held
    kept: list  # what TE's test keeps: parameters, their grads, the last output (not cloned)


def train(kind: str, device: str, mode: str, seed: int, pool=None, steps: int = 3, microbatches: int = 2) -> Run:
    """SGD steps of ``microbatches`` microbatches through three layers: eagerly, or graphed
    (``mode``: one of tests/harness.py's modes)."""
    layers, dtype = _layers(kind, device, seed)
    callables = layers
    if mode != EAGER:
        sample = tuple((torch.randn(S, B, H, device=device, dtype=dtype, requires_grad=True),) for _ in layers)
        callables = te_graph.make_graphed_callables(tuple(layers), sample, pool=pool,
                                                    eager_replay=harness.eager_replay(mode))
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01)
    g = torch.Generator().manual_seed(seed)
    outputs = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=False)
        for _ in range(microbatches):
            y = torch.randn(S, B, H, generator=g).to(device, dtype).requires_grad_(True)
            for layer in callables:
                y = layer(y)
            outputs.append(y)
            weighted_loss(y).backward()
        optimizer.step()
    kept = [t for p in params for t in (p, p.grad)] + [outputs[-1]]
    return Run(layers, outputs, kept)


def _outcome(got: torch.Tensor, want: torch.Tensor, message: str) -> str:
    """"equal", "raised" (the documented error), or "differs"."""
    try:
        return "equal" if torch.equal(got.detach(), want.detach()) else "differs"
    except RuntimeError as error:
        return "raised" if message in str(error) else f"other error: {error}"


def _churn(device: str) -> list:
    """Free what is cached and hand the memory to new tensors of other values."""
    gc.collect()
    if device != "cuda":
        return []
    torch.cuda.empty_cache()
    return [torch.full((1 << 20,), float("nan"), device=device) for _ in range(32)]


def held_outputs(kind: str, device: str, mode: str) -> dict:
    """The first run's kept tensors after reset, other graphs, collection and a refilled
    cache, against eager; and its earlier outputs, which later calls overwrote."""
    want = {seed: train(kind, device, EAGER, seed) for seed in (1, 3)}
    pool = te_graph.graph_pool_handle() if mode == GRAPHS else None
    first = train(kind, device, mode, 1, pool=pool)
    te_graph.reset(first.layers)
    second = train(kind, device, mode, 2, pool=pool)  # the same pool, memory handed on
    third = train(kind, device, mode, 3)  # a pool of its own; collected, never reset
    te_graph.reset(second.layers)
    third_kept, third.layers = third.kept[-1], None
    del second, third
    junk = _churn(device)
    result = {
        "kept": [_outcome(a, b, OVERWRITTEN) for a, b in zip(first.kept, want[1].kept)],
        "collected": _outcome(third_kept, want[3].kept[-1], OVERWRITTEN),
        "earlier": [_outcome(a, b, OVERWRITTEN) for a, b in zip(first.outputs[:-1], want[1].outputs[:-1])],
    }
    del junk
    if device == "cuda":
        torch.cuda.synchronize()  # an illegal memory access surfaces here at the latest
    return result


def reused_outputs(device: str, mode: str) -> dict:
    """With buffer reuse under an order, an output lives in memory other graphs take once its
    backward ran: read after that backward, or after reset and a refilled cache, it raises."""
    from tests.test_pipeline import ONE_F_ONE_B  # noqa: PLC0415 - the schedule the pipeline tests use

    layers, dtype = _layers("torch", device, 1)
    microbatches = ONE_F_ONE_B.count(1)
    sample = tuple((torch.randn(S, B, H, device=device, requires_grad=True),) for _ in range(microbatches * len(layers)))
    graphed = te_graph.make_graphed_callables(tuple(layers), sample, order=ONE_F_ONE_B,
                                              num_layers_per_chunk=len(layers),
                                              reuse_graph_input_output_buffers=True,
                                              eager_replay=harness.eager_replay(mode))
    g = torch.Generator().manual_seed(5)
    started, done, held, at_forward = 0, 0, [], []
    for c in ONE_F_ONE_B:
        if c > 0:
            y = torch.randn(S, B, H, generator=g).to(device, dtype).requires_grad_(True)
            for layer in range(len(layers)):
                y = graphed[started * len(layers) + layer](y)
            held.append(y)
            at_forward.append(y.detach().clone())
            started += 1
        else:
            weighted_loss(held[done]).backward()
            done += 1
    after_backward = [_outcome(y, want, REUSED) for y, want in zip(held, at_forward)]
    te_graph.reset(graphed)
    junk = _churn(device)
    after_reset = [_outcome(y, want, REUSED) for y, want in zip(held, at_forward)]
    del junk
    if device == "cuda":
        torch.cuda.synchronize()
    return {"after_backward": after_backward, "after_reset": after_reset}


if __name__ == "__main__":
    layers_, mode_ = sys.argv[1], sys.argv[2]
    torch.cuda.set_device(0)
    found = reused_outputs("cuda", mode_) if layers_ == "reuse" else held_outputs(layers_, "cuda", mode_)
    print(json.dumps(found))
