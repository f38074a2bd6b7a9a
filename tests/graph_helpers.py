"""Shared helpers for the make_graphed_callables tests: a GPT stack, eager references and
bitwise comparisons."""
from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn

import rng
from examples.gpt import GPTBlock


class Stack(nn.Module):
    """Blocks run in sequence, tensor in, tensor out (to graph a stack as one callable)."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x, attention_mask=None):
        for block in self.blocks:
            x, _ = block(x, attention_mask=attention_mask)
        return x


def make_blocks(n=3, hidden=64, heads=4, dropout=0.0, recompute=False, use_reentrant=True,
                device="cuda", dtype=torch.float32, seed=1234):
    rng.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return [
        GPTBlock(hidden, heads, dropout, recompute=recompute, use_reentrant=use_reentrant,
                 device=device, dtype=dtype)
        for _ in range(n)
    ]


def run_layers(layers, x, **kwargs):
    for layer in layers:
        out = layer(x, **kwargs)
        x = out[0] if isinstance(out, tuple) else out
    return x


def weighted_loss(y: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient is a contiguous tensor. ``y.sum()`` hands autograd an expanded
    (stride-0) gradient, which a graph copies into its contiguous static buffer; matrix
    products may then round differently from eager's, so bitwise comparisons use this."""
    return (y.float() * torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)).sum()


def assert_all_equal(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what} {i} differs (max abs diff {(x.float() - y.float()).abs().max().item()})"


def clone_modules(modules):
    return [copy.deepcopy(m) for m in modules]


class DuckTracker:
    """Megatron-core's tracker as a duck: on CUDA its graph-safe mode (generator objects,
    get_states() hands out references, fork() swaps with graphsafe_set_state); on CPU its
    classic mode (byte states copied in and out of the default generator)."""

    def __init__(self, device: str):
        self.device = device
        self.states_: dict[str, Any] = {}

    def reset(self):
        self.states_ = {}

    def add(self, name, seed):
        if self.device == "cuda":
            self.states_[name] = torch.Generator(device="cuda").manual_seed(seed)
        else:
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = states

    @contextlib.contextmanager
    def fork(self, name=rng.MODEL_PARALLEL_RNG):
        if self.device == "cuda":
            default = torch.cuda.default_generators[torch.cuda.current_device()]
            previous = default.graphsafe_get_state()
            default.graphsafe_set_state(self.states_[name])
            try:
                yield
            finally:
                default.graphsafe_set_state(previous)
            return
        previous = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(previous)


class NoGrad(torch.autograd.Function):
    """Hands back no gradient (a stop-gradient written as a Function)."""

    @staticmethod
    def forward(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, g):
        return None
