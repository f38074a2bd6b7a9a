"""megatron-core's GPTModel trained through Megatron's own loop: its schedule
(``get_forward_backward_func``), its DDP (``main_grad``, gradient-accumulation fusion) and its
CUDA-graph helper (``TECudaGraphHelper``, ``cuda_graph_impl="transformer_engine"``), with
te_graph as the graph maker (``te_graph.integrations.megatron.enable()``), with Transformer
Engine's graphs, or eagerly. The GPU tests (tests/test_megatron_path.py) compare the runs
bitwise; ``benchmarks/bench_megatron.py --path gpt`` times them.

Needs a CUDA GPU, megatron-core 0.19 and Transformer Engine 2.20 (the helper graphs TE-spec
layers). One process, one GPU (an NCCL group of one rank)::

    python -m examples.megatron_gpt --graphs eager,te_graph --dropout 0.1 --out /tmp/run.pt

What it does, in Megatron's order: seed (TE's RNG tracker, before the model is built),
build GPTModel with the TE layer spec (bf16, one ``main_grad`` buffer through DDP), train
``--warmup-steps`` steps eagerly, make the graphs with the helper, train on. Each step:
``zero_grad_buffer()``, Megatron's schedule over ``--microbatches``, then a plain SGD step on
``main_grad`` (in place: the graphs read the parameters by address). The output layer is
Megatron's ``ColumnParallelLinear``, whose fused weight-gradient kernel needs NVIDIA apex:
it is built with fusion off (``gradient_accumulation_fusion`` stays on for every TE layer).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterator

import torch

__all__ = ["RunConfig", "setup_process", "train", "main"]


@dataclass(frozen=True)
class RunConfig:
    layers: int = 4
    hidden: int = 512
    heads: int = 8
    seq: int = 256
    micro_batch: int = 2
    microbatches: int = 4
    vocab: int = 1024
    dropout: float = 0.1
    fp8: str = ""  # "" (bf16), "delayed" or "tensorwise"
    fusion: bool = True  # gradient_accumulation_fusion (TE's fuse_wgrad_accumulation)
    recompute: str = "none"  # "none" or "full" (Megatron's full recompute, one layer at a time)
    # "eager", "te_graph" (the helper, te_graph's graphs), "te_graph_replay" (te_graph's eager
    # replay) or "te" (the helper, Transformer Engine's graphs)
    graphs: str = "te_graph"
    steps: int = 4
    warmup_steps: int = 1  # eager steps before the helper makes the graphs
    seed: int = 1234
    lr: float = 1e-3


def setup_process() -> None:
    """One NCCL rank on the current GPU, Megatron's parallel state and microbatch
    calculator; idempotent."""
    from megatron.core import parallel_state  # noqa: PLC0415

    if not torch.distributed.is_initialized():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        torch.cuda.set_device(0)
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def _build(cfg: RunConfig) -> tuple[list, Any]:
    """Seed, then the model (GPTModel, TE spec) wrapped as Megatron trains it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: PLC0415
    from megatron.core.distributed import finalize_model_grads  # noqa: PLC0415
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec  # noqa: PLC0415
    from megatron.core.num_microbatches_calculator import (  # noqa: PLC0415
        destroy_num_microbatches_calculator, init_num_microbatches_calculator)
    from megatron.core.tensor_parallel import layers as tp_layers  # noqa: PLC0415
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: PLC0415
    from megatron.core.transformer.module import Float16Module  # noqa: PLC0415
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(0, None, cfg.microbatches * cfg.micro_batch, cfg.micro_batch, 1)
    # Seed before building: Megatron's TE layers take the tracker when they are made.
    model_parallel_cuda_manual_seed(cfg.seed, te_rng_tracker=True, force_reset_rng=True)
    torch.manual_seed(cfg.seed)
    fp8 = {"fp8": "hybrid", "fp8_recipe": cfg.fp8} if cfg.fp8 else {}
    config = TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        bf16=True, params_dtype=torch.bfloat16, hidden_dropout=cfg.dropout, attention_dropout=cfg.dropout,
        # The same in every run (the eager one never makes graphs): DDP and the layers then
        # take the same paths, and only the helper differs.
        cuda_graph_impl="transformer_engine",
        cuda_graph_warmup_steps=cfg.warmup_steps, gradient_accumulation_fusion=cfg.fusion, **fp8,
    )
    if cfg.recompute == "full":
        # Megatron's __post_init__ refuses full recompute with per-layer graphs (its own
        # checkpoint would draw other dropout masks); te_graph's is exact. Set after the check.
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
    # The output layer is Megatron's ColumnParallelLinear: its fused weight-gradient kernel
    # is NVIDIA apex's. Let it be built, then turn its fusion off (the same in every run).
    available = tp_layers._grad_accum_fusion_available
    tp_layers._grad_accum_fusion_available = True
    try:
        gpt = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=cfg.vocab,
                       max_sequence_length=cfg.seq)
    finally:
        tp_layers._grad_accum_fusion_available = available
    gpt.output_layer.gradient_accumulation_fusion = False
    model = [DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                     Float16Module(config, gpt.cuda()))]
    config.finalize_model_grads_func = finalize_model_grads
    return model, config


def _batches(cfg: RunConfig) -> Iterator[dict]:
    """Random token batches with a causal mask, from a generator of their own."""
    g = torch.Generator(device="cuda").manual_seed(cfg.seed + 1)
    positions = torch.arange(cfg.seq, device="cuda").expand(cfg.micro_batch, cfg.seq)
    mask = torch.ones(cfg.seq, cfg.seq, dtype=torch.bool, device="cuda").triu(1)
    mask = mask[None, None].expand(cfg.micro_batch, 1, cfg.seq, cfg.seq).contiguous()
    while True:
        tokens = torch.randint(0, cfg.vocab, (cfg.micro_batch, cfg.seq), device="cuda", generator=g)
        yield {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "positions": positions, "mask": mask}


