"""Host waits inside a capture: refused by name, in the user's terms.

A graph replays GPU work only. A graphed callable that waits for the GPU from the host
(``.item()``, ``.cpu()``, ``.tolist()``, ``nonzero``, a boolean mask, an event's
``synchronize()``) reads on the host a value that no replay would refresh: megatron-core's
dropless MoE dispatch brings its per-expert token counts and all-to-all split sizes to the
host that way. CUDA refuses such a wait during capture, with errors that name neither the
wait nor the line ("operation not permitted on an event last recorded in a capturing
stream"). So, while each graph is captured:

* the host waits torch's synchronisation hooks miss (``torch.cuda.Event.synchronize``,
  ``torch.cuda.synchronize``, ``torch.accelerator.synchronize``; and
  ``torch.cuda.Stream.synchronize``, to name it) raise :class:`HostSyncError` before CUDA
  sees them where the current stream captures (the capturing thread, and autograd's worker
  while it runs a captured backward; other threads are not touched), and a refusal the
  callable caught is raised again when the capture ends;
* CUDA's own capture errors (from ``.item()`` and the other implicit waits) become a
  :class:`HostSyncError` that names the line.

The decision is made under the real capture, never in warmup: code that skips its host
read while ``torch.cuda.is_current_stream_capturing()`` is then never refused. torch's
``set_sync_debug_mode("error")`` would catch the implicit waits before CUDA too, but it is
one setting for the whole process (a data-loader or logging thread's ``.item()`` would fail
during the capture), so it is left alone. Eager replay captures nothing and refuses nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
import traceback
from typing import Any, Callable, Iterator, Optional

import torch

from checkpointing.recompute_state import cuda_stream_capturing

__all__ = ["HostSyncError", "waits_refused", "refusal_of"]


class HostSyncError(RuntimeError):
    """A graphed callable waits for the GPU from the host while it is captured."""

    def __init__(self, message: str, wait: Optional[tuple] = None):
        super().__init__(message)
        # A refusal raised where the graph's name is not known (autograd's worker thread runs
        # a captured backward outside the capturing thread's context): (op, frames), for
        # ``refusal_of`` to tell again with the name.
        self.unnamed_wait = wait


# The host waits refused by name: (owner, attribute, how the message names it).
_WAITS = (
    ("torch.cuda.Event", "synchronize", "torch.cuda.Event.synchronize()"),
    ("torch.cuda.Stream", "synchronize", "torch.cuda.Stream.synchronize()"),
    ("torch.cuda", "synchronize", "torch.cuda.synchronize()"),
    ("torch.accelerator", "synchronize", "torch.accelerator.synchronize()"),
)
# CUDA's stream-capture errors (cudaErrorStreamCaptureUnsupported, cudaErrorCapturedEvent,
# cudaErrorStreamCaptureInvalidated) and torch's refusal of a copy to host memory that is not
# pinned during capture: what an implicit host wait raises inside a capture. Other errors
# that mention capture (a generator's seed read, say) are not host waits and pass unchanged.
_CAPTURE_ERRORS = ("stream is capturing", "capturing stream", "during capture", "unless the CPU tensor is pinned")
# Where a frame is library code rather than the line that waits: torch, te_graph and its
# siblings, and the standard library's wrappers.
_LIBRARIES = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,) + tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), package) + os.sep
    for package in ("te_graph", "rng", "checkpointing")
)
_WRAPPERS = frozenset(os.path.abspath(m.__file__) for m in (contextlib, functools))


class _Refusals:
    """The one owner of the patched waits: installed while any capture window is open
    (counted, so overlapping windows of several threads neither stack patches nor take
    them away early), and the refusals they raised, so that a window whose body caught one
    and went on is refused when it closes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.windows = 0
        self.replaced: list[tuple[Any, str, Callable]] = []
        self.raised: list[HostSyncError] = []

    def open(self) -> int:
        with self.lock:
            if self.windows == 0:
                for where, attribute, label in _WAITS:
                    target = _resolve(where)
                    original = getattr(target, attribute, None) if target is not None else None
                    if original is not None:
                        setattr(target, attribute, self._refusing(original, label))
                        self.replaced.append((target, attribute, original))
            self.windows += 1
            return len(self.raised)

    def close(self) -> None:
        with self.lock:
            self.windows -= 1
            if self.windows == 0:
                for target, attribute, original in reversed(self.replaced):
                    setattr(target, attribute, original)
                self.replaced.clear()
                self.raised.clear()

    def _refusing(self, original: Callable, label: str) -> Callable:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            # Only a wait made while this thread's stream captures (the capturing thread, or
            # autograd's worker running a captured backward): other threads go through.
            if not cuda_stream_capturing():
                return original(*args, **kwargs)
            frames, name = traceback.extract_stack()[:-1], _NAME.get()
            error = HostSyncError(_message(name or "a graphed callable", label, frames, None),
                                  None if name else (label, frames))
            self.raised.append(error)
            raise error

        refuse.__wrapped__ = original
        return refuse


