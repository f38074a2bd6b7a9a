"""Activation recompute (checkpointing) with exact random numbers, eagerly and inside
te_graph's CUDA graphs."""
from .checkpoint import checkpoint

__all__ = ["checkpoint"]
