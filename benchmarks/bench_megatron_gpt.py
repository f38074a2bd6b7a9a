"""megatron-core's own CUDA-graph path, timed: GPTModel (TE spec) through Megatron's schedule,
DDP and ``TECudaGraphHelper``, eagerly, with Transformer Engine's graphs and with te_graph's
(``te_graph.integrations.megatron.enable()``). ``bench_megatron.py --path gpt`` runs this.

Each row runs in a fresh process (``examples/megatron_gpt.py``): TE's graphs are not freed by
the helper's ``delete_cuda_graphs()`` and a failed TE capture can leave its generator in
capture mode. Median ms per train step (``--microbatches`` microbatches) over the graphed
steps, footprint = ``max_memory_reserved()`` over those steps after ``empty_cache()``::

    python benchmarks/bench_megatron_gpt.py --steps 30 --out /tmp/megatron_gpt.json
"""
from __future__ import annotations

import argparse
import sys

from _megatron_run import model_arguments, run_example, save

ROWS = ("eager", "te", "te_graph")  # "te": TE's graphs in the helper, captured thread_local (examples/megatron_gpt.py)


def _run(graphs: str, precision: str, dropout: float, fusion: int, args: argparse.Namespace) -> dict:
    record = run_example(graphs, model_arguments(args, args.steps, precision, dropout, fusion), args.timeout)
    if "error" in record:
        return record
    return {"ms": record["ms"], "footprint_mib": record["footprint_mib"], "capture_s": record.get("capture_s")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", default="bf16,delayed")
    p.add_argument("--dropouts", default="0.1,0.0")
    p.add_argument("--fusions", default="1", help="gradient_accumulation_fusion: 1, 0 or 1,0")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    results = []
    print(f"GPTModel (TE spec) {args.layers} layers, h {args.hidden}, s {args.seq}, micro-batch {args.micro_batch}, "
          f"{args.microbatches} microbatches; ms per step (median), footprint MiB")
    for fusion in map(int, args.fusions.split(",")):
        for precision in args.precisions.split(","):
            for dropout in map(float, args.dropouts.split(",")):
                line = {}
                for graphs in args.rows.split(","):
                    row = _run(graphs, precision, dropout, fusion, args)
                    line[graphs] = row
                    results.append({"precision": precision, "dropout": dropout, "fusion": fusion, "graphs": graphs,
                                    **row})
                shown = "  ".join(
                    f"{g}: {r['ms']:.2f} ms / {r['footprint_mib']:.0f} MiB" if "ms" in r
                    else f"{g}: failed ({r['error'][:160]})" for g, r in line.items())
                print(f"{precision:8} dropout {dropout} fusion {fusion}: {shown}", flush=True)
    save(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
