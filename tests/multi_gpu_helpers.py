"""Multi-rank scenarios for tests/test_multi_gpu.py, and the harness that spawns them.

Each scenario is written once and runs on every rank of a spawned group in one of two
forms:

* ``GLOO_CPU``: gloo on the CPU, te_graph in eager replay (the same wrapper, no graphs);
  runs everywhere, CI included;
* ``NCCL_CUDA``: NCCL with one GPU per rank and real CUDA graphs, collectives captured
  inside them (needs 2 GPUs).

A scenario runs the same program eagerly and through te_graph on each rank and returns
what both produced (CPU copies; a training run as tests/harness.py's ``Trace``); the test
compares them bitwise with the harness's ``assert_same``, and across ranks. Every rank gets
a deadline: a hang fails the test (faulthandler prints each rank's Python stack) instead of
blocking the suite.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import rng
import te_graph
from checkpointing import checkpoint
from examples.gpt import GPTBlock
from examples.parallel import ParallelGPTBlock, allreduce_sequence_parallel_grads
from examples.runtime import init_process_group, shutdown
from tests.harness import Trace

WORLD = 2
SEED = 1234
SEQ, BATCH, HIDDEN, HEADS, LAYERS = 8, 2, 32, 4, 2
DROPOUT = 0.1
STEPS = 3
SHARDED_DISTRIBUTE_ERROR = (
    "checkpoint(distribute_saved_activations=True): the first input differs between the ranks"
)


@dataclass(frozen=True)
class Backend:
    """How the ranks talk and where they compute."""

    name: str
    backend: str  # torch.distributed backend
    device_type: str
    eager_replay: bool  # te_graph without graphs (the CPU form)


GLOO_CPU = Backend("gloo-cpu", "gloo", "cpu", eager_replay=True)
NCCL_CUDA = Backend("nccl-cuda", "nccl", "cuda", eager_replay=False)


# -- the harness ---------------------------------------------------------------------------------
@dataclass
class Rank:
    """What a scenario gets on its rank."""

    rank: int
    world: int
    backend: Backend
    device: torch.device
    tracker: rng.CudaRNGStatesTracker
    graphed: list = field(default_factory=list)

    def get_tracker(self) -> rng.CudaRNGStatesTracker:
        return self.tracker

    def seed(self, seed: int, tp_rank: int | None = None) -> None:
        """Megatron seeding: the default generator of this rank's device gets ``seed``, the
        model-parallel stream ``seed + 2718 + tp_rank`` (``tp_rank`` defaults to the rank)."""
        rng.model_parallel_cuda_manual_seed(seed, tp_rank=self.rank if tp_rank is None else tp_rank, tracker=self.tracker)

    def graph(self, modules: Any, samples: Any, **kwargs: Any) -> Any:
        """``te_graph.make_graphed_callables`` in this backend's form; what it returns is
        reset before the process group goes."""
        graphed = te_graph.make_graphed_callables(
            modules, samples, eager_replay=self.backend.eager_replay,
            get_rng_state_tracker=self.get_tracker, **kwargs,
        )
        self.graphed.append(graphed)
        return graphed

    def randn(self, *shape: int, generator: torch.Generator, requires_grad: bool = False) -> torch.Tensor:
        """Normal samples from a CPU generator (the same numbers on any device)."""
        return torch.randn(shape, generator=generator).to(self.device).requires_grad_(requires_grad)


TEARDOWN_S = 30.0  # once the results are in: free the graphs, leave the group, exit


def run_on_ranks(scenario: Callable[..., dict], backend: Backend, tmp_path: Path, *,
                 world: int = WORLD, timeout_s: float = 120.0, **options: Any) -> list[dict]:
    """Run ``scenario(rank, **options)`` on ``world`` spawned ranks; return each rank's result.

    A rank that raises fails the call with its traceback. Ranks still running after
    ``timeout_s``, or more than ``TEARDOWN_S`` after every result was written (a teardown
    that hangs), are killed and the call fails; each rank prints its stack first.
    """
    results = [tmp_path / f"rank{r}.pt" for r in range(world)]
    for path in results:
        path.unlink(missing_ok=True)
    store = tmp_path / f"store-{time.monotonic_ns()}"
    context = mp.start_processes(
        _rank_main, args=(scenario, backend, world, str(store), str(tmp_path), timeout_s, options),
        nprocs=world, join=False, start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s + 10
    teardown_deadline = None
    while not context.join(timeout=0.5):
        if teardown_deadline is None and all(path.exists() for path in results):
            teardown_deadline = time.monotonic() + TEARDOWN_S + 10
        if time.monotonic() > min(deadline, teardown_deadline or deadline):
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            what = ("did not exit after writing their results (teardown hang: te_graph.reset, "
                    "then destroy_process_group)" if teardown_deadline else f"were still running after {timeout_s:.0f} s")
            raise TimeoutError(
                f"{scenario.__name__} on {backend.name}: the ranks {what} and were killed; each "
                "rank's Python stack is printed above."
            )
    return [torch.load(path, weights_only=False) for path in results]


def _rank_main(rank: int, scenario: Callable[..., dict], backend: Backend, world: int, store: str,
               out_dir: str, timeout_s: float, options: dict) -> None:
    # A hang prints every thread's Python stack and ends the rank.
    faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.stderr)
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend.device_type == "cuda" else torch.device("cpu")
    init_process_group(backend.backend, rank, world, f"file://{store}", timeout_s,
                       device if device.type == "cuda" else None)
    tracker = rng.get_cuda_rng_tracker() if device.type == "cuda" else rng.CudaRNGStatesTracker(device="cpu")
    ctx = Rank(rank, world, backend, device, tracker)
    try:
        result = _to_cpu(scenario(ctx, **options))
        path = os.path.join(out_dir, f"rank{rank}.pt")
        torch.save(result, path + ".tmp")
        os.replace(path + ".tmp", path)  # appears whole: the parent starts the teardown clock
        faulthandler.dump_traceback_later(TEARDOWN_S, exit=True, file=sys.stderr)
    finally:
        shutdown(*ctx.graphed, device=device)
    faulthandler.cancel_dump_traceback_later()


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Trace):
        return Trace(**{f.name: _to_cpu(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


class Layers(nn.Module):
    """Megatron-style layers run in sequence: ``hidden_states`` in, ``hidden_states`` out."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x, _ = layer(x)
        return x


