"""Per-layer CUDA graphs for Megatron-style training: ``make_graphed_callables`` with
activation recompute inside the graphs and exact dropout randomness.

Where things live: ``schedule`` and ``layout`` (pure planning), ``checks`` (bad input),
``capture`` (warmup and capture), ``replay`` (the per-call path), ``grads`` (where
gradients go). The RNG bookkeeping is ``rng.graph_streams``.
"""
from .api import eager_replay_default, make_graphed_callables


def graph_pool_handle():
    """A memory pool token to share between several ``make_graphed_callables`` calls."""
    import torch

    return torch.cuda.graph_pool_handle()


__all__ = ["make_graphed_callables", "graph_pool_handle", "eager_replay_default"]