def _forward_step(data: Iterator[dict], model: Any) -> tuple:
    batch = next(data)
    losses = model(batch["tokens"], batch["positions"], batch["mask"], labels=batch["labels"])

    def loss_func(output: torch.Tensor) -> tuple:
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return losses, loss_func


def train(cfg: RunConfig) -> dict:
    """Train ``cfg``; what every step left: losses, main_grads, weights, and step times."""
    import te_graph  # noqa: PLC0415
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper  # noqa: PLC0415
    from te_graph.integrations import megatron as integration  # noqa: PLC0415

    setup_process()
    integration.disable()
    if cfg.graphs in ("te_graph", "te_graph_replay"):
        integration.enable()
    elif cfg.recompute != "none" and cfg.graphs == "eager":
        integration.enable(recompute=True)  # the eager reference recomputes exactly too
    model, config = _build(cfg)
    params = [p for p in model[0].parameters() if p.requires_grad]
    helper = None
    if cfg.graphs != "eager":
        helper = TECudaGraphHelper(model=model, config=config, seq_length=cfg.seq, micro_batch_size=cfg.micro_batch,
                                   optimizers=[])
    step_fn = get_forward_backward_func()
    data = _batches(cfg)
    record: dict = {"losses": [], "main_grads": [], "weights": [], "step_ms": [], "config": asdict(cfg)}
    for step in range(cfg.steps):
        if helper is not None and step == cfg.warmup_steps:
            started = time.perf_counter()
            replay = cfg.graphs == "te_graph_replay"  # te_graph's eager replay: the graphs' mirror
            previous = os.environ.get("TE_GRAPH_EAGER_REPLAY")
            os.environ["TE_GRAPH_EAGER_REPLAY"] = "1" if replay else "0"
            try:
                with _thread_local_capture() if cfg.graphs == "te" else contextlib.nullcontext():
                    helper.create_cudagraphs()
            finally:
                if previous is None:
                    del os.environ["TE_GRAPH_EAGER_REPLAY"]
                else:
                    os.environ["TE_GRAPH_EAGER_REPLAY"] = previous
            torch.cuda.synchronize()
            record["capture_s"] = time.perf_counter() - started
            record["graphed_with"] = type(model[0].module.module.decoder.layers[0].cuda_graphs[0]).__module__
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model[0].zero_grad_buffer()
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = step_fn(forward_step_func=_forward_step, data_iterator=data, model=model,
                      num_microbatches=cfg.microbatches, seq_length=cfg.seq, micro_batch_size=cfg.micro_batch,
                      forward_only=False)
        with torch.no_grad():
            for p in params:  # plain SGD on main_grad, in place
                p.add_(p.main_grad.to(p.dtype), alpha=-cfg.lr)
        torch.cuda.synchronize()
        record["step_ms"].append((time.perf_counter() - started) * 1e3)
        record["losses"].append(torch.stack([o["lm loss"] for o in out]).cpu())
        record["main_grads"].append([p.main_grad.detach().cpu().clone() for p in params])
        record["weights"].append([p.detach().cpu().clone() for p in params])
    record["footprint_mib"] = torch.cuda.max_memory_reserved() / 2**20
    if helper is not None:
        helper.delete_cuda_graphs()
    te_graph.reset()
    integration.disable()
    return record


@contextlib.contextmanager
def _thread_local_capture() -> Iterator[None]:
    """Transformer Engine's graphs capture with ``torch.cuda.graph``'s default, CUDA's global
    capture mode, which fails beside the NCCL process group's watchdog thread ("operation
    would make the legacy stream depend on a capturing blocking stream", seen on an H100
    with torch 2.11); TE's rows run with ``thread_local``, the mode te_graph captures in."""
    original = torch.cuda.graph.__init__

    def init(self: Any, cuda_graph: Any, pool: Any = None, stream: Any = None,
             capture_error_mode: str = "thread_local") -> None:
        original(self, cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode)

    torch.cuda.graph.__init__ = init
    try:
        yield
    finally:
        torch.cuda.graph.__init__ = original


def timing(record: dict) -> float:
    """Median step time (ms) over the graphed steps."""
    graphed = record["step_ms"][record["config"]["warmup_steps"] + 1:]
    return statistics.median(graphed or record["step_ms"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graphs", default="eager,te_graph", help="comma-separated: eager, te_graph, te")
    for field, default in asdict(RunConfig()).items():
        if field == "graphs":
            continue
        kind = type(default)
        p.add_argument("--" + field.replace("_", "-"), type=(lambda v: v in ("1", "true", "True")) if kind is bool else kind,
                       default=default)
    p.add_argument("--out", default=None, help="torch.save the records here")
    args = p.parse_args(argv)
    base = RunConfig(**{k: getattr(args, k) for k in asdict(RunConfig()) if k != "graphs"})
    records = {}
    for graphs in args.graphs.split(","):
        records[graphs] = train(replace(base, graphs=graphs))
        print(f"{graphs}: median step {timing(records[graphs]):.2f} ms, footprint "
              f"{records[graphs]['footprint_mib']:.0f} MiB, losses {records[graphs]['losses'][-1].tolist()}", flush=True)
    if args.out:
        torch.save(records, args.out)
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
