"""Speed and memory footprint of one train step of a GPT-block stack: te_graph against its peers.

Run from the repository root on a CUDA machine::

    python benchmarks/bench_step.py --out /tmp/bench_step.json --png /tmp/bench_step.png
    python benchmarks/bench_step.py --configs tiny --iters 200 --variants "eager,te_graph,kernel floor"

For each config (DESIGN.md "Performance targets") it builds a stack of ``GPTBlock``s (bf16
parameters, ``[s, b, h]`` activations, causal attention, dropout 0.1 on hidden states and
attention probabilities) and measures, one variant after the other in the same process:

* ``eager``               the blocks run eagerly;
* ``eager+recompute``     blocks built with ``recompute=True`` (full-layer checkpoint), eager;
* ``eager 3 buckets``     eager, the steps cycling through sequence lengths s, s/2, s/4;
* ``te_graph``            ``te_graph.make_graphed_callables(tuple(blocks), sample_args)``;
* ``te_graph+recompute``  recompute blocks graphed by te_graph (recompute inside the graphs);
* ``te_graph 3 buckets``  the stack graphed for s, s/2 and s/4 in one call
                          (``more_shapes=``), the steps cycling through them;
* ``torch graphed``       ``torch.cuda.make_graphed_callables(tuple(blocks), sample_args)``;
* ``TE graphed``          Transformer Engine's ``make_graphed_callables`` on the same blocks
                          (where TE is importable; an error row otherwise);
* ``whole-step graph``    the eager step (grad zeroing, forward, loss, backward) captured as
                          one CUDA graph, replayed after copying the input in: no launch or
                          Python cost at all, only the kernels and the gaps between dependent
                          kernels (which the kernel floor leaves out). A reference for the
                          least any graphing of the step can take, not a training method;
* ``te_graph step``       the same step through ``te_graph.make_graphed_step``: one graph,
                          exact dropout and recompute, guards checked at each call;
* ``te_graph verify 1/100`` ``te_graph`` with the runtime verifier on every 100th call
                          (``verify=te_graph.Verify(first=0, every=100)``): what sampling costs;
* ``te_graph verify all`` the verifier on every call (each call also runs eagerly and compares);
* ``kernel floor``        the GPU time of one eager step (``torch.profiler``: the sum of
                          every device event's time, averaged over a few steps);
* ``forward kernels``     the GPU time of one forward of the stack as in training (grad
                          on, no backward): what full recompute adds to a step.

The two profiled rows of every config run after all timed rows of all configs.

One train step = zero the parameters' grads in place (one ``torch._foreach_zero_``, no
optimizer), a forward of the stack on a fresh leaf input (rotating through a few pre-made
tensors, so graphed variants copy it into their first static input as in training),
``out.float().square().mean()`` and its backward.

Each row (``_measure.py`` says exactly how): median ms over ``--iters`` steps after
``--warmup`` untimed ones; the steady footprint, ``torch.cuda.max_memory_reserved()`` over
the timed steps after ``gc.collect(); empty_cache(); reset_peak_memory_stats()`` (reserved,
not allocated: ``max_memory_allocated()`` does not count graph-pool memory that capture
freed but every replay still writes, so it flatters graphs; allocated is shown beside it);
the peak reserved during build + capture (peak stats reset right before building); the
seconds of the ``make_graphed_callables`` call. Variants run from a clean allocator and
their graphs are freed (``te_graph.reset``) before the next.

The PASS/FAIL lines check the step targets (``_targets.py``); they inform and assert
nothing. A variant that raises prints its error in its row and the run goes on; every
finished row is printed at once and written to ``--out`` (a killed run keeps them). The
default run (3 configs, all rows, 100 timed steps each) is budgeted at a few minutes on
one H100.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Callable, Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402
from _measure import (  # noqa: E402
    Built,
    FirstOutput,
    Variant,
    add_measure_args,
    csv_choice,
    environment,
    make_forward,
    make_train_step,
    run_rows,
    settings_from,
    synchronised,
    whole_step_graph,
)
from _report import JsonReport, add_output_args, finish  # noqa: E402
from _targets import (  # noqa: E402
    EAGER,
    EAGER_BUCKETS,
    EAGER_RECOMPUTE,
    FORWARD_KERNELS,
    KERNEL_FLOOR,
    STEP_TARGETS,
    WHOLE_STEP_GRAPH,
    TE_GRAPH,
    TE_GRAPH_STEP,
    TE_GRAPH_VERIFY_ALL,
    TE_GRAPH_VERIFY_SAMPLED,
    TE_GRAPH_BUCKETS,
    TE_GRAPH_RECOMPUTE,
    TORCH_GRAPHED,
    TE_GRAPHED,
)
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
# The table's order. Each row starts from a clean allocator (cuBLAS workspaces included),
# so the order of the timed rows does not change their numbers; profiled rows run last.
VARIANTS = (EAGER, EAGER_RECOMPUTE, EAGER_BUCKETS, TE_GRAPH, TE_GRAPH_RECOMPUTE,
            TE_GRAPH_BUCKETS, TORCH_GRAPHED, TE_GRAPHED, WHOLE_STEP_GRAPH, TE_GRAPH_STEP, TE_GRAPH_VERIFY_SAMPLED,
            TE_GRAPH_VERIFY_ALL, KERNEL_FLOOR, FORWARD_KERNELS)
DROPOUT = 0.1
SEED = 1234
DEVICE = "cuda"  # a module constant so a CPU dry run of the plumbing can change it
NUM_INPUTS = 4  # pre-made inputs the one-shape steps rotate through
INPUTS_PER_BUCKET = 2  # the bucket steps rotate through 2 inputs per length
DEFAULT_ITERS = 100
DEFAULT_WARMUP = 10


def bucket_seqs(seq: int) -> tuple[int, int, int]:
    """The three sequence lengths of the bucket rows: s, s/2, s/4."""
    return seq, max(1, seq // 2), max(1, seq // 4)


# --------------------------------------------------------------------------- model


class _NoFork:
    """A tracker whose ``fork()`` does nothing, for the ``torch graphed`` peer.

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


