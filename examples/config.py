"""train_gpt's options: the flags, their per-device defaults, and the checked ``Config``.

Every refusal is a ``SystemExit`` whose message names the flag and what to do, raised
before anything is built.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

from examples.runtime import DETERMINISTIC_CUBLAS_CONFIGS

# Sizes per device. The CPU default finishes in well under two minutes on two cores; the
# GPU default is small enough to be bound by kernel launches, where per-layer graphs pay.
# CPU schedule: around steps 15-35 this small model leaves its first phase, in which it
# predicts the same characters everywhere from a residual-stream vector shared by all
# positions. An AdamW step at a learning rate above about 5e-4 there can flip what the
# final LayerNorm makes of that vector, and the loss jumps above chance for a step or two
# (2e-3 with a 20-step warmup did at steps 19-20 with seed 1234, and with 9 of 16 seeds).
# A 1e-3 peak after an 80-step warmup passes that phase below 4e-4: smooth in all 56 runs
# tried (16 seeds to the end, 40 more through step 80), and 400 steps end lower (about
# 2.47) than 200 at 2e-3 did (2.57).
DEFAULTS = {
    "cpu": dict(layers=2, hidden=128, heads=4, seq=64, micro_batch=16, steps=400, lr=1e-3),
    "cuda": dict(layers=12, hidden=256, heads=4, seq=128, micro_batch=16, steps=300, lr=1e-3),
}
WARMUP_DIVISOR = {"cpu": 5, "cuda": 10}  # default --warmup: steps // this


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a small Megatron-style GPT on the repository's own text, with "
        "per-layer CUDA graphs (te_graph) on a GPU. Several GPUs: torchrun --nproc-per-node N "
        "examples/train_gpt.py --tensor-parallel N (or --data-parallel).",
    )

    def auto(name: str) -> str:
        return f"default: {DEFAULTS['cpu'][name]:g} on CPU, {DEFAULTS['cuda'][name]:g} on CUDA"

    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="graph the transformer layers (default: on with CUDA; needs a GPU)")
    p.add_argument("--recompute", choices=("none", "full"), default=None,
                   help="activation recompute of each layer (default: full on CUDA, none on CPU)")
    p.add_argument("--layers", type=int, default=None, help=auto("layers"))
    p.add_argument("--hidden", type=int, default=None, help=auto("hidden"))
    p.add_argument("--heads", type=int, default=None, help=auto("heads"))
    p.add_argument("--seq", type=int, default=None, help=auto("seq"))
    p.add_argument("--seq-buckets", default=None, metavar="S1,S2,...",
                   help="train on batches of varying length: each step picks one of these lengths "
                   "(from the seed); the layers are graphed once for all of them (replaces --seq)")
    p.add_argument("--micro-batch", type=int, default=None, help=auto("micro_batch"))
    p.add_argument("--steps", type=int, default=None, help=auto("steps"))
    p.add_argument("--lr", type=float, default=None, help=auto("lr"))
    p.add_argument("--warmup", type=int, default=None,
                   help="linear learning-rate warmup steps, then cosine decay to lr/10 (default: "
                   f"steps/{WARMUP_DIVISOR['cpu']} on CPU, steps/{WARMUP_DIVISOR['cuda']} on CUDA)")
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout (default: 0.1)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default: 0.01)")
    p.add_argument("--clip-grad", type=float, default=1.0, help="max grad norm, 0 for none (default: 1.0)")
    p.add_argument("--seed", type=int, default=1234, help="seeds weights, dropout and batches (default: 1234)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's own; 1 is faster on a busy machine)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="parameter dtype (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.use_deterministic_algorithms during training on CUDA (flash "
                   "attention's backward otherwise adds in a varying order at longer --seq; default: on)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split each layer over N processes (Megatron tensor parallelism; launch with "
                   "torchrun --nproc-per-node N; default: 1)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tensor-parallel: split the activations between the parallel linears "
                   "along the sequence")
    p.add_argument("--distribute-saved-activations", action="store_true",
                   help="with --tensor-parallel and recompute: keep 1/N of each layer's input between "
                   "forward and backward (not with --sequence-parallel)")
    p.add_argument("--data-parallel", action="store_true",
                   help="use the processes beyond --tensor-parallel as data-parallel replicas (torch "
                   "DDP; each replica trains on other batches)")
    p.add_argument("--graph-step", action="store_true",
                   help="graph the whole training step as one CUDA graph (te_graph.make_graphed_step: "
                   "forward, loss, backward, grad clipping and the AdamW step) instead of each layer; "
                   "the first step runs eagerly and makes the optimizer's state. Without CUDA: "
                   "te_graph's eager-replay wrapper of the step")
    p.add_argument("--eager-replay", action="store_true",
                   help="run te_graph's graphed wrapper without graphs (debugging; CPU too); implies --graphs")
    p.add_argument("--compare", action="store_true",
                   help="run eager and graphed back to back with the same seed; print the speedup "
                   "and whether the losses and final weights matched bitwise")
    p.add_argument("--out", default="runs/train_gpt",
                   help="directory for loss_curve.png and summary.json (default: runs/train_gpt)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="tqdm progress bar (default: on when the output is a terminal)")
    return p


@dataclass(frozen=True)
class Config:
    device: torch.device
    dtype: torch.dtype
    graphs: bool
    eager_replay: bool
    graph_step: bool  # with graphs: the whole step as one graph instead of each layer
    recompute: str
    layers: int
    hidden: int
    heads: int
    seq: int  # the longest sequence (the position table's size)
    seq_buckets: Optional[tuple[int, ...]]
    micro_batch: int
    steps: int
    lr: float
    warmup: int
    dropout: float
    weight_decay: float
    clip_grad: float
    seed: int
    deterministic: bool
    progress: Optional[bool]
    tensor_parallel: int
    sequence_parallel: bool
    distribute_saved_activations: bool
    data_parallel: bool

    def with_graphs(self, graphs: bool) -> "Config":
        return replace(self, graphs=graphs)

    def to_json(self) -> dict:
        d = asdict(self)
        d["device"] = str(self.device)
        d["dtype"] = str(self.dtype).replace("torch.", "")
        d["seq_buckets"] = list(self.seq_buckets) if self.seq_buckets else None
        return d


def _fail(message: str) -> SystemExit:
    return SystemExit(f"train_gpt: {message}")


def _parse_buckets(text: str) -> tuple[int, ...]:
    try:
        buckets = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise _fail(f"--seq-buckets {text!r}: give comma-separated lengths, e.g. 64,128,256.") from None
    if not buckets or min(buckets) < 1:
        raise _fail(f"--seq-buckets {text!r}: give comma-separated lengths of at least 1, e.g. 64,128,256.")
    if len(set(buckets)) != len(buckets):
        raise _fail(f"--seq-buckets {text!r} repeats a length; give each length once.")
    return buckets


def resolve(args: argparse.Namespace, world: int = 1, local_rank: int = 0) -> tuple[Config, list[str]]:
    """Fill per-device defaults and check every flag; returns the config and notes to print.

    ``world`` and ``local_rank`` are the launch's (``torchrun`` sets them; 1 and 0 when run
    as a single process): a CUDA run uses ``cuda:local_rank``.
    """
    notes = []
    cuda = torch.cuda.is_available()
    device = torch.device(args.device) if args.device else torch.device("cuda" if cuda else "cpu")
    if device.type == "cuda" and not cuda:
        raise _fail("--device cuda was asked for, but CUDA is not available.")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank if world > 1 else torch.cuda.current_device())
    kind = "cuda" if device.type == "cuda" else "cpu"
    defaults = DEFAULTS[kind]
    values = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    buckets = _parse_buckets(args.seq_buckets) if args.seq_buckets is not None else None
    if buckets and args.seq is not None:
        raise _fail("pass either --seq or --seq-buckets, not both (the buckets are the lengths).")
    if buckets:
        values["seq"] = max(buckets)
    eager_replay = args.eager_replay
    if eager_replay and args.graphs is False:
        raise _fail("--eager-replay runs te_graph's graphed wrapper without graphs; it cannot go with --no-graphs.")
    if args.graph_step:
        _check_graph_step(args, buckets)
        if device.type != "cuda" and not eager_replay:
            where = "No CUDA device" if not cuda else f"--device {device}"
            notes.append(f"{where}: --graph-step runs te_graph's eager-replay wrapper of the whole step "
                         f"on {device} (the same static-buffer wrapper, without a graph).")
            eager_replay = True
    # --eager-replay is te_graph's wrapper without graphs, so it implies --graphs.
    graphs = args.graphs if args.graphs is not None else (kind == "cuda" or eager_replay)
    if kind != "cuda" and not (graphs and eager_replay):
        if not cuda:
            notes.append("CUDA not available: training eagerly on CPU (graphs need a GPU).")
        elif graphs:
            notes.append(f"--device {device}: training eagerly (graphs need a CUDA device).")
        graphs = False
    recompute = args.recompute or ("full" if kind == "cuda" else "none")
    if args.dtype == "auto":
        dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    else:
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    for name in ("layers", "hidden", "heads", "seq", "micro_batch", "steps"):
        if values[name] < 1:
            raise _fail(f"--{name.replace('_', '-')} must be at least 1.")
    if values["hidden"] % values["heads"]:
        raise _fail(f"--hidden {values['hidden']} is not divisible by --heads {values['heads']}.")
    if args.warmup is not None and args.warmup < 0:
        raise _fail("--warmup must be at least 0.")
    if not 0.0 <= args.dropout < 1.0:
        raise _fail("--dropout must be in [0, 1).")
    _check_parallelism(args, world, values, buckets, recompute)
    if args.data_parallel and world == args.tensor_parallel:
        notes.append(f"--data-parallel with {world} process(es) and --tensor-parallel "
                     f"{args.tensor_parallel}: one replica.")
    deterministic = args.deterministic and kind == "cuda"
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if deterministic and workspace not in DETERMINISTIC_CUBLAS_CONFIGS:
        notes.append(
            f"CUBLAS_WORKSPACE_CONFIG={workspace!r} is not one of {DETERMINISTIC_CUBLAS_CONFIGS}: "
            "training without deterministic algorithms (runs may differ in the last bits)."
        )
        deterministic = False
    config = Config(
        device=device, dtype=dtype, graphs=graphs, eager_replay=eager_replay, graph_step=args.graph_step,
        recompute=recompute, seq_buckets=buckets, dropout=args.dropout,
        warmup=args.warmup if args.warmup is not None else values["steps"] // WARMUP_DIVISOR[kind],
        weight_decay=args.weight_decay, clip_grad=args.clip_grad, seed=args.seed,
        deterministic=deterministic, progress=args.progress,
        tensor_parallel=args.tensor_parallel, sequence_parallel=args.sequence_parallel,
        distribute_saved_activations=args.distribute_saved_activations,
        data_parallel=args.data_parallel, **values,
    )
    return config, notes


def _check_graph_step(args: argparse.Namespace, buckets: Optional[tuple[int, ...]]) -> None:
    """What one graph of the whole step cannot hold, refused before anything is built."""
    if args.graphs is False:
        raise _fail("--graph-step graphs the whole training step; it cannot go with --no-graphs.")
    if buckets:
        raise _fail("--graph-step captures the step for one batch shape; it cannot go with --seq-buckets "
                    "(drop --graph-step: the per-layer graphs take every length).")
    if args.tensor_parallel > 1 or args.data_parallel:
        raise _fail("--graph-step runs on one process; it cannot go with --tensor-parallel or --data-parallel "
                    "(drop --graph-step: the per-layer graphs run under both).")


def _check_parallelism(args: argparse.Namespace, world: int, values: dict, buckets, recompute: str) -> None:
    tp = args.tensor_parallel
    if tp < 1:
        raise _fail("--tensor-parallel must be at least 1.")
    if tp > world:
        raise _fail(
            f"--tensor-parallel {tp} needs {tp} processes, one per GPU; launch with "
            f"torchrun --nproc-per-node {tp} examples/train_gpt.py --tensor-parallel {tp}."
        )
    if world % tp:
        raise _fail(f"--tensor-parallel {tp} does not divide the {world} processes.")
    if world > tp and not args.data_parallel:
        raise _fail(
            f"{world} processes but --tensor-parallel {tp}: pass --data-parallel to train the "
            f"other processes as data-parallel replicas, or --tensor-parallel {world}."
        )
    if values["heads"] % tp:
        raise _fail(f"--heads {values['heads']} is not divisible by --tensor-parallel {tp}.")
    if args.sequence_parallel:
        if tp == 1:
            raise _fail("--sequence-parallel needs --tensor-parallel 2 or more.")
        for length in buckets or (values["seq"],):
            if length % tp:
                raise _fail(f"--sequence-parallel: sequence length {length} is not divisible by "
                            f"--tensor-parallel {tp}.")
    if args.distribute_saved_activations:
        if tp == 1 or recompute != "full":
            raise _fail("--distribute-saved-activations needs --tensor-parallel 2 or more and "
                        "--recompute full (it splits the saved layer inputs over the TP ranks).")
        if args.sequence_parallel:
            raise _fail(
                "--distribute-saved-activations with --sequence-parallel: each rank's layer input "
                "is already its own sequence shard, which cannot be split and gathered back "
                "(checkpoint() refuses it); pass one of them."
            )
