"""Measuring one benchmark variant on the GPU: build it, time its steps, read its footprint.

Shared by the benchmark scripts so that every row is measured the same way:

* from a clean allocator: before a variant builds, ``gc.collect()``, cuBLAS workspaces
  cleared, ``torch.cuda.empty_cache()`` (each variant pays its own workspaces, as a
  process running only it would), then ``reset_peak_memory_stats()``;
* build (model, sample args, capture) twice, the first build dropped (it pays the
  process's one-time costs for the shapes, which would otherwise land on whichever variant
  runs first; its times are kept as ``first_build_s`` and ``first_capture_s``); of the
  second: ``build_s`` wall time; ``capture_s`` the synchronised wall time of the
  ``make_graphed_callables`` call alone; the peak reserved and allocated memory of build
  + capture (``build_peak_*``);
* ``warmup`` untimed steps, then ``gc.collect(); empty_cache(); reset_peak_memory_stats()``
  and ``iters`` timed steps: median ms per step and the steady footprint,
  ``max_memory_reserved()`` over those steps (``steady_reserved_mib``), beside
  ``max_memory_allocated()``. Reserved is the footprint: a graph pool's memory that
  capture freed is still written by every replay, and ``allocated`` does not count it, so
  it flatters graphs;
* the graphs are freed (``te_graph.reset``) and everything dropped before the next row.

Kernel time (the floor) comes from ``torch.profiler``: the sum of the device time of every
GPU event (kernels, memcpy, memset) of a few runs, per run.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from _report import record_failure

MIB = 1024.0 * 1024.0
PROFILE_RUNS = 5


@dataclass
class Built:
    """What a variant's builder hands back: the step to run and what keeps it alive."""

    step: Callable[[torch.Tensor], None]
    keep: Any = None  # the model and graphs; dropped after the row
    capture_s: Optional[float] = None  # synchronised wall time of make_graphed_callables
    release: Optional[Callable[[], None]] = None  # frees graphs and static buffers
    checks: Optional[Callable[[], dict]] = None  # after the timed steps: fields added to the row


@dataclass(frozen=True)
class Settings:
    iters: int
    warmup: int
    sync: bool
    traceback: bool


class FirstOutput(torch.nn.Module):
    """``block(x)[0]``: torch's and Transformer Engine's make_graphed_callables need
    tensor-only outputs, and a GPTBlock returns ``(hidden_states, None)``."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)[0]


def free_memory(clear_cublas_workspaces: bool = True) -> None:
    """Drop garbage and cached blocks. Clearing the cuBLAS workspaces is only safe when no
    captured graph that used them survives (between variants)."""
    gc.collect()
    torch.cuda.synchronize()
    if clear_cublas_workspaces:
        with contextlib.suppress(Exception):
            torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


def synchronised(function: Callable[[], Any]) -> tuple[Any, float]:
    """``(function(), seconds)``, the device synchronised before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    value = function()
    torch.cuda.synchronize()
    return value, time.perf_counter() - start


def make_train_step(layers: Sequence[Callable], params: Iterable[torch.Tensor],
                    layer_kwargs: Optional[Mapping[str, Any]] = None) -> Callable[[torch.Tensor], None]:
    """One train step: zero the grads in place (one ``_foreach_zero_``, no optimizer), a
    forward of ``layers`` on a new leaf made from the input (graphed variants copy it into
    their first static input, as in training), ``out.float().square().mean()`` backward.
    A layer may return a tensor or a tuple whose first item is the hidden states."""
    params = tuple(params)
    kwargs = dict(layer_kwargs or {})

    def step(x: torch.Tensor) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)  # zero_grad(set_to_none=False)
        run_forward(layers, x, kwargs).float().square().mean().backward()

    return step


def make_forward(layers: Sequence[Callable], layer_kwargs: Optional[Mapping[str, Any]] = None
                 ) -> Callable[[torch.Tensor], None]:
    """One forward of ``layers`` as in training (grad enabled, the autograd graph built and
    then dropped), no backward: the extra work full recompute adds to a step."""
    kwargs = dict(layer_kwargs or {})

    def forward(x: torch.Tensor) -> None:
        run_forward(layers, x, kwargs)

    return forward


def run_forward(layers: Sequence[Callable], x: torch.Tensor, kwargs: Mapping[str, Any]) -> torch.Tensor:
    h = x.detach().requires_grad_(True)
    for layer in layers:
        out = layer(h, **kwargs)
        h = out[0] if isinstance(out, tuple) else out
    return h