def build_blocks(cfg: tuple, recompute: bool = False,
                 get_rng_tracker: Callable = rng.get_cuda_rng_tracker) -> list[GPTBlock]:
    layers, hidden, _, _ = cfg
    rng.model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)
    return [
        GPTBlock(hidden, hidden // 64, DROPOUT, recompute=recompute,
                 get_rng_tracker=get_rng_tracker, device=DEVICE, dtype=torch.bfloat16)
        for _ in range(layers)
    ]


def sample_args_for(cfg: tuple, seq: int | None = None) -> tuple:
    """One ``(x,)`` per layer, for sequence length ``seq`` (the config's by default)."""
    layers, hidden, cfg_seq, batch = cfg
    return tuple(
        (torch.randn(seq or cfg_seq, batch, hidden, device=DEVICE, dtype=torch.bfloat16,
                     requires_grad=True),)
        for _ in range(layers)
    )


def _params(blocks: Sequence[nn.Module]) -> list[torch.Tensor]:
    return [p for b in blocks for p in b.parameters()]


def _eager(cfg: tuple, recompute: bool = False) -> Built:
    blocks = build_blocks(cfg, recompute=recompute)
    return Built(make_train_step(blocks, _params(blocks)), keep=blocks)


def _forward_only(cfg: tuple) -> Built:
    blocks = build_blocks(cfg)
    return Built(make_forward(blocks), keep=blocks)


