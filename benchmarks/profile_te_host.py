"""Where the host time of a te_graph step over Transformer Engine layers goes, per precision
(issue 29): bf16 against each FP8 recipe, on the launch-bound te-tiny stack by default.

For each precision it builds bench_te.py's ``te_graph`` row (same layers, same step), then

* times ``--iters`` steps, each synchronised (median ms per step);
* times the host and the GPU apart: each step queued behind a GPU spin longer than the
  step, so the host issues it without waiting for the GPU (median host ms) and the GPU runs
  it without waiting for the host (median GPU ms, between events around the step); a
  sample whose host time outlasts the spin is left out and counted; both also per layer
  call (the step's time divided by the number of layers: one forward and its backward);
* runs ``--profile-iters`` steps under ``cProfile`` and prints the functions with the most
  own time, in microseconds per layer call.

Back to back, a step takes about the larger of the two: where the GPU time is the larger,
host work moved out of the hot path does not show in the step time. ``--kinds`` adds other
bench_te rows (``whole-step graph``: the GPU time of the step with no launch cost at all).
Run on a GPU with Transformer Engine::

    python benchmarks/profile_te_host.py --precisions bf16,fp8-delayed,fp8-current --out /tmp/host.txt
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from typing import Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

import bench_te  # noqa: E402
from _targets import TE_GRAPH, WHOLE_STEP_GRAPH  # noqa: E402


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


def profile(config: str, precision: str, kind: str, iters: int, profile_iters: int, top: int) -> str:
    cfg = bench_te.CONFIGS[config]
    layers = cfg[0]
    built = bench_te.build(cfg, precision, kind, recompute=False)
    inputs = bench_te.make_inputs(cfg, "single")
    try:
        for i in range(10):
            built.step(inputs[i % len(inputs)])
        step_ms = _median_ms(built.step, inputs, iters)
        host_ms, gpu_ms, broken = _host_and_gpu_ms(built.step, inputs, iters)
        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        for i in range(profile_iters):
            built.step(inputs[i % len(inputs)])
        profiler.disable()
        torch.cuda.synchronize()
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
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_te_host.py: CUDA is not available; this needs a CUDA GPU and Transformer Engine.")
    report = []
    for config in args.configs.split(","):
        for precision in args.precisions.split(","):
            for kind in args.kinds.split(","):
                text = profile(config, precision, kind, args.iters, args.profile_iters, args.top)
                print(text, flush=True)
                report.append(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(report) + "\n")


if __name__ == "__main__":
    main()