_REFUSALS = _Refusals()
# The graph being captured, for the message; unset on autograd's worker thread, where the
# refusal is named again when it reaches the capture (``refusal_of``).
_NAME: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("te_graph_capture_name", default=None)


@contextlib.contextmanager
def waits_refused(name: str) -> Iterator[None]:
    """While a graph of ``name`` is captured, a host wait named in ``_WAITS`` made where the
    current stream captures raises :class:`HostSyncError` before CUDA sees it (the capture
    stays valid); one the body caught and went on from is raised when the window closes."""
    token = _NAME.set(name)
    seen = _REFUSALS.open()
    try:
        yield
        caught = _REFUSALS.raised[seen:]
        if caught:
            raise caught[0]
    finally:
        _REFUSALS.close()
        _NAME.reset(token)


def refusal_of(name: str, error: BaseException) -> Optional[HostSyncError]:
    """The :class:`HostSyncError` that tells ``error`` (raised inside a capture of ``name``)
    in the user's terms, where it is CUDA refusing an operation during capture; else None."""
    if isinstance(error, HostSyncError):
        if error.unnamed_wait is None:
            return error
        op, frames = error.unnamed_wait
        return HostSyncError(_message(name, op, frames, None))
    text = str(error)
    if not isinstance(error, RuntimeError) or not any(marker in text for marker in _CAPTURE_ERRORS):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return HostSyncError(_message(
        name, f"an operation CUDA does not allow during capture ({first})",
        traceback.extract_tb(error.__traceback__),
        "Such an operation is most often a host wait (.item(), .cpu(), .tolist(), nonzero, a "
        "boolean mask, a copy to host memory that is not pinned)"))


def _message(name: str, op: str, frames: traceback.StackSummary, note: Optional[str]) -> str:
    site = _site(frames)
    megatron_moe = any("megatron/core/transformer/moe/" in f.filename.replace(os.sep, "/") for f in frames)
    if megatron_moe:
        way_out = (
            "megatron-core's MoE layers with dropless routing bring the per-expert token counts "
            "to the host: graph each layer up to token dispatch (cuda_graph_modules=['attn', "
            "'moe_router', 'moe_preprocess'] through its TECudaGraphHelper, with "
            "te_graph.integrations.megatron.enable()), so that dispatch and the experts run "
            "eagerly after the graph, or route with drop-and-pad (moe_expert_capacity_factor "
            "with moe_pad_expert_input_to_capacity=True), which has no host wait."
        )
    else:
        way_out = (
            "Graph the parts before and after it separately and run the part that reads on the "
            "host eagerly between them; or, where the graph does not need that read, skip it "
            "while torch.cuda.is_current_stream_capturing()."
        )
    return (
        f"make_graphed_callables: {name} waits for the GPU from the host while it is captured: "
        f"{op}{site}. {note + '. ' if note else ''}A graph replays GPU work only: that wait, and "
        "whatever the host reads after it (a count, a split size, a shape), would be frozen at "
        f"capture, so this callable cannot be graphed as it is. {way_out} The model and the "
        "process were left as they were."
    )


def _site(frames: traceback.StackSummary) -> str:
    """`` at file:line (`source`)``: the innermost frame outside torch and te_graph."""
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_LIBRARIES) and path not in _WRAPPERS and not frame.filename.startswith("<"):
            return f" at {_short(path)}:{frame.lineno} (`{(frame.line or '').strip()}`)"
    return ""


def _short(path: str) -> str:
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative


def _resolve(dotted: str) -> Optional[Any]:
    """``torch.cuda.Event`` and the like, or None where this torch has no such thing."""
    target: Any = torch
    for part in dotted.split(".")[1:]:
        target = getattr(target, part, None)
        if target is None:
            return None
    return target