def time_steps(step: Callable[[torch.Tensor], None], inputs: Sequence[torch.Tensor], iters: int,
               sync: bool) -> list[float]:
    """ms per step. Default: back-to-back steps between CUDA events (throughput: a
    CPU-bound step shows its launch time, a GPU-bound one its GPU time). ``sync``:
    synchronise around each step and use ``perf_counter`` (latency of an isolated step)."""
    if sync:
        times = []
        for i in range(iters):
            _, seconds = synchronised(lambda: step(inputs[i % len(inputs)]))
            times.append(seconds * 1e3)
        return times
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    for i in range(iters):
        starts[i].record()
        step(inputs[i % len(inputs)])
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _event_device_us(event: Any) -> float:
    for attr in ("device_time_total", "cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return float(event.time_range.elapsed_us())


def device_time_ms(run: Callable[[torch.Tensor], None], inputs: Sequence[torch.Tensor],
                   runs: int = PROFILE_RUNS) -> float:
    """Sum of the device time of all GPU events per ``run`` (profiler, ``runs`` averaged)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(runs):
            run(inputs[i % len(inputs)])
        torch.cuda.synchronize()
    events = [e for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA]
    if not events:
        raise RuntimeError("the profiler recorded no CUDA device events (is CUPTI available?)")
    return sum(_event_device_us(e) for e in events) / 1e3 / runs


def medians_by_label(times: Sequence[float], labels: Sequence[Any]) -> dict[str, float]:
    """Median of the steps that ran input ``i % len(labels)``, per distinct label."""
    groups: dict[str, list[float]] = {}
    for i, t in enumerate(times):
        groups.setdefault(str(labels[i % len(labels)]), []).append(t)
    return {label: statistics.median(ts) for label, ts in groups.items()}


def measure_steps(build: Callable[[], Built], inputs: Sequence[torch.Tensor], settings: Settings,
                  row: dict, labels: Optional[Sequence[Any]] = None) -> None:
    """Build, warm up and time a variant, filling ``row`` as it goes (see the module
    docstring): a failure after the capture still leaves the capture's numbers in it."""
    # Built twice, the first build dropped: it pays the process's one-time costs for these
    # shapes (cuDNN and cuBLAS plans, lazy initialisation), which would otherwise land on
    # whichever variant of a config happens to run first.
    first, row["first_build_s"] = synchronised(build)
    row["first_capture_s"] = first.capture_s
    _release(first, {})
    del first
    free_memory()
    torch.cuda.reset_peak_memory_stats()
    row["base_reserved_mib"] = torch.cuda.memory_reserved() / MIB
    built, row["build_s"] = synchronised(build)
    row["capture_s"] = built.capture_s
    row["build_peak_reserved_mib"] = torch.cuda.max_memory_reserved() / MIB
    row["build_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / MIB
    try:
        for i in range(settings.warmup):
            built.step(inputs[i % len(inputs)])
        free_memory(clear_cublas_workspaces=False)  # graphs are alive: keep their workspaces
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        times = time_steps(built.step, inputs, settings.iters, settings.sync)
        row["wall_mean_ms"] = (time.perf_counter() - start) * 1e3 / settings.iters
        row["steady_reserved_mib"] = torch.cuda.max_memory_reserved() / MIB
        row["steady_allocated_mib"] = torch.cuda.max_memory_allocated() / MIB
        row["ms"] = statistics.median(times)
        row["times_ms"] = times
        if labels is not None and len(set(labels)) > 1:
            row["ms_by_input"] = medians_by_label(times, labels)
        if built.checks is not None:
            row.update(built.checks())
    finally:
        _release(built, row)


def measure_device_time(build: Callable[[], Built], inputs: Sequence[torch.Tensor],
                        settings: Settings, row: dict) -> None:
    """The kernel time of a variant's step (profiled after ``warmup`` untimed runs)."""
    free_memory()
    built = build()
    try:
        for i in range(settings.warmup):
            built.step(inputs[i % len(inputs)])
        row["ms"] = device_time_ms(built.step, inputs)
        row["profiled_runs"] = PROFILE_RUNS
    finally:
        _release(built, row)


def _release(built: Built, row: dict) -> None:
    with contextlib.suppress(Exception):  # a sticky CUDA error must not hide the first one
        torch.cuda.synchronize()
    if built.release is not None:
        try:
            built.release()
        except Exception as error:  # noqa: BLE001 - the row's numbers still stand
            row["release_error"] = f"{type(error).__name__}: {error}"
    built.keep = None
    built.step = None  # type: ignore[assignment]


def whole_step_graph(step: Callable[[torch.Tensor], None], static_x: torch.Tensor,
                     tracker: Any) -> tuple[Callable[[torch.Tensor], None], Callable[[], None]]:
    """The reference the per-layer graphs are held against: the whole eager ``step``
    (grad zeroing, forward, loss, backward) captured as one ``torch.cuda.CUDAGraph``, after
    three warm-up steps on the capture stream (lazy init; the grads exist afterwards and are
    zeroed in place). The tracker's graph-safe generators are registered with the graph
    where torch needs it. Returns the replaying step and what frees the graph."""
    import rng  # noqa: PLC0415

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    if rng.generator_registration_required():
        for key, generator in rng.live_stream_generators(tracker, static_x.device).items():
            if key != rng.DEFAULT_STREAM:  # torch registers the default one itself
                graph.register_generator_state(generator)
    with torch.cuda.graph(graph, stream=side):
        step(static_x)

    def run(x: torch.Tensor) -> None:
        static_x.copy_(x)
        graph.replay()

    return run, graph.reset


@dataclass(frozen=True)
class Variant:
    """A row to measure: its builder, and whether it is timed or profiled."""

    build: Callable[[], Built]
    profiled: bool = False
    inputs: str = "single"  # which input set of the config it runs on
    labels: Optional[Sequence[Any]] = None  # per input, for per-input medians


def run_variant(name: str, variant: Variant, inputs: Sequence[torch.Tensor], settings: Settings) -> dict:
    """The row of one variant; a failure becomes the row's ``error`` and the run goes on."""
    row: dict = {"variant": name}
    try:
        if variant.profiled:
            measure_device_time(variant.build, inputs, settings, row)
        else:
            measure_steps(variant.build, inputs, settings, row, variant.labels)
    except Exception as error:  # noqa: BLE001 - report and go on
        record_failure(row, error, settings.traceback)
    with contextlib.suppress(Exception):
        free_memory()
    return row


def run_rows(config: str, variants: Mapping[str, Variant], names: Sequence[str],
             make_inputs: Callable[[str], Sequence[torch.Tensor]], settings: Settings,
             on_row: Callable[[str, dict], None]) -> None:
    """Measure the named variants one after the other, each on a fresh set of its inputs
    (``make_inputs(variant.inputs)``, so only its own inputs count in its footprint); each
    row goes to ``on_row`` and a progress line is printed as soon as it is done."""
    for name in names:
        variant = variants[name]
        row = run_variant(name, variant, make_inputs(variant.inputs), settings)
        on_row(name, row)
        print(progress_line(config, name, row), flush=True)


def progress_line(config: str, name: str, row: Mapping[str, Any]) -> str:
    """A one-line summary printed as soon as a row is done (a killed run still shows it)."""
    if row.get("error"):
        return f"[{config}] {name}: ERROR {str(row['error']).splitlines()[0][:200]}"
    parts = [f"{row['ms']:.3f} ms"] if isinstance(row.get("ms"), float) else []
    if row.get("steady_reserved_mib") is not None:
        parts.append(f"steady {row['steady_reserved_mib']:.0f} MiB reserved "
                     f"({row['steady_allocated_mib']:.0f} allocated)")
    if row.get("build_peak_reserved_mib") is not None:
        parts.append(f"build peak {row['build_peak_reserved_mib']:.0f} MiB")
    if row.get("capture_s") is not None:
        parts.append(f"capture {row['capture_s']:.3f} s")
    if row.get("bitwise_equal_to_eager") is not None:
        parts.append("bitwise equal to eager" if row["bitwise_equal_to_eager"] else
                     f"DIFFERS from eager: {str(row.get('mismatch', '')).splitlines()[0][:160]}")
    return f"[{config}] {name}: " + ", ".join(parts)


def add_measure_args(parser: Any, default_iters: int, default_warmup: int) -> None:
    parser.add_argument("--iters", type=int, default=default_iters,
                        help=f"timed steps per variant (default {default_iters})")
    parser.add_argument("--warmup", type=int, default=default_warmup,
                        help=f"untimed steps per variant after build/capture (default {default_warmup})")
    parser.add_argument("--sync", action="store_true",
                        help="synchronise around every step and time with perf_counter "
                             "(default: back-to-back steps timed with CUDA events)")
    parser.add_argument("--traceback", action="store_true",
                        help="print full tracebacks of failing variants")


def csv_choice(known: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """An argparse ``type``: a comma-separated list of names out of ``known``."""

    def parse(value: str) -> list[str]:
        items = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [v for v in items if v not in known]
        if unknown or not items:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {unknown or value!r}; choose from {', '.join(known)}")
        return items

    return parse


def settings_from(args: Any) -> Settings:
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("--iters must be >= 1 and --warmup >= 0")
    return Settings(iters=args.iters, warmup=args.warmup, sync=args.sync, traceback=args.traceback)


def environment() -> dict:
    """Versions and device, for the JSON and the header line."""
    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    with contextlib.suppress(Exception):
        info["commit"] = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        ).stdout.strip() or None
    return info
