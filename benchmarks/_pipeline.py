"""A pipeline schedule on one device: Megatron's interleaved 1F1B order, as one rank sees
it, and a driver that runs an order through per-(chunk, microbatch) callables.

Shared by ``bench_pipeline_memory.py`` and the split-weight-gradient tests
(``tests/test_te_layers.py``). Orders use TE's ``_order`` form: ``+c`` runs the forward of
chunk ``c`` (1-based) for its next microbatch, ``-c`` its backward, ``-c-0.5`` its
weight-gradient pass (``backward_dw()``) for the oldest backward waiting for one.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

__all__ = ["interleaved_1f1b_order", "with_wgrad_passes", "check_runnable_on_one_device", "run_order"]


def interleaved_1f1b_order(num_chunks: int, num_microbatches: int, pipeline_size: int,
                           rank: int = 0) -> list[int]:
    """Megatron's interleaved 1F1B schedule as seen by one pipeline rank.

    Forwards visit chunks in groups of ``pipeline_size`` microbatches (chunk 1 mb 0..P-1,
    chunk 2 mb 0..P-1, ..., chunk 1 mb P..2P-1, ...); backwards the same, chunks last to
    first. Warmup = ``(P - rank - 1) * 2 + (C - 1) * P`` forwards (all of them if fewer),
    then one forward and one backward at a time, then the remaining backwards.
    """
    if num_chunks < 1 or num_microbatches < 1 or pipeline_size < 1:
        raise ValueError("chunks, microbatches and pipeline size must be >= 1")
    if not 0 <= rank < pipeline_size:
        raise ValueError(f"rank {rank} is not in 0..{pipeline_size - 1}")
    if num_chunks > 1 and num_microbatches % pipeline_size:
        raise ValueError(
            f"an interleaved schedule needs microbatches ({num_microbatches}) divisible by "
            f"the pipeline size ({pipeline_size})")
    total = num_chunks * num_microbatches

    def chunk_id(k: int, forward: bool) -> int:
        group = (k // pipeline_size) % num_chunks
        return group + 1 if forward else -(num_chunks - group)

    if num_chunks == 1:
        warmup = min(pipeline_size - rank - 1, total)
    else:
        warmup = min((pipeline_size - rank - 1) * 2 + (num_chunks - 1) * pipeline_size, total)
    order = [chunk_id(k, True) for k in range(warmup)]
    forwards, backwards = warmup, 0
    while forwards < total:
        order.append(chunk_id(forwards, True))
        forwards += 1
        order.append(chunk_id(backwards, False))
        backwards += 1
    order.extend(chunk_id(k, False) for k in range(backwards, total))
    check_runnable_on_one_device(order, num_chunks)
    return order


def with_wgrad_passes(order: Sequence[int], placement: str = "after") -> list[float]:
    """``order`` with each backward's weight-gradient pass: right after it (``"after"``,
    Megatron's way), or all at the end, chunk by chunk (``"deferred"``)."""
    if placement == "after":
        return [e for c in order for e in ([c, c - 0.5] if c < 0 else [c])]
    assert placement == "deferred", placement
    return list(order) + [-c - 0.5 for c in sorted({-c for c in order if c < 0}) for _ in range(order.count(-c))]


def check_runnable_on_one_device(order: Sequence[float], num_chunks: int) -> None:
    """Each chunk's forward of microbatch m needs chunk c-1's forward of m; each backward
    needs its own forward and chunk c+1's backward of m (the data that crosses ranks)."""
    fwd_done = [0] * (num_chunks + 2)
    bwd_done = [0] * (num_chunks + 2)
    bwd_done[num_chunks + 1] = 1 << 30  # nothing after the last chunk
    fwd_done[0] = 1 << 30  # nothing before the first chunk
    for position, c in enumerate(order):
        if c != int(c):
            continue  # a weight-gradient pass crosses no rank
        chunk = abs(int(c))
        if c > 0:
            mb = fwd_done[chunk]
            if fwd_done[chunk - 1] <= mb:
                raise ValueError(f"order[{position}]: forward of chunk {chunk} mb {mb} before "
                                 f"chunk {chunk - 1}'s forward of it")
            fwd_done[chunk] += 1
        else:
            mb = bwd_done[chunk]
            if fwd_done[chunk] <= mb or bwd_done[chunk + 1] <= mb:
                raise ValueError(f"order[{position}]: backward of chunk {chunk} mb {mb} before "
                                 f"its forward or chunk {chunk + 1}'s backward of it")
            bwd_done[chunk] += 1


def run_order(order: Sequence[float], call: Callable[[int, int, torch.Tensor], torch.Tensor],
              inputs: Sequence[torch.Tensor],
              backward_dw: Optional[Callable[[int, int], None]] = None) -> tuple[list, list]:
    """One training iteration through ``order``: ``call(chunk, mb, x)`` runs a chunk's
    forward (0-based chunk), ``backward_dw(chunk, mb)`` its weight-gradient pass.

    Chunk ``c+1`` receives a copy of chunk ``c``'s output (the p2p receive), chunk ``c`` the
    input grad of chunk ``c+1`` (the p2p send of the backward); the last chunk backprops
    ``out.float().square().mean()``. Returns the losses and chunk 0's input grads, per
    microbatch.
    """
    chunks = max(int(c) for c in order)
    nxt = {kind: [0] * chunks for kind in "fbw"}
    ins, outs, grads, losses, input_grads = {}, {}, {}, {}, {}
    for c in order:
        if c != int(c):
            chunk = int(-c - 0.5) - 1
            mb, nxt["w"][chunk] = nxt["w"][chunk], nxt["w"][chunk] + 1
            backward_dw(chunk, mb)
            continue
        chunk = abs(int(c)) - 1
        if c > 0:
            mb, nxt["f"][chunk] = nxt["f"][chunk], nxt["f"][chunk] + 1
            x = (inputs[mb] if chunk == 0 else outs[chunk - 1, mb].detach().clone()).detach().requires_grad_(True)
            ins[chunk, mb], outs[chunk, mb] = x, call(chunk, mb, x)
            continue
        mb, nxt["b"][chunk] = nxt["b"][chunk], nxt["b"][chunk] + 1
        out, x = outs.pop((chunk, mb)), ins.pop((chunk, mb))
        if chunk == chunks - 1:
            loss = out.float().square().mean()
            losses[mb] = loss.detach()
            loss.backward()
        else:
            torch.autograd.backward(out, grads.pop((chunk + 1, mb)))
        if chunk > 0:
            grads[chunk, mb] = x.grad
        else:
            input_grads[mb] = x.grad.clone()
    assert not outs and not grads, "order left work undone"
    return [losses[m] for m in sorted(losses)], [input_grads[m] for m in sorted(input_grads)]
