"""``switch`` and ``if_``: conditional nodes captured into the graph torch is capturing.

A conditional node is one node of the graph; at each replay the GPU chooses which of its
bodies runs (a SWITCH node: body ``index``, none where the index is out of range; an IF node:
its body where the flag is nonzero) from a value the graph computed itself, so the host never
waits for it. The index is read at its address at every replay: a tensor computed inside the
capture stays there; one from outside must live as long as the graph.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from checkpointing.recompute_state import cuda_stream_capturing

from . import driver, runtime
from .guards import ConditionalCaptureError, body_guard, collector_paused, in_body, pause_collector, resume_collector

__all__ = ["switch", "if_", "Switch", "Body", "native_if_available"]

_SWITCH_DTYPES = (torch.int64, torch.int32, torch.uint8)
_IF_DTYPES = (torch.bool, torch.uint8, torch.int32, torch.int64)
_MODES = ("thread_local", "global", "relaxed")


def native_if_available() -> bool:
    """Whether torch captures IF nodes itself (``CUDAGraph.begin_capture_to_if_node``,
    pytorch/pytorch#168912); ``if_`` prefers it where it is."""
    graph = getattr(torch.cuda, "CUDAGraph", None)
    return all(hasattr(graph, n) for n in ("get_currently_capturing_graph", "begin_capture_to_if_node",
                                           "end_capture_to_conditional_node"))


def _check_value(what: str, value: Any, dtypes: tuple, convert: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor of one element on the GPU, not {type(value).__name__}")
    if value.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{what} must have dtype {names}, not {str(value.dtype).replace('torch.', '')}; "
                        f"convert it inside the capture ({convert})")
    if value.numel() != 1:
        raise ValueError(f"{what} must have one element, not {value.numel()} (shape {tuple(value.shape)})")
    if value.device.type != "cuda":
        raise ValueError(f"{what} must be on a CUDA device (the GPU reads it at every replay), not {value.device}")


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"capture_error_mode must be one of {', '.join(_MODES)}, not {mode!r}")


def _check_capture(name: str, value: torch.Tensor) -> None:
    """Refusals of the state: before anything changes."""
    if in_body():
        raise ConditionalCaptureError(f"{name}: conditional nodes do not nest (this thread captures a body)")
    if value.device.index != torch.cuda.current_device():
        raise ValueError(f"{name}: the index is on {value.device}, the capture on cuda:{torch.cuda.current_device()}")
    if not cuda_stream_capturing():
        raise ConditionalCaptureError(
            f"{name}: no CUDA graph capture is under way on the current stream; use it inside "
            "torch.cuda.graph(g, pool=pool) (or between capture_begin and capture_end)")


class Body:
    """One body of a conditional node: ``with body:`` captures the torch ops of its block into it."""

    def __init__(self, node: "Switch", index: int, graph: Any):
        self._node, self.index, self._graph = node, index, graph
        self._used = False
        self._exit: Optional[contextlib.ExitStack] = None

    def __repr__(self) -> str:
        return f"body {self.index} of {self._node.name}"

    def __enter__(self) -> "Body":
        node = self._node
        if node._closed:
            raise ConditionalCaptureError(f"{self}: its conditional's with block has ended")
        if self._used:
            raise ConditionalCaptureError(f"{self} was captured already; each body is captured once")
        if node._open is not None:
            raise ConditionalCaptureError(f"{self}: {node._open} is still being captured")
        if torch.cuda.current_stream().cuda_stream != node._home.cuda_stream:
            raise ConditionalCaptureError(f"{self}: enter it on the stream the conditional was made on")
        stream = node._stream
        driver.begin_capture_to(stream.cuda_stream, self._graph, node.mode)
        self._used, node._open = True, self
        exit_stack = contextlib.ExitStack()
        try:
            exit_stack.enter_context(torch.cuda.stream(stream))
            exit_stack.enter_context(body_guard(str(self)))
        except BaseException:
            exit_stack.close()
            node._open = None
            driver.end_capture(stream.cuda_stream)
            raise
        self._exit = exit_stack
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        node, exit_stack, self._exit = self._node, self._exit, None
        try:
            exit_stack.close()  # the guards off, the capturing stream current again
        finally:
            node._open = None
            try:
                driver.end_capture(node._stream.cuda_stream)
            except RuntimeError as end_error:
                if error is None:
                    raise ConditionalCaptureError(
                        f"{self}: its capture failed ({end_error}); the work in the body is one a "
                        "conditional body cannot hold (a host wait, an event, another stream)") from end_error
                if hasattr(error, "add_note"):
                    error.add_note(f"te_graph: ending the capture of {self} then failed too: {end_error}")


