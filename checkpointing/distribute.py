"""Keep 1/TP of a saved activation between forward and backward (Megatron's
``distribute_saved_activations``): each tensor-parallel rank keeps its slice, and the
recompute gathers the slices back."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _group_size_rank(group: Any) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "checkpoint(distribute_saved_activations=True) needs torch.distributed to be "
            "initialized and a tensor-parallel group (tp_group=...)."
        )
    return dist.get_world_size(group), dist.get_rank(group)


def keep_slice(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's contiguous 1/world slice of ``tensor`` (a copy, not a view)."""
    world, rank = _group_size_rank(group)
    if tensor.numel() % world:
        raise ValueError(
            f"checkpoint(distribute_saved_activations=True): the first input has "
            f"{tensor.numel()} elements, not divisible by the tensor-parallel size {world}."
        )
    size = tensor.numel() // world
    return tensor.detach().reshape(-1)[rank * size : (rank + 1) * size].clone()


def gather_slices(piece: torch.Tensor, shape: torch.Size, group: Any) -> torch.Tensor:
    """Inverse of :func:`keep_slice`: the whole tensor, gathered from every rank."""
    world, _ = _group_size_rank(group)
    pieces = [torch.empty_like(piece) for _ in range(world)]
    dist.all_gather(pieces, piece, group=group)
    return torch.cat(pieces).view(shape)
