"""Megatron-style GPT training on a character-level corpus, with per-layer CUDA graphs.

Trains the GPT of ``examples/gpt.py`` on the repository's own text (``examples/data.py``;
nothing is downloaded). On a GPU each transformer layer's forward and backward become one
CUDA graph each (``te_graph.make_graphed_callables``), with full activation recompute
inside the graphs and dropout masks exactly those of eager training; the embedding, the
output layer, the loss and the optimizer stay eager. With ``--graph-step`` the whole
training step (forward, loss, backward, grad clipping, the AdamW step) is one graph
instead (``te_graph.make_graphed_step``). Without CUDA it trains eagerly on the CPU.

    python examples/train_gpt.py                      # defaults for the device at hand
    python examples/train_gpt.py --no-graphs          # eager baseline
    python examples/train_gpt.py --compare            # eager then graphed, same seed: bitwise equal?
    python examples/train_gpt.py --graph-step --compare   # the whole step as one graph against eager
    python examples/train_gpt.py --seq-buckets 64,128,256   # varying lengths, graphed per length
    torchrun --nproc-per-node 2 examples/train_gpt.py --tensor-parallel 2
    torchrun --nproc-per-node 2 examples/train_gpt.py --data-parallel

At the end rank 0 prints the median step time, tokens/s and peak memory, and writes
``loss_curve.png`` and ``summary.json`` to ``--out``. The flags are in
``examples/config.py``; the tensor-parallel layers in ``examples/parallel.py``.
"""
from __future__ import annotations

import gc
import itertools
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

# Strict deterministic algorithms (--deterministic, the default on CUDA) need cuBLAS's
# workspace config to be set before the process's first cuBLAS call: torch reads it once.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as `python examples/train_gpt.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import rng  # noqa: E402
import te_graph  # noqa: E402
from examples import report  # noqa: E402
from examples.config import Config, build_parser, resolve  # noqa: E402
from examples.data import CharCorpus, bucket_lengths, load_corpus  # noqa: E402
from examples.gpt import GPT  # noqa: E402
from examples.parallel import ParallelGPT, allreduce_sequence_parallel_grads, clip_grad_norm_  # noqa: E402
from examples.runtime import Parallelism, deterministic_algorithms, init_process_group, make_groups, shutdown  # noqa: E402

__all__ = [
    "main", "train", "build_model", "graph_layers", "learning_rate", "lm_loss", "make_optimizer", "train_step",
    "build_parser", "resolve", "Config", "CharCorpus", "load_corpus", "REPO_ROOT",
]


# -- the model -----------------------------------------------------------------------------------
def build_model(config: Config, vocab: int, parallel: Parallelism = Parallelism()) -> GPT:
    """Seeded the Megatron way: the same seed gives the same weights, graphed or not, and
    the same whole model on every rank before tensor parallelism splits its layers."""
    torch.manual_seed(config.seed)
    rng.model_parallel_cuda_manual_seed(config.seed, tp_rank=parallel.tp_rank)
    sizes = (vocab, config.seq, config.hidden, config.heads, config.layers)
    common = dict(dropout=config.dropout, recompute=config.recompute == "full", device=config.device, dtype=config.dtype)
    if config.tensor_parallel > 1:
        model = ParallelGPT(
            *sizes, tp_group=parallel.tp_group, sequence_parallel=config.sequence_parallel,
            distribute_saved_activations=config.distribute_saved_activations, **common,
        )
    else:
        model = GPT(*sizes, **common)
    return model.train()


