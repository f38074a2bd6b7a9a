"""Process-wide setup for the examples, tests and benchmarks: the process group and its
tensor- and data-parallel groups, strict deterministic algorithms, and a clean teardown.

One place sets the rule of the multi-GPU machines (never enable NVLink multicast) before
any process group exists, for ``torchrun`` launches and for spawned test ranks alike.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

# NVLink SHARP (NVLS) and symmetric-memory multicast stay off on every machine we run on.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
DETERMINISTIC_CUBLAS_CONFIGS = (":4096:8", ":16:8")


def set_nccl_env() -> None:
    """Turn NVLink multicast off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``);
    call before ``init_process_group``."""
    os.environ.update(NCCL_ENV)


@dataclass(frozen=True)
class Parallelism:
    """Where this process sits: its rank, its tensor-parallel group and its data-parallel
    group. ``Parallelism()`` is the single process (no groups, nothing initialised)."""

    world: int = 1
    rank: int = 0
    tp: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    dp: int = 1
    dp_rank: int = 0
    dp_group: Any = None

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 prints and writes files."""
        return self.rank == 0


def init_process_group(
    backend: str,
    rank: int,
    world: int,
    init_method: str = "env://",
    timeout_s: float = 120.0,
    device: torch.device | None = None,
) -> None:
    """``dist.init_process_group`` with the NCCL environment set first and a timeout, so a
    peer that never shows up fails the run instead of blocking it."""
    set_nccl_env()
    kwargs = {}
    if backend == "nccl" and device is not None:
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # binds the communicator to this rank's GPU
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s), **kwargs,
    )


def make_groups(tp: int) -> Parallelism:
    """Split the initialised world into tensor-parallel groups of ``tp`` consecutive ranks
    and data-parallel groups of the ranks at the same place in each of them (Megatron's
    layout). Every rank must call it: creating a group is collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the world size {world}.")
    dp = world // tp
    tp_group = dp_group = None
    for first in range(0, world, tp):
        ranks = list(range(first, first + tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    for offset in range(tp):
        ranks = list(range(offset, world, tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    return Parallelism(
        world=world, rank=rank, tp=tp, tp_rank=rank % tp, tp_group=tp_group,
        dp=dp, dp_rank=rank // tp, dp_group=dp_group,
    )


def barrier(device: torch.device | None = None) -> None:
    """``dist.barrier`` that names the GPU for NCCL (which otherwise guesses and warns)."""
    if device is not None and device.type == "cuda" and dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def shutdown(*graphed: Any, device: torch.device | None = None) -> None:
    """Free the graphs, then leave the process group.

    Destroying the process group while graphs that captured NCCL collectives are alive left
    both ranks unable to exit (``tests/multi_gpu_teardown_probe.py`` reproduces
    it), so ``te_graph.reset`` frees them first. Only what is given is reset.
    """
    import te_graph

    if graphed:
        te_graph.reset(*graphed)
    if dist.is_available() and dist.is_initialized():
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.destroy_process_group()


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Strict ``torch.use_deterministic_algorithms`` inside, the previous settings after.

    Strict (not warn-only) mode is what makes flash attention's backward deterministic.
    cuBLAS then needs ``CUBLAS_WORKSPACE_CONFIG`` set before its first call (train_gpt sets
    it at import).
    """
    if not enabled:
        yield
        return
    import torch.utils.deterministic as det

    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    previous_fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = False  # no NaN-fill kernels for every torch.empty
    try:
        yield
    finally:
        det.fill_uninitialized_memory = previous_fill
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
