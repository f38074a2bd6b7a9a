"""The CUDA driver calls of conditional nodes, through ``cuda-bindings`` (imported on first use).

Per conditional node, inside a stream capture (CUDA >= 12.4 driver):

1. the graph being captured (``cuStreamGetCaptureInfo`` on the capturing stream);
2. a conditional handle in it (``cuGraphConditionalHandleCreate``, reset to its default at
   every launch of the graph);
3. a one-thread kernel captured on that stream, which reads the index from device memory
   and sets the handle (``cudaGraphSetConditional``, a device-side builtin);
4. the conditional node, after what the stream captured so far (``cuGraphAddNode``); CUDA
   makes its body graphs;
5. the stream's capture continues after the node (``cuStreamUpdateCaptureDependencies``);
6. each body is captured by another stream into its body graph (``cuStreamBeginCaptureToGraph``
   ... ``cuStreamEndCapture``).

The set kernel is compiled by NVRTC for the device; where NVRTC is missing or emits PTX newer
than the driver takes, a hand-written PTX of the same kernel (ISA 8.0) is loaded instead.
Both signatures of the CUDA 12 and CUDA 13 bindings (with and without edge data) are taken.
"""
from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Optional

__all__ = ["EXTRA", "bindings", "check", "CaptureInfo", "capture_info", "add_conditional", "continue_after",
           "begin_capture_to", "end_capture", "SetKernel", "create_stream", "destroy_stream", "SWITCH", "IF"]

EXTRA = "pip install 'te-graph[conditional]' (the cuda-bindings package, matching the CUDA driver)"
IF, SWITCH = 0, 2  # CUgraphConditionalNodeType
_ASSIGN_DEFAULT = 1  # CU_GRAPH_COND_ASSIGN_DEFAULT: the handle takes its default at every graph launch
_SET_DEPENDENCIES = 1  # CU_STREAM_SET_CAPTURE_DEPENDENCIES
_CAPTURE_ACTIVE = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING
_MODES = {"global": 0, "thread_local": 1, "relaxed": 2}  # CUstreamCaptureMode

_modules: Optional[tuple] = None


def bindings() -> tuple:
    """``(driver, nvrtc)`` of cuda-bindings (the ``cuda.bindings`` layout of cuda-python >= 12.6,
    else the older ``cuda.cuda``); an ImportError naming the pip extra where it is missing."""
    global _modules
    if _modules is None:
        try:
            from cuda.bindings import driver, nvrtc  # noqa: PLC0415 - optional dependency
        except ImportError:
            try:
                from cuda import cuda as driver, nvrtc  # noqa: PLC0415 - cuda-python < 12.6
            except ImportError as error:
                raise ImportError(
                    f"te_graph.capture.conditional needs cuda-bindings, which is not installed: {EXTRA}"
                ) from error
        _modules = (driver, nvrtc)
    return _modules


def check(result: Any, what: str) -> Any:
    """A cuda-bindings result ``(error, outputs...)``: raise on an error; None, the one output,
    or a tuple of the outputs."""
    result = result if isinstance(result, tuple) else (result,)
    if int(result[0]) != 0:
        name = getattr(result[0], "name", str(result[0]))
        raise RuntimeError(f"{what} failed: {name} ({int(result[0])})")
    return None if len(result) == 1 else (result[1] if len(result) == 2 else result[1:])


class CaptureInfo:
    """What a capturing stream captures into: the graph, the nodes the next one will follow,
    and their edge data (None where every edge is a plain one)."""

    __slots__ = ("graph", "dependencies", "edges")

    def __init__(self, graph: Any, dependencies: list, edges: Optional[list]):
        self.graph, self.dependencies, self.edges = graph, dependencies, edges


def capture_info(stream: int) -> Optional[CaptureInfo]:
    """The capture under way on ``stream`` (a raw stream handle), None where it captures nothing."""
    driver, _ = bindings()
    result = driver.cuStreamGetCaptureInfo(driver.CUstream(stream))
    out = check(result, "cuStreamGetCaptureInfo")
    # CUDA 13 bindings: status, id, graph, dependencies, edge data, count; CUDA 12: no edge data.
    status, _, graph, deps, edges, count = out if len(result) == 7 else (*out[:4], None, out[4])
    if int(status) != _CAPTURE_ACTIVE:
        return None
    copied = []  # the driver's edge array is valid only until the next call on the stream
    for edge in list(edges or [])[:count]:
        copy = type(edge)()
        copy.from_port, copy.to_port, copy.type = edge.from_port, edge.to_port, edge.type
        copied.append(copy)
    plain = all(not (int(e.type) or e.from_port or e.to_port) for e in copied)
    return CaptureInfo(graph, list(deps or [])[:count], None if plain else copied)


