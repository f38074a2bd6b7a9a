"""checkpoint(distribute_saved_activations=True) on a 2-rank gloo group.

Each rank keeps only its half of the first input between forward and backward; the
recompute gathers the halves back. Two processes are spawned; each writes what it saw to
a file, and the parent asserts on it.
"""
from __future__ import annotations

import datetime
import os
import re

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.multi_gpu_helpers import free_port

WORLD = 2
SEED = 4321


def _region(x, scale, *, w, tracker, log):
    """A tensor-parallel-ish block: a rank-local weight shard and a model-parallel dropout."""
    h = x @ w
    with tracker.fork():
        h = F.dropout(h, p=0.5, training=True)
    log.append(h == 0)
    return torch.tanh(h) * scale, None


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import rng
    from checkpointing import checkpoint

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    try:
        group = dist.new_group(list(range(WORLD)))
        # A CPU tracker even where CUDA exists: the region draws on the CPU generator.
        tracker = rng.CudaRNGStatesTracker(device="cpu")
        g = torch.Generator().manual_seed(0)
        x0 = torch.randn(6, 4, 16, generator=g)  # the same activation on every TP rank
        w_all = torch.randn(WORLD, 16, 8, generator=g)
        w0 = w_all[rank]  # this rank's shard
        grad_out = torch.randn(6, 4, 8, generator=g)

        def once(ckpt):
            rng.model_parallel_cuda_manual_seed(SEED, tp_rank=rank, tracker=tracker)
            x = x0.clone().requires_grad_()
            w = w0.clone().requires_grad_()
            log = []
            kwargs = dict(w=w, tracker=tracker, log=log)
            if ckpt:
                out, none = checkpoint(
                    _region, x, 0.5, distribute_saved_activations=True, tp_group=group,
                    get_rng_state_tracker=lambda: tracker, **kwargs
                )
                saved = out.grad_fn.saved_tensors
            else:
                out, none = _region(x, 0.5, **kwargs)
                saved = None
            assert none is None
            (out * grad_out).sum().backward()
            return dict(
                out=out.detach(), gx=x.grad, gw=w.grad, masks=log, saved=saved,
                states=tracker.get_states(), cpu=torch.get_rng_state(),
            )

        ref = once(False)
        got = once(True)
        saved = got.pop("saved")
        try:
            checkpoint(
                _region, torch.randn(3, requires_grad=True), 1.0,
                distribute_saved_activations=True, tp_group=group,
                get_rng_state_tracker=lambda: tracker, w=torch.randn(3, 2), tracker=tracker, log=[],
            )
            odd_error = None
        except ValueError as error:
            odd_error = str(error)
        # A sequence-parallel shard (a different first input on each rank) is refused
        # before the region runs: gathering the slices would rebuild someone else's input.
        shard = torch.randn(6, 4, 16, generator=torch.Generator().manual_seed(100 + rank), requires_grad=True)
        cpu_before = torch.get_rng_state()
        try:
            checkpoint(
                _region, shard, 1.0, distribute_saved_activations=True, tp_group=group,
                get_rng_state_tracker=lambda: tracker, w=w0, tracker=tracker, log=[],
            )
            shard_error = None
        except ValueError as error:
            shard_error = str(error)
        shard_untouched = torch.equal(cpu_before, torch.get_rng_state())
        torch.save(
            dict(
                ref={k: v for k, v in ref.items() if k != "saved"},
                got=got,
                saved_first=saved[0].clone(),
                saved_first_nbytes=saved[0].untyped_storage().nbytes(),
                input_nbytes=x0.untyped_storage().nbytes(),
                n_saved=len(saved),
                x0=x0,
                odd_error=odd_error,
                shard_error=shard_error,
                shard_untouched=shard_untouched,
            ),
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_distribute_saved_activations_on_two_gloo_ranks(tmp_path):
    mp.spawn(_rank_main, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    for rank, result in enumerate(results):
        ref, got = result["ref"], result["got"]
        # Outputs, grads and every stream after backward: bitwise the plain run's.
        for key in ("out", "gx", "gw", "cpu"):
            assert torch.equal(got[key], ref[key]), f"rank {rank}: {key}"
        assert ref["states"].keys() == got["states"].keys()
        for name in ref["states"]:
            assert torch.equal(got["states"][name], ref["states"][name]), f"rank {rank}: {name}"
        # Forward and recompute drew the plain run's mask.
        assert len(ref["masks"]) == 1 and len(got["masks"]) == 2
        for mask in got["masks"]:
            assert torch.equal(mask, ref["masks"][0]), f"rank {rank}: mask"
        # Only the first input is saved (the weight is a kwarg), and only this rank's half.
        assert result["n_saved"] == 1
        assert result["saved_first_nbytes"] * WORLD == result["input_nbytes"], f"rank {rank}"
        half = result["x0"].numel() // WORLD
        expected = result["x0"].reshape(-1)[rank * half : (rank + 1) * half]
        assert torch.equal(result["saved_first"], expected), f"rank {rank}: saved slice"
        # A first input that does not split evenly is refused with the sizes named.
        assert result["odd_error"] is not None, f"rank {rank}: odd input accepted"
        assert re.fullmatch(
            re.escape(
                "checkpoint(distribute_saved_activations=True): the first input has 3 elements, "
                "not divisible by the tensor-parallel size 2."
            ),
            result["odd_error"],
        ), result["odd_error"]
        assert result["shard_error"] is not None and result["shard_error"].startswith(
            "checkpoint(distribute_saved_activations=True): the first input differs between the "
            "ranks of the tensor-parallel group (a sequence-parallel shard?)."
        ), result["shard_error"]
        assert result["shard_error"].endswith(
            "Pass distribute_saved_activations=False when the input is sharded."
        )
        assert result["shard_untouched"], f"rank {rank}: the refused region drew random numbers"

    # 'model-parallel-rng' keeps its tensor-parallel meaning: each rank drew its own mask.
    assert not torch.equal(results[0]["ref"]["masks"][0], results[1]["ref"]["masks"][0])
