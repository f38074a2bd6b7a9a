"""Transformer Engine's own layers: te_graph against TE's ``make_graphed_callables`` and
eager TE, bf16 and FP8, with and without recompute.

Run from the repository root on a GPU with Transformer Engine (on the GPU machine:
``source .te/setup.sh`` first)::

    python benchmarks/bench_te.py --out /tmp/bench_te.json --png /tmp/bench_te.png
    python benchmarks/bench_te.py --configs te-small --precisions bf16 --iters 50
    python benchmarks/bench_te.py --variants "te_graph,whole-step graph,te_graph step" --no-recompute

For each config it builds a stack of ``te.TransformerLayer`` (bf16 parameters, causal
attention, dropout 0.1 under TE's RNG tracker, ``[s, b, h]`` activations) and measures, one
row after the other in the same process (``_measure.py`` says exactly how: median ms over
``--iters`` back-to-back steps, steady footprint = ``max_memory_reserved()``, capture peak,
capture seconds), for each precision (``bf16``; ``fp8-delayed`` = DelayedScaling;
``fp8-current`` = Float8CurrentScaling; ``fp8-delayed-weights`` = DelayedScaling with FP8
primary weights, the layers built inside ``te.quantized_model_init`` with fused QKV
parameters, which TE needs for them), the step running inside
``te.autocast(enabled, recipe)``:

* ``eager``            the layers run eagerly;
* ``TE graphed``       ``te.make_graphed_callables(tuple(layers), sample_args, enabled=..., recipe=...)``;
* ``te_graph``         ``te_graph.make_graphed_callables`` with the same arguments;

* ``whole-step graph`` the eager step (grad zeroing, forward under ``te.autocast`` with its
  FP8 amax reductions and scale updates, loss, backward) captured as one CUDA graph: the
  reference for what the GPU needs;
* ``te_graph step``    the same step through ``te_graph.make_graphed_step`` (the product's
  whole-step graph: exact dropout, guards checked at each call); its first call is verified
  (``verify=te_graph.Verify(first=1, on_mismatch="warn")``, in the untimed warmup): the row
  says whether the graph's step was bitwise equal to the eager step;

and the first three with each layer recomputed (``+rc``): TE's own
``te.distributed.checkpoint`` for eager and TE's graphs, ``checkpointing.checkpoint`` (exact
dropout in the recompute) for te_graph, both driven by TE's tracker.

The target lines (peers: te_graph faster than TE's graphs on every row, steady footprint
and capture peak no larger; FP8: each FP8 row of te_graph within 1.15x of its bf16 row
and within 1.1x of the whole-step graph; the product's whole-step graph within 1.02x of
the hand-made one, and bitwise equal to eager) inform and assert nothing. A row that fails prints its error and
the run goes on.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Callable, Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402
from _measure import (  # noqa: E402
    Built,
    Variant,
    add_measure_args,
    csv_choice,
    environment,
    run_forward,
    run_rows,
    settings_from,
    synchronised,
    whole_step_graph,
)
from _report import JsonReport, add_output_args, table_lines, write_png  # noqa: E402
from _targets import (  # noqa: E402
    EAGER,
    TE_GRAPH,
    TE_GRAPH_STEP,
    TE_GRAPHED,
    WHOLE_STEP_GRAPH,
    format_lines,
    fp8_targets,
    peer_targets,
    whole_step_targets,
)
from torch import nn  # noqa: E402

import checkpointing  # noqa: E402
import te_graph  # noqa: E402

CONFIGS = {
    # name: (layers, hidden, ffn, heads, seq, batch)
    "te-small": (6, 1024, 4096, 16, 512, 2),  # the peer table's config
    "te-tiny": (24, 256, 1024, 4, 128, 2),  # launch-bound
}
PRECISIONS = ("bf16", "fp8-delayed", "fp8-current", "fp8-delayed-weights")
DROPOUT = 0.1
SEED = 1234
NUM_INPUTS = 4


def te():
    import transformer_engine.pytorch as te_pytorch

    return te_pytorch


def recipe_for(precision: str):
    from transformer_engine.common import recipe

    return {"bf16": None, "fp8-delayed": recipe.DelayedScaling(), "fp8-current": recipe.Float8CurrentScaling(),
            "fp8-delayed-weights": recipe.DelayedScaling()}[precision]


_TRACKER = None


def tracker():
    return _TRACKER


def reseed() -> None:
    global _TRACKER
    if _TRACKER is None:
        _TRACKER = te().distributed.CudaRNGStatesTracker()
    _TRACKER.reset()
    _TRACKER.add("model-parallel-rng", SEED + 2718)
    torch.manual_seed(SEED)
    torch.cuda.manual_seed(SEED)


class Recomputed(nn.Module):
    """A layer whose activations are recomputed in the backward: TE's checkpoint or ours."""

    def __init__(self, layer: nn.Module, ours: bool):
        super().__init__()
        self.layer = layer
        self.ours = ours

    def forward(self, x):
        if self.ours:
            return checkpointing.checkpoint(self.layer, x, get_rng_state_tracker=tracker)
        return te().distributed.checkpoint(self.layer, x, get_rng_state_tracker=tracker)


