"""Per-layer CUDA graphs for Megatron-style training: ``make_graphed_callables`` with
activation recompute inside the graphs and exact dropout randomness.

Where things live, in the order a call goes through them:

* ``api``: ``make_graphed_callables`` itself (normalise, check, plan, capture, wrap) and ``reset``;
* ``options``, ``arguments``: the options (frozen) and the call forms, sample sets and specs;
* ``checks``: bad input, refused before anything changes;
* ``schedule``, ``plan``: pure planning (the run order from ``order``; which graphs share buffers);
* ``records``: the frozen records a graph's state flows through (spec, warmup record, captured graph);
* ``capture`` (the algorithm, top to bottom), ``warmup``, ``parameters`` (stand-ins),
  ``module_state`` (module buffers), ``hooks`` (capture-time hooks);
* ``recompute_rng``: the RNG bookkeeping of recompute inside graphs;
* ``replay`` (the per-call path: runners and the autograd node), ``graphed`` (the callable
  handed back), ``grads`` (where gradients go);
* ``resources``: the process-wide state (capture streams, gradient buffers, live callables,
  ``fp8_reduction``'s graph of TE's backward amax reduction) and its teardown;
* ``compat``: every use of a torch private or a version-dependent path.
"""
from .api import Samples, eager_replay_default, graph_pool_handle, make_graphed_callables, reset

__all__ = ["make_graphed_callables", "graph_pool_handle", "eager_replay_default", "Samples", "reset"]
