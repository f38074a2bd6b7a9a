"""The process-wide resources of te_graph: one owner, one teardown.

* **Capture streams**, one per device, shared by every warmup and capture: cuBLAS keeps a
  workspace per (handle, stream) for the life of the process (tens of MiB on Hopper) and
  captured graphs bake in its address, so a new stream per call would add a set of
  workspaces for every ``make_graphed_callables`` call.
* **Parameter-gradient buffers**, one per trainable parameter, at a fixed address, shared
  by every graph that uses the parameter (``grads``). Held weakly: a buffer lives as long as
  a graph that accumulates into it or the parameter's ``.grad`` holds it.
* **Per-device objects an integration owns** (:meth:`ProcessResources.per_device`; the
  Transformer Engine integration's backward amax reduction graph), each reset at teardown.
* **Live graphed callables**, held weakly, so that ``te_graph.reset()`` with no argument
  can free every graph (teardown before ``destroy_process_group``).
* **What the calls capturing into one memory pool share** (:meth:`ProcessResources.pool_state`:
  the replay order of its graphs), held weakly by the pool's handle.
* **A lease on each memory pool handle** (:class:`PoolLease`): held by the graphed
  callables captured into the pool, and for the process by a handle the user passed, so
  that the handle can be captured into again after every graph of it was reset while
  tensors in it are still held.

``RESOURCES`` is the one instance; ``RESOURCES.teardown()`` (what ``te_graph.reset()``
calls) frees the graphs and forgets the rest. :class:`Graphed` is the base of te_graph's
graphed callables, so that every stage can recognise one (``graphed_callable_of``).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import compat

__all__ = ["ProcessResources", "RESOURCES", "PoolLease", "Graphed", "graphed_callable_of", "graphed_callables_in"]


class PoolLease:
    """One use of a graph memory pool, held by an empty graph captured into it.

    torch (checked on 2.11) keeps a pool while tensors in it live, but refuses to capture
    into it again once every graph using it is gone ("it->second->use_count > 0 INTERNAL
    ASSERT FAILED" in the device and the pinned-host caching allocators; torch's own
    ``graph_pool_handle`` docs assume graphs outlive their outputs). Outputs te_graph hands
    out keep their memory after ``reset()``, so a handle is kept in use as long as it can be
    named again.
    """

    __slots__ = ("handle", "_graph", "__weakref__")

    def __init__(self, handle: tuple[int, int], stream: "torch.cuda.Stream"):
        self.handle = handle
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
                graph.capture_begin(pool=handle)
                graph.capture_end()
        except RuntimeError as error:
            compat.end_generator_capture(())  # capture_begin put the default generator in capture mode
            raise RuntimeError(
                f"make_graphed_callables: pool={handle} names a memory pool whose graphs were all freed "
                "while tensors in it are still alive (pool= a graphed callable that was reset, or a handle "
                "passed again after te_graph.reset() with no argument); torch cannot capture into such a "
                "pool again. Pass a new te_graph.graph_pool_handle()."
            ) from error
        self._graph = graph

    def release(self) -> None:
        if self._graph is not None:
            self._graph.reset()
            self._graph = None


class Graphed:
    """The base of te_graph's graphed callables (``replay.graphed.GraphedCallable``)."""

    def reset(self) -> None:
        raise NotImplementedError

    def accumulated_parameters(self) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def share_parameters(self, ids: set) -> None:
        raise NotImplementedError

    def static_inputs(self) -> Iterator[torch.Tensor]:
        raise NotImplementedError


def graphed_callable_of(obj: Any) -> Optional[Graphed]:
    """The graphed callable behind ``obj`` (itself, or a module whose forward it is)."""
    if isinstance(obj, Graphed):
        return obj
    if isinstance(obj, torch.nn.Module):
        forward = obj.__dict__.get("forward")
        if isinstance(forward, Graphed):
            return forward
    return None


def graphed_callables_in(objects: Any) -> list[tuple[Any, Optional[Graphed]]]:
    """Each object of ``objects`` (nested tuples and lists opened, in order) with the graphed
    callable behind it, or None: what ``reset()`` and ``verify()`` check whole before they
    act on any."""
    found: list[tuple[Any, Optional[Graphed]]] = []
    pending = list(objects)
    while pending:
        obj = pending.pop(0)
        if isinstance(obj, (tuple, list)):
            pending[:0] = list(obj)
        else:
            found.append((obj, graphed_callable_of(obj)))
    return found


