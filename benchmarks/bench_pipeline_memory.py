"""Memory and time of per-(layer, microbatch) graphs under an interleaved 1F1B pipeline
order, with and without ``reuse_graph_input_output_buffers`` (issue "pipeline"), beside
Transformer Engine's ``make_graphed_callables`` with ``_order`` and
``_reuse_graph_input_output_buffers`` where TE is importable.

Run from the repository root on a CUDA machine::

    python benchmarks/bench_pipeline_memory.py
    python benchmarks/bench_pipeline_memory.py --microbatches 8 --pipeline-size 4 --out /tmp/pp.json

What it does, on one GPU, as pipeline rank ``--rank`` of ``--pipeline-size`` would see it:

1. Builds ``--chunks`` x ``--layers-per-chunk`` ``GPTBlock``s (default 2 x 4; h 1024, s 512,
   b 2, bf16, dropout 0 so graphed and eager training must agree bitwise) and an interleaved
   1F1B order for them (:func:`interleaved_1f1b_order`: warmup forwards, steady one-forward-
   one-backward, cooldown backwards, microbatches taken in groups of ``--pipeline-size``
   per chunk as Megatron does), checked for causality on one device.
2. Per variant (``eager`` reference, ``te_graph`` without reuse, ``te_graph`` with
   ``reuse_graph_input_output_buffers=True``, and TE's graphs without and with reuse,
   called with the same arguments under TE's private names), from a fresh allocator state:
   builds the blocks, makes one sample input per (chunk, microbatch, layer), calls
   ``te_graph.make_graphed_callables(blocks, sample_args, order=..., num_layers_per_chunk=...,
   reuse_graph_input_output_buffers=..., pool=pool)``, drops its own references to the
   sample args (with reuse, the library may hand their memory on) and reports

   * static buffers: ``memory_allocated`` after capture minus before the sample args were
     made (sample inputs + outputs + grad buffers + parameter grad buffers), and the same
     without the parameter grad buffers;
   * the graph pool's reserved and allocated bytes (``torch.cuda.memory_snapshot`` segments
     whose ``segment_pool_id`` is the pool handle passed in), when the snapshot has them;
   * peak allocated and peak reserved memory of build + capture;
   * one training iteration run through the order, after ``gc.collect(); empty_cache();
     reset_peak_memory_stats()``: its peak allocated memory and its footprint, the peak
     *reserved* memory (``max_memory_allocated`` does not count graph-pool memory that
     capture freed but replay still writes, so it flatters graphs); then the median wall
     time of ``--iters`` more iterations.
3. The iteration feeds chunk ``c+1`` a copy of chunk ``c``'s output (the p2p receive) and
   chunk ``c`` the input grad of chunk ``c+1`` (the p2p send of the backward); the last chunk
   backprops ``out.float().square().mean()``. Parameter grads of the graphed variants are
   compared with the eager ones (``torch.equal``, and the largest difference).

Where Transformer Engine is importable, two more tables run the same rows on one TE MLP
(``te.LayerNormLinear``, GELU, ``te.Linear``) per chunk (``--chunks`` x ``--layers-per-chunk`` chunks of one layer:
TE's rule for split weight gradients), in the interleaved order for that many chunks:
weight gradients in the backward (integer order), and split out
(``delay_wgrad_compute=True``, each backward ``-c`` followed by its ``-c-0.5`` pass, run by
``backward_dw()``; the eager row calls the modules' own). Each table's rows are compared
with its own eager row.

A variant that raises (e.g. reuse not implemented) prints its error and the run goes on.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
from _measure import MIB, FirstOutput, environment, free_memory  # noqa: E402
from _pipeline import interleaved_1f1b_order, run_order, with_wgrad_passes  # noqa: E402
from _report import record_failure  # noqa: E402

import rng  # noqa: E402
import te_graph  # noqa: E402
from examples.gpt import GPTBlock  # noqa: E402
from te_graph.planning.schedule import plan_schedule  # noqa: E402

SEED = 1234


# --------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Table:
    """One table of rows: its layers (built fresh per row, chunk by chunk) and its order
    (``-c-0.5`` entries split the weight gradients out)."""

    title: str
    chunks: int
    layers_per_chunk: int
    order: list
    build: Callable[[], list]
    hidden_of: Callable[[Any], torch.Tensor]  # a layer's output -> its hidden states
    tensor_out: Callable[[Any], Any]  # a layer -> one with tensor outputs (TE's graphs need it)


def gpt_table(args, order):
    def build():
        rng.model_parallel_cuda_manual_seed(SEED)
        torch.manual_seed(SEED)
        return [GPTBlock(args.hidden, args.hidden // 64, 0.0, device="cuda", dtype=torch.bfloat16)
                for _ in range(args.chunks * args.layers_per_chunk)]

    return Table(f"{args.chunks} chunks x {args.layers_per_chunk} GPTBlocks (h {args.hidden}, dropout 0)",
                 args.chunks, args.layers_per_chunk, order, build, lambda out: out[0], FirstOutput)


class _TEMLP(torch.nn.Module):
    """An MLP of two delayable TE modules: te.LayerNormLinear (h -> 4h), GELU, te.Linear
    (4h -> h). (TE 2.20.2's own graphs fail to capture te.LayerNormMLP with
    delay_wgrad_compute=True: its backward_dw reads a bias gradient that is None there.)"""

    def __init__(self, hidden: int, split: bool):
        super().__init__()
        import transformer_engine.pytorch as te

        self.fc1 = te.LayerNormLinear(hidden, 4 * hidden, params_dtype=torch.bfloat16, delay_wgrad_compute=split)
        self.fc2 = te.Linear(4 * hidden, hidden, params_dtype=torch.bfloat16, delay_wgrad_compute=split)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    def backward_dw(self):  # what an eager caller runs for a split layer
        self.fc1.backward_dw()
        self.fc2.backward_dw()


def te_mlp_table(args, order, split):
    """One TE MLP per chunk (TE's rule for split weight gradients), its modules built with
    ``delay_wgrad_compute=split``."""
    def build():
        torch.manual_seed(SEED)
        return [_TEMLP(args.hidden, split).cuda() for _ in range(args.chunks * args.layers_per_chunk)]

    chunks = args.chunks * args.layers_per_chunk
    title = (f"{chunks} chunks x 1 TE MLP (te.LayerNormLinear h {args.hidden} -> {4 * args.hidden}, GELU, "
             f"te.Linear back), weight gradients "
             + ("split out (delay_wgrad_compute=True, -c-0.5 after each -c)" if split else "in the backward"))
    return Table(title, chunks, 1, order, build, lambda out: out, lambda layer: layer)


def make_inputs(args):
    gen = torch.Generator(device="cuda").manual_seed(SEED + 1)
    return [
        torch.randn(args.seq, args.batch, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(args.microbatches)
    ]


def run_iteration(call_layer, backward_dw, table, inputs):
    """One training iteration through the table's order (``_pipeline.run_order``);
    ``call_layer(chunk, mb, layer, h)`` -> hidden states. Returns the losses per microbatch."""
    def call(chunk, mb, x):
        h = x
        for layer in range(table.layers_per_chunk):
            h = call_layer(chunk, mb, layer, h)
        return h

    losses, _ = run_order(table.order, call, inputs, backward_dw)
    return [loss.item() for loss in losses]


def pool_bytes(pool):
    """(reserved, allocated) bytes of the segments of graph pool ``pool``, or (None, None)."""
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:  # noqa: BLE001
        return None, None
    if not segments or "segment_pool_id" not in segments[0]:
        return None, None
    want = tuple(pool)
    mine = [s for s in segments if tuple(s["segment_pool_id"]) == want]
    return sum(s["total_size"] for s in mine), sum(s["allocated_size"] for s in mine)


def prime_capture_stream():
    """Graph a tiny linear once, so the process-wide capture stream's cuBLAS workspaces
    (tens of MiB, paid once per process) exist before any row is measured and no row is
    charged for them."""
    lin = torch.nn.Linear(64, 64, device="cuda", dtype=torch.bfloat16)
    sample = (torch.randn(8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True),)
    te_graph.make_graphed_callables(lin, sample)(sample[0]).sum().backward()
    del lin, sample
    _free()


def _free():
    # Keep the cuBLAS workspaces: prime_capture_stream made them so that no row pays them.
    free_memory(clear_cublas_workspaces=False)


def _graph(kind, table, blocks, sample_args, reuse, pool):
    """te_graph's or TE's make_graphed_callables over the table's order, same arguments
    (TE's under their private names, on layers with tensor outputs)."""
    if kind == "TE":
        from transformer_engine.pytorch import make_graphed_callables as te_make_graphed_callables

        return te_make_graphed_callables(
            tuple(table.tensor_out(b) for b in blocks), sample_args, _order=table.order,
            _num_layers_per_chunk=[table.layers_per_chunk] * table.chunks,
            _reuse_graph_input_output_buffers=reuse, pool=pool)
    return te_graph.make_graphed_callables(
        tuple(blocks), sample_args, order=table.order, num_layers_per_chunk=table.layers_per_chunk,
        reuse_graph_input_output_buffers=reuse, pool=pool)


def run_variant(name, kind, reuse, table, args, inputs):
    """One row: ``kind`` is "eager", "te_graph" or "TE"."""
    C, M, L = table.chunks, args.microbatches, table.layers_per_chunk
    result = {"variant": name}
    _free()
    torch.cuda.reset_peak_memory_stats()
    try:
        blocks = table.build()
        params = [p for b in blocks for p in b.parameters()]
        if kind == "eager":
            def call_layer(chunk, mb, layer, h):
                return table.hidden_of(blocks[chunk * L + layer](h))

            def backward_dw(chunk, mb):
                for layer in range(L):
                    blocks[chunk * L + layer].backward_dw()
        else:
            before = torch.cuda.memory_allocated()
            sample_args = [
                (torch.randn(args.seq, args.batch, args.hidden, device="cuda",
                             dtype=torch.bfloat16, requires_grad=True),)
                for _ in range(C * M * L)
            ]
            sample_bytes = sum(a[0].numel() * a[0].element_size() for a in sample_args)
            pool = te_graph.graph_pool_handle()
            graphed = _graph(kind, table, blocks, tuple(sample_args), reuse, pool)
            del sample_args  # with reuse the library may hand their memory to other graphs
            gc.collect()
            torch.cuda.synchronize()
            delta = torch.cuda.memory_allocated() - before
            param_grad_bytes = sum(p.numel() * p.element_size() for p in params)
            reserved, allocated = pool_bytes(pool)
            result.update(
                graphs=len(graphed),
                sample_args_mib=sample_bytes / MIB,
                static_mib=delta / MIB,
                static_without_param_grads_mib=(delta - param_grad_bytes) / MIB,
                param_grad_mib=param_grad_bytes / MIB,
                pool_reserved_mib=None if reserved is None else reserved / MIB,
                pool_allocated_mib=None if allocated is None else allocated / MIB,
                capture_peak_mib=torch.cuda.max_memory_allocated() / MIB,
                capture_peak_reserved_mib=torch.cuda.max_memory_reserved() / MIB,
            )
            hidden_of = (lambda out: out) if kind == "TE" else table.hidden_of

            def call_layer(chunk, mb, layer, h):
                return hidden_of(graphed[chunk * M * L + mb * L + layer](h))

            def backward_dw(chunk, mb):
                for layer in range(L):
                    graphed[chunk * M * L + mb * L + layer].backward_dw()

        _free()
        torch.cuda.reset_peak_memory_stats()
        losses = run_iteration(call_layer, backward_dw, table, inputs)
        torch.cuda.synchronize()
        result["losses"] = losses
        result["peak_mib"] = torch.cuda.max_memory_allocated() / MIB
        result["footprint_mib"] = torch.cuda.max_memory_reserved() / MIB
        grads = [p.grad for p in params]
        if any(g is None for g in grads):
            result["error"] = "some parameter has no grad after the iteration"
        result["grads"] = [None if g is None else g.detach().cpu() for g in grads]
        result["iteration_ms"] = _median_iteration_ms(
            lambda: run_iteration(call_layer, backward_dw, table, inputs), args.iters)
        del grads, call_layer, backward_dw, blocks, params
    except Exception as error:  # noqa: BLE001 - report and go on
        record_failure(result, error, args.traceback)
    with contextlib.suppress(NameError):
        del graphed
    _free()
    return result


def _median_iteration_ms(iteration, iters):
    """Median wall time of ``iters`` more iterations (grads keep accumulating; only the
    first iteration's are compared). Each is synchronised: a sync point per iteration."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        iteration()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times) if times else None


def compare(reference, result):
    if reference.get("grads") is None or result.get("grads") is None:
        return "n/a"
    pairs = list(zip(reference["grads"], result["grads"]))
    if any(a is None or b is None for a, b in pairs):
        return "n/a (missing grads)"
    equal = all(torch.equal(a, b) for a, b in pairs)
    worst = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
    losses = "losses equal" if reference.get("losses") == result.get("losses") else "losses DIFFER"
    return f"{'bitwise equal' if equal else 'DIFFER'} (max |diff| {worst:.3g}), {losses}"


def _fmt(value, spec="10.1f"):
    return f"{'-':>{spec.split('.')[0]}}" if value is None else format(value, spec)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Static-buffer and peak memory of te_graph per-(layer, microbatch) graphs "
                    "under an interleaved 1F1B order, with and without "
                    "reuse_graph_input_output_buffers; runs one training iteration each.")
    parser.add_argument("--chunks", type=int, default=2, help="model chunks (default 2)")
    parser.add_argument("--layers-per-chunk", type=int, default=4, help="layers per chunk (default 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches (default 8)")
    parser.add_argument("--pipeline-size", type=int, default=4,
                        help="pipeline ranks the schedule is made for (default 4; must divide "
                             "--microbatches when --chunks > 1)")
    parser.add_argument("--rank", type=int, default=0, help="pipeline rank whose order is used (default 0)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20,
                        help="timed iterations after the measured one (median ms; default 20)")
    parser.add_argument("--no-te", action="store_true",
                        help="leave out Transformer Engine's rows and tables")
    parser.add_argument("--out", default=None, help="optional JSON path for the raw numbers")
    parser.add_argument("--traceback", action="store_true", help="print full tracebacks of failing variants")
    return parser.parse_args(argv)


ROWS = [("eager", "eager", False), ("te_graph", "te_graph", False), ("te_graph+reuse", "te_graph", True),
        ("TE graphs", "TE", False), ("TE graphs+reuse", "TE", True)]


def print_table(table, results):
    header = (f"{'variant':<16} {'static MiB':>10} {'w/o pgrad':>10} {'pool res':>10} "
              f"{'pool alloc':>10} {'capt peak':>10} {'capt res':>10} {'iter peak':>10} "
              f"{'footprint':>10} {'iter ms':>8}  vs eager grads")
    print(f"\n== {table.title} ==")
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        if "error" in r and "peak_mib" not in r:
            print(f"{name:<16} ERROR: {r['error'].replace(chr(10), ' ')[:200]}")
            continue
        check = "reference" if name == "eager" else compare(results["eager"], r)
        print(f"{name:<16} {_fmt(r.get('static_mib'))} {_fmt(r.get('static_without_param_grads_mib'))} "
              f"{_fmt(r.get('pool_reserved_mib'))} {_fmt(r.get('pool_allocated_mib'))} "
              f"{_fmt(r.get('capture_peak_mib'))} {_fmt(r.get('capture_peak_reserved_mib'))} "
              f"{_fmt(r.get('peak_mib'))} {_fmt(r.get('footprint_mib'))} "
              f"{_fmt(r.get('iteration_ms'), '8.2f')}  {check}")
        if "error" in r:
            print(f"{'':<16} ERROR: {r['error']}")
    plain, reused = results.get("te_graph", {}), results.get("te_graph+reuse", {})
    if plain.get("static_mib") is not None and reused.get("static_mib") is not None:
        saved = plain["static_mib"] - reused["static_mib"]
        print(f"reuse saves {saved:.1f} MiB of static buffers "
              f"({reused['static_mib']:.1f} vs {plain['static_mib']:.1f} MiB), peak "
              f"{reused.get('peak_mib', float('nan')):.1f} vs {plain.get('peak_mib', float('nan')):.1f} MiB")


def main(argv=None):
    args = parse_args(argv)
    te_present = importlib.util.find_spec("transformer_engine") is not None
    try:
        order = interleaved_1f1b_order(args.chunks, args.microbatches, args.pipeline_size, args.rank)
        schedule = plan_schedule(args.chunks * args.layers_per_chunk,
                                 args.chunks * args.microbatches * args.layers_per_chunk,
                                 order, args.layers_per_chunk)
        tables = [gpt_table(args, order)]
        if te_present and not args.no_te:  # one layer per chunk: TE's rule for split weight gradients
            per_layer = interleaved_1f1b_order(args.chunks * args.layers_per_chunk, args.microbatches,
                                               args.pipeline_size, args.rank)
            tables += [te_mlp_table(args, per_layer, split=False),
                       te_mlp_table(args, with_wgrad_passes(per_layer), split=True)]
    except ValueError as error:
        sys.exit(f"bench_pipeline_memory.py: {error}")
    print(f"order ({len(order)} entries, {schedule.num_graphs} graphs): {order}")
    if not torch.cuda.is_available():
        sys.exit("bench_pipeline_memory.py: CUDA is not available; this benchmark needs a CUDA GPU.")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {args.microbatches} microbatches "
          f"(s {args.seq}, b {args.batch}, bf16), pipeline size {args.pipeline_size}, rank {args.rank}")
    inputs = make_inputs(args)
    rows = [row for row in ROWS if row[1] != "TE" or (te_present and not args.no_te)]
    prime_capture_stream()
    all_results = {}
    for table in tables:
        results = {name: run_variant(name, kind, reuse, table, args, inputs) for name, kind, reuse in rows}
        print_table(table, results)
        all_results[table.title] = results
    print("\nstatic = memory_allocated after capture (sample args dropped) - before the sample "
          "args; w/o pgrad = minus parameter grad buffers; pool = graph pool segments; capt "
          "peak/res = peak allocated/reserved of build + capture; iter peak = peak allocated "
          "of the iteration; footprint = its peak reserved (after empty_cache); iter ms = "
          "median wall time of --iters more iterations.")
    if args.out:
        payload = {
            **environment(), "args": vars(args),
            "tables": {title: {"order": table.order,
                               "variants": {n: {k: v for k, v in r.items() if k != "grads"} for n, r in results.items()}}
                       for table, (title, results) in zip(tables, all_results.items())},
        }
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"raw numbers written to {args.out}")


if __name__ == "__main__":
    main()
