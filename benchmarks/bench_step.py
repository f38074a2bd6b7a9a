"""Speed and memory of one train step of a GPT-block stack: te_graph against its peers.

Run from the repository root on a CUDA machine::

    python benchmarks/bench_step.py                       # tiny, small, medium
    python benchmarks/bench_step.py --configs tiny --iters 100 --out /tmp/bench.json

For each config (DESIGN.md "Performance targets") it builds a stack of ``GPTBlock``s (bf16
parameters, ``[s, b, h]`` activations, causal attention, dropout 0.1 on hidden states and
attention probabilities) and measures, one variant after the other in the same process:

* ``eager``               the blocks run eagerly;
* ``eager+recompute``     blocks built with ``recompute=True`` (full-layer checkpoint), eager;
* ``torch``               ``torch.cuda.make_graphed_callables(tuple(blocks), sample_args)``;
* ``te_graph``            ``te_graph.make_graphed_callables(tuple(blocks), sample_args)``;
* ``te_graph+recompute``  recompute blocks graphed by te_graph (recompute inside the graphs);
* ``kernel floor``        the sum of GPU time of every device event of one eager step,
                          from ``torch.profiler`` (averaged over a few steps).

One train step = zero the parameters' grads in place (``set_to_none=False``, one
``torch._foreach_zero_`` for every variant; no optimizer), a forward of the whole stack on a
fresh leaf input (rotating through a few pre-made tensors, so graphed variants copy it into
their first layer's static input as in real training), ``out.float().square().mean()`` and
its backward.

Time: after ``--warmup`` steps, ``--iters`` steps are run back to back with a CUDA event
before and after each; the table shows the median per-step time (steady-state throughput:
a CPU-bound step measures the launch time, a GPU-bound one the GPU time). ``--sync`` instead
synchronises around each step and uses ``time.perf_counter`` (latency of an isolated step).
Memory: ``torch.cuda.reset_peak_memory_stats()`` right before a variant builds its model;
``max_memory_allocated()`` over the whole variant (build, sample args, warmup, capture,
timed steps). Each variant's model is dropped, ``gc.collect()`` and
``torch.cuda.empty_cache()`` run before the next, so variants do not pollute each other.
The last column, peak *reserved* memory, also shows graph pools' cached blocks, which
``max_memory_allocated`` does not count once capture has freed them.

The printed PASS/FAIL lines check DESIGN.md's targets; they inform, they assert nothing.
A variant that raises prints its error in its row and the run goes on.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
from _report import record_failure  # noqa: E402
from torch import nn  # noqa: E402

import rng  # noqa: E402
import te_graph  # noqa: E402
from examples.gpt import GPTBlock  # noqa: E402

CONFIGS = {
    # name: (layers, hidden, seq, batch)
    "tiny": (24, 256, 128, 2),
    "small": (12, 1024, 512, 2),
    "medium": (4, 2048, 2048, 1),
}
VARIANTS = ("eager", "eager+recompute", "torch", "te_graph", "te_graph+recompute", "kernel floor")
DROPOUT = 0.1
SEED = 1234
NUM_INPUTS = 4  # pre-made inputs the train steps rotate through
PROFILE_STEPS = 5
MIB = 1024.0 * 1024.0


# --------------------------------------------------------------------------- model


class _NoFork:
    """A tracker whose ``fork()`` does nothing, for the ``torch`` peer.

    ``torch.cuda.make_graphed_callables`` registers only the default CUDA generator with its
    graphs, so attention dropout drawn under our tracker's ``'model-parallel-rng'`` fork
    (another generator swapped in) would fail to capture or draw wrong numbers. The torch
    peer's blocks therefore draw attention dropout from the default generator, outside any
    fork: the same dropout amount and the same kernels, only the stream differs.
    """

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        yield


_NO_FORK = _NoFork()


def _no_fork_tracker() -> _NoFork:
    return _NO_FORK


class _FirstOutput(nn.Module):
    """``block(x)[0]``: torch's make_graphed_callables needs tensor-only outputs, and a
    GPTBlock returns ``(hidden_states, None)``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)[0]


def build_blocks(cfg, recompute=False, get_rng_tracker=rng.get_cuda_rng_tracker):
    layers, hidden, _, _ = cfg
    rng.model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)
    return [
        GPTBlock(hidden, hidden // 64, DROPOUT, recompute=recompute,
                 get_rng_tracker=get_rng_tracker, device="cuda", dtype=torch.bfloat16)
        for _ in range(layers)
    ]


def sample_args_for(cfg):
    layers, hidden, seq, batch = cfg
    return tuple(
        (torch.randn(seq, batch, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True),)
        for _ in range(layers)
    )


def make_train_step(layers, params):
    """One train step over ``layers`` (callables returning a tensor or a tuple)."""
    params = tuple(params)

    def step(x):
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)  # zero_grad(set_to_none=False), one launch group
        h = x.detach().requires_grad_(True)  # a new leaf each step, like a real input
        for layer in layers:
            out = layer(h)
            h = out[0] if isinstance(out, tuple) else out
        h.float().square().mean().backward()

    return step


