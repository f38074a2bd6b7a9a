"""CUDA conditional nodes in a torch capture (``te_graph.capture.conditional``).

On the GPU: SWITCH and IF nodes with torch ops in their bodies, replayed many times with new
device data and no host sync, bitwise equal to eager; the bodies' temporaries in the graph's
pool; refusals and failures inside a body that leave the capture, the pool and the allocator
routing clean. On the CPU: the module imports without cuda-bindings and refuses bad arguments.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import weakref

import pytest
import torch

from te_graph.capture import conditional
from te_graph.capture.conditional import ConditionalCaptureError, driver
from tests.harness import assert_same, refused

gpu = pytest.mark.gpu
ROWS = (64, 128, 256)  # rows of body k's program: a padded bucket each
K = N = 512


def fact(**facts) -> None:
    """What a GPU test measured, one JSON line in $COND_FACTS where set."""
    path = os.environ.get("COND_FACTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(facts, default=str) + "\n")


# -- CPU: import and arguments -----------------------------------------------------------------------
def test_imports_without_cuda_bindings():
    code = ("import sys, te_graph.capture.conditional as c; "
            "assert not [m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')], sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_missing_cuda_bindings_names_the_extra(monkeypatch):
    monkeypatch.setattr(driver, "_modules", None)
    monkeypatch.setitem(sys.modules, "cuda", None)  # an import of cuda.* fails as if not installed
    with pytest.raises(ImportError, match=r"needs cuda-bindings.*pip install 'te-graph\[conditional\]'"):
        driver.bindings()


I64 = torch.zeros((), dtype=torch.int64)
BAD_ARGUMENTS = [
    pytest.param(lambda: conditional.switch(3, 2), TypeError, "must be a torch.Tensor", id="index-not-tensor"),
    pytest.param(lambda: conditional.switch(torch.zeros(()), 2), TypeError, "dtype int64, int32, uint8, not float32",
                 id="index-float"),
    pytest.param(lambda: conditional.switch(torch.zeros(2, dtype=torch.int64), 2), ValueError, "one element, not 2",
                 id="index-two-elements"),
    pytest.param(lambda: conditional.switch(I64, 2), ValueError, "must be on a CUDA device", id="index-on-cpu"),
    pytest.param(lambda: conditional.switch(I64, 0), ValueError, "at least 1, not 0", id="n-zero"),
    pytest.param(lambda: conditional.switch(I64, True), TypeError, "must be an int, not bool", id="n-bool"),
    pytest.param(lambda: conditional.switch(I64, 2.0), TypeError, "must be an int, not float", id="n-float"),
    pytest.param(lambda: conditional.switch(I64, 2, capture_error_mode="strict"), ValueError, "capture_error_mode",
                 id="mode"),
    pytest.param(lambda: conditional.if_(torch.zeros(()), pool=None).__enter__(), TypeError,
                 "dtype bool, uint8, int32, int64, not float32", id="flag-float"),
    pytest.param(lambda: conditional.if_(torch.zeros((), dtype=torch.int8)).__enter__(), TypeError, "not int8",
                 id="flag-int8"),
]


@pytest.mark.parametrize("call, error, match", BAD_ARGUMENTS)
def test_bad_arguments_refused(call, error, match):
    with refused(error, match):
        call()


@pytest.mark.parametrize("enabled", [True, False], ids=["collector-on", "collector-off"])
def test_collector_pauses_nest_and_restore(enabled):
    from te_graph.capture.conditional import guards
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        guards.pause_collector()
        with guards.collector_paused():  # a second node, on another thread or after the first
            assert not gc.isenabled()
        assert not gc.isenabled(), "the inner resume enabled the collector while a node is still captured"
        guards.resume_collector()
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


@pytest.fixture(autouse=True)
def kernel_loaded(request):
    """GPU tests start with the set kernel loaded outside any capture (one test loads it inside)."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        torch.cuda.set_stream(torch.cuda.default_stream())  # a failed torch.cuda.graph leaves its stream current
        fact(test="prepare", kernel=conditional.prepare())