@torch.no_grad()
def sgd_step(params: list[torch.Tensor], lr: float = 0.1) -> None:
    """Plain SGD, then grads zeroed in place (torch.optim's first use imports torch._dynamo,
    seconds per spawned rank)."""
    grads = [p.grad for p in params]
    torch._foreach_add_(params, grads, alpha=-lr)
    torch._foreach_zero_(grads)


def _weighted_sum(y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A loss whose gradient differs per element (so a wrong element shows)."""
    return (y * torch.randn(y.shape, generator=generator).to(y)).sum()


# -- 1 and 2: tensor and sequence parallelism ----------------------------------------------------
def _parallel_blocks(ctx: Rank, dropout: float, **options: Any) -> tuple[list[GPTBlock], list[ParallelGPTBlock]]:
    """Whole blocks built from the seed (the same on every rank) and this rank's shards."""
    ctx.seed(SEED)
    dense = [GPTBlock(HIDDEN, HEADS, dropout, get_rng_tracker=ctx.get_tracker, device=ctx.device)
             for _ in range(LAYERS)]
    return dense, [ParallelGPTBlock.from_dense(block, None, **options) for block in dense]


def _shard(x: torch.Tensor, ctx: Rank) -> torch.Tensor:
    return x.chunk(ctx.world)[ctx.rank].contiguous()


def _train_tensor_parallel(ctx: Rank, blocks: list[ParallelGPTBlock], layers: list, sequence_parallel: bool) -> Trace:
    """STEPS SGD steps; every rank gets the same batch (its sequence shard under SP): each
    step's output and input grad, the weights after the last step and its grads, by name."""
    data = torch.Generator().manual_seed(SEED + 1)
    params = [p for b in blocks for p in b.parameters()]
    trace = Trace()
    ctx.seed(SEED)
    for step in range(STEPS):
        x = ctx.randn(SEQ, BATCH, HIDDEN, generator=data)
        x = (_shard(x, ctx) if sequence_parallel else x).requires_grad_()
        y = x
        for layer in layers:
            y, _ = layer(y)
        grad = torch.randn(SEQ, BATCH, HIDDEN, generator=data).to(y)
        y.backward(_shard(grad, ctx) if sequence_parallel else grad)
        if sequence_parallel:
            for block in blocks:
                allreduce_sequence_parallel_grads(block)
        trace.microbatch(y, x)
        if step < STEPS - 1:  # the last step's grads are part of the result
            sgd_step(params)
    named = [(f"layer{i}.{n}", p) for i, b in enumerate(blocks) for n, p in b.named_parameters()]
    trace.weights = {n: p.detach().clone() for n, p in named}
    trace.param_grads = {n: p.grad.clone() for n, p in named if p.grad is not None}
    return trace


def _dense_difference(ctx: Rank, sequence_parallel: bool) -> dict:
    """Without dropout, the parallel blocks compute what the whole blocks compute (up to the
    order of the sums): largest differences of the output and the input gradient."""
    dense, blocks = _parallel_blocks(ctx, 0.0, sequence_parallel=sequence_parallel)
    data = torch.Generator().manual_seed(SEED + 3)
    x = ctx.randn(SEQ, BATCH, HIDDEN, generator=data)
    grad = ctx.randn(SEQ, BATCH, HIDDEN, generator=data)
    outs = {}
    for name, layers in (("dense", dense), ("parallel", blocks)):
        split = sequence_parallel and name == "parallel"
        inp = (_shard(x, ctx) if split else x.clone()).requires_grad_()
        y = inp
        for layer in layers:
            y, _ = layer(y)
        y.backward(_shard(grad, ctx) if split else grad)
        outs[name] = (y.detach(), inp.grad)
    want_y, want_g = outs["dense"]
    if sequence_parallel:
        want_y, want_g = _shard(want_y, ctx), _shard(want_g, ctx)
    got_y, got_g = outs["parallel"]
    return {"output": (got_y - want_y).abs().max().item(), "input_grad": (got_g - want_g).abs().max().item(),
            "scale": want_y.abs().max().item()}


def tensor_parallel(ctx: Rank, recompute: str = "none", sequence_parallel: bool = False) -> dict:
    """TP blocks (dropout on, 2 layers) trained eagerly and through te_graph; ``recompute``
    is ``none``, ``full`` or ``distributed`` (full, distribute_saved_activations=True)."""
    options = dict(sequence_parallel=sequence_parallel, recompute=recompute != "none",
                   distribute_saved_activations=recompute == "distributed")
    _, eager_blocks = _parallel_blocks(ctx, DROPOUT, **options)
    eager = _train_tensor_parallel(ctx, eager_blocks, eager_blocks, sequence_parallel)

    _, blocks = _parallel_blocks(ctx, DROPOUT, **options)
    samples = torch.Generator().manual_seed(SEED + 2)  # the same samples on every rank
    seq = SEQ // ctx.world if sequence_parallel else SEQ
    ctx.seed(SEED)
    graphed = ctx.graph(tuple(blocks), tuple((ctx.randn(seq, BATCH, HIDDEN, generator=samples, requires_grad=True),)
                                             for _ in blocks))
    result = _train_tensor_parallel(ctx, blocks, list(graphed), sequence_parallel)
    return {"eager": eager, "graphed": result, "dense_difference": _dense_difference(ctx, sequence_parallel)}


def sequence_parallel_with_distributed_recompute(ctx: Rank) -> dict:
    """Sequence-parallel shards handed to checkpoint(distribute_saved_activations=True):
    the eager call and make_graphed_callables must both refuse them."""
    ctx.seed(SEED)
    block = ParallelGPTBlock(HIDDEN, HEADS, DROPOUT, None, sequence_parallel=True, recompute=True,
                             distribute_saved_activations=True, get_rng_tracker=ctx.get_tracker, device=ctx.device)
    shard = ctx.randn(SEQ // ctx.world, BATCH, HIDDEN, generator=torch.Generator().manual_seed(SEED + ctx.rank),
                      requires_grad=True)
    errors = {}
    try:
        block(shard)
        errors["eager"] = None
    except ValueError as error:
        errors["eager"] = str(error)
    try:
        ctx.graph((block,), ((shard.detach().clone().requires_grad_(),),))
        errors["graph"] = None
    except ValueError as error:
        errors["graph"] = str(error)
    return errors


# -- 3: data parallelism (DDP around graphed layers) ---------------------------------------------
def data_parallel(ctx: Rank, order: str = "eager") -> dict:
    """Stacks of GPTBlocks (dropout, full recompute) under DDP, each rank on its own data.

    ``order``: ``eager`` (no te_graph), ``graph-then-wrap`` or ``wrap-then-graph``.
    """
    ddp_options = {"device_ids": [ctx.device.index]} if ctx.device.type == "cuda" else {}

    def build() -> Layers:
        ctx.seed(SEED, tp_rank=0)  # data-parallel replicas share every stream
        return Layers([GPTBlock(HIDDEN, HEADS, DROPOUT, recompute=True, get_rng_tracker=ctx.get_tracker,
                               device=ctx.device) for _ in range(LAYERS)])

    def samples() -> tuple:
        g = torch.Generator().manual_seed(SEED + 2)
        return tuple((ctx.randn(SEQ, BATCH, HIDDEN, generator=g, requires_grad=True),) for _ in range(LAYERS))

    def run(order: str) -> Trace:
        stack = build()
        if order == "graph-then-wrap":
            ctx.graph(tuple(stack.layers), samples())
        model = DistributedDataParallel(stack, **ddp_options)
        if order == "wrap-then-graph":
            ctx.graph(tuple(stack.layers), samples())
        optimizer = torch.optim.SGD(stack.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(SEED + 100 * ctx.rank)  # other data on each rank
        ctx.seed(SEED, tp_rank=0)
        trace = Trace()
        for _ in range(STEPS):
            optimizer.zero_grad(set_to_none=False)
            x = ctx.randn(SEQ, BATCH, HIDDEN, generator=data, requires_grad=True)
            y = model(x)
            _weighted_sum(y, data).backward()
            trace.microbatch(y, x)
            grads = {n: p.grad.clone() for n, p in stack.named_parameters()}
            optimizer.step()
        trace.param_grads = grads  # the last step's, by name
        trace.weights = {n: p.detach().clone() for n, p in stack.named_parameters()}
        return trace

    return {"eager": run("eager"), "graphed": run(order)}


# -- 4: pipeline parallelism -----------------------------------------------------------------------
CHUNKS, MICROBATCHES, LAYERS_PER_CHUNK = 2, 4, 2


def interleaved_order(pp_rank: int, pp_size: int, chunks: int, microbatches: int) -> list[int]:
    """Megatron's interleaved 1F1B schedule for one pipeline rank, written as te_graph's
    ``order``: 1-based model-chunk ids, ``+c`` a forward, ``-c`` a backward."""
    if microbatches % pp_size:
        raise ValueError(f"interleaved schedule: {microbatches} microbatches, not a multiple of {pp_size} stages.")
    total = chunks * microbatches
    warmup = min((pp_size - pp_rank - 1) * 2 + (chunks - 1) * pp_size, total)

    def forward_chunk(k: int) -> int:
        return (k // pp_size) % chunks + 1

    def backward_chunk(k: int) -> int:
        return chunks - (k // pp_size) % chunks

    order = [forward_chunk(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward_chunk(warmup + k), -backward_chunk(k)]
    return order + [-backward_chunk(k) for k in range(total - warmup, total)]


def pipeline_events(orders: list[list[int]]) -> list[tuple[int, str, int, int]]:
    """One global sequence of ``(rank, "F" or "B", chunk, microbatch)`` (chunk 0-based)
    that keeps each rank's order and the data flow between stages: stage ``v = chunk *
    ranks + rank``; a forward needs the previous stage's forward of its microbatch, a
    backward its own forward and the next stage's backward. Every rank walks the same
    sequence, sending and receiving in lockstep, so no P2P can deadlock or mismatch.
    Raises ValueError if the orders cannot run together."""
    ranks = len(orders)
    chunks = max(abs(c) for order in orders for c in order)
    last = chunks * ranks - 1
    position, count, done, events = [0] * ranks, {}, set(), []
    while any(position[r] < len(orders[r]) for r in range(ranks)):
        for r in range(ranks):
            if position[r] == len(orders[r]):
                continue
            c = orders[r][position[r]]
            kind, chunk = ("F" if c > 0 else "B"), abs(c) - 1
            mb, stage = count.get((r, kind, chunk), 0), chunk * ranks + r
            if kind == "F":
                ready = stage == 0 or ("F", stage - 1, mb) in done
            else:
                ready = ("F", stage, mb) in done and (stage == last or ("B", stage + 1, mb) in done)
            if ready:
                done.add((kind, stage, mb))
                count[r, kind, chunk] = mb + 1
                position[r] += 1
                events.append((r, kind, chunk, mb))
                break
        else:
            raise ValueError(f"pipeline orders deadlock: {orders}")
    return events


def _run_pipeline(ctx: Rank, events: list, call: Callable, step: int, trace: Trace) -> None:
    """One iteration: activations forward and gradients backward between the ranks with
    P2P send/recv outside the layers. Records each local stage's outputs and input grads
    under ``step{step}/stage{stage}/mb{microbatch}``."""
    ranks, shape = ctx.world, (SEQ, BATCH, HIDDEN)
    last = CHUNKS * ranks - 1
    data = torch.Generator().manual_seed(SEED + 10 + step)  # the same on every rank
    inputs = [ctx.randn(*shape, generator=data) for _ in range(MICROBATCHES)]
    loss_grads = [ctx.randn(*shape, generator=data) for _ in range(MICROBATCHES)]
    received, live = {}, {}
    for owner, kind, chunk, mb in events:
        stage = chunk * ranks + owner
        if owner != ctx.rank:  # another rank's step: receive what it sends here
            if kind == "F" and stage < last:
                received["F", stage + 1, mb] = _recv(shape, owner, ctx)
            elif kind == "B" and stage > 0:
                received["B", stage - 1, mb] = _recv(shape, owner, ctx)
            continue
        if kind == "F":
            source = inputs[mb] if stage == 0 else received.pop(("F", stage, mb))
            x = source.detach().requires_grad_()
            y = x
            for layer in range(LAYERS_PER_CHUNK):
                y, _ = call(chunk, mb, layer)(y)
            live[chunk, mb] = (x, y)
            trace.outputs[f"step{step}/stage{stage}/mb{mb}"] = y.detach().clone()  # valid until its backward
            if stage < last:
                dist.send(y.detach().contiguous(), dst=(stage + 1) % ranks)
        else:
            x, y = live.pop((chunk, mb))
            y.backward(loss_grads[mb] if stage == last else received.pop(("B", stage, mb)))
            trace.input_grads[f"step{step}/stage{stage}/mb{mb}"] = x.grad.clone()
            if stage > 0:
                dist.send(x.grad.contiguous(), dst=(stage - 1) % ranks)
    assert not received and not live, "every message and activation was used"


def _recv(shape: tuple, src: int, ctx: Rank) -> torch.Tensor:
    buffer = torch.empty(shape, device=ctx.device)
    dist.recv(buffer, src=src)
    return buffer


def pipeline(ctx: Rank, steps: int = 2) -> dict:
    """Two pipeline ranks, one stage each, Megatron's interleaved schedule with CHUNKS model
    chunks per rank and MICROBATCHES microbatches; through te_graph one callable per
    (chunk, microbatch, layer) with ``order=`` and buffer reuse. Layers: GPTBlocks with
    dropout and full recompute."""
    orders = [interleaved_order(r, ctx.world, CHUNKS, MICROBATCHES) for r in range(ctx.world)]
    events = pipeline_events(orders)

    def build() -> list[list[GPTBlock]]:
        ctx.seed(SEED + 100 * ctx.rank, tp_rank=0)  # Megatron offsets the seed per stage
        return [[GPTBlock(HIDDEN, HEADS, DROPOUT, recompute=True, get_rng_tracker=ctx.get_tracker, device=ctx.device)
                 for _ in range(LAYERS_PER_CHUNK)] for _ in range(CHUNKS)]

    def train(chunks: list[list[GPTBlock]], call: Callable) -> Trace:
        params = [p for chunk in chunks for layer in chunk for p in layer.parameters()]
        ctx.seed(SEED + 100 * ctx.rank, tp_rank=0)
        trace = Trace(outputs={}, input_grads={}, weights={})
        for step in range(steps):
            _run_pipeline(ctx, events, call, step, trace)
            sgd_step(params)
        for c, chunk in enumerate(chunks):
            for i, layer in enumerate(chunk):
                trace.weights.update({f"chunk{c}/layer{i}/{n}": p.detach().clone() for n, p in layer.named_parameters()})
        return trace

    eager_chunks = build()
    eager = train(eager_chunks, lambda chunk, mb, layer: eager_chunks[chunk][layer])

    chunks = build()
    g = torch.Generator().manual_seed(SEED + 2)
    samples = tuple((ctx.randn(SEQ, BATCH, HIDDEN, generator=g, requires_grad=True),)
                    for _ in range(CHUNKS * MICROBATCHES * LAYERS_PER_CHUNK))
    ctx.seed(SEED + 100 * ctx.rank, tp_rank=0)
    graphed = ctx.graph(tuple(layer for chunk in chunks for layer in chunk), samples,
                        order=orders[ctx.rank], num_layers_per_chunk=LAYERS_PER_CHUNK,
                        reuse_graph_input_output_buffers=True)

    def graphed_call(chunk: int, mb: int, layer: int) -> Callable:
        # te_graph's layout: by chunk, then microbatch, then layer.
        return graphed[(chunk * MICROBATCHES + mb) * LAYERS_PER_CHUNK + layer]

    return {"order": orders[ctx.rank], "eager": eager, "graphed": train(chunks, graphed_call)}


# -- 5: what the random streams mean across tensor-parallel ranks ----------------------------------
MASK_P = 0.5


class DropoutProbe(nn.Module):
    """A recomputed region that shows its dropout masks: the first half of the features is
    dropped from the default stream, the second under the tracker's model-parallel fork,
    with ``distribute_saved_activations`` over the TP group. With positive inputs and
    gradients, the output's zeros are the forward's masks and the input gradient's zeros
    the recompute's."""

    def __init__(self, get_tracker: Callable, device: torch.device):
        super().__init__()
        self.get_tracker = get_tracker
        self.scale = nn.Parameter(torch.ones((), device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._region, x, distribute_saved_activations=True, tp_group=None,
                          get_rng_state_tracker=self.get_tracker)

    def _region(self, x: torch.Tensor) -> torch.Tensor:
        default, parallel = (x * self.scale).chunk(2, dim=-1)
        default = F.dropout(default, MASK_P)
        with self.get_tracker().fork():
            parallel = F.dropout(parallel, MASK_P)
        return torch.cat([default, parallel], dim=-1)


def rng_streams(ctx: Rank) -> dict:
    """Forward and recompute masks of the probe over STEPS steps, eagerly and through te_graph,
    seeded as tensor-parallel rank ``rank``."""

    def run(graphed: bool) -> dict:
        ctx.seed(SEED)
        probe = DropoutProbe(ctx.get_tracker, ctx.device)
        layer = probe
        if graphed:
            g = torch.Generator().manual_seed(SEED + 2)  # replicated samples (the check needs it)
            layer = ctx.graph(probe, (ctx.randn(SEQ, BATCH, 2 * HIDDEN, generator=g, requires_grad=True),))
        data = torch.Generator().manual_seed(SEED + 1)  # the same on every rank
        masks = {"forward": [], "recompute": []}
        for _ in range(STEPS):
            x = (torch.rand(SEQ, BATCH, 2 * HIDDEN, generator=data) + 0.1).to(ctx.device).requires_grad_()
            y = layer(x)
            masks["forward"].append(y.detach() != 0)
            y.backward((torch.rand(y.shape, generator=data) + 0.1).to(y))
            masks["recompute"].append(x.grad != 0)
        return masks

    return {"eager": run(False), "graphed": run(True)}


# -- the training example under a torchrun-like launch ---------------------------------------------
ROOT = str(Path(__file__).resolve().parent.parent)


def fresh_process_env(ranks: int = 1) -> dict:
    """The environment of a fresh process (the Megatron examples' and probes'): the repository
    root first on PYTHONPATH (pytest puts it on sys.path of its own process only), no torchrun
    variables of this one, the multi-GPU rules, and with one rank this worker's GPU alone."""
    path = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    for name in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    if torch.cuda.is_available() and ranks == 1:
        env["CUDA_VISIBLE_DEVICES"] = str(torch.cuda.current_device())
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (for a process group's rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_gpt_rank(rank: int, world: int, port: int, argv: list[str], out_dir: str, timeout_s: float) -> None:
    faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.stderr)
    # What torchrun sets for each process.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from examples.train_gpt import main

    summary = main(argv)
    torch.save(summary, os.path.join(out_dir, f"summary{rank}.pt"))
    faulthandler.cancel_dump_traceback_later()


def run_train_gpt(argv: list[str], tmp_path: Path, world: int = WORLD, timeout_s: float = 120.0) -> list[dict]:
    """``examples/train_gpt.py``'s ``main(argv)`` on ``world`` processes launched the way
    torchrun launches them; returns each rank's summary."""
    context = mp.start_processes(
        _train_gpt_rank, args=(world, free_port(), argv, str(tmp_path), timeout_s),
        nprocs=world, join=False, start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s + 10
    while not context.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"train_gpt on {world} ranks still running after {timeout_s:.0f} s; killed.")
    return [torch.load(tmp_path / f"summary{r}.pt", weights_only=False) for r in range(world)]
