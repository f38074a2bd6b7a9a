"""Shared helpers for the make_graphed_callables tests: a GPT stack, eager references and
bitwise comparisons."""
from __future__ import annotations

import copy

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


def sample_like(x, requires_grad=True):
    return torch.randn_like(x).requires_grad_(requires_grad)


def train_steps(layers, params, inputs, steps=3, micro=2, lr=0.1, **kwargs):
    """SGD steps of ``micro`` accumulated microbatches (zero_grad(set_to_none=False)).

    Returns per-microbatch outputs and input grads, and the final parameters."""
    opt = torch.optim.SGD(params, lr=lr)
    outputs, input_grads = [], []
    it = iter(inputs)
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        for _ in range(micro):
            x = next(it).detach().requires_grad_(True)
            y = run_layers(layers, x, **kwargs)
            (y.float() * torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)).sum().backward()
            outputs.append(y.detach().clone())
            input_grads.append(x.grad.clone())
    return outputs, input_grads, [p.detach().clone() for p in params]


def assert_all_equal(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what} {i} differs (max abs diff {(x.float() - y.float()).abs().max().item()})"


def clone_modules(modules):
    return [copy.deepcopy(m) for m in modules]