def build_layers(cfg: tuple, precision: str, recompute: bool, ours: bool) -> list[nn.Module]:
    layers, hidden, ffn, heads, _, _ = cfg
    reseed()
    fp8_weights = precision.endswith("-weights")  # FP8 primary weights
    with te().quantized_model_init(enabled=fp8_weights, recipe=recipe_for(precision)):
        made = [
            te().TransformerLayer(hidden, ffn, heads, hidden_dropout=DROPOUT, attention_dropout=DROPOUT,
                                  params_dtype=torch.bfloat16, self_attn_mask_type="causal",
                                  get_rng_state_tracker=tracker,
                                  fuse_qkv_params=fp8_weights)  # TE cannot split FP8 weights
            for _ in range(layers)
        ]
    return [Recomputed(m, ours) for m in made] if recompute else made


def sample_args_for(cfg: tuple) -> tuple:
    layers, hidden, _, _, seq, batch = cfg
    return tuple((torch.randn(seq, batch, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True),)
                 for _ in range(layers))


def make_step(layers: Sequence[Callable], params: Sequence[torch.Tensor], precision: str) -> Callable:
    """One train step inside ``te.autocast``: grads zeroed in place, forward, loss, backward."""
    recipe = recipe_for(precision)
    params = tuple(params)

    def step(x: torch.Tensor) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)
        with te().autocast(enabled=recipe is not None, recipe=recipe):
            out = run_forward(layers, x, {})
        out.float().square().mean().backward()

    return step


