"""What conditional nodes keep for the process, and how bodies allocate in the graph's pool.

* Per device, one :class:`DeviceRuntime` (held by ``te_graph.resources.RESOURCES``, reset by
  its teardown and by :func:`teardown`): the loaded set kernel, and the stream every body is
  captured on. The stream is made by the driver, so torch's stream pool never hands it out as
  a capture stream, and its cuBLAS workspace is made once, outside any body, by a warm-up.
* :func:`route_to_pool`: the allocator route of a capture that holds a conditional node.
* :func:`capture_pool`: the pool of the capture under way, which te_graph's capture names
  (:func:`capturing_into`) for nodes made deep inside the code it captures.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator, Optional

import torch

from ...resources import RESOURCES
from . import driver

__all__ = ["DeviceRuntime", "runtime", "prepare", "teardown", "route_to_pool", "routing_available",
           "capturing_into", "capture_pool", "backward_retaining", "retains_graph"]

_lock = threading.Lock()
_runtimes: "weakref.WeakSet[DeviceRuntime]" = weakref.WeakSet()


class DeviceRuntime:
    """The set kernel and the body stream of one device, made at first need."""

    def __init__(self, device: int):
        self.device = device
        self._kernel: Optional[driver.SetKernel] = None
        self._stream: Optional[torch.cuda.ExternalStream] = None
        self._raw_stream = 0

    def kernel(self, source: Optional[str] = None) -> driver.SetKernel:
        """The loaded set kernel (``source``: "nvrtc" or "ptx" forces one, for tests)."""
        with _lock:
            if self._kernel is not None and source not in (None, self._kernel.origin):
                self._kernel.unload()
                self._kernel = None
            if self._kernel is None:
                major, minor = torch.cuda.get_device_capability(self.device)
                with torch.cuda.device(self.device):
                    _context_current(self.device)
                    self._kernel = driver.SetKernel(f"{major}{minor}", source)
            return self._kernel

    def stream(self) -> torch.cuda.ExternalStream:
        """The stream bodies are captured on, its cuBLAS workspaces made (default pool)."""
        with _lock:
            if self._stream is None:
                with torch.cuda.device(self.device):
                    _context_current(self.device)
                    self._raw_stream = driver.create_stream()
                    self._stream = torch.cuda.ExternalStream(self._raw_stream, device=self.device)
                    _warm_up(self._stream)
            return self._stream

    def ready(self, source: Optional[str] = None) -> bool:
        """Whether the kernel (from ``source`` where given) and the stream exist: making them needs
        work outside any capture (``prepare``)."""
        kernel = self._kernel
        return self._stream is not None and kernel is not None and source in (None, kernel.origin)

    def reset(self) -> None:
        """Unload the kernel and destroy the stream (later bodies make new ones). No graph that
        holds a conditional node of this device may replay afterwards: its set kernel is gone."""
        with _lock:
            kernel, self._kernel = self._kernel, None
            stream, self._stream, raw, self._raw_stream = self._stream, None, self._raw_stream, 0
        if kernel is not None:
            kernel.unload()
        if stream is not None:
            stream.synchronize()
            driver.destroy_stream(raw)


def _context_current(device: int) -> None:
    """torch's primary context of ``device`` current on this thread, which the driver calls need:
    torch makes it at its first CUDA work, so a process whose first CUDA call is ``prepare()``
    has none yet (cuStreamCreate: CUDA_ERROR_INVALID_CONTEXT). A device synchronize makes it;
    the runtime is prepared outside any capture."""
    torch.cuda.synchronize(device)


def _warm_up(stream: torch.cuda.ExternalStream) -> None:
    """cuBLAS makes a workspace per (handle, stream) at the first matmul on a stream and keeps it
    for the process: made inside a body, it would be a block of the graph's pool that outlives
    the graph. A matmul per common dtype makes them here, eagerly (the stream is not capturing)."""
    with torch.cuda.stream(stream):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a = torch.ones(8, 8, device=stream.device, dtype=dtype)
            torch.mm(a, a)
            torch.addmm(a, a, a)


def runtime(device: Optional[int] = None) -> DeviceRuntime:
    """The runtime of ``device`` (the current device by default)."""
    device = torch.cuda.current_device() if device is None else device
    with torch.cuda.device(device):
        owned = RESOURCES.per_device("conditional-nodes", lambda: DeviceRuntime(device))
    _runtimes.add(owned)
    return owned


def prepare(device: Optional[int] = None, kernel_source: Optional[str] = None) -> str:
    """Load the set kernel and make the body stream of ``device``, outside any capture: needed
    once per device (and after ``teardown``) before capturing a conditional node, because
    warming the stream up launches work a capture refuses. Returns where the kernel came from:
    "nvrtc" or "ptx"."""
    owned = runtime(device)
    owned.stream()
    return owned.kernel(kernel_source).origin


def teardown() -> None:
    """Reset every device's runtime (``te_graph.reset()`` does too); free the graphs that hold
    conditional nodes first."""
    for owned in list(_runtimes):
        owned.reset()


# -- allocation in the graph's pool ---------------------------------------------------------------
# torch 2.4-2.13 (checked on 2.11): the capture's pool route, installed by ``capture_begin``,
# takes the allocations of streams capturing with the capture's own id only. A body is captured
# by another stream under another capture id, so its temporaries would come from the default
# pool, and replays would write into blocks the allocator hands out to others after the
# capture. torch's own IF nodes (pytorch/pytorch#168912) route bodies with a child filter that
# Python cannot reach. So, at the capture's first conditional node, the route is replaced by one
# that takes every allocation on the device (``_cuda_beginAllocateToPool``), until
# ``capture_end`` ends it by the pool's id as it would have ended torch's. The one route a pool
# may have is why it is replaced, not added to. Allocations of other threads during the rest of
# that capture go to the pool too.
_END_ROUTE = ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")  # the later, older name


def routing_available() -> bool:
    names = ("_cuda_beginAllocateToPool", "_cuda_releasePool")
    return all(hasattr(torch._C, n) for n in names) and any(hasattr(torch._C, n) for n in _END_ROUTE)


def route_to_pool(device: int, pool: Any) -> None:
    """Route every allocation on ``device`` to ``pool`` until the capture into it ends (again
    at each conditional node: the same route). Raises ValueError, changing nothing, where
    ``pool`` is not the pool of a capture under way."""
    pool = tuple(pool)
    end = next(getattr(torch._C, n) for n in _END_ROUTE if hasattr(torch._C, n))
    try:
        end(device, pool)
    except RuntimeError as error:
        raise ValueError(
            f"pool={pool} is not the memory pool of the capture under way: pass the pool given to "
            "torch.cuda.graph(..., pool=) (a torch.cuda.graph_pool_handle()) or to capture_begin(pool=)"
        ) from error
    torch._C._cuda_beginAllocateToPool(device, pool)
    torch._C._cuda_releasePool(device, pool)  # begin took a use of the pool; the capture holds one already


# -- the pool of the capture under way ------------------------------------------------------------
# A node made inside code te_graph captures (a layer's forward, or its backward on autograd's
# worker thread) cannot be handed the pool by its caller: te_graph's capture names it here, per
# device, for as long as it captures. torch >= 2.12 names its own current capture.
_capture_pools: dict[int, Any] = {}


@contextlib.contextmanager
def capturing_into(pool: Any) -> Iterator[None]:
    """While te_graph captures into ``pool`` on the current device: :func:`capture_pool` names it."""
    device = torch.cuda.current_device()
    previous = _capture_pools.get(device)
    _capture_pools[device] = pool
    try:
        yield
    finally:
        if previous is None:
            _capture_pools.pop(device, None)
        else:
            _capture_pools[device] = previous


def capture_pool() -> Any:
    """The memory pool of the capture under way on the current device: te_graph's, else torch's
    own current capture's where torch names it (``CUDAGraph.get_currently_capturing_graph``);
    None where neither is known."""
    pool = _capture_pools.get(torch.cuda.current_device())
    if pool is not None:
        return pool
    current = getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None)
    if current is None:
        return None
    try:
        return current().pool()
    except RuntimeError:
        return None


# -- whether the backward under way keeps its graph --------------------------------------------------
# torch tells a custom autograd Function's backward nothing of retain_graph; a switched node
# keeps its programs' graphs for a second backward only where te_graph runs one that retains
# (``retain_graph_in_backward``): its capture and its eager replay say so here. Process-wide:
# the backward runs on autograd's worker thread.
_retaining = [0]


@contextlib.contextmanager
def backward_retaining(retain: bool) -> Iterator[None]:
    """While a backward that keeps its graph (``retain``) runs: :func:`retains_graph` is True."""
    if not retain:
        yield
        return
    _retaining[0] += 1
    try:
        yield
    finally:
        _retaining[0] -= 1


def retains_graph() -> bool:
    """Whether te_graph runs a backward that keeps its graph now (:func:`backward_retaining`)."""
    return _retaining[0] > 0
