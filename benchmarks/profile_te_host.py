"""Where the host time of a te_graph step over Transformer Engine layers goes, per precision:
bf16 against each FP8 recipe, on the launch-bound te-tiny stack by default.

For each precision it builds bench_te.py's ``te_graph`` row (same layers, same step), then

* times ``--iters`` steps, each synchronised (median ms per step);
* times the host and the GPU apart: each step queued behind a GPU spin longer than the
  step, so the host issues it without waiting for the GPU (median host ms) and the GPU runs
  it without waiting for the host (median GPU ms, between events around the step); a
  sample whose host time outlasts the spin is left out and counted; both also per layer
  call (the step's time divided by the number of layers: one forward and its backward);
* runs ``--profile-iters`` steps under ``cProfile`` and prints the functions with the most
  own time, in microseconds per layer call (``--dump DIR`` also saves the stats, for
  ``pstats`` on any machine);
* for te_graph's rows, the floor of its replay path: the host time of the bare graph
  launches alone (each layer's forward graph, then each backward graph, nothing around
  them), per layer call; what the replay path adds to it is te_graph's own Python;
* for te_graph's rows, a timeline of ``--timeline`` steps: the host time of each function
  of the replay path (``_TIMED``: the fingerprint check, the input copies, the graph
  launches...), clocked inside whole steps, per layer call, and the rest of the step.

Back to back, a step takes about the larger of the two: where the GPU time is the larger,
host work moved out of the hot path does not show in the step time. ``--kinds`` adds other
bench_te rows (``whole-step graph``: the GPU time of the step with no launch cost at all).
Run on a GPU with Transformer Engine::

    python benchmarks/profile_te_host.py --precisions bf16,fp8-delayed,fp8-current --out /tmp/host.txt
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from typing import Callable, Iterator, Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

import bench_te  # noqa: E402
from _targets import TE_GRAPH, WHOLE_STEP_GRAPH  # noqa: E402
from te_graph.resources import graphed_callable_of  # noqa: E402


def _median_ms(step, inputs: Sequence[torch.Tensor], iters: int) -> float:
    """Median wall ms of a step and the synchronisation after it."""
    times = []
    for i in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(inputs[i % len(inputs)])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _host_and_gpu_ms(step, inputs: Sequence[torch.Tensor], iters: int) -> tuple[float, float, int]:
    """Median host ms (issuing the step) and GPU ms (running it), each step queued behind a
    GPU spin longer than the step: the host does not wait for the GPU (a full launch queue,
    an allocator sync), and the GPU does not wait for the host (no gaps between its
    kernels). Also how many samples broke that: the spin was over before the host had
    issued the whole step (those are left out)."""
    host, gpu, broken = [], [], 0
    spun = torch.cuda.Event()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(iters):
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        spun.record()
        begin.record()
        start = time.perf_counter()
        step(inputs[i % len(inputs)])
        issued = time.perf_counter()
        valid = not spun.query()
        end.record()
        torch.cuda.synchronize()
        if valid:
            host.append((issued - start) * 1e3)
            gpu.append(begin.elapsed_time(end))
        else:
            broken += 1
    if not host:
        raise RuntimeError("profile_te_host.py: every step outlasted the GPU spin; raise SPIN_CYCLES.")
    return statistics.median(host), statistics.median(gpu), broken


SPIN_CYCLES = 60_000_000  # ~30 ms of an H100's clock: longer than the steps profiled here


def _bare_replays(graphed: Sequence[torch.nn.Module]) -> Callable[[torch.Tensor], None]:
    """A step of the bare graph launches of te_graph's graphed layers: every forward graph,
    then every backward graph in reverse, nothing else (no copies, checks or FP8 and RNG
    bookkeeping: numerically meaningless, a floor of the host time)."""
    pairs = [(r.graph.fwd_graph, r.graph.bwd_graph) for m in graphed
             for r in graphed_callable_of(m)._runners.values()]

    def step(_: torch.Tensor) -> None:
        for forward, _backward in pairs:
            forward.replay()
        for _forward, backward in reversed(pairs):
            backward.replay()

    return step


# te_graph's replay path, function by function: (owner, attribute, label). Each is timed
# inclusive of what it calls, so the rows nest (the call holds the check and the forward).
_FORWARD, _BACKWARD = "forward call (all of it)", "backward node (all of it)"
_TIMED = (
    ("te_graph.replay.graphed", "GraphedCallable.__call__", _FORWARD),
    ("te_graph.guards.fingerprint", "Fingerprint.check", "  fingerprint check of what the graph froze"),
    ("te_graph.replay.graph_runner", "GraphRunner.through_autograd", "  in-graph or autograd parameter gradients"),
    ("te_graph.replay.graph_runner", "GraphRunner.forward", "  runner forward"),
    ("te_graph.replay.runner", "Runner._copy_inputs", "    input copies into the static buffers"),
    ("te_graph.replay.function", "_Replay.backward", _BACKWARD),
    ("te_graph.grads", "ParamGrads.prepare_in_graph", "  parameter-gradient bookkeeping"),
    ("torch.cuda.graphs", "CUDAGraph.replay", "graph launches, forward and backward (inside the rows above)"),
)


@contextlib.contextmanager
def _timed(totals: dict) -> Iterator[None]:
    """Wrap ``_TIMED``'s functions with a clock adding their inclusive host ns to
    ``totals`` (a few hundred ns per call of overhead); unwrapped on exit."""
    import importlib

    saved = []
    try:
        for module_name, path, label in _TIMED:
            owner_name, attribute = path.split(".")
            owner = getattr(importlib.import_module(module_name), owner_name)
            raw = owner.__dict__[attribute]
            function = raw.__func__ if isinstance(raw, staticmethod) else raw

            def clocked(*args, _function=function, _label=label, **kwargs):
                start = time.perf_counter_ns()
                try:
                    return _function(*args, **kwargs)
                finally:
                    totals[_label] = totals.get(_label, 0) + time.perf_counter_ns() - start

            setattr(owner, attribute, staticmethod(clocked) if isinstance(raw, staticmethod) else clocked)
            saved.append((owner, attribute, raw))
        yield
    finally:
        for owner, attribute, raw in saved:
            setattr(owner, attribute, raw)


def _timeline(step, inputs: Sequence[torch.Tensor], steps: int, layers: int) -> list[str]:
    """Host us per layer call of each ``_TIMED`` function inside whole steps (each queued
    behind a GPU spin, so that no launch waits for the GPU), and the rest of the step."""
    totals: dict = {}
    spent = 0.0
    with _timed(totals):
        for i in range(steps):
            torch.cuda.synchronize()
            torch.cuda._sleep(SPIN_CYCLES)
            start = time.perf_counter_ns()
            step(inputs[i % len(inputs)])
            spent += time.perf_counter_ns() - start
        torch.cuda.synchronize()
    calls = steps * layers
    ours = totals.get(_FORWARD, 0) + totals.get(_BACKWARD, 0)
    lines = [f"   timeline, host us per layer call ({steps} steps, each function inclusive of what it calls):",
             f"   {spent / 1e3 / calls:8.1f}  the step / layers"]
    lines += [f"   {totals.get(label, 0) / 1e3 / calls:8.1f}  {label}" for _, _, label in _TIMED]
    lines.append(f"   {(spent - ours) / 1e3 / calls:8.1f}  the rest of the step / layers (grad zeroing, autocast, "
                 "loss, the autograd engine)")
    return lines


def profile(config: str, precision: str, kind: str, iters: int, profile_iters: int, top: int,
            dump: str | None = None, timeline_steps: int = 0) -> str:
    cfg = bench_te.CONFIGS[config]
    layers = cfg[0]
    built = bench_te.build(cfg, precision, kind, recompute=False)
    inputs = bench_te.make_inputs(cfg, "single")
    try:
        for i in range(10):
            built.step(inputs[i % len(inputs)])
        step_ms = _median_ms(built.step, inputs, iters)
        host_ms, gpu_ms, broken = _host_and_gpu_ms(built.step, inputs, iters)
        bare, timeline = None, []
        if kind == TE_GRAPH:
            bare = _host_and_gpu_ms(_bare_replays(built.keep[1]), inputs, iters)
            if timeline_steps:
                timeline = _timeline(built.step, inputs, timeline_steps, layers)
        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        for i in range(profile_iters):
            built.step(inputs[i % len(inputs)])
        profiler.disable()
        torch.cuda.synchronize()
        if dump:
            os.makedirs(dump, exist_ok=True)
            profiler.dump_stats(os.path.join(dump, f"{config}-{kind}-{precision}.prof".replace(" ", "_")))
    finally:
        if built.release is not None:
            built.release()
    calls = profile_iters * layers
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    lines = [f"== {config} {kind} {precision} ({layers} layers): step {step_ms:.3f} ms synchronised; host {host_ms:.3f} ms "
             f"({host_ms * 1e3 / layers:.1f} us per layer call); GPU {gpu_ms:.3f} ms "
             f"({gpu_ms * 1e3 / layers:.1f} us per layer call; per layer call = per step / layers)"
             + (f"; {broken} of {iters} samples outlasted the spin, left out" if broken else ""),
             f"   own time, us per layer call (cProfile, {profile_iters} steps; cProfile itself adds time):"]
    if bare is not None:
        lines.insert(1, f"   bare graph launches alone: host {bare[0] * 1e3 / layers:.1f} us, GPU {bare[1] * 1e3 / layers:.1f} us "
                        "per layer call")
    lines[2:2] = timeline
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in rows:
        where = f"{os.path.basename(os.path.dirname(file))}/{os.path.basename(file)}:{line}" if line else file
        lines.append(f"   {tottime * 1e6 / calls:8.2f} own {cumtime * 1e6 / calls:8.2f} cum "
                     f"{ncalls / calls:6.2f}x  {name}  ({where})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="te-tiny")
    p.add_argument("--precisions", default="bf16,fp8-delayed,fp8-current")
    p.add_argument("--kinds", default=f"{TE_GRAPH},{WHOLE_STEP_GRAPH}", help="bench_te rows, comma-separated")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--profile-iters", type=int, default=20)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--dump", default=None, help="save each row's cProfile stats in this directory")
    p.add_argument("--timeline", type=int, default=20,
                   help="steps of te_graph's rows timed function by function (0: none)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_te_host.py: CUDA is not available; this needs a CUDA GPU and Transformer Engine.")
    report = []
    for config in args.configs.split(","):
        for precision in args.precisions.split(","):
            for kind in args.kinds.split(","):
                text = profile(config, precision, kind, args.iters, args.profile_iters, args.top, args.dump, args.timeline)
                print(text, flush=True)
                report.append(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(report) + "\n")


if __name__ == "__main__":
    main()
