"""CUDA conditional nodes inside a torch capture: the GPU chooses, at each replay, which
captured program runs, from a value the graph computed itself, with no host sync.

::

    conditional.prepare()                                  # once per device, outside any capture
    with torch.cuda.graph(g, pool=pool):
        bucket = counts_to_bucket(counts)                  # on the GPU
        with conditional.switch(bucket, 3, pool=pool) as bodies:
            for k, body in enumerate(bodies):
                with body:
                    run_bucket(k)                          # torch ops, allocations in the pool
        with conditional.if_(flag, pool=pool):
            fix_up()

``switched(index, programs, inputs, module=)`` runs one of several differentiable programs,
chosen on the GPU in the forward and again in the backward (two SWITCH nodes); outside a
capture it reads the index on the host. ``switch`` adds a SWITCH node (body ``index`` runs;
none out of range), ``if_`` an IF node (torch's own where torch has one,
``native_if_available``). Bodies hold kernels, copies and
allocations; no random numbers, collectives, events, other streams or host waits (refused by
name, ``ConditionalCaptureError``) and no nesting. Needs the ``cuda-bindings`` package
(``pip install 'te-graph[conditional]'``), imported on first use, and a CUDA >= 12.4 driver.
``prepare`` loads the set kernel and warms up the body stream, outside any capture (a capture
refuses that work); ``teardown`` (and ``te_graph.reset()``) frees them.
"""
from __future__ import annotations

from .driver import EXTRA
from .guards import ConditionalCaptureError
from .nodes import Body, Switch, if_, native_if_available, switch
from .runtime import capture_pool, prepare, teardown
from .switched import switched

__all__ = ["switch", "if_", "switched", "capture_pool", "Switch", "Body", "ConditionalCaptureError",
           "native_if_available", "prepare",
           "teardown", "EXTRA"]