def layer_input_shapes(config: Config) -> list[tuple[int, int, int]]:
    """``[s, b, h]`` of a layer's input for each sequence length (a rank's shard under
    sequence parallelism); the first is ``--seq-buckets``' first length."""
    split = config.tensor_parallel if config.sequence_parallel else 1
    return [(s // split, config.micro_batch, config.hidden) for s in config.seq_buckets or (config.seq,)]


def graph_layers(
    layers: Sequence[torch.nn.Module],
    shapes: Sequence[tuple[int, ...]],
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    eager_replay: bool = False,
) -> None:
    """Replace each layer's forward by its graphed version (modules keep their identity):
    one forward and one backward graph per layer and input shape, all in one memory pool.

    The samples come from a generator seeded with ``seed``, so they are the same on every
    tensor-parallel rank (``distribute_saved_activations`` checks that its input is).
    """
    generator = torch.Generator(device=device).manual_seed(seed)

    def samples_for(shape: tuple[int, ...]) -> tuple:
        return tuple(
            (torch.randn(shape, device=device, dtype=dtype, generator=generator).requires_grad_(),)
            for _ in layers
        )

    te_graph.make_graphed_callables(
        tuple(layers), samples_for(shapes[0]),
        more_shapes=[samples_for(shape) for shape in shapes[1:]], eager_replay=eager_replay,
    )


# -- the optimisation ------------------------------------------------------------------------------
def learning_rate(config: Config, step: int) -> float:
    """Megatron's schedule: linear warmup, then cosine decay to a tenth of ``--lr``."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    decay = max(config.steps - config.warmup, 1)
    progress = min((step - config.warmup) / decay, 1.0)
    return config.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy; ``logits [s, b, vocab]``, ``targets [b, s]``."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.t().flatten())


def finish_grads(model: GPT, config: Config, parallel: Parallelism) -> None:
    """Between backward and optimizer step (Megatron's ``finalize_model_grads``): sum the
    partial gradients of sequence-parallel parameters, then clip the whole model's norm."""
    if config.sequence_parallel:
        allreduce_sequence_parallel_grads(model, parallel.tp_group)
    if config.clip_grad > 0:
        if parallel.tp > 1:
            clip_grad_norm_(model, config.clip_grad, parallel.tp_group)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad)


def make_optimizer(model: torch.nn.Module, config: Config) -> torch.optim.AdamW:
    """AdamW (fused on CUDA) with its learning rate a tensor that the schedule fills in
    place, so a graph of the whole step reads each step's rate; every run uses it, so all
    runs train alike. float32 on CUDA (what the fused kernel reads), float64 on CPU (the
    same numbers as a Python float). Capturable where the step is graphed."""
    cuda = config.device.type == "cuda"
    lr = torch.tensor(config.lr, dtype=torch.float32 if cuda else torch.float64, device=config.device)
    return torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=config.weight_decay,
        fused=cuda or None, capturable=cuda and config.graph_step,
    )


def train_step(runner: torch.nn.Module, model: GPT, optimizer: torch.optim.Optimizer, config: Config,
               parallel: Parallelism):
    """One training step on a batch: forward, loss, backward, the gradients finished
    (clipped), the optimizer's step and the gradients zeroed in place; returns the loss as a
    tensor (nothing is read on the host, so ``te_graph.make_graphed_step`` can capture it)."""

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(runner(tokens), targets)
        loss.backward()
        finish_grads(model, config, parallel)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss.detach()

    return step


# -- one run ---------------------------------------------------------------------------------------
def train(config: Config, corpus: CharCorpus, parallel: Parallelism = Parallelism(), label: str = "") -> dict:
    """One training run; returns its summary."""
    device, started, started_utc = config.device, time.perf_counter(), report.utc_now()
    memory_at_start = report.start_memory(device)
    with deterministic_algorithms(config.deterministic):
        model = build_model(config, corpus.vocab_size, parallel)
        graph_step = config.graphs and config.graph_step
        capture_start = time.perf_counter()
        if config.graphs and not graph_step:
            graph_layers(model.layers, layer_input_shapes(config), dtype=config.dtype, device=device,
                         seed=config.seed, eager_replay=config.eager_replay)
            report.sync(device)
        capture_s = time.perf_counter() - capture_start if config.graphs and not graph_step else 0.0
        # DDP wraps the graphed model: te_graph sees DDP's forward and hands parameter
        # gradients to autograd, so DDP's hooks reduce them as in eager training.
        runner = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            process_group=parallel.dp_group,
        ) if config.data_parallel else model
        optimizer = make_optimizer(model, config)
        lengths = bucket_lengths(config.seq_buckets, config.seed + 1) if config.seq_buckets else itertools.repeat(config.seq)
        # Tensor-parallel ranks share batches; data-parallel replicas each get their own.
        batches = corpus.batches(lengths, config.micro_batch, config.seed + 7919 * parallel.dp_rank, device)
        label = label or (("graphed step" if graph_step else "graphed") if config.graphs else "eager")
        log = report.RunLog(config.steps, label, device, parallel, config.progress)

        run_step = eager_step = train_step(runner, model, optimizer, config, parallel)
        batch: tuple = ()
        for step in range(config.steps):
            if graph_step and step == 1:
                # After one eager step, which made the optimizer's state; warmup and capture
                # leave no trace (the sample is the last batch; its values do not matter).
                capture_start = time.perf_counter()
                run_step = te_graph.make_graphed_step(eager_step, batch, modules=model,
                                                      optimizer=optimizer, eager_replay=config.eager_replay)
                report.sync(device)
                capture_s += time.perf_counter() - capture_start
            log.start()
            batch = tokens, targets = next(batches)
            for group in optimizer.param_groups:
                group["lr"].fill_(learning_rate(config, step))
            loss = run_step(tokens, targets)
            log.done(loss, tokens.shape[1])

        log.close()
        summary = report.summarize(log, model, parallel, config, capture_s=capture_s,
                                   memory_at_start=memory_at_start, started=started, started_utc=started_utc)
    if graph_step and run_step is not eager_step:
        run_step.reset()  # free the graph now, not whenever gc finds it
    elif config.graphs and not graph_step:
        te_graph.reset(*model.layers)  # free the graphs now, not whenever gc finds them
    del runner, model, optimizer, run_step, eager_step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return summary


