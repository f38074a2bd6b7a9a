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


def megatron_ddp_hooks(params) -> list:
    """What megatron-core's DDP does per parameter: a main_grad buffer (fp32), the
    grad_added_to_main_grad flag, and a hook on the gradient accumulator that adds .grad into
    main_grad unless the kernel did it already, then drops .grad. Keep the returned
    accumulators alive while training."""
    kept = []
    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        p.grad_added_to_main_grad = False
        accumulator = p.expand_as(p).grad_fn.next_functions[0][0]

        def hook(*_, p=p):
            if p.grad is not None and not p.grad_added_to_main_grad:
                p.main_grad.add_(p.grad.data)
            p.grad = None
        accumulator.register_hook(hook)
        kept.append(accumulator)
    return kept


def main_grad_steps(layers, params, batch, trace, lr: float = 0.01):
    """Three SGD steps on main_grad, two microbatches each, ``batch(generator)`` making each
    input: into ``trace`` each input's grad, each step's main_grads and grad_added_to_main_grad
    flags, and the weights after it."""
    data = torch.Generator(device=params[0].device).manual_seed(5)
    for _ in range(3):
        for p in params:
            p.main_grad.zero_()
        for _ in range(2):
            x = batch(data)
            y = x
            for layer in layers:
                y = layer(y)
            weighted_loss(y).backward()
            trace.input_grads.append(x.grad.clone())
        # each step's main_grads, then whether the fused kernels wrote them
        trace.main_grads.append([p.main_grad.clone() for p in params]
                                + [torch.tensor(p.grad_added_to_main_grad) for p in params])
        with torch.no_grad():
            for p in params:
                p.add_(p.main_grad.to(p.dtype), alpha=-lr)
        trace.weights.append([p.detach().clone() for p in params])
    return trace
