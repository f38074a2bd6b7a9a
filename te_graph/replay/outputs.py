"""The tensors a call hands out: valid memory while the caller holds them, and raising the
documented error when read once a later replay may have overwritten them (graphs and eager
replay alike)."""
from __future__ import annotations

import weakref

import torch

from .. import compat
from ..memory import in_memory_of, module_memory
from ..records import GraphSpec

__all__ = ["GraphOutputs", "EagerOutputs"]


_OVERWRITTEN = (
    "{name}: this output was overwritten by a later call of the same graph (a graph writes its "
    "outputs into the same memory at every replay). Clone an output you keep past the graph's "
    "next call (y.clone()), or capture one graph per microbatch (order=...)."
)


_REUSED = (
    "{name}: this output lived in a buffer that other graphs reuse once its backward has run "
    "(reuse_graph_input_output_buffers=True), and that backward ran (or the graphs were reset): "
    "its memory holds other values now. Clone an output you keep past its backward (y.clone()), "
    "or graph without reuse_graph_input_output_buffers."
)


class GraphOutputs:
    """The tensors a graph's calls hand out: valid memory while the caller holds them, and
    raising when read once a later replay may have overwritten them, as CUDA Graph Trees do
    (``compat.poison_storage``).

    Each output handed out views its static output through a storage of its own that keeps
    the static memory allocated (``compat.owning_alias``), so an output held past ``reset()``,
    past the callable's collection or past ``torch.cuda.empty_cache()`` still reads its
    values. Before a replay, one whose storage someone still holds (the caller kept the
    output, or a view of it) is poisoned and a fresh alias takes its place; the common call
    pays one use-count read per output. Static outputs that other graphs reuse once this
    graph's backward ran (``borrowed``: they own no memory) are poisoned where held at that
    backward, at ``reset()`` and when this object is collected, since the memory is then
    other tensors'. Outputs that are the module's own memory (a view of a parameter) are
    never overwritten and never poisoned. Where torch cannot poison a storage (its CPU
    builds) the static outputs are handed out as they are.
    """

    def __init__(self, name: str, static: tuple[torch.Tensor, ...], spec: GraphSpec, borrowed: bool = False):
        self.name = name
        own = module_memory(spec.func)  # never overwritten: stays right after any number of calls
        self._static = static
        self._guarded = tuple(
            compat.CAN_POISON and type(o) is torch.Tensor and o.device.type == "cuda" and not in_memory_of(o, own)
            for o in static
        )
        self._held = _Held()
        self._track(tuple(map(self._alias, static, self._guarded)))
        if borrowed and any(self._guarded):
            # Collected with its graphs: the memory goes back to the pool's next owner.
            self._finalizer = weakref.finalize(self, self._held.poison, _REUSED.format(name=name))

    def _track(self, current: tuple[torch.Tensor, ...]) -> None:
        """Hand out ``current`` from now on; its storages' use counts, as they are while
        nobody else holds them, are the baseline a held output exceeds."""
        self._current = current
        self._held.track(tuple(t.untyped_storage() if g else None for t, g in zip(current, self._guarded)))

    @staticmethod
    def _alias(t: torch.Tensor, guarded: bool) -> torch.Tensor:
        return compat.owning_alias(t) if guarded else t

    def before_replay(self) -> None:
        """Poison each output of the last call that is still held, before the replay
        overwrites it."""
        self._retire(_OVERWRITTEN)

    def after_reuse(self) -> None:
        """This graph's backward ran and its borrowed static outputs are other graphs' now:
        poison each output still held."""
        self._retire(_REUSED)

    def _retire(self, message: str) -> None:
        held = self._held.held()
        if not held:
            return
        current = list(self._current)
        for i in held:
            compat.poison_storage(self._held.storages[i], message.format(name=self.name))
            current[i] = self._alias(self._static[i], True)
        self._track(tuple(current))

    def reset(self) -> None:
        """The graphs are freed: outputs held on borrowed memory are poisoned (on owned
        memory they keep it, and their values)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.detach() for t in self._current)


class _Held:
    """The storages of the outputs handed out last and their use counts while only
    te_graph holds them: a higher count means the caller holds that output."""

    __slots__ = ("storages", "baseline")

    def track(self, storages: tuple) -> None:
        self.storages = storages
        self.baseline = tuple(compat.use_count(s) if s is not None else 0 for s in storages)

    def held(self) -> list[int]:
        return [i for i, s in enumerate(self.storages) if s is not None and compat.use_count(s) > self.baseline[i]]

    def poison(self, message: str) -> None:
        for i in self.held():
            compat.poison_storage(self.storages[i], message)
        self.storages = ()


class EagerOutputs:
    """Eager replay's mirror of :class:`GraphOutputs`: each call's outputs are new tensors,
    and where graphs would have overwritten them (the module's next call) the ones still
    held are poisoned, so that a program that reads an overwritten output fails the same
    way in both (on a CUDA device, where torch can poison). The tensor handed out is
    poisoned, not its storage (which the live output owns): a view the caller made of it
    keeps its values here, where with graphs it raises too."""

    def __init__(self, name: str, spec: GraphSpec):
        self.name = name
        self._own = module_memory(spec.func)
        self._held: list = []

    def hand_out(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        detached = tuple(o.detach() for o in outputs)
        self._held = [weakref.ref(t) for t in detached if compat.CAN_POISON and type(t) is torch.Tensor and t.device.type == "cuda"]
        return detached

    def before_call(self) -> None:
        self._retire(_OVERWRITTEN)

    def after_reuse(self) -> None:
        """Where the graphs would hand this call's output memory on after its backward
        (``GraphOutputs.after_reuse``)."""
        self._retire(_REUSED)

    def _retire(self, message: str) -> None:
        for ref in self._held:
            t = ref()
            if t is not None and not in_memory_of(t, self._own):
                compat.poison_tensor(t, message.format(name=self.name))
        self._held = []

