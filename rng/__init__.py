"""Graph-safe RNG states: the named-stream tracker, Megatron seeding and state snapshots.

``rng`` knows nothing of graphed callables: ``te_graph`` tells it when a capture starts
and ends and when a graph replays (see ``rng.graph_streams``).
"""
from .states import (
    RNGState,
    default_generator,
    generator_registration_required,
    get_rng_state,
    graph_safe_rng_available,
    is_graph_safe_rng_state,
    restore_generator,
    set_rng_state,
    snapshot_generator,
    to_byte_state,
    to_generator_state,
)
from .tracker import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
    restore_streams,
    restore_tracker_states,
    snapshot_streams,
    snapshot_tracker_states,
)

__all__ = [
    "RNGState",
    "CudaRNGStatesTracker",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "MODEL_PARALLEL_RNG",
    "EXPERT_PARALLEL_RNG",
    "DATA_PARALLEL_RNG",
    "graph_safe_rng_available",
    "is_graph_safe_rng_state",
    "generator_registration_required",
    "default_generator",
    "get_rng_state",
    "set_rng_state",
    "snapshot_generator",
    "restore_generator",
    "to_byte_state",
    "to_generator_state",
    "snapshot_tracker_states",
    "restore_tracker_states",
    "snapshot_streams",
    "restore_streams",
]