def context_of(stream: int) -> Any:
    """The CUDA context ``stream`` belongs to (torch's primary context of its device)."""
    driver, _ = bindings()
    try:
        return check(driver.cuStreamGetCtx(driver.CUstream(stream)), "cuStreamGetCtx")
    except RuntimeError:
        return check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")


def create_handle(graph: Any, context: Any, default: int) -> Any:
    driver, _ = bindings()
    return check(driver.cuGraphConditionalHandleCreate(graph, context, default, _ASSIGN_DEFAULT),
                 "cuGraphConditionalHandleCreate")


def add_conditional(info: CaptureInfo, context: Any, handle: Any, kind: int, size: int) -> tuple[Any, list]:
    """Add a conditional node of ``kind`` with ``size`` bodies after ``info``'s dependencies:
    ``(node, body graphs)``; the body graphs belong to the node."""
    driver, _ = bindings()
    params = driver.CUgraphNodeParams()
    params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    params.conditional.type = driver.CUgraphConditionalNodeType(kind)
    params.conditional.ctx = context
    params.conditional.handle, params.conditional.size = handle, size
    deps = info.dependencies
    try:
        node = check(driver.cuGraphAddNode(info.graph, deps, info.edges, len(deps), params), "cuGraphAddNode")
    except TypeError:  # the CUDA 12 bindings: no edge data
        node = check(driver.cuGraphAddNode(info.graph, deps, len(deps), params), "cuGraphAddNode")
    return node, list(params.conditional.phGraph_out)[:size]


def continue_after(stream: int, node: Any) -> None:
    """``stream``'s capture continues after ``node`` alone."""
    driver, _ = bindings()
    try:
        check(driver.cuStreamUpdateCaptureDependencies(driver.CUstream(stream), [node], None, 1, _SET_DEPENDENCIES),
              "cuStreamUpdateCaptureDependencies")
    except TypeError:  # the CUDA 12 bindings: no edge data
        check(driver.cuStreamUpdateCaptureDependencies(driver.CUstream(stream), [node], 1, _SET_DEPENDENCIES),
              "cuStreamUpdateCaptureDependencies")


def begin_capture_to(stream: int, graph: Any, mode: str) -> None:
    """``stream`` captures into ``graph`` (a body graph of a conditional node)."""
    driver, _ = bindings()
    check(driver.cuStreamBeginCaptureToGraph(driver.CUstream(stream), graph, None, None, 0,
                                             driver.CUstreamCaptureMode(_MODES[mode])),
          "cuStreamBeginCaptureToGraph")


def end_capture(stream: int) -> None:
    """End ``stream``'s capture (into a body graph, which its node owns)."""
    driver, _ = bindings()
    check(driver.cuStreamEndCapture(driver.CUstream(stream)), "cuStreamEndCapture")


def create_stream() -> int:
    """A new non-blocking stream of the current context (raw handle): never one torch's stream
    pool hands out again, so never the stream a capture runs on."""
    driver, _ = bindings()
    return int(check(driver.cuStreamCreate(_NON_BLOCKING), "cuStreamCreate"))


def destroy_stream(stream: int) -> None:
    driver, _ = bindings()
    check(driver.cuStreamDestroy(driver.CUstream(stream)), "cuStreamDestroy")


