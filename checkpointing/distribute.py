"""Keep 1/TP of a saved activation between forward and backward (Megatron's
``distribute_saved_activations``): each tensor-parallel rank keeps its slice, and the
recompute gathers the slices back."""
from __future__ import annotations

import functools
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


_SHARDED = (
    "checkpoint(distribute_saved_activations=True): the first input differs between the "
    "ranks of the tensor-parallel group (a sequence-parallel shard?). Each rank keeps only "
    "its 1/TP slice of the input and the recompute gathers the slices back, which rebuilds "
    "the input only when every rank holds the same one; with sequence-parallel shards the "
    "gradients would be wrong (Megatron forbids this combination too). Pass "
    "distribute_saved_activations=False when the input is sharded."
)


# A device-side assertion's message must stay under 255 characters.
_SHARDED_ON_DEVICE = (
    "checkpoint(distribute_saved_activations=True): the first input differs across the "
    "tensor-parallel ranks (sequence-parallel shard?); pass distribute_saved_activations=False"
)


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Two exact integer sums of the tensor's bit pattern (whole and first half): equal on
    every rank when the tensors are equal, and in practice nowhere else."""
    flat = tensor.detach().contiguous().view(-1)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    words = flat.view(bits)
    return torch.stack([words.sum(dtype=torch.int64), words[: words.numel() // 2].sum(dtype=torch.int64)])


def check_replicated(tensor: torch.Tensor, group: Any) -> None:
    """Refuse a first input that is not the same on every rank of ``group``.

    Eagerly this raises ``ValueError`` before the region runs. While a CUDA graph is
    being captured no host check can run, so the graph gets a device-side assertion
    instead: a replay fed sharded inputs stops with a device assert rather than computing
    wrong gradients (te_graph's warmup runs the eager check on the sample inputs first).
    """
    world, _ = _group_size_rank(group)
    if world == 1:
        return
    mine = _fingerprint(tensor)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    same = torch.stack([(mine == other).all() for other in everyone]).all()
    if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
        if _assert_takes_message():
            torch._assert_async(same, _SHARDED_ON_DEVICE)
        else:
            torch._assert_async(same)
        return
    if not bool(same):
        raise ValueError(_SHARDED)


@functools.lru_cache(maxsize=None)
def _assert_takes_message() -> bool:
    """Whether this torch's ``_assert_async`` takes a message (feature-detected once)."""
    try:
        torch._assert_async(torch.ones((), dtype=torch.bool), "probe")
    except TypeError:
        return False
    return True
