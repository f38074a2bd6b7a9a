"""Speed and memory of one train step on 2 GPUs: tensor parallel (TP=2) and data parallel
(DDP, DP=2), each eager, te_graph and te_graph+recompute.

Run from the repository root on a machine with 2 GPUs::

    torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu.py
    torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu.py --configs tiny --iters 200 --out /tmp/mg.json
    torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu.py --device cpu --configs smoke   # checks the script

The model is the training example's (``examples/gpt.py``'s ``GPT``; for TP its layers are
``examples/parallel.py``'s ``ParallelGPTBlock`` shards, for DP the whole model is wrapped
in torch DDP), bf16, dropout 0.1, causal attention, graphed with the example's
``graph_layers``. One train step = a forward of the whole model on pre-made random tokens,
the cross-entropy loss and its backward (for DP: DDP's gradient all-reduce included), then
``zero_grad(set_to_none=False)``; no optimizer, as in ``bench_step.py``.

Time: after ``--warmup`` steps, ``--iters`` steps back to back, a CUDA event before and
after each; a row shows the median per-step time of rank 0 (the JSON has every rank's).
Memory (the steady footprint, DESIGN.md's measure): ``torch.cuda.empty_cache()`` and a
peak reset after the warmup steps, then ``max_memory_reserved()`` over the timed steps,
per rank. A variant that raises prints its error in its row and the run goes on.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _report import record_failure  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import rng  # noqa: E402
import te_graph  # noqa: E402
from examples.gpt import GPT  # noqa: E402
from examples.parallel import ParallelGPT  # noqa: E402
from examples.report import device_name, gather  # noqa: E402
from examples.runtime import Parallelism, init_process_group, make_groups  # noqa: E402
from examples.train_gpt import graph_layers, lm_loss  # noqa: E402

CONFIGS = {
    # name: (layers, hidden, seq, batch); heads = hidden / 64 (DESIGN.md's tiny and small)
    "tiny": (24, 256, 128, 2),
    "small": (12, 1024, 512, 2),
    "smoke": (2, 128, 16, 2),  # a few seconds on CPU: checks the script, measures nothing
}
PARALLELISM = ("TP=2", "DP=2")
VARIANTS = ("eager", "te_graph", "te_graph+recompute")
VOCAB, DROPOUT, SEED, NUM_INPUTS = 256, 0.1, 1234, 4
MIB = 2.0**20


def build(parallelism: str, cfg: tuple, recompute: bool, parallel: Parallelism, device: torch.device,
          dtype: torch.dtype) -> torch.nn.Module:
    """The example's GPT, seeded the same on every rank: TP shards its layers, DP keeps it whole."""
    layers, hidden, seq, _ = cfg
    torch.manual_seed(SEED)
    rng.model_parallel_cuda_manual_seed(SEED, tp_rank=parallel.tp_rank)
    sizes = dict(vocab=VOCAB, seq=seq, hidden=hidden, heads=hidden // 64 or 1, layers=layers,
                 dropout=DROPOUT, recompute=recompute, device=device, dtype=dtype)
    if parallelism == "TP=2":
        return ParallelGPT(**sizes, tp_group=parallel.tp_group).train()
    return GPT(**sizes).train()


