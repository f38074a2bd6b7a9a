"""What a conditional body refuses, by name, before CUDA or torch sees it.

* **Random numbers.** A body that draws from a generator advances it only in the replays that
  run the body, but a captured draw reserves its offsets at every replay: the graph's random
  streams would part from eager's. torch refuses RNG in its own IF nodes too
  (pytorch/pytorch#175001). Seen as aten ops tagged ``nondeterministic_seeded``.
* **Collectives.** NCCL's captured work waits on events, which conditional bodies cannot hold
  (pytorch/pytorch#180960), and every rank would have to take the same body. Seen as ops of
  the ``c10d`` namespaces.
* **Events and stream waits** (``torch.cuda.Event.record``/``wait``, ``Stream.wait_event``,
  ``wait_stream``, ``record_event``): a stream forked into a body would allocate outside the
  graph's pool and must join the body again before it ends.
* **Host waits** (``.item()``, ``.cpu()``, ``nonzero``, a boolean mask, ``repeat_interleave``
  without ``output_size``, ``Event``/``Stream.synchronize``): CUDA invalidates the body's
  capture, and on torch 2.11 + CUDA 13.0 the process then died (measured 2026-11-29, H200).

Kernels that draw random numbers, launch NCCL or wait for the GPU below torch's dispatcher (an
extension's own C++ calls) are not seen: keep them outside the bodies.

**Automatic garbage collection** is paused while a node is captured (:func:`pause_collector`):
a collection there may free a graph of an earlier capture that only a reference cycle kept.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import threading
from typing import Any, Iterator, Optional

import torch

from ... import compat

__all__ = ["ConditionalCaptureError", "body_guard", "in_body", "pause_collector", "resume_collector",
           "collector_paused"]

_COLLECTIVES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")
_STREAM_CALLS = (("Event", "record"), ("Event", "wait"), ("Stream", "wait_event"), ("Stream", "wait_stream"),
                 ("Stream", "record_event"), ("Event", "synchronize"), ("Stream", "synchronize"))
_WAITING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique_consecutive", "_unique", "_unique2",
                "unique_dim")  # aten ops that bring a value or a size to the host
_INDEXING = ("index", "index_put", "index_put_", "_index_put_impl_")


class ConditionalCaptureError(RuntimeError):
    """A conditional node cannot be captured here, or its body does what a body cannot."""


_local = threading.local()


def _host_wait(func: Any, args: tuple, kwargs: dict) -> Optional[str]:
    """How ``func`` would wait for the GPU from the host, or None."""
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else ""
    if getattr(func, "namespace", "") != "aten":
        return None
    if name in _WAITING_OPS:
        return f"{func} brings a value to the host"
    tensor_repeats = getattr(func, "_overloadname", "") in ("Tensor", "self_Tensor")
    if name == "repeat_interleave" and tensor_repeats and kwargs.get("output_size") is None:
        return f"{func} without output_size reads the repeats on the host"
    if name in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ()):
            return f"{func} with a boolean mask counts the mask on the host"
    if name == "_to_copy" and torch.device(kwargs.get("device") or "cuda").type == "cpu":
        return f"{func} copies to the CPU"
    if name == "copy_" and len(args) > 1 and args[0].device.type == "cpu" and args[1].device.type == "cuda" \
            and not args[0].is_pinned():
        return f"{func} copies into pageable CPU memory"
    return None


def in_body() -> bool:
    """Whether this thread is capturing a conditional body."""
    return getattr(_local, "body", None) is not None


class _BodyOps(compat.TorchDispatchMode):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if compat.draws_random(func):
            raise ConditionalCaptureError(
                f"{self.name}: {func} draws random numbers inside a conditional body; a captured draw "
                "advances the generator at every replay, whether the body runs or not, so the graph's "
                "random numbers would part from eager's. Draw outside the conditional (before it, into a "
                "tensor the body reads) or keep dropout out of the body.")
        wait = _host_wait(func, args, kwargs or {})
        if wait is not None:
            raise ConditionalCaptureError(
                f"{self.name}: {wait}: a host wait inside a conditional body (a graph replays GPU work "
                "only, and CUDA invalidates the body's capture). Compute on the GPU, or move the read "
                "before the graph.")
        if getattr(func, "namespace", "") in _COLLECTIVES:
            raise ConditionalCaptureError(
                f"{self.name}: {func} is a collective inside a conditional body; CUDA cannot run NCCL's "
                "captured work in a body, and every rank would have to take the same body. Run the "
                "collective before or after the conditional node.")
        return func(*args, **(kwargs or {}))


def _refused(owner: str, name: str, original: Any) -> Any:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        body = getattr(_local, "body", None)
        if body is not None:
            raise ConditionalCaptureError(
                f"{body}: torch.cuda.{owner}.{name}() inside a conditional body; a stream forked into a "
                "body would allocate outside the graph's pool, events cannot cross into a body, and the "
                "host cannot wait in one. Keep the body on the stream it is captured on (record or wait "
                "outside the conditional).")
        return original(*args, **kwargs)
    return call


_patched = 0
_patch_lock = threading.Lock()
_saved: list = []  # (class, name, its own attribute or None) while installed


@contextlib.contextmanager
def _stream_calls_refused() -> Iterator[None]:
    """The event and stream-wait methods refuse on threads that capture a body (other threads
    pass through), installed while any thread captures one."""
    global _patched
    with _patch_lock:
        if _patched == 0:
            for owner, name in _STREAM_CALLS:
                cls = getattr(torch.cuda, owner)
                _saved.append((cls, name, cls.__dict__.get(name)))
                setattr(cls, name, _refused(owner, name, getattr(cls, name)))
        _patched += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patched -= 1
            if _patched == 0:
                while _saved:
                    cls, name, own = _saved.pop()
                    if own is None:  # inherited: the base's method shows again
                        delattr(cls, name)
                    else:
                        setattr(cls, name, own)


@contextlib.contextmanager
def body_guard(name: str) -> Iterator[None]:
    """Refuse, while this thread captures the body ``name``, what a body cannot do."""
    if in_body():
        raise ConditionalCaptureError(
            f"{name}: conditional nodes do not nest; {_local.body} is still being captured on this thread")
    _local.body = name
    try:
        with _stream_calls_refused(), _BodyOps(name):
            yield
    finally:
        _local.body = None


# -- the cyclic garbage collector -------------------------------------------------------------------
_collector_lock = threading.Lock()
_collector_pauses = 0
_collector_was_enabled = False


def pause_collector() -> None:
    """Stop automatic collections until the matching :func:`resume_collector` (counted across
    threads and nodes; the collector is process-wide). Python may collect at any allocation;
    one inside a body can free a ``torch.cuda.CUDAGraph`` of an earlier capture that only a
    reference cycle kept (an exception's traceback keeps its frame's graph), so its executable
    graph is destroyed inside the body's capture, the suspected cause of a crash in torch's
    ``capture_end`` (docs/conditional-nodes.md, Failures): a body capture invalidated by a
    driver call makes the CUDA 13.0 driver crash when the capture ends (NVIDIA/cuda-python#2918).
    Garbage found meanwhile waits for the next collection after the node; an explicit
    ``gc.collect()`` in a body is not stopped."""
    global _collector_pauses, _collector_was_enabled
    with _collector_lock:
        if _collector_pauses == 0:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _collector_pauses += 1


def resume_collector() -> None:
    """End one :func:`pause_collector`; the last one enables the collector where it was enabled."""
    global _collector_pauses
    with _collector_lock:
        _collector_pauses -= 1
        if _collector_pauses == 0 and _collector_was_enabled:
            gc.enable()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic garbage collection inside the block (:func:`pause_collector`)."""
    pause_collector()
    try:
        yield
    finally:
        resume_collector()
