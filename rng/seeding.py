"""Megatron's seeding: the default generator and the tracker's three named streams.

Every derived seed is computed and checked before anything is seeded, so a call that
cannot seed every stream changes nothing.
"""
from __future__ import annotations

import operator
from typing import Any

import torch

from .checks import SEED_MAX, as_seed
from .states import default_generator
from .tracker import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
)

__all__ = ["model_parallel_cuda_manual_seed"]

_GROUPS = {"tp_rank": "tensor-parallel", "ep_rank": "expert-parallel", "etp_rank": "expert-tensor-parallel"}
# 2718 + tp_rank == 1024 + 100 * ep_rank + etp_rank: the one way two streams can meet.
_COLLISION = 2718 - 1024


def _derived_seeds(seed: int, tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0) -> dict[str, int]:
    """Megatron's seed of each named stream, by name (pure arithmetic, nothing checked)."""
    return {
        MODEL_PARALLEL_RNG: seed + 2718 + tp_rank,
        EXPERT_PARALLEL_RNG: seed + 1024 + 100 * ep_rank + etp_rank,
        DATA_PARALLEL_RNG: seed,
    }


def model_parallel_cuda_manual_seed(
    seed: int,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    *,
    tracker: Any = None,
) -> None:
    """Seed the default generator and the tracker's streams the way Megatron does.

    * default generator (data-parallel stream): ``seed``, identical on every TP rank;
    * ``'model-parallel-rng'``: ``seed + 2718 + tp_rank``, different on every TP rank;
    * ``'expert-parallel-rng'``: ``seed + 1024 + 100 * ep_rank + etp_rank``;
    * ``'data-parallel-rng'``: ``seed`` (Megatron-core's named copy of the default stream).

    Ranks default to 0 (one rank of each kind). ``tracker`` defaults to ours; a duck-typed
    graph-safe tracker (Megatron-core's, TE's) has each stream it already holds as a
    generator reseeded in place (graphs captured earlier keep drawing from it) and the
    others added. The seed, the ranks and every derived seed are checked first (two
    streams with one seed would draw the same numbers), so an error changes nothing.
    """
    seed = as_seed(seed, "model_parallel_cuda_manual_seed: seed", "model_parallel_cuda_manual_seed(1234)")
    ranks = {name: _rank(name, value) for name, value in (("tp_rank", tp_rank), ("ep_rank", ep_rank), ("etp_rank", etp_rank))}
    seeds = _derived_seeds(seed, **ranks)
    _check_seeds(seed, seeds, **ranks)
    tracker = tracker if tracker is not None else get_cuda_rng_tracker()
    device = getattr(tracker, "device", None)
    generator = default_generator(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    _seed_streams(tracker, seeds)
    generator.manual_seed(seed)  # last: a duck-typed tracker's own add() may still raise


def _seed_streams(tracker: Any, seeds: dict[str, int]) -> None:
    if not isinstance(tracker, CudaRNGStatesTracker):
        live = tracker.get_states()
        if any(isinstance(state, torch.Generator) for state in live.values()):
            for name, stream_seed in seeds.items():
                if isinstance(live.get(name), torch.Generator):
                    live[name].manual_seed(stream_seed)  # in place: the objects stay the same
                else:
                    tracker.add(name, stream_seed)
            return
    tracker.reset()
    for name, stream_seed in seeds.items():
        tracker.add(name, stream_seed)


def _check_seeds(seed: int, seeds: dict[str, int], tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    """Refuse derived seeds beyond torch's range, and two streams with one seed."""
    largest = max(seeds.values())
    if largest > SEED_MAX:
        raise ValueError(
            f"model_parallel_cuda_manual_seed: seed {seed} with these ranks gives a stream the "
            f"seed {largest}, beyond torch's largest seed 2**64 - 1 (Megatron adds "
            f"{largest - seed} to it here); pass a seed of at most {SEED_MAX - (largest - seed)}."
        )
    # With ranks >= 0 the data-parallel seed is below both others, so only these two can meet.
    if seeds[MODEL_PARALLEL_RNG] == seeds[EXPERT_PARALLEL_RNG]:
        raise ValueError(
            f"model_parallel_cuda_manual_seed: '{MODEL_PARALLEL_RNG}' (seed + 2718 + tp_rank, "
            f"tp_rank={tp_rank}) and '{EXPERT_PARALLEL_RNG}' (seed + 1024 + 100 * ep_rank + "
            f"etp_rank, ep_rank={ep_rank}, etp_rank={etp_rank}) would both get seed "
            f"{seeds[MODEL_PARALLEL_RNG]} and draw the same numbers; nothing was seeded. "
            f"Megatron's offsets are fixed, so another seed does not help: the two meet whenever "
            f"100 * ep_rank + etp_rank - tp_rank == {_COLLISION}, whatever the seed. Change "
            "the parallel layout so that no process has such ranks, or seed the streams yourself: "
            "tracker.reset(), then tracker.add(name, seed) with a seed per stream that differs "
            "from the other streams' and across ranks as Megatron's do (model-parallel per "
            "tp_rank, expert-parallel per (ep_rank, etp_rank)), and torch.manual_seed(seed) "
            "(torch.cuda.manual_seed on CUDA) for the default generator."
        )


def _rank(name: str, value: Any) -> int:
    """A rank argument as an int >= 0 (numpy ints too); flags in rank positions are refused."""
    if value is None:
        return 0
    try:
        if isinstance(value, bool):
            raise TypeError
        rank = operator.index(value)
    except TypeError:
        raise TypeError(
            f"model_parallel_cuda_manual_seed: {name} must be an int rank, got {value!r}. "
            "Megatron's own function takes flags (te_rng_tracker, inference_rng_tracker, ...) "
            "in these positions; pass ranks by keyword, e.g. "
            "model_parallel_cuda_manual_seed(seed, tp_rank=rank)."
        ) from None
    if rank < 0:
        raise ValueError(
            f"model_parallel_cuda_manual_seed: {name} is {rank}; ranks count from 0. Pass this "
            f"process's rank in its {_GROUPS[name]} group (torch.distributed.get_rank(group)), "
            "or leave it None for 0."
        )
    return rank