def measure(parallelism: str, cfg: tuple, variant: str, args: argparse.Namespace, parallel: Parallelism,
            device: torch.device, dtype: torch.dtype) -> dict:
    """One row cell: median step ms (every rank) and steady footprint MiB (every rank)."""
    layers, hidden, seq, batch = cfg
    cuda = device.type == "cuda"
    model = build(parallelism, cfg, variant.endswith("recompute"), parallel, device, dtype)
    if variant != "eager":
        graph_layers(model.layers, [(seq, batch, hidden)], dtype=dtype, device=device, seed=SEED,
                     eager_replay=not cuda)
    runner = model
    if parallelism == "DP=2":
        runner = DistributedDataParallel(model, device_ids=[device.index] if cuda else None, process_group=parallel.dp_group)
    g = torch.Generator().manual_seed(SEED + parallel.dp_rank)  # DP replicas train on other data
    batches = [(torch.randint(VOCAB, (batch, seq), generator=g).to(device),
                torch.randint(VOCAB, (batch, seq), generator=g).to(device)) for _ in range(NUM_INPUTS)]

    def step(i: int) -> None:
        tokens, targets = batches[i % NUM_INPUTS]
        lm_loss(runner(tokens), targets).backward()
        model.zero_grad(set_to_none=False)

    try:
        for i in range(args.warmup):
            step(i)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(args.iters)]
            for i, (start, end) in enumerate(events):
                start.record()
                step(i)
                end.record()
            torch.cuda.synchronize(device)
            times = [start.elapsed_time(end) for start, end in events]
            footprint = torch.cuda.max_memory_reserved(device) / MIB
        else:
            import time

            times = []
            for i in range(args.iters):
                start = time.perf_counter()
                step(i)
                times.append(1e3 * (time.perf_counter() - start))
            footprint = None
        return {"median_ms": gather(statistics.median(times), parallel), "footprint_mib": gather(footprint, parallel)}
    finally:
        if variant != "eager":
            te_graph.reset(*model.layers)
        del runner, model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def _cell(result: dict, key: str, fmt: str) -> str:
    if "error" in result:
        return "error"
    value = result[key][0]
    return "n/a" if value is None else format(value, fmt)


def print_table(rows: list[dict]) -> None:
    print("\n| config | parallel | eager ms | te_graph ms | te_graph+recompute ms | footprint MiB/rank eager / te_graph / +recompute |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        r = row["variants"]
        eager_ms = r["eager"].get("median_ms", [None])[0]

        def ms(name: str) -> str:
            cell = _cell(r[name], "median_ms", ".2f")
            value = r[name].get("median_ms", [None])[0]
            if name != "eager" and eager_ms and value:
                cell += f" ({eager_ms / value:.2f}x)"
            return cell

        footprint = " / ".join(_cell(r[name], "footprint_mib", ".0f") for name in VARIANTS)
        print(f"| {row['config']} | {row['parallel']} | {ms('eager')} | {ms('te_graph')} | "
              f"{ms('te_graph+recompute')} | {footprint} |")
    for row in rows:
        for name, result in row["variants"].items():
            if "error" in result:
                print(f"{row['config']} {row['parallel']} {name}: {result['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="tiny,small", help=f"comma-separated, from {', '.join(CONFIGS)}")
    parser.add_argument("--parallel", default=",".join(PARALLELISM), help="TP=2, DP=2 or both")
    parser.add_argument("--iters", type=int, default=100, help="timed steps per variant (default 100)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: gloo and te_graph's eager replay, to check the script (default cuda)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here (rank 0)")
    parser.add_argument("--traceback", action="store_true", help="print the traceback of a failing variant")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 2:
        raise SystemExit("bench_multi_gpu: run with torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu.py")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = args.device == "cuda"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    init_process_group("nccl" if cuda else "gloo", rank, world, timeout_s=600, device=device if cuda else None)
    rows = []
    try:
        # TP=2: both ranks share each layer; DP=2: a whole replica per rank.
        layouts = {"TP=2": make_groups(2), "DP=2": make_groups(1)}
        for name in args.configs.split(","):
            cfg = CONFIGS[name]
            for parallelism in args.parallel.split(","):
                parallel = layouts[parallelism]
                row = {"config": name, "parallel": parallelism, "layers_hidden_seq_batch": cfg, "variants": {}}
                for variant in VARIANTS:
                    result = {}
                    try:
                        result.update(measure(parallelism, cfg, variant, args, parallel, device, dtype))
                    except Exception as error:  # a failing variant is a row, not a crash
                        record_failure(result, error, args.traceback)
                    row["variants"][variant] = result
                    dist.barrier(device_ids=[device.index]) if cuda else dist.barrier()
                rows.append(row)
                if rank == 0:
                    print(f"done: {name} {parallelism}", flush=True)
        devices = gather(device_name(device), Parallelism(world=world, rank=rank))
        if rank == 0:
            print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, devices: {devices}; "
                  f"{args.iters} timed steps after {args.warmup}, median of rank 0")
            print_table(rows)
            if args.out:
                with open(args.out, "w", encoding="utf-8") as f:
                    json.dump({"torch": torch.__version__, "cuda": torch.version.cuda, "devices": devices,
                               "iters": args.iters, "warmup": args.warmup, "rows": rows}, f, indent=2)
                print(f"wrote {args.out}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