class Switch:
    """A SWITCH node (or an IF node, ``size`` 1), made on entering its with block; its bodies
    (``switch[i]``, iteration) are captured inside that block, each at most once, in any order;
    a body never entered stays empty."""

    def __init__(self, value: torch.Tensor, n: int, pool: Any, kind: int, name: str, mode: str,
                 kernel_source: Optional[str] = None):
        self._value, self.n, self._pool, self._kind, self.name, self.mode = value, n, pool, kind, name, mode
        self._kernel_source = kernel_source
        self._bodies: list[Body] = []
        self._open: Optional[Body] = None
        self._closed = self._paused = False

    def __repr__(self) -> str:
        return self.name

    def __enter__(self) -> "Switch":
        value, name = self._value, self.name
        _check_capture(name, value)
        if self._pool is None:
            raise ConditionalCaptureError(
                f"{name}: pass pool=, the memory pool of the capture under way (torch.cuda.graph(g, pool=pool)); "
                "the bodies' temporaries must live in it")
        if not runtime.routing_available():
            raise ConditionalCaptureError(
                f"{name}: torch {torch.__version__} lacks the allocator calls that route a body's "
                "allocations to the graph's pool (torch._C._cuda_beginAllocateToPool)")
        driver.bindings()  # ImportError naming the pip extra, before anything changes
        device = torch.cuda.current_device()
        owned = runtime.runtime(device)
        if not owned.ready(self._kernel_source):
            raise ConditionalCaptureError(
                f"{name}: call te_graph.capture.conditional.prepare() before the capture (once per device, "
                "and again after teardown()): it loads the set kernel and warms up the body stream, work "
                "a capture refuses")
        self._stream, kernel = owned.stream(), owned.kernel(self._kernel_source)
        self._home = torch.cuda.current_stream()
        home = self._home.cuda_stream
        if driver.capture_info(home) is None:
            raise ConditionalCaptureError(f"{name}: the current stream is not capturing")
        runtime.route_to_pool(device, self._pool)  # ValueError for a pool not being captured into
        pause_collector()  # until __exit__: no graph of an earlier capture freed while this node is captured
        try:
            context = driver.context_of(home)
            default = 0 if self._kind == driver.IF else self.n
            handle = driver.create_handle(driver.capture_info(home).graph, context, default)
            kernel.launch(home, handle, value.data_ptr(), value.element_size(), self.n, self._kind == driver.IF)
            node, graphs = driver.add_conditional(driver.capture_info(home), context, handle, self._kind, self.n)
            driver.continue_after(home, node)
            self._bodies = [Body(self, i, g) for i, g in enumerate(graphs)]
        except BaseException:
            resume_collector()
            raise
        self._paused = True
        return self

    def __exit__(self, *raised: Any) -> None:
        self._closed = True
        if self._paused:
            self._paused = False
            resume_collector()

    def __len__(self) -> int:
        return len(self._bodies)

    def __getitem__(self, i: int) -> Body:
        if not self._bodies:
            raise ConditionalCaptureError(f"{self.name}: its bodies exist inside its with block")
        return self._bodies[i]

    def __iter__(self) -> Iterator[Body]:
        self[0]  # the refusal outside the with block
        return iter(list(self._bodies))


def switch(index: torch.Tensor, n: int, *, pool: Any = None, capture_error_mode: str = "thread_local",
           kernel_source: Optional[str] = None) -> Switch:
    """A SWITCH node with ``n`` bodies in the graph being captured: at each replay body ``index``
    runs, none where ``index`` is outside ``[0, n)``. ``index``: a CUDA tensor of one integer
    element (int64, int32, uint8); ``pool``: the capture's memory pool, where the bodies'
    temporaries go. Use ``with switch(i, n, pool=p) as bodies:`` then ``with bodies[k]: ...``.
    ``capture_error_mode``: the bodies' capture mode; ``kernel_source``: "nvrtc" or "ptx" forces
    how the set kernel is built (tests)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"switch: n, the number of bodies, must be an int, not {type(n).__name__}")
    if n < 1:
        raise ValueError(f"switch: n, the number of bodies, must be at least 1, not {n}")
    _check_mode(capture_error_mode)
    _check_value("switch: index", index, _SWITCH_DTYPES, "index.to(torch.int32)")
    return Switch(index, n, pool, driver.SWITCH, f"switch over {n} bodies", capture_error_mode, kernel_source)


@contextlib.contextmanager
def if_(flag: torch.Tensor, *, pool: Any = None, capture_error_mode: str = "thread_local",
        native: Optional[bool] = None, kernel_source: Optional[str] = None) -> Iterator[None]:
    """``with if_(flag, pool=p): ...``: an IF node in the graph being captured, its body the block,
    run at each replay where ``flag`` (a CUDA tensor of one bool or integer element) is nonzero.
    ``native``: torch's own IF node (None: where torch has it, ``native_if_available``; it needs
    no ``pool``); False: the cuda-bindings node."""
    _check_mode(capture_error_mode)
    _check_value("if_: flag", flag, _IF_DTYPES, "flag != 0")
    use_native = native_if_available() if native is None else native
    if use_native and not native_if_available():
        raise ConditionalCaptureError(f"if_: torch {torch.__version__} has no IF nodes of its own; pass native=False")
    if not use_native:
        with Switch(flag, 1, pool, driver.IF, "if_", capture_error_mode, kernel_source) as node:
            with node[0]:
                yield
        return
    _check_capture("if_", flag)
    graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    predicate = flag.reshape(()) if flag.dtype == torch.bool else flag.reshape(()) != 0
    with collector_paused():
        graph.begin_capture_to_if_node(predicate)
        try:
            with body_guard("the body of if_"):
                yield
        finally:
            graph.end_capture_to_conditional_node()
