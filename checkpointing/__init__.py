"""Activation recompute (checkpointing) with exact random numbers, eagerly and inside
te_graph's CUDA graphs."""
from .checkpoint import checkpoint, is_reentrant_checkpoint_node

__all__ = ["checkpoint", "is_reentrant_checkpoint_node"]