def fresh_state() -> None:
    """Transformer Engine's global FP8 state and te_graph's process-wide state as a process
    running only this row starts with.

    Under delayed scaling every TE module puts its amaxes in TE's process-wide buffers, keyed
    by the recipe, and nothing takes them out: every autocast exit and first backward after
    it reduces and updates all of them (``reduce_and_update_fp8_tensors``), whatever the
    recipe now running. Rows built one after the other in one process would each pay for the
    layers of every delayed-scaling row before them, on the host and on the GPU (a
    whole-step graph captures their reductions too). TE's own tests reset it the same way.
    ``te_graph.reset()`` also frees te_graph's graph of that reduction (``fp8_reduction``),
    which holds the earlier rows' tensors."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    te_graph.reset()
    FP8GlobalStateManager.reset()


def build(cfg: tuple, precision: str, kind: str, recompute: bool) -> Built:
    fresh_state()
    layers = build_layers(cfg, precision, recompute, ours=kind == TE_GRAPH)
    params = [p for m in layers for p in m.parameters()]
    if kind == EAGER:
        return Built(make_step(layers, params, precision), keep=layers)
    if kind == WHOLE_STEP_GRAPH:
        _, hidden, _, _, seq, batch = cfg
        static_x = torch.zeros(seq, batch, hidden, device="cuda", dtype=torch.bfloat16)
        step = make_step(layers, params, precision)
        (run, free), seconds = synchronised(lambda: whole_step_graph(step, static_x, tracker()))
        return Built(run, keep=(layers, static_x), capture_s=seconds, release=free)
    if kind == TE_GRAPH_STEP:
        return _te_graph_step(cfg, layers, params, precision)
    recipe = recipe_for(precision)
    graph = te().make_graphed_callables if kind == TE_GRAPHED else te_graph.make_graphed_callables
    extra = {} if kind == TE_GRAPHED else {"get_rng_state_tracker": tracker}
    graphed, seconds = synchronised(lambda: graph(tuple(layers), sample_args_for(cfg), enabled=recipe is not None,
                                                  recipe=recipe, **extra))
    release = (lambda: te_graph.reset(graphed)) if kind == TE_GRAPH else (lambda: [g.reset() for g in graphed])
    return Built(make_step(graphed, params, precision), keep=(layers, graphed), capture_s=seconds, release=release)


def _te_graph_step(cfg: tuple, layers: list[nn.Module], params: list[torch.Tensor], precision: str) -> Built:
    """The product's whole-step graph of the same step; its first call (untimed warmup) is
    verified against the eager step, bitwise, and the row keeps what that found."""
    _, hidden, _, _, seq, batch = cfg
    static_x = torch.zeros(seq, batch, hidden, device="cuda", dtype=torch.bfloat16)
    step = make_step(layers, params, precision)
    verify = te_graph.Verify(first=1, on_mismatch="warn")
    graphed, seconds = synchronised(lambda: te_graph.make_graphed_step(
        step, (static_x,), modules=layers, get_rng_state_tracker=tracker, verify=verify))
    found: dict = {}

    def run(x: torch.Tensor) -> None:
        if found:
            graphed(x)
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graphed(x)
        reports = [str(w.message) for w in caught if "te_graph's verifier" in str(w.message)]
        found.update(bitwise_equal_to_eager=not reports, **({"mismatch": reports[0]} if reports else {}))

    return Built(run, keep=(layers, static_x, graphed), capture_s=seconds, release=graphed.reset,
                 checks=lambda: dict(found))


def row_name(kind: str, precision: str, recompute: bool) -> str:
    return f"{kind} {precision}{'+rc' if recompute else ''}"


KINDS = (EAGER, TE_GRAPHED, TE_GRAPH, WHOLE_STEP_GRAPH, TE_GRAPH_STEP)


def variants_for(cfg: tuple, precisions: Sequence[str], kinds: Sequence[str] = KINDS,
                 recomputes: Sequence[bool] = (False, True)) -> dict[str, Variant]:
    # The whole-step graphs are rows without recompute only: TE's checkpoint copies RNG
    # states in and out around its recompute, which one graph of the step cannot replay.
    return {
        row_name(kind, precision, recompute): Variant(
            lambda kind=kind, precision=precision, recompute=recompute: build(cfg, precision, kind, recompute))
        for precision in precisions for recompute in recomputes
        for kind in kinds if not (recompute and kind in (WHOLE_STEP_GRAPH, TE_GRAPH_STEP))
    }


def make_inputs(cfg: tuple, kind: str) -> list[torch.Tensor]:
    _, hidden, _, _, seq, batch = cfg
    gen = torch.Generator(device="cuda").manual_seed(SEED + 1)
    return [torch.randn(seq, batch, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(NUM_INPUTS)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="te.TransformerLayer stacks: eager TE, TE's graphs and "
                                                 "te_graph, bf16 and FP8, with and without recompute.")
    parser.add_argument("--configs", default=",".join(CONFIGS), type=csv_choice(tuple(CONFIGS), "config"))
    parser.add_argument("--precisions", default=",".join(PRECISIONS), type=csv_choice(PRECISIONS, "precision"))
    parser.add_argument("--variants", default=",".join(KINDS), type=csv_choice(KINDS, "variant"),
                        help="comma-separated kinds of rows (default: all)")
    parser.add_argument("--no-recompute", action="store_true", help="leave out the +rc rows")
    add_measure_args(parser, 100, 10)
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    settings = settings_from(args)
    if not torch.cuda.is_available():
        sys.exit("bench_te.py: CUDA is not available; this benchmark needs a CUDA GPU.")
    try:
        import transformer_engine as te_root
    except ImportError:
        sys.exit("bench_te.py: Transformer Engine is not importable (on the GPU machine: source .te/setup.sh).")
    env = {**environment(), "transformer_engine": te_root.__version__}
    print(f"torch {env['torch']}, CUDA {env['cuda']}, TE {env['transformer_engine']}, {env['device']}; "
          f"iters {args.iters}, warmup {args.warmup}", flush=True)
    report = JsonReport(args.out, {**env, "benchmark": "bench_te", "iters": args.iters, "warmup": args.warmup,
                                   "dropout": DROPOUT})
    recomputes = (False,) if args.no_recompute else (False, True)
    order = list(variants_for(CONFIGS[args.configs[0]], args.precisions, args.variants, recomputes))
    for config in args.configs:
        layers, hidden, ffn, heads, seq, batch = CONFIGS[config]
        report.add_config(config, {"layers": layers, "hidden": hidden, "ffn": ffn, "heads": heads,
                                   "seq": seq, "batch": batch})
        print(f"\n== {config}: {layers} x te.TransformerLayer, h {hidden}, ffn {ffn}, heads {heads}, "
              f"s {seq}, b {batch}, dropout {DROPOUT} ==", flush=True)
        cfg = CONFIGS[config]
        variants = variants_for(cfg, args.precisions, args.variants, recomputes)
        run_rows(config, variants, list(variants), lambda kind, cfg=cfg: make_inputs(cfg, kind), settings,
                 lambda name, row, config=config: report.add_row(config, name, row))
    results = report.results(order)
    for config, rows in results.items():
        print(f"\n{config}:")
        print("\n".join(table_lines(rows)), flush=True)
    pairs = [(row_name(TE_GRAPH, p, rc), row_name(TE_GRAPHED, p, rc)) for p in args.precisions for rc in (False, True)]
    lines = peer_targets(results, pairs)
    print("\nPeer targets (informational; they assert nothing):")
    print("\n".join(format_lines(lines)), flush=True)
    fp8 = {p: (row_name(TE_GRAPH, p, False), row_name(TE_GRAPH, "bf16", False), row_name(WHOLE_STEP_GRAPH, p, False))
           for p in args.precisions if p != "bf16"}
    fp8_lines = fp8_targets(results, fp8)
    print("\nFP8 targets (informational; they assert nothing):")
    print("\n".join(format_lines(fp8_lines)), flush=True)
    step_lines = whole_step_targets(results, [(row_name(TE_GRAPH_STEP, p, False), row_name(WHOLE_STEP_GRAPH, p, False))
                                              for p in args.precisions])
    print("\nWhole-step targets (informational; they assert nothing):")
    print("\n".join(format_lines(step_lines)), flush=True)
    report.set_targets(lines + fp8_lines + step_lines)
    if args.png and write_png(args.png, results, f"bench_te on {env['device']} (TE {env['transformer_engine']})"):
        print(f"table plotted to {args.png}")


if __name__ == "__main__":
    main()
