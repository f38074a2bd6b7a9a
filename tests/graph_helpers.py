"""Shared helpers for the make_graphed_callables tests: a GPT stack, eager references, a
Megatron-style tracker and DDP hook (comparisons and refusals: tests/harness.py)."""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Optional

import pytest
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


def ddp_pre_hook(calls: Optional[list] = None):
    """megatron-core DDP's ``_make_forward_pre_hook`` (``overlap_param_gather``): one closure
    per call, one code; with ``calls``, each call records its module (where it would wait for
    the parameters' all-gather)."""
    def hook(module, *unused):
        if calls is not None:
            calls.append(module)
    return hook


def require(module: str, what: str):
    """Import te_graph's ``module`` (an integration, or a part of one), or skip the calling
    test module: the engine's tests run without it, as without its framework."""
    return pytest.importorskip(module, reason=f"needs {module} ({what}), which does not import here")
