"""Per-layer CUDA graphs for Megatron-style training: ``make_graphed_callables`` with
activation recompute inside the graphs and exact dropout randomness.

The stages a call goes through, each a folder (docs/architecture.md draws them):
``intake`` (call forms, options, specs, refusals before anything changes), ``planning``
(schedule and shared buffers, pure), ``capture`` (warmup and capture), ``replay`` (every
call), ``guards`` (what a graph froze, checked at each call), ``verify`` (the runtime
verifier), ``step`` (whole-step graphs); ``api`` tells the story. A
flat base holds the records, layouts, gradients, memory, torch compatibility and the
process's resources; ``integrations`` (Transformer Engine, megatron-core) meet the engine
only through ``extension``, the one seam, and are imported here so that they register.
"""
from . import integrations  # noqa: F401 - registers the installed integrations with the seam
from .api import (
    GraphedStep, Samples, Verify, eager_replay_default, graph_pool_handle, make_graphed_callables, make_graphed_step,
    reset, verify,
)

__all__ = ["make_graphed_callables", "make_graphed_step", "GraphedStep", "graph_pool_handle", "eager_replay_default",
           "Samples", "reset", "Verify", "verify"]