def _te_graph(cfg: tuple, recompute: bool = False, buckets: bool = False, verify_every: int = 0) -> Built:
    blocks = build_blocks(cfg, recompute=recompute)
    seqs = bucket_seqs(cfg[2]) if buckets else (cfg[2],)
    samples = [sample_args_for(cfg, s) for s in seqs]
    options = {"more_shapes": samples[1:]} if buckets else {}
    if verify_every:
        options["verify"] = te_graph.Verify(first=0, every=verify_every)
    graphed, seconds = synchronised(lambda: te_graph.make_graphed_callables(tuple(blocks), samples[0], **options))
    return Built(make_train_step(graphed, _params(blocks)), keep=(blocks, graphed),
                 capture_s=seconds, release=lambda: te_graph.reset(graphed))


def _torch_graphed(cfg: tuple) -> Built:
    blocks = build_blocks(cfg, get_rng_tracker=_no_fork_tracker)
    wrapped = tuple(FirstOutput(b) for b in blocks)
    samples = sample_args_for(cfg)
    graphed, seconds = synchronised(lambda: torch.cuda.make_graphed_callables(wrapped, samples))
    return Built(make_train_step(graphed, _params(blocks)), keep=(blocks, graphed), capture_s=seconds)


def _te_graphed(cfg: tuple) -> Built:
    """Transformer Engine's make_graphed_callables on the same blocks (an error row where TE
    is not importable). TE registers only its own tracker's generators with its graphs, so
    its blocks draw attention dropout outside any fork, as the torch peer's do."""
    from transformer_engine.pytorch import make_graphed_callables as te_make_graphed_callables

    blocks = build_blocks(cfg, get_rng_tracker=_no_fork_tracker)
    wrapped = tuple(FirstOutput(b) for b in blocks)
    samples = sample_args_for(cfg)
    graphed, seconds = synchronised(lambda: te_make_graphed_callables(wrapped, samples))
    return Built(make_train_step(graphed, _params(blocks)), keep=(blocks, graphed), capture_s=seconds,
                 release=lambda: [g.reset() for g in graphed])


def _whole_step_graph(cfg: tuple) -> Built:
    _, hidden, seq, batch = cfg
    blocks = build_blocks(cfg)
    static_x = torch.zeros(seq, batch, hidden, device=DEVICE, dtype=torch.bfloat16)
    step = make_train_step(blocks, _params(blocks))
    (run, free), seconds = synchronised(lambda: whole_step_graph(step, static_x, rng.get_cuda_rng_tracker()))
    return Built(run, keep=(blocks, static_x), capture_s=seconds, release=free)


def _te_graph_step(cfg: tuple) -> Built:
    """The product's whole-step graph (``te_graph.make_graphed_step``) of the same step."""
    _, hidden, seq, batch = cfg
    blocks = build_blocks(cfg)
    static_x = torch.zeros(seq, batch, hidden, device=DEVICE, dtype=torch.bfloat16)
    step = make_train_step(blocks, _params(blocks))
    graphed, seconds = synchronised(lambda: te_graph.make_graphed_step(step, (static_x,), modules=blocks))
    return Built(graphed, keep=(blocks, static_x, graphed), capture_s=seconds, release=graphed.reset)


def variants_for(cfg: tuple) -> dict[str, Variant]:
    labels = [f"s{s}" for _ in range(INPUTS_PER_BUCKET) for s in bucket_seqs(cfg[2])]
    return {
        EAGER: Variant(lambda: _eager(cfg)),
        EAGER_RECOMPUTE: Variant(lambda: _eager(cfg, recompute=True)),
        EAGER_BUCKETS: Variant(lambda: _eager(cfg), inputs="buckets", labels=labels),
        KERNEL_FLOOR: Variant(lambda: _eager(cfg), profiled=True),
        FORWARD_KERNELS: Variant(lambda: _forward_only(cfg), profiled=True),
        TE_GRAPH: Variant(lambda: _te_graph(cfg)),
        TE_GRAPH_RECOMPUTE: Variant(lambda: _te_graph(cfg, recompute=True)),
        TE_GRAPH_BUCKETS: Variant(lambda: _te_graph(cfg, buckets=True), inputs="buckets", labels=labels),
        TORCH_GRAPHED: Variant(lambda: _torch_graphed(cfg)),
        TE_GRAPHED: Variant(lambda: _te_graphed(cfg)),
        WHOLE_STEP_GRAPH: Variant(lambda: _whole_step_graph(cfg)),
        TE_GRAPH_STEP: Variant(lambda: _te_graph_step(cfg)),
        TE_GRAPH_VERIFY_SAMPLED: Variant(lambda: _te_graph(cfg, verify_every=100)),
        TE_GRAPH_VERIFY_ALL: Variant(lambda: _te_graph(cfg, verify_every=1)),
    }