# -- the script ------------------------------------------------------------------------------------
def join_process_group(config: Config, world: int) -> Parallelism:
    """Under torchrun (``WORLD_SIZE`` > 1): join the process group (NCCL on CUDA, gloo on
    CPU) and split it into tensor- and data-parallel groups."""
    if world == 1:
        return Parallelism()
    cuda = config.device.type == "cuda"
    init_process_group("nccl" if cuda else "gloo", int(os.environ["RANK"]), world,
                       device=config.device if cuda else None)
    return make_groups(config.tensor_parallel)


def _describe_setup(c: Config, corpus: CharCorpus, parallel: Parallelism) -> str:
    seq = f"seq buckets {','.join(map(str, c.seq_buckets))}" if c.seq_buckets else f"seq {c.seq}"
    line = (
        f"corpus: {len(corpus.text):,} characters, vocabulary {corpus.vocab_size}; model: "
        f"{c.layers} layers, hidden {c.hidden}, {c.heads} heads, {seq}, micro-batch "
        f"{c.micro_batch}, {str(c.dtype).replace('torch.', '')} on {c.device}; dropout {c.dropout}, "
        f"recompute {c.recompute}, {c.steps} steps"
    )
    if c.graph_step:
        line += "; the whole step as one graph (te_graph.make_graphed_step)"
    if parallel.distributed:
        extras = [name for name, on in (("sequence parallel", c.sequence_parallel),
                  ("distributed saved activations", c.distribute_saved_activations)) if on]
        line += (f"; {parallel.world} ranks: tensor parallel {parallel.tp} x data parallel "
                 f"{parallel.dp}{''.join(', ' + e for e in extras)}")
    return line


def main(argv: Sequence[str] | None = None) -> dict:
    """Train; rank 0 prints the summary and writes ``loss_curve.png`` and ``summary.json``
    to ``--out``.

    Returns the summary (with ``--compare``: both runs under ``'eager'`` and ``'graphed'``
    (``'eager-replay'`` without CUDA), plus ``'speedup'``, ``'losses_match_bitwise'`` and
    ``'weights_match_bitwise'``).
    """
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config, notes = resolve(args, world, int(os.environ.get("LOCAL_RANK", "0")))
    if args.compare and config.device.type != "cuda":
        notes = [
            f"No CUDA device: --compare runs eager against te_graph's eager-replay wrapper"
            f"{' of the whole step' if config.graph_step else ''} on {config.device} (the same static-buffer "
            f"wrapper, without graphs)."
        ]
        config = replace(config, eager_replay=True)
    parallel = join_process_group(config, world)
    say = print if parallel.is_main else (lambda *a, **k: None)
    try:
        for note in notes:
            say(note)
        corpus = CharCorpus(load_corpus())
        say(_describe_setup(config, corpus, parallel))

        if args.compare:
            graphed_name = ("eager-replay" if config.eager_replay else "graphed") + (" step" if config.graph_step else "")
            runs = {
                "eager": train(config.with_graphs(False), corpus, parallel, "eager"),
                graphed_name: train(config.with_graphs(True), corpus, parallel, graphed_name),
            }
            eager, graphed = runs["eager"], runs[graphed_name]
            summary = {
                "eager": eager,
                graphed_name: graphed,
                "graphed_name": graphed_name,
                "speedup": eager["median_step_ms"] / graphed["median_step_ms"],
                "losses_match_bitwise": report.bitwise_equal(eager["losses"], graphed["losses"]),
                "weights_match_bitwise": eager["params_sha256"] == graphed["params_sha256"],
            }
            for name, s in runs.items():
                say(report.describe_run(name, s))
            say(f"speedup {graphed_name} vs eager: {summary['speedup']:.2f}x")
            say(f"losses matched bitwise: {summary['losses_match_bitwise']} (final weights "
                f"{'equal' if summary['weights_match_bitwise'] else 'differ'})")
            if not summary["losses_match_bitwise"] and not config.deterministic and config.device.type == "cuda":
                say("  (deterministic algorithms were off: flash attention's backward may add in "
                    "another order from run to run; drop --no-deterministic)")
        else:
            summary = train(config, corpus, parallel)
            name = "graphed" if summary["graphs"] else ("eager-replay" if summary["eager_replay"] else "eager")
            name += " step" if config.graph_step and name != "eager" else ""
            runs = {name: summary}
            say(report.describe_run(name, summary))
        if parallel.is_main:
            out = Path(args.out)
            report.write_outputs(runs, summary, out)
            say(f"wrote {out / 'loss_curve.png'} and {out / 'summary.json'}")
    finally:
        if parallel.distributed:
            shutdown(device=config.device)
    return summary


if __name__ == "__main__":
    main()
