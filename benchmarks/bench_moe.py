"""megatron-core MoE layers, timed side by side: eager, te_graph and Transformer Engine's graphs
through Megatron's own helper (``TECudaGraphHelper``), dropless and drop-and-pad.

GPTModel (TE spec) whose every MLP is megatron-core's ``MoELayer`` (TE grouped GEMM, alltoall
dispatcher, aux-loss load balancing), trained through Megatron's schedule and DDP
(``examples/megatron_gpt.py``). Rows:

* ``eager``: dropless routing, no graphs.
* ``te_graph partial`` / ``TE partial``: dropless; each layer graphed up to token dispatch
  (``cuda_graph_modules=["attn", "moe_router", "moe_preprocess"]``, Megatron's per-layer
  scheme for dropless MoE); dispatch, the routed experts and the combine run eagerly.
* ``te_graph buckets``: as ``te_graph partial``, and the routed experts in graphs too, one per
  token capacity (1, 1.25, 1.5 and 2 times the even share per expert; a call beyond runs the
  padded program eagerly at a capacity rounded up to 128 rows, or with ``eager overflow``
  the experts' own forward): ``te_graph.integrations.megatron.moe_experts``. Dropless: nothing is dropped.
  The graphs hold the dispatch around the experts too (the padding, the gather, with expert
  parallelism the alltoalls of padded blocks, and the un-permutation,
  ``te_graph.integrations.megatron.moe_dispatch``); ``te_graph buckets experts only`` graphs the
  experts alone, behind megatron-core's eager dispatch.
  ``te_graph buckets 4x`` adds 3 and 4 times (with top-2 of 8 experts, 4 times the even
  share is every token: no call runs eagerly), for a larger pool.
* ``te_graph switch``: dropless, each layer graphed whole (as drop-and-pad is), the capacity
  chosen on the GPU by a conditional node over the buckets 1 to 2 times the even share in
  eighths, 2.25, 2.5 and 3 times, and every token (``te_graph.integrations.megatron.moe_switch``): no host sync and no
  eager call per layer. ``te_graph switch recompute``: the node keeps no activations and
  runs the bucket's experts again in the backward (one bucket's memory, not every bucket's).
* ``eager drop-pad`` / ``te_graph drop-pad`` / ``TE drop-pad``: drop-and-pad routing at
  capacity factor 1 (tokens beyond an expert's capacity are dropped), graphed whole: the
  reference a dropless graph is measured against, and the share of token assignments it drops.

Each row runs in a fresh process. Median ms per train step over the graphed steps,
footprint = ``max_memory_reserved()`` over those steps after ``empty_cache()``, capture
seconds, and the share of (token, expert) assignments dropped (from an eager run of the
drop-and-pad setup; 0 for dropless routing)::

    python benchmarks/bench_moe.py --precisions bf16,delayed --steps 12 --out /tmp/moe.json

Rows of separate processes vary from process to process and machine to machine (20-40 %
measured on single-H100 machines, docs/performance.md): ``--repeats N`` runs every row N
times, in rounds whose order alternates (forward, then reversed), and ends with each row's
median over the rounds and its ratio to the reference row (``--reference``, by default
``te_graph drop-pad``): the median of the ratios within each round, whose rows ran next to
each other.

``--expert-parallel 2`` runs every row under torchrun on 2 GPUs of this host, the experts
split over them (alltoall dispatch over NCCL, data parallel, each rank its own batches); a
row's time and footprint are its slowest rank's, each rank's median is printed beside it
(the ranks start each step together, after a barrier off the clock).
"""
from __future__ import annotations

import argparse
import statistics
import sys

from _megatron_run import model_arguments, run_example, save

_PARTIAL = ["--graph-modules", "attn,moe_router,moe_preprocess"]
_DROP_PAD = ["--capacity", "1.0"]
# A bucket the GPU does not take costs no time, only pool memory: finer than the host's.
_SWITCH_BUCKETS = "1.0,1.125,1.25,1.375,1.5,1.625,1.75,1.875,2.0,2.25,2.5,3.0"
# row -> (examples.megatron_gpt --graphs, extra arguments)
ROWS = {
    "eager": ("eager", []),
    "te_graph partial": ("te_graph", _PARTIAL),
    "TE partial": ("te", _PARTIAL),
    "te_graph buckets": ("te_graph", _PARTIAL + ["--buckets", "1.0,1.25,1.5,2.0"]),
    "te_graph buckets experts only": ("te_graph", _PARTIAL + ["--buckets", "1.0,1.25,1.5,2.0", "--moe-span", "experts"]),
    "te_graph buckets eager overflow": ("te_graph", _PARTIAL + ["--buckets", "1.0,1.25,1.5,2.0", "--overflow", "eager"]),
    "te_graph buckets 4x": ("te_graph", _PARTIAL + ["--buckets", "1.0,1.25,1.5,2.0,3.0,4.0"]),
    "te_graph switch": ("te_graph", ["--buckets", _SWITCH_BUCKETS, "--choose", "device"]),
    "te_graph switch recompute": ("te_graph", ["--buckets", _SWITCH_BUCKETS, "--choose", "device",
                                               "--switch-recompute", "1"]),
    "eager drop-pad": ("eager", _DROP_PAD),
    "te_graph drop-pad": ("te_graph", _DROP_PAD),
    "TE drop-pad": ("te", _DROP_PAD),
}