# -- GPU helpers ----------------------------------------------------------------------------------------
def program(a: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """Body k's work: a matmul and elementwise ops, each a temporary from the allocator."""
    return torch.relu(a[:ROWS[k]] @ w) * float(k + 1) + 0.5


def segment_pool(ptr: int):
    for s in torch.cuda.memory._snapshot()["segments"]:
        if s["address"] <= ptr < s["address"] + s["total_size"]:
            return tuple(s.get("segment_pool_id", ("no-field",)))
    return None


def assert_clean(pool) -> None:
    """After a capture ended (or failed): nothing captures, the guards are off, the pool takes a
    new ordinary capture and a new conditional one, and eager allocations stay out of it."""
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert not hasattr(torch.cuda.Event.record, "__wrapped__"), "the event refusal is still installed"
    assert not hasattr(torch.cuda.Stream.wait_stream, "__wrapped__"), "the stream refusal is still installed"
    x = torch.full((256, 256), 3.0, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        y = x * 2
    g.replay()
    assert_same(y, torch.full((256, 256), 6.0, device="cuda"))
    eager = torch.empty(1 << 20, device="cuda")
    assert segment_pool(eager.data_ptr()) != tuple(pool), "an eager allocation went to the graph's pool"
    sel = torch.tensor(1, device="cuda")
    g2, out = torch.cuda.CUDAGraph(), torch.zeros(4, device="cuda")
    with torch.cuda.graph(g2, pool=pool):
        with conditional.switch(sel, 2, pool=pool) as bodies:
            for k, body in enumerate(bodies):
                with body:
                    out.copy_(torch.full((4,), float(k + 10), device="cuda"))
    g2.replay()
    assert_same(out, torch.full((4,), 11.0, device="cuda"))
    torch.randn(4, device="cuda")  # the default generator is out of capture mode


def inputs(seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(max(ROWS), K, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(K, N, device="cuda", generator=gen, dtype=torch.bfloat16) / K ** 0.5
    return a, w


# -- GPU: switch and if ---------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("kernel_source", [None, "ptx"], ids=["auto", "embedded-ptx"])
def test_switch_three_bodies_many_replays(kernel_source):
    origin = conditional.prepare(kernel_source=kernel_source)
    a, w = inputs()
    outs = [torch.empty(r, N, device="cuda", dtype=a.dtype) for r in ROWS]
    after = torch.empty(ROWS[2], N, device="cuda", dtype=a.dtype)
    scores = torch.zeros(len(ROWS) + 1, device="cuda")  # argmax == len(ROWS): out of range, no body
    g, pool, temporaries = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle(), []
    for k in range(len(ROWS)):  # warm-up on the capture's side stream, as torch.cuda.graph advises
        program(a, w, k)
    torch.cuda.synchronize()
    with torch.cuda.graph(g, pool=pool):
        for o in outs:
            o.fill_(float("nan"))
        index = torch.argmax(scores)
        with conditional.switch(index, len(ROWS), pool=pool, kernel_source=kernel_source) as bodies:
            assert len(bodies) == 3
            for k, body in enumerate(bodies):
                with body:
                    t = program(a, w, k)
                    temporaries.append(t.data_ptr())
                    outs[k].copy_(t)
        after.copy_(outs[2] * 2)  # after the node: sees body 2's output of this replay
    pools = {segment_pool(p) for p in temporaries}
    fact(test="switch", kernel=origin, temporaries_pools=sorted(map(str, pools)), graph_pool=pool)
    assert pools == {tuple(pool)}, f"body temporaries in {pools}, not the graph's pool {pool}"
    canaries = [torch.full((ROWS[-1], N), 7.0, device="cuda", dtype=a.dtype) for _ in range(8)]
    with torch.cuda.stream(conditional.runtime.runtime().stream()):
        canaries += [torch.full((ROWS[-1], N), 7.0, device="cuda", dtype=a.dtype) for _ in range(8)]
    torch.cuda.synchronize()

    replays = 40
    choices = [i % (len(ROWS) + 1) for i in range(replays)]
    new_scores = torch.rand(replays, len(ROWS) + 1, device="cuda")
    new_scores[torch.arange(replays), torch.tensor(choices)] = 2.0
    new_a = [inputs(seed=i + 1)[0] for i in range(replays)]
    seen = [[torch.empty_like(o) for o in outs + [after]] for _ in range(replays)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(replays):
            scores.copy_(new_scores[i])
            a.copy_(new_a[i])
            g.replay()
            for s, o in zip(seen[i], outs + [after]):
                s.copy_(o)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for i, chosen in enumerate(choices):
        ran = [not bool(torch.isnan(seen[i][k]).all()) for k in range(len(ROWS))]
        assert ran == [k == chosen for k in range(len(ROWS))], f"replay {i}: index {chosen}, bodies run {ran}"
        if chosen < len(ROWS):
            assert_same(seen[i][chosen], program(new_a[i], w, chosen), f"replay {i}, body {chosen}")
        if chosen == 2:
            assert_same(seen[i][3], seen[i][2] * 2, f"replay {i}, after the node")
    assert all(bool((c == 7.0).all()) for c in canaries), "a replay wrote into memory outside the graph's pool"
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        g.replay()
    torch.cuda.synchronize()
    fact(test="switch", kernel=origin, replays=replays, us_per_replay=round((time.perf_counter() - t0) / 200 * 1e6, 1))


@gpu
def test_out_of_range_and_negative_index_run_no_body():
    sel = torch.tensor(0, device="cuda", dtype=torch.int32)  # static: written by the host between replays
    hits = torch.zeros(3, device="cuda")
    g, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    with torch.cuda.graph(g, pool=pool):
        with conditional.switch(sel, 3, pool=pool) as bodies:
            for k in (2, 0, 1):  # any order
                with bodies[k]:
                    hits[k:k + 1].add_(torch.ones(1, device="cuda"))
    want = torch.zeros(3, device="cuda")
    for value in (1, -1, 3, 100, -(2 ** 31), 2, 0, 2):
        sel.fill_(value)
        g.replay()
        if 0 <= value < 3:
            want[value] += 1
    torch.cuda.synchronize()
    assert_same(hits, want)


@gpu
@pytest.mark.parametrize("native", [None, False], ids=["auto", "cuda-bindings"])
def test_if_nodes_bool_and_integer_flags(native):
    a, w = inputs()
    out1 = torch.zeros(ROWS[0], N, device="cuda", dtype=a.dtype)
    out2 = torch.zeros(ROWS[1], N, device="cuda", dtype=a.dtype)
    count = torch.zeros((), device="cuda", dtype=torch.int64)  # an int64 flag from outside the graph
    g, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    torch.cuda.synchronize()
    with torch.cuda.graph(g, pool=pool):
        positive = a[0, 0] > 0  # a bool flag computed in the graph
        with conditional.if_(positive, pool=pool, native=native):
            out1.copy_(program(a, w, 0))
        with conditional.if_(count, pool=pool, native=native):
            out2.add_(program(a, w, 1))
    fact(test="if", native=native, native_available=conditional.native_if_available())
    want1, want2 = out1.clone(), out2.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps = []
        for i in range(16):
            a_i = inputs(seed=100 + i)[0]
            a.copy_(a_i)
            count.fill_(i % 3)
            g.replay()
            steps.append((a_i, i % 3, out1.clone(), out2.clone()))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for i, (a_i, c, got1, got2) in enumerate(steps):
        if bool(a_i[0, 0] > 0):
            want1 = program(a_i, w, 0)
        if c:
            want2 = want2 + program(a_i, w, 1)
        assert_same(got1, want1, f"replay {i}, first IF")
        assert_same(got2, want2, f"replay {i}, second IF")


@gpu
def test_unprepared_refused_then_teardown_and_prepare_again():
    conditional.teardown()
    sel = torch.tensor(1, device="cuda")
    out = torch.zeros(4, device="cuda")
    g, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    with pytest.raises(ConditionalCaptureError, match=r"call te_graph.capture.conditional.prepare\(\) before"):
        with torch.cuda.graph(g, pool=pool):
            out.add_(1.0)
            conditional.switch(sel, 2, pool=pool).__enter__()
    conditional.prepare()
    assert_clean(pool)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, pool=pool):
        with conditional.switch(sel, 2, pool=pool) as bodies:
            for k, body in enumerate(bodies):
                with body:
                    out.add_(float(k + 1))
    out.zero_()
    for _ in range(3):
        g2.replay()
    assert_same(out, torch.full((4,), 6.0, device="cuda"))


# -- GPU: refusals and failures ---------------------------------------------------------------------------
@gpu
def test_not_capturing_refused():
    sel = torch.tensor(1, device="cuda")
    with refused(ConditionalCaptureError, "no CUDA graph capture is under way", sel):
        with conditional.switch(sel, 2, pool=torch.cuda.graph_pool_handle()):
            pass


def _fails_in_a_body(body, error, match, pool=None, switch_pool=...):
    a, w = inputs()
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    g = torch.cuda.CUDAGraph()
    with pytest.raises(error, match=match) as info:
        with torch.cuda.graph(g, pool=pool):
            sel = torch.argmax(a[:4, 0])
            with conditional.switch(sel, 2, pool=pool if switch_pool is ... else switch_pool) as bodies:
                with bodies[0]:
                    body(a, w)
    if error is not RuntimeError:  # a CUDA error comes as torch's RuntimeError or a subclass
        assert info.type is error, f"raised {info.type.__name__}: {info.value}"
    fact(test="failure", match=match, raised=f"{info.type.__name__}: {info.value}"[:300])
    assert_clean(pool)  # g stays alive: torch refuses a pool whose graphs are all gone while tensors in it live


def _rng(a, w):
    torch.nn.functional.dropout(a @ w, 0.1)


def _python_error(a, w):
    a @ w
    raise KeyError("boom in a body")


def _event(a, w):
    torch.cuda.Event().record()


def _other_stream(a, w):
    torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())


def _nested(a, w):
    with conditional.switch(torch.argmax(a[:2, 0]), 2, pool=torch.cuda.graph_pool_handle()):
        pass


def _item(a, w):
    (a @ w).sum().item()


def _mask(a, w):
    a[a > 0].sum()


def _to_cpu(a, w):
    a[:2].cpu()


def _synchronize(a, w):
    torch.cuda.current_stream().synchronize()


FAILURES = [
    pytest.param(_python_error, KeyError, "boom in a body", id="python-error"),
    pytest.param(_rng, ConditionalCaptureError, "draws random numbers inside a conditional body", id="rng"),
    pytest.param(_event, ConditionalCaptureError, r"torch.cuda.Event.record\(\) inside a conditional body",
                 id="event"),
    pytest.param(_other_stream, ConditionalCaptureError, r"Stream.wait_stream\(\) inside a conditional body",
                 id="stream-wait"),
    pytest.param(_nested, ConditionalCaptureError, "conditional nodes do not nest", id="nested"),
    pytest.param(_item, ConditionalCaptureError, "_local_scalar_dense.default brings a value to the host: a host wait",
                 id="item"),
    pytest.param(_mask, ConditionalCaptureError, "with a boolean mask counts the mask on the host", id="mask"),
    pytest.param(_to_cpu, ConditionalCaptureError, "copies to the CPU", id="cpu"),
    pytest.param(_synchronize, ConditionalCaptureError, r"Stream.synchronize\(\) inside a conditional body",
                 id="synchronize"),
]


@gpu
@pytest.mark.parametrize("body, error, match", FAILURES)
def test_failure_in_a_body_leaves_capture_and_pool_clean(body, error, match):
    _fails_in_a_body(body, error, match)


@gpu
def test_wrong_pool_and_missing_pool_refused():
    _fails_in_a_body(lambda a, w: None, ValueError, "is not the memory pool of the capture under way",
                     switch_pool=torch.cuda.graph_pool_handle())
    _fails_in_a_body(lambda a, w: None, ConditionalCaptureError, "pass pool=", switch_pool=None)


@gpu
def test_body_misuse_refused():
    g, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    sel, out = torch.tensor(0, device="cuda"), torch.zeros(2, device="cuda")
    with torch.cuda.graph(g, pool=pool):
        with conditional.switch(sel, 3, pool=pool) as bodies:
            with bodies[0]:
                out.add_(1.0)
            with pytest.raises(ConditionalCaptureError, match="was captured already"):
                with bodies[0]:
                    pass
            with bodies[1]:
                with pytest.raises(ConditionalCaptureError, match="body 1 of switch over 3 bodies is still being"):
                    bodies[2].__enter__()
        with pytest.raises(ConditionalCaptureError, match="with block has ended"):
            with bodies[1]:
                pass
    g.replay()
    torch.cuda.synchronize()
    assert_same(out, torch.ones(2, device="cuda"))
    assert_clean(pool)


# -- GPU: process state ----------------------------------------------------------------------------------
def _unreachable_graph(replayed: bool):
    """A graph holding a SWITCH node, reachable only through a reference cycle (as a failed test's
    traceback holds its graph): ``(weak reference to it, the list that holds the cycle)``."""
    pool, g = torch.cuda.graph_pool_handle(), torch.cuda.CUDAGraph()
    sel, out = torch.tensor(1, device="cuda"), torch.zeros(4, device="cuda")
    try:
        with torch.cuda.graph(g, pool=pool):
            with conditional.switch(sel, 2, pool=pool) as bodies:
                for k, body in enumerate(bodies):
                    with body:
                        out.add_(torch.full((4,), float(k + 1), device="cuda"))
                        if not replayed:
                            raise KeyError("a failure in the body")
    except KeyError:
        pass
    if replayed:
        g.replay()
        torch.cuda.synchronize()
    cycle = [g, sel, out]
    cycle.append(cycle)
    return weakref.ref(g), [cycle]


@gpu
@pytest.mark.parametrize("replayed", [False, True], ids=["failed-capture", "replayed"])
def test_collector_waits_while_a_node_is_captured(replayed):
    """An earlier graph becomes garbage (in a cycle) before a later conditional capture, and its
    body allocates enough to start an automatic collection. Freed there, the old graph's
    destruction crashed the process when the capture ended; the collector waits for the node
    instead, the capture replays as eager, and the next collection frees the old graph."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    gc.collect()
    gc.disable()  # the old graph stays in the youngest generation until the body
    try:
        old, holder = _unreachable_graph(replayed)
        sel, out = torch.tensor(0, device="cuda"), torch.zeros(4, device="cuda")
        g, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        gc.set_threshold(50_000)
        gc.enable()
        with torch.cuda.graph(g, pool=pool):
            holder.clear()  # the old graph is garbage from here on
            with conditional.switch(sel, 2, pool=pool) as bodies:
                for k, body in enumerate(bodies):
                    with body:
                        junk = [[] for _ in range(100_000)]  # past the threshold: a collection is due
                        del junk
                        assert old() is not None, "a collection ran inside the body"
                        out.copy_(torch.full((4,), float(k + 10), device="cuda"))
            assert gc.isenabled(), "the collector stayed off after the node"
        gc.collect()
        assert old() is None, "the old graph was not freed by the next collection"
        for value, want in ((0, 10.0), (1, 11.0), (2, 11.0)):
            sel.fill_(value)
            g.replay()
            assert_same(out, torch.full((4,), want, device="cuda"), f"index {value}")
    finally:
        gc.set_threshold(*thresholds)
        (gc.enable if enabled else gc.disable)()
    assert_clean(pool)


@gpu
def test_prepare_as_the_first_cuda_call_of_a_process():
    code = "from te_graph.capture import conditional; print('kernel', conditional.prepare())"
    done = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] in (["kernel", "nvrtc"], ["kernel", "ptx"]), done.stdout
