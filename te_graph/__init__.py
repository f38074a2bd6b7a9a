"""Per-layer CUDA graphs for Megatron-style training: ``make_graphed_callables`` with
activation recompute inside the graphs and exact dropout randomness.

Where things live: ``api`` (the call forms), ``checks`` (bad input), ``schedule`` and
``layout`` (pure planning), ``capture`` (warmup and capture, told top to bottom),
``recompute_rng`` (the RNG bookkeeping of recompute inside graphs), ``parameters``
(parameter stand-ins during capture), ``module_state`` (module buffers), ``grads`` (where
gradients go), ``hooks`` (capture-time hooks), ``replay`` (the per-call path).
"""
from .api import Samples, eager_replay_default, graph_pool_handle, make_graphed_callables, reset

__all__ = ["make_graphed_callables", "graph_pool_handle", "eager_replay_default", "Samples", "reset"]