def build_variant(name, cfg):
    """(step function, keepalive) for a variant; all capture happens in here."""
    if name in ("eager", "eager+recompute", "kernel floor"):
        blocks = build_blocks(cfg, recompute=name == "eager+recompute")
        params = [p for b in blocks for p in b.parameters()]
        return make_train_step(blocks, params), blocks
    if name == "torch":
        blocks = build_blocks(cfg, get_rng_tracker=_no_fork_tracker)
        wrapped = tuple(_FirstOutput(b) for b in blocks)
        graphed = torch.cuda.make_graphed_callables(wrapped, sample_args_for(cfg))
        params = [p for b in blocks for p in b.parameters()]
        return make_train_step(graphed, params), (blocks, graphed)
    if name in ("te_graph", "te_graph+recompute"):
        blocks = build_blocks(cfg, recompute=name == "te_graph+recompute")
        graphed = te_graph.make_graphed_callables(tuple(blocks), sample_args_for(cfg))
        params = [p for b in blocks for p in b.parameters()]
        return make_train_step(graphed, params), (blocks, graphed)
    raise ValueError(f"unknown variant {name!r}")


# --------------------------------------------------------------------------- measuring


def make_inputs(cfg):
    _, hidden, seq, batch = cfg
    gen = torch.Generator(device="cuda").manual_seed(SEED + 1)
    return [
        torch.randn(seq, batch, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(NUM_INPUTS)
    ]


def time_steps(step, inputs, iters, sync):
    times = []
    if sync:
        for i in range(iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(inputs[i % len(inputs)])
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
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


def _event_device_us(event) -> float:
    for attr in ("device_time_total", "cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return float(event.time_range.elapsed_us())


def kernel_floor_ms(step, inputs, steps=PROFILE_STEPS):
    """Sum of device time of all GPU events (kernels, memcpy, memset) per eager step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(inputs[i % len(inputs)])
        torch.cuda.synchronize()
    total_us = 0.0
    count = 0
    for event in prof.events():
        if getattr(event, "device_type", None) == DeviceType.CUDA:
            total_us += _event_device_us(event)
            count += 1
    if count == 0:
        raise RuntimeError("the profiler recorded no CUDA device events (is CUPTI available?)")
    return total_us / 1e3 / steps


def _free():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run_variant(name, cfg, inputs, args):
    result = {"variant": name}
    _free()
    torch.cuda.reset_peak_memory_stats()
    try:
        step, keep = build_variant(name, cfg)
        for i in range(args.warmup):
            step(inputs[i % len(inputs)])
        torch.cuda.synchronize()
        if name == "kernel floor":
            result["ms"] = kernel_floor_ms(step, inputs)
        else:
            t0 = time.perf_counter()
            times = time_steps(step, inputs, args.iters, args.sync)
            result["wall_mean_ms"] = (time.perf_counter() - t0) * 1e3 / args.iters
            result["times_ms"] = times
            result["ms"] = statistics.median(times)
            result["peak_mib"] = torch.cuda.max_memory_allocated() / MIB
            result["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / MIB
        del step, keep
    except Exception as error:  # noqa: BLE001 - report and go on
        record_failure(result, error, args.traceback)
    _free()
    return result


# --------------------------------------------------------------------------- reporting


def _fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def print_table(name, cfg, results):
    layers, hidden, seq, batch = cfg
    print(f"\n== {name}: {layers} layers, h {hidden}, s {seq}, b {batch}, heads {hidden // 64}, "
          f"bf16, dropout {DROPOUT} ==")
    header = (f"{'variant':<20} {'median ms/step':>15} {'x floor':>8} {'peak MiB':>10} "
              f"{'x eager peak':>13} {'reserved MiB':>13}")
    print(header)
    print("-" * len(header))
    floor = results.get("kernel floor", {}).get("ms")
    eager_peak = results.get("eager", {}).get("peak_mib")
    for variant, r in results.items():
        if "error" in r:
            message = r["error"].replace("\n", " ")
            print(f"{variant:<20} ERROR: {message[:160]}")
            continue
        ms = r.get("ms")
        peak = r.get("peak_mib")
        print(
            f"{variant:<20} {_fmt(ms, '15.3f')} "
            f"{_fmt(ms / floor if ms and floor else None, '8.2f', '       -')} "
            f"{_fmt(peak, '10.1f', '         -')} "
            f"{_fmt(peak / eager_peak if peak and eager_peak else None, '13.2f', '            -')} "
            f"{_fmt(r.get('peak_reserved_mib'), '13.1f', '            -')}"
        )


def check_targets(all_results):
    """DESIGN.md's targets as (label, detail, PASS/FAIL/n/a) lines."""
    lines = []

    def get(config, variant, key="ms"):
        return all_results.get(config, {}).get(variant, {}).get(key)

    def line(config, label, ok, detail):
        verdict = "n/a" if ok is None else ("PASS" if ok else "FAIL")
        lines.append((config, label, detail, verdict))

    te, floor = get("tiny", "te_graph"), get("tiny", "kernel floor")
    if "tiny" in all_results:
        line("tiny", "te_graph <= 1.25x floor",
             None if not (te and floor) else te <= 1.25 * floor,
             f"{te / floor:.2f}x" if te and floor else "missing numbers")
        peer = get("tiny", "torch")
        line("tiny", "te_graph >= 2x faster than torch",
             None if not (te and peer) else peer >= 2 * te,
             f"{peer / te:.2f}x faster" if te and peer else "missing numbers")
    if "small" in all_results:
        te, floor = get("small", "te_graph"), get("small", "kernel floor")
        line("small", "te_graph <= 1.1x floor",
             None if not (te and floor) else te <= 1.1 * floor,
             f"{te / floor:.2f}x" if te and floor else "missing numbers")
    if "medium" in all_results:
        te, eager = get("medium", "te_graph"), get("medium", "eager")
        line("medium", "te_graph not slower than eager",
             None if not (te and eager) else te <= eager,
             f"{te:.3f} vs {eager:.3f} ms ({te / eager:.3f}x)" if te and eager else "missing numbers")
    for config in all_results:
        te, eager = get(config, "te_graph", "peak_mib"), get(config, "eager", "peak_mib")
        line(config, "te_graph peak <= 1.15x eager peak",
             None if not (te and eager) else te <= 1.15 * eager,
             f"{te:.0f} vs {eager:.0f} MiB ({te / eager:.2f}x)" if te and eager else "missing numbers")
        te_rc = get(config, "te_graph+recompute", "peak_mib")
        eager_rc = get(config, "eager+recompute", "peak_mib")
        if te_rc and eager_rc:
            saving = f"saving vs no recompute: eager {eager - eager_rc:.0f} MiB" if eager else ""
            saving += f", te_graph {te - te_rc:.0f} MiB" if te else ""
            detail = f"{te_rc:.0f} vs {eager_rc:.0f} MiB ({te_rc / eager_rc:.2f}x); {saving}"
        else:
            detail = "missing numbers"
        line(config, "recompute saving kept (te_graph+recompute <= 1.15x eager+recompute peak)",
             None if not (te_rc and eager_rc) else te_rc <= 1.15 * eager_rc, detail)
    return lines


def _csv(value, known, what):
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in known]
    if unknown or not items:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {unknown or value!r}; choose from {', '.join(known)}")
    return items


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Median ms per train step and peak memory of a GPTBlock stack: eager, "
                    "torch.cuda.make_graphed_callables, te_graph (with and without recompute) "
                    "and the kernel floor.")
    parser.add_argument("--configs", default="tiny,small,medium",
                        type=lambda v: _csv(v, tuple(CONFIGS), "config"),
                        help="comma-separated configs (default: tiny,small,medium)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        type=lambda v: _csv(v, VARIANTS, "variant"),
                        help="comma-separated variants (default: all)")
    parser.add_argument("--iters", type=int, default=50, help="timed steps per variant (default 50)")
    parser.add_argument("--warmup", type=int, default=10,
                        help="untimed steps per variant after build/capture (default 10)")
    parser.add_argument("--sync", action="store_true",
                        help="synchronise around every step and time with perf_counter "
                             "(default: back-to-back steps timed with CUDA events)")
    parser.add_argument("--out", default=None, help="optional JSON path for the raw numbers")
    parser.add_argument("--traceback", action="store_true", help="print full tracebacks of failing variants")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_step.py: CUDA is not available; this benchmark needs a CUDA GPU.")
    device = torch.cuda.get_device_name()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {device}; iters {args.iters}, "
          f"warmup {args.warmup}, timing {'sync+perf_counter' if args.sync else 'CUDA events, back to back'}")
    all_results = {}
    for config in args.configs:
        cfg = CONFIGS[config]
        inputs = make_inputs(cfg)
        results = {}
        for variant in args.variants:
            results[variant] = run_variant(variant, cfg, inputs, args)
        del inputs
        _free()
        all_results[config] = results
        print_table(config, cfg, results)
        sys.stdout.flush()
    targets = check_targets(all_results)
    print("\nDESIGN.md targets (informational):")
    for config, label, detail, verdict in targets:
        print(f"  {verdict:<4} {config:<7} {label}: {detail}")
    if args.out:
        payload = {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": device,
            "iters": args.iters,
            "warmup": args.warmup,
            "timing": "sync" if args.sync else "events",
            "configs": {
                config: {"layers": CONFIGS[config][0], "hidden": CONFIGS[config][1],
                         "seq": CONFIGS[config][2], "batch": CONFIGS[config][3],
                         "variants": all_results[config]}
                for config in all_results
            },
            "targets": [dict(zip(("config", "target", "detail", "verdict"), t)) for t in targets],
        }
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"raw numbers written to {args.out}")


if __name__ == "__main__":
    main()