def make_inputs(cfg: tuple, kind: str) -> list[torch.Tensor]:
    """The step inputs (the same numbers every time): ``single``, all at the config's
    length; ``buckets``, cycling through s, s/2, s/4."""
    _, hidden, seq, batch = cfg
    gen = torch.Generator(device=DEVICE).manual_seed(SEED + 1)
    if kind == "single":
        seqs = [seq] * NUM_INPUTS
    else:
        seqs = [s for _ in range(INPUTS_PER_BUCKET) for s in bucket_seqs(seq)]
    return [torch.randn(s, batch, hidden, device=DEVICE, dtype=torch.bfloat16, generator=gen)
            for s in seqs]


# --------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Median ms per train step and memory footprint of a GPTBlock stack: eager, "
                    "torch.cuda.make_graphed_callables, te_graph (with and without recompute, "
                    "one and three sequence-length buckets) and the kernel floor.")
    parser.add_argument("--configs", default="tiny,small,medium",
                        type=csv_choice(tuple(CONFIGS), "config"),
                        help="comma-separated configs (default: tiny,small,medium)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        type=csv_choice(VARIANTS, "variant"),
                        help="comma-separated variants, in the order to run (default: all)")
    add_measure_args(parser, DEFAULT_ITERS, DEFAULT_WARMUP)
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    settings = settings_from(args)
    if not torch.cuda.is_available():
        sys.exit("bench_step.py: CUDA is not available; this benchmark needs a CUDA GPU.")
    env = environment()
    print(f"torch {env['torch']}, CUDA {env['cuda']}, {env['device']}; iters {args.iters}, warmup "
          f"{args.warmup}, timing {'sync+perf_counter' if args.sync else 'CUDA events, back to back'}",
          flush=True)
    report = JsonReport(args.out, {**env, "benchmark": "bench_step", "iters": args.iters,
                                   "warmup": args.warmup, "timing": "sync" if args.sync else "events",
                                   "dropout": DROPOUT})
    for config in args.configs:
        layers, hidden, seq, batch = CONFIGS[config]
        report.add_config(config, {"layers": layers, "hidden": hidden, "seq": seq, "batch": batch,
                                   "heads": hidden // 64, "buckets": list(bucket_seqs(seq))})
    # Profiled rows last, after every timed row: a profiler session may leave CUPTI hooked
    # into later launches (and CUPTI re-initialisation has not always mixed with graphs).
    for profiled in (False, True):
        for config in args.configs:
            cfg = CONFIGS[config]
            variants = variants_for(cfg)
            names = [n for n in args.variants if variants[n].profiled == profiled]
            if not names:
                continue
            print(f"\n== {describe(config)}{' (profiled rows)' if profiled else ''} ==", flush=True)
            run_rows(config, variants, names, lambda kind, cfg=cfg: make_inputs(cfg, kind), settings,
                     lambda name, row, config=config: report.add_row(config, name, row))
    finish(report, args.variants, STEP_TARGETS, args.png,
           f"bench_step on {env['device']} (torch {env['torch']}, CUDA {env['cuda']})")


def describe(config: str) -> str:
    layers, hidden, seq, batch = CONFIGS[config]
    return (f"{config}: {layers} layers, h {hidden}, s {seq}, b {batch}, heads {hidden // 64}, "
            f"bf16, dropout {DROPOUT}; buckets s {'/'.join(map(str, bucket_seqs(seq)))}")


if __name__ == "__main__":
    main()