# -- the set kernel ----------------------------------------------------------------------------------
# set(handle, index, bytes, n, is_if): reads the index (8-byte signed, 4-byte signed, or 1-byte
# unsigned: bool, uint8) and sets the handle: an IF node's 1 (index != 0) or 0; a SWITCH node's
# index where 0 <= index < n, else n (no body runs).
_NAME = b"te_graph_set_conditional"
_SOURCE = rb"""
extern "C" __device__ void cudaGraphSetConditional(unsigned long long handle, unsigned int value);
extern "C" __global__ void te_graph_set_conditional(unsigned long long handle, const void* index,
                                                    unsigned int bytes, unsigned int n, unsigned int is_if) {
  long long v = bytes == 8 ? *(const long long*)index
              : bytes == 4 ? (long long)*(const int*)index : (long long)*(const unsigned char*)index;
  unsigned int value = is_if ? (v != 0 ? 1u : 0u) : ((v >= 0 && v < (long long)n) ? (unsigned int)v : n);
  cudaGraphSetConditional(handle, value);
}
"""
_PTX = b""".version 8.0
.target sm_75
.address_size 64
.extern .func cudaGraphSetConditional(.param .b64 handle, .param .b32 value);
.visible .entry te_graph_set_conditional(.param .u64 p_handle, .param .u64 p_index, .param .u32 p_bytes,
                                         .param .u32 p_n, .param .u32 p_if)
{
  .reg .pred %p<6>; .reg .b16 %rs<2>; .reg .b32 %r<8>; .reg .b64 %rd<8>;
  ld.param.u64 %rd1, [p_handle]; ld.param.u64 %rd2, [p_index]; ld.param.u32 %r1, [p_bytes];
  ld.param.u32 %r2, [p_n]; ld.param.u32 %r3, [p_if];
  cvta.to.global.u64 %rd3, %rd2;
  setp.eq.u32 %p1, %r1, 8; @%p1 bra LOAD8;
  setp.eq.u32 %p2, %r1, 4; @%p2 bra LOAD4;
  ld.global.u8 %rs1, [%rd3]; cvt.u64.u16 %rd4, %rs1; bra.uni LOADED;
LOAD4:
  ld.global.s32 %r4, [%rd3]; cvt.s64.s32 %rd4, %r4; bra.uni LOADED;
LOAD8:
  ld.global.u64 %rd4, [%rd3];
LOADED:
  setp.ne.u32 %p3, %r3, 0; @%p3 bra ISIF;
  cvt.u64.u32 %rd5, %r2; setp.lt.u64 %p4, %rd4, %rd5;
  cvt.u32.u64 %r5, %rd4; selp.b32 %r6, %r5, %r2, %p4; bra.uni SET;
ISIF:
  setp.ne.s64 %p5, %rd4, 0; selp.u32 %r6, 1, 0, %p5;
SET:
  { .param .b64 a0; .param .b32 a1; st.param.b64 [a0], %rd1; st.param.b32 [a1], %r6;
    call.uni cudaGraphSetConditional, (a0, a1); }
  ret;
}
"""


def _nvrtc_ptx(arch: str) -> bytes:
    _, nvrtc = bindings()
    program = check(nvrtc.nvrtcCreateProgram(_SOURCE, _NAME + b".cu", 0, [], []), "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture=compute_{arch}".encode()]
        check(nvrtc.nvrtcCompileProgram(program, len(options), options), "nvrtcCompileProgram")
        size = check(nvrtc.nvrtcGetPTXSize(program), "nvrtcGetPTXSize")
        buffer = b" " * size
        check(nvrtc.nvrtcGetPTX(program, buffer), "nvrtcGetPTX")
        return buffer.rstrip(b"\0 ")
    finally:
        with contextlib.suppress(Exception):
            nvrtc.nvrtcDestroyProgram(program)


class SetKernel:
    """The set kernel, loaded into the current context: from NVRTC's PTX for ``arch`` (e.g. "90"),
    else from the embedded PTX; ``source`` forces one ("nvrtc" or "ptx"). ``origin`` says which."""

    def __init__(self, arch: str, source: Optional[str] = None):
        driver, _ = bindings()
        self._driver, self._module, tried = driver, None, []
        candidates = []
        if source in (None, "nvrtc"):
            try:
                candidates.append(("nvrtc", _nvrtc_ptx(arch)))
            except Exception as error:  # NVRTC missing or failing: the embedded PTX follows
                tried.append(f"nvrtc: {error}")
        if source in (None, "ptx"):
            candidates.append(("ptx", _PTX))
        for origin, ptx in candidates:
            image = ctypes.create_string_buffer(ptx)  # NUL-terminated, alive while the load reads it
            try:
                module = check(driver.cuModuleLoadData(ctypes.addressof(image)), "cuModuleLoadData")
            except RuntimeError as error:  # e.g. NVRTC's PTX newer than the driver
                tried.append(f"{origin}: {error}")
                continue
            self._module, self.origin = module, origin
            self._function = check(driver.cuModuleGetFunction(module, _NAME), "cuModuleGetFunction")
            return
        raise RuntimeError("te_graph.capture.conditional: the set-conditional kernel did not load: "
                           + "; ".join(tried))

    def launch(self, stream: int, handle: Any, index_ptr: int, index_bytes: int, n: int, is_if: bool) -> None:
        """Captured on ``stream``: one thread sets ``handle`` from the index at ``index_ptr``."""
        values = [ctypes.c_ulonglong(int(handle)), ctypes.c_void_p(index_ptr), ctypes.c_uint(index_bytes),
                  ctypes.c_uint(n), ctypes.c_uint(int(is_if))]
        args = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        check(self._driver.cuLaunchKernel(self._function, 1, 1, 1, 1, 1, 1, 0, self._driver.CUstream(stream),
                                          ctypes.addressof(args), 0), "cuLaunchKernel")

    def unload(self) -> None:
        """Unload the module: no graph holding one of its launches may replay afterwards."""
        if self._module is not None:
            module, self._module = self._module, None
            check(self._driver.cuModuleUnload(module), "cuModuleUnload")
