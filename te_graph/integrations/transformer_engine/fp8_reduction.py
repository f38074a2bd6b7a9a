"""Transformer Engine's backward amax reduction, replayed as one CUDA graph.

Under delayed scaling, after the backward of an autocast's first FP8 call, the amaxes of
every module in TE's global buffers are reduced and their scales updated
(``FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)``, TE 2.20): a
``torch.cat`` over the amaxes, an all-reduce where the amax group has several ranks, and
TE's fused update, whose C++ binding walks three lists of tensors. It is device work on
tensors at fixed addresses, and its host time is paid once per autocast: about 0.2 ms per
step for 24 layers on an H100 host, in eager TE and, before this module, in te_graph's
replays too. So te_graph captures it once and replays it while TE's backward buffers hold
the same tensors under the same recipe settings; each call compares them (the tensors by
identity in one C-level pass, the recipe's settings by value: megatron-core makes a new,
equal recipe for every autocast) and captures anew when they changed (a module registered,
TE's state reset), freeing the old graph first. The replay runs the same kernels on the
same tensors: the FP8 meta stays bitwise what eager TE leaves (tests/test_te_layers.py
checks it after every step).

Left to TE's own call: a reduction across several ranks (a collective in a graph captured
and replayed by each rank at its own time is not proven here; with ``reduce_amax`` off
there is none, and the graph is used), the unfused update
(``NVTE_UNFUSED_FP8_UPDATE`` or callable amax/scale algorithms, Python per module), and
anything whose capture fails (warned once, then eager for those buffers).
"""
from __future__ import annotations

import operator
import os
import warnings
from typing import Any, Optional

import torch

from ...capture.graphs import capturing

__all__ = ["BackwardAmaxReduction"]


class _Buffers:
    """What a capture of the backward reduction reads, taken from TE's state at one call:
    the tensors (compared by identity, and held, so that an identity is never reused) and
    the settings the kernels were launched with and the tensors' addresses (compared by
    value)."""

    __slots__ = ("tensors", "settings")

    def __init__(self, tensors: tuple, settings: tuple):
        self.tensors = tensors
        self.settings = settings

    def same_as(self, other: Optional["_Buffers"]) -> bool:
        return (
            other is not None
            and len(self.tensors) == len(other.tensors)
            and all(map(operator.is_, self.tensors, other.tensors))
            and self.settings == other.settings
        )


def _backward_buffers(state: Any) -> Optional[_Buffers]:
    """TE's backward buffers as the reduction will read them; None where the reduction is
    left to TE (across ranks, unfused, or nothing to reduce)."""
    qstate = state.quantization_state
    tensors: list = [qstate]  # a reset of TE's state makes a new one
    settings: list = [os.getenv("NVTE_UNFUSED_FP8_UPDATE", "0")]
    if bool(int(settings[0])):
        return None
    for key, amaxes in qstate.global_amax_buffer.items():
        forward, autocast_key = state.split_key_in_buffer(key)
        if forward or not amaxes:
            continue
        recipe, group = qstate.autocast_arguments[autocast_key]
        if callable(getattr(recipe, "amax_compute_algo", None)) or callable(
                getattr(recipe, "scaling_factor_compute_algo", None)):
            return None
        if (getattr(recipe, "reduce_amax", False) and torch.distributed.is_initialized()
                and torch.distributed.get_world_size(group=group) > 1):
            return None
        # The recipe by value, not by identity: megatron-core makes an equal recipe for every
        # forward's autocast, and TE's key holds its text and the group's identity already.
        tensors += [*amaxes, *qstate.global_amax_history_buffer[key], *qstate.global_scale_buffer[key]]
        settings += [key, getattr(recipe, "amax_compute_algo", None), getattr(recipe, "margin", None),
                     getattr(recipe, "fp8_format", None)]
    if len(tensors) == 1:
        return None  # nothing registered: TE's call is an empty loop
    # The graph reads addresses: a tensor whose storage was swapped in place (``.data =``,
    # ``set_``; TE does neither) keeps its identity and moves.
    settings.append(tuple(map(torch.Tensor.data_ptr, tensors[1:])))
    return _Buffers(tuple(tensors), tuple(settings))


class BackwardAmaxReduction:
    """The backward amax reduction of one device as a graph (one per device, owned by
    ``resources.RESOURCES``)."""

    def __init__(self, stream: "torch.cuda.Stream"):
        self._stream = stream  # the device's capture stream
        self._graph: Any = None
        self._captured: Optional[_Buffers] = None  # what the graph reads
        self._eager: Optional[_Buffers] = None  # buffers whose capture failed: TE's call for them
        self.captures = 0  # how many times it was captured (for tests and benchmarks)
        self.replays = 0  # how many reductions ran as a replay of the graph

    def run(self, state: Any) -> None:
        """Reduce and update as ``state.reduce_and_update_fp8_tensors(forward=False)``."""
        buffers = _backward_buffers(state)
        if buffers is None and self._captured is not None and self._captured.tensors[0] is not state.quantization_state:
            self.reset()  # TE's state was reset since the capture: let go of the old tensors
        if (buffers is not None and not buffers.same_as(self._eager)
                and (buffers.same_as(self._captured) or self._capture(state, buffers))):
            self._graph.replay()
            self.replays += 1
            return
        state.reduce_and_update_fp8_tensors(forward=False)

    def _capture(self, state: Any, buffers: _Buffers) -> bool:
        """Capture TE's call for ``buffers`` (nothing runs: the replay that follows does it);
        False, with a warning, where the capture fails."""
        # The old graph goes first, and each capture gets a pool of its own, freed with its
        # graph. One pool handle kept across captures fails once every graph of it was freed
        # (a reset of TE's state frees ours): torch's allocators assert the pool is still used
        # at the next capture_begin (``use_count > 0``, torch 2.11, in the pinned-memory
        # allocator too), and that failure left the default generator capturing.
        self.reset()
        graph = torch.cuda.CUDAGraph()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream), capturing("TE's backward amax reduction", graph, None, (), "thread_local"):
                state.reduce_and_update_fp8_tensors(forward=False)
        except Exception as error:  # noqa: BLE001 - TE's own call stays, as eager TE has it
            warnings.warn(
                f"te_graph: Transformer Engine's backward amax reduction could not be captured as a "
                f"graph ({type(error).__name__}: {error}); it runs eagerly, as in eager TE.", stacklevel=2)
            self.reset()
            self._eager = buffers
            return False
        torch.cuda.current_stream().wait_stream(stream)
        self._graph, self._captured = graph, buffers
        self.captures += 1
        return True

    def reset(self) -> None:
        """Free the graph and let go of the tensors it read."""
        if self._graph is not None:
            self._graph.reset()
        self._graph = self._captured = self._eager = None