class ProcessResources:
    """What te_graph keeps for the life of the process, and its teardown."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        # Keyed by identity (a plain WeakKeyDictionary would compare tensors with ``==``).
        self._grad_buffers = WeakIdKeyDictionary()
        self._callables: "weakref.WeakSet[Graphed]" = weakref.WeakSet()
        self._per_device: dict[tuple[str, int], Any] = {}
        self._pool_states: "weakref.WeakValueDictionary[Any, Any]" = weakref.WeakValueDictionary()
        self._leases: "weakref.WeakValueDictionary[Any, PoolLease]" = weakref.WeakValueDictionary()
        self._given_pools: dict[Any, PoolLease] = {}  # handles the user passed: kept until teardown

    def pool_state(self, pool: Any, make: Callable[[], Any]) -> Any:
        """What the graphs captured into ``pool`` (a pool handle) share, made by ``make`` at
        first need and held as long as a graph holds it."""
        state = self._pool_states.get(pool)
        if state is None:
            state = self._pool_states[pool] = make()
        return state

    def pool_lease(self, handle: tuple[int, int], given: bool) -> PoolLease:
        """The lease on pool ``handle`` (``PoolLease``), kept for the process where the user
        passed the handle (``given``) and can pass it again."""
        lease = self._leases.get(handle)
        if lease is None:
            lease = self._leases[handle] = PoolLease(handle, self.capture_stream())
        if given:
            self._given_pools[handle] = lease
        return lease

    def capture_stream(self) -> "torch.cuda.Stream":
        """The side stream of the current device for every warmup and capture."""
        device = torch.cuda.current_device()
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def grad_buffer(self, param: torch.Tensor) -> torch.Tensor:
        """The persistent buffer ``param``'s gradient is accumulated into by every graph."""
        ref = self._grad_buffers.get(param)
        buffer = ref() if ref is not None else None
        if buffer is None:
            # A quantized weight's gradient is a plain tensor of its nominal dtype.
            plain = type(param) in (torch.Tensor, torch.nn.Parameter)
            buffer = torch.zeros_like(param) if plain else torch.zeros(param.shape, dtype=param.dtype, device=param.device)
            self._grad_buffers[param] = weakref.ref(buffer)
        return buffer

    def per_device(self, key: str, make: Callable[[], Any]) -> Any:
        """The current device's object named ``key``, made by ``make`` at first need; its
        ``reset()`` runs at teardown."""
        slot = (key, torch.cuda.current_device())
        if slot not in self._per_device:
            self._per_device[slot] = make()
        return self._per_device[slot]

    def add_callable(self, graphed: Graphed) -> None:
        """Track a graphed callable for ``teardown`` (weakly: it keeps nothing alive)."""
        self._callables.add(graphed)

    def live_callables(self) -> Iterator[Graphed]:
        return iter(list(self._callables))

    def parameters_in_graphs(self) -> frozenset:
        """Ids of the parameters whose gradients live graphs may add to ``.grad`` without
        autograd: a later call graphing one of them treats it as a tied weight."""
        return frozenset(id(p) for graphed in self.live_callables() for p in graphed.accumulated_parameters())

    def static_input_storages(self) -> set:
        """``(device, storage address)`` of every live graph's static inputs: a later call's
        sample in one of them gets a buffer of its own (``intake.specs.SampleMemory``)."""
        return {(t.device, t.untyped_storage().data_ptr()) for graphed in self.live_callables()
                for t in graphed.static_inputs() if t.numel()}

    def share_parameters(self, new: Iterable[Graphed], ids: set) -> None:
        """Graphs made earlier than ``new`` whose parameter gradients they add to ``.grad``
        themselves hand those of the parameters ``ids`` to autograd from now on."""
        made = {id(g) for g in new}
        for graphed in self.live_callables():
            if id(graphed) not in made:
                graphed.share_parameters(ids)

    def teardown(self) -> None:
        """Free every graphed callable's graphs and buffers and the per-device objects, and
        forget the streams, pool leases and gradient buffers (later captures make new ones)."""
        for graphed in self.live_callables():
            graphed.reset()
        for owned in self._per_device.values():
            owned.reset()
        self._per_device = {}
        self._pool_states = weakref.WeakValueDictionary()
        for lease in self._given_pools.values():
            lease.release()
        self._given_pools = {}
        self._leases = weakref.WeakValueDictionary()
        self._callables = weakref.WeakSet()
        self._streams = {}
        self._grad_buffers = WeakIdKeyDictionary()


RESOURCES = ProcessResources()
