"""Graph-safe RNG states: the named-stream tracker, Megatron seeding, state snapshots and
the live generator objects behind each stream.

``rng`` holds RNG state only; it names neither graphs nor checkpoints.
"""
from .states import (
    RNGState,
    default_generator,
    env_flag,
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
from .discovery import TERegistryTracker, process_tracker
from .seeding import model_parallel_cuda_manual_seed
from .streams import DEFAULT_STREAM, live_stream_generators, streams_swapped
from .tracker import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    restore_streams,
    restore_tracker_states,
    snapshot_streams,
    snapshot_tracker_states,
)

__all__ = [
    "RNGState",
    "CudaRNGStatesTracker",
    "get_cuda_rng_tracker",
    "process_tracker",
    "TERegistryTracker",
    "model_parallel_cuda_manual_seed",
    "MODEL_PARALLEL_RNG",
    "EXPERT_PARALLEL_RNG",
    "DATA_PARALLEL_RNG",
    "graph_safe_rng_available",
    "is_graph_safe_rng_state",
    "generator_registration_required",
    "env_flag",
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
    "DEFAULT_STREAM",
    "live_stream_generators",
    "streams_swapped",
]
