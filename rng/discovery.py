"""The RNG tracker a process's layers fork, found without being told.

Transformer Engine's graphs find the tracker states on their own (TE's module-level
registry, ``transformer_engine.pytorch.distributed.get_all_rng_states()``, which TE's
tracker fills), and megatron-core's ``TECudaGraphHelper`` relies on that: it passes no
tracker. ``process_tracker()`` looks, in order, for:

1. ours (``rng.get_cuda_rng_tracker()``), when seeded;
2. megatron-core's (``megatron.core.tensor_parallel.random``), when initialised and
   holding streams (with ``te_rng_tracker=True`` it is Transformer Engine's class, whose
   states are TE's registry);
3. Transformer Engine's registry of tracker states, through :class:`TERegistryTracker`;
4. ours, unseeded (no named streams: the default generator alone).

Each library is looked up in ``sys.modules`` only: nothing is imported.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Mapping

from .tracker import MODEL_PARALLEL_RNG, get_cuda_rng_tracker

__all__ = ["process_tracker", "TERegistryTracker"]


def process_tracker() -> Any:
    """The tracker this process's layers fork (see the module's docstring)."""
    ours = get_cuda_rng_tracker()
    if ours.is_initialized():
        return ours
    megatron = sys.modules.get("megatron.core.tensor_parallel.random")
    if megatron is not None and getattr(megatron, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        tracker = getattr(megatron, "_CUDA_RNG_STATE_TRACKER", None)
        if tracker is not None and tracker.get_states():
            return tracker
    te = sys.modules.get("transformer_engine.pytorch.distributed")
    if te is not None and getattr(te, "get_all_rng_states", None) is not None and te.get_all_rng_states():
        return TERegistryTracker(te)
    return ours


class TERegistryTracker:
    """Transformer Engine's registry of tracker states as a tracker (``get_states``,
    ``set_states``, ``fork``). TE's ``CudaRNGStatesTracker`` publishes its own states dict
    as the registry, so the registry's dict *is* the tracker's: ``set_states`` updates it in
    place, and the tracker a layer forks sees every stream swapped here."""

    def __init__(self, distributed: Any):
        self._distributed = distributed

    def _states(self) -> dict:
        return self._distributed.get_all_rng_states()

    def get_states(self) -> dict:
        return dict(self._states())

    def set_states(self, states: Mapping[str, Any]) -> None:
        live = self._states()
        live.clear()
        live.update(states)

    def is_initialized(self) -> bool:
        return bool(self._states())

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        import torch  # noqa: PLC0415

        generator = torch.cuda.default_generators[torch.cuda.current_device()]
        previous = generator.graphsafe_get_state()
        generator.graphsafe_set_state(self._states()[name])
        try:
            yield
        finally:
            generator.graphsafe_set_state(previous)