def _run(graphs: str, extra: list[str], precision: str, args: argparse.Namespace, steps: int) -> dict:
    record = run_example(graphs, [
        *model_arguments(args, steps, precision, args.dropout, fusion=1), "--experts", str(args.experts),
        "--topk", str(args.topk), "--moe-ffn", str(args.moe_ffn), "--expert-parallel", str(args.expert_parallel),
        *extra], args.timeout, ranks=args.expert_parallel)
    if "error" in record:
        return record
    return {"ms": record["ms"], "ms_per_rank": record["ms_per_rank"], "footprint_mib": record["footprint_mib"],
            "capture_s": record.get("capture_s"), "tokens_dropped": record.get("tokens_dropped"),
            "expert_calls": record.get("expert_calls")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", default="bf16,delayed", help="bf16, delayed, tensorwise (comma-separated)")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated, from: " + ", ".join(ROWS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--moe-ffn", type=int, default=2816)
    p.add_argument("--expert-parallel", type=int, default=1, help="ranks (GPUs) the experts are split over")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--repeats", type=int, default=1, help="rounds of every row (alternating order)")
    p.add_argument("--reference", default="te_graph drop-pad", help="the row the summary's ratios are to")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    print(f"GPTModel (TE spec), {args.layers} MoE layers: {args.experts} experts, top-{args.topk}, h {args.hidden}, "
          f"expert ffn {args.moe_ffn}, s {args.seq}, micro-batch {args.micro_batch}, {args.microbatches} microbatches, "
          f"dropout {args.dropout}, expert parallel {args.expert_parallel}; ms per step (median), footprint MiB, "
          "capture s, token assignments dropped")
    results = []
    for precision in args.precisions.split(","):
        dropped = None
        if any(ROWS[r][1] == _DROP_PAD for r in rows):
            # The share drop-and-pad drops, from eager steps (a sync point per router call).
            counted = _run("eager", _DROP_PAD + ["--count-dropped", "1"], precision, args, steps=3)
            dropped = counted.get("tokens_dropped")
        for round_, row in rounds(rows, args.repeats):
            graphs, extra = ROWS[row]
            result = _run(graphs, extra, precision, args, args.steps)
            if "ms" in result:
                result["tokens_dropped"] = dropped if extra == _DROP_PAD else 0.0
            results.append({"precision": precision, "row": row, "round": round_, **result})
            where = f" round {round_ + 1}" if args.repeats > 1 else ""
            if "ms" in result:
                share = "?" if result["tokens_dropped"] is None else f"{100 * result['tokens_dropped']:.1f} %"
                calls = f"  expert calls {result['expert_calls']}" if result.get("expert_calls") else ""
                ranks = ("  per rank " + " / ".join(f"{ms:.2f}" for ms in result["ms_per_rank"])
                         if len(result["ms_per_rank"]) > 1 else "")
                print(f"{precision:9} {row:31}{where} {result['ms']:8.2f} ms  {result['footprint_mib']:7.0f} MiB  "
                      f"capture {result['capture_s'] or 0:5.2f} s  dropped {share}{calls}{ranks}", flush=True)
            else:
                print(f"{precision:9} {row:31}{where} failed: {result['error'][:300]}", flush=True)
            save(args.out, results)
        if args.repeats > 1:
            print("\n".join(summary_lines([r for r in results if r["precision"] == precision], args.reference)))
    return 0


def rounds(rows: list[str], repeats: int) -> list[tuple[int, str]]:
    """(round, row) in run order: every row once per round, the order reversed every other
    round, so that a drift of the machine over the run weighs on no row more than another."""
    return [(i, row) for i in range(repeats) for row in (rows if i % 2 == 0 else rows[::-1])]


def summary_lines(results: list[dict], reference: str) -> list[str]:
    """Per row: the median ms over its rounds, their range, and the median over rounds of its
    ratio to ``reference`` in the same round (rounds where either failed are left out)."""
    by_round: dict[int, dict[str, float]] = {}
    for r in results:
        if "ms" in r:
            by_round.setdefault(r["round"], {})[r["row"]] = r["ms"]
    lines = [f"over {len(by_round)} rounds: row, median ms (min-max), median ratio to {reference!r} within a round"]
    for row in dict.fromkeys(r["row"] for r in results):
        times = [ms[row] for ms in by_round.values() if row in ms]
        if not times:
            lines.append(f"  {row:31} failed in every round")
            continue
        ratios = [ms[row] / ms[reference] for ms in by_round.values() if row in ms and reference in ms]
        ratio = f"{statistics.median(ratios):.2f}x over {len(ratios)} rounds" if ratios else "n/a"
        lines.append(f"  {row:31} {statistics.median(times):8.2f} ({min(times):.2f}-{max(times):.2f})  {ratio}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
