"""megatron-core's GPTModel trained through Megatron's own loop: its schedule
(``get_forward_backward_func``), its DDP (``main_grad``, gradient-accumulation fusion) and its
CUDA-graph helper (``TECudaGraphHelper``, ``cuda_graph_impl="transformer_engine"``), with
te_graph as the graph maker (``te_graph.integrations.megatron.enable()``), with Transformer
Engine's graphs, or eagerly. The GPU tests (tests/test_megatron_path.py) compare the runs
bitwise; ``benchmarks/bench_megatron.py --path gpt`` times them.

Needs a CUDA GPU, megatron-core 0.19 and Transformer Engine 2.20 (the helper graphs TE-spec
layers). One process, one GPU (an NCCL group of one rank)::

    python -m examples.megatron_gpt --graphs eager,te_graph --dropout 0.1 --out /tmp/run.pt

or one process per GPU under torchrun, data parallel, with ``--expert-parallel N`` splitting
the experts over N of the ranks (each rank trains on batches of its own; ``--out`` gets the
rank before its suffix, ``run.rank1.pt``)::

    torchrun --nproc-per-node 2 -m examples.megatron_gpt --experts 4 --expert-parallel 2 \
        --graph-modules attn,moe_router,moe_preprocess --out /tmp/run.pt

What it does, in Megatron's order: seed (TE's RNG tracker, before the model is built),
build GPTModel with the TE layer spec (``--spec local``: megatron-core's own modules; bf16, one
``main_grad`` buffer through DDP), train
``--warmup-steps`` steps eagerly, make the graphs with the helper, train on. Each step:
``zero_grad_buffer()``, Megatron's schedule over ``--microbatches``, then a plain SGD step on
``main_grad`` (in place: the graphs read the parameters by address), or with ``--optimizer
megatron`` / ``--dist-opt 1`` Megatron's own Adam (fp32 main weights, distributed or not). ``--overlap-grad-reduce`` and ``--overlap-param-gather`` are DDP's options; with the
latter, DDP's forward pre-hooks are turned off around capture and the helper runs them by
hand before each replay, as Megatron-LM's ``training.py`` does. The output layer is
Megatron's ``ColumnParallelLinear``, whose fused weight-gradient kernel needs NVIDIA apex:
it is built with fusion off (``gradient_accumulation_fusion`` stays on for every TE layer).

``--tensor-parallel N`` (with ``--sequence-parallel 1``), ``--context-parallel N`` (each rank
a share of the sequence; TE's attention exchanges keys and values in a ring) and
``--pipeline-parallel N`` (with ``--virtual-pipeline N`` model chunks per stage: the
interleaved schedule) split the model over torchrun's ranks (the ranks left over are data parallel); ``--rope 1`` uses rotary
position embeddings, ``--mtp 1`` adds a multi-token prediction layer, ``--spec local``
builds megatron-core's own modules instead of TE's (with ``--fusion 0``), and
``--regraph-at N`` deletes the graphs and makes them again before step N::

    torchrun --nproc-per-node 2 -m examples.megatron_gpt --pipeline-parallel 2 --out /tmp/run.pt

``--graphs te_graph_step`` graphs the whole step instead, through megatron-core's own
schedule: every microbatch's forward and backward, DDP's accumulation into ``main_grad`` and
its reduction, and the plain SGD step, as one graph
(``te_graph.integrations.megatron.make_graphed_train_step``; Megatron's optimizer steps
eagerly after it)::

    python -m examples.megatron_gpt --graphs eager,te_graph_step --dropout 0.1 --recompute full

``--experts N`` makes every MLP megatron-core's ``MoELayer`` (TE grouped GEMM, alltoall
dispatcher; dropless, or drop-and-pad with ``--capacity``); ``--graph-modules`` is the
helper's ``cuda_graph_modules`` (``attn,moe_router,moe_preprocess`` graphs each layer up to
token dispatch, which dropless routing needs); ``--buckets`` also graphs the dropless experts,
one graph per token capacity (``te_graph.integrations.megatron.moe_experts``), and with them the
dispatch around them where each rank holds whole experts, alltoalls included (``--moe-span experts``: the
experts alone)::

    python -m examples.megatron_gpt --graphs eager,te_graph --experts 4 \
        --graph-modules attn,moe_router,moe_preprocess --buckets 1.0,1.25,1.5,2

``--choose device`` picks the capacity on the GPU instead (a conditional node, no host sync),
inside the graph of the whole layer (an empty ``--graph-modules``)::

    python -m examples.megatron_gpt --graphs eager,te_graph --experts 4 --buckets 1.0,1.25 --choose device

``--sync-check 1`` runs the graphed steps' forward and backward under
``torch.cuda.set_sync_debug_mode("error")``: a host sync in them fails the run.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterator, Optional

import torch

__all__ = ["RunConfig", "setup_process", "graph_event", "train", "main"]


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
    fp8_amax_history: int = 1  # delayed scaling: amax history length and how the scale reads it
    fp8_amax_algo: str = "most_recent"  # or "max"
    fusion: bool = True  # gradient_accumulation_fusion (TE's fuse_wgrad_accumulation)
    # The layer spec: "te" (Transformer Engine's modules) or "local" (megatron-core's own,
    # transformer_impl="local": no TE module in the layers; its fused weight-gradient kernels
    # are NVIDIA apex's, so with fusion off)
    spec: str = "te"
    rope: bool = False  # rotary position embeddings (position_embedding_type="rope"), else learned ones
    mtp: int = 0  # multi-token prediction layers (DeepSeek-V3's; the helper graphs their transformer layers too)
    # Model parallelism over torchrun's ranks: tensor parallel (with sequence parallel where
    # set), context parallel (each rank a zigzag share of the sequence, attention over TE's
    # ring of send/recv) and pipeline parallel; the ranks left over are data parallel.
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    context_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: int = 1  # model chunks per pipeline stage (interleaved 1F1B where above 1)
    recompute: str = "none"  # "none", "full" (whole layers, one at a time) or "selective" (core attention)
    optimizer: str = "sgd"  # "sgd": plain SGD on main_grad; "megatron": get_megatron_optimizer's Adam
    dist_opt: bool = False  # Megatron's distributed optimizer (implies optimizer="megatron")
    overlap_grad_reduce: bool = False  # DDP reduces each bucket as its gradients become ready
    overlap_param_gather: bool = False  # DDP's forward pre-hooks wait for parameter all-gathers (dist_opt)
    # Mixture of experts (0: dense layers): every layer's MLP becomes megatron-core's MoELayer
    # (TE grouped GEMM, alltoall dispatcher, aux-loss load balancing).
    experts: int = 0
    topk: int = 2
    moe_ffn: int = 0  # the experts' hidden size (0: 4 * hidden)
    capacity: float = 0.0  # 0: dropless; else drop-and-pad at this capacity factor
    expert_parallel: int = 1  # experts split over this many ranks (torchrun; alltoall dispatch over NCCL)
    # Each expert's GEMMs split over this many tensor-parallel ranks (megatron-core's default is
    # all of them; above 1 it needs the linear layers' biases off, which this then sets).
    expert_tensor_parallel: int = 1
    permute_fusion: bool = False  # moe_permute_fusion: TE's fused permute and un-permute kernels
    aux_loss: float = 1e-2
    # The helper's cuda_graph_modules, comma-separated ("": the whole layer), for example
    # "attn,moe_router,moe_preprocess": the graphs end before token dispatch, which runs eagerly.
    graph_modules: str = ""
    count_dropped: bool = False  # record the share of token assignments the routers drop (sync points)
    # Dropless experts in graphs (te_graph rows): token capacities per expert, as multiples of
    # the even share (comma-separated, e.g. "1.25,1.5,2"); "": the experts run eagerly.
    buckets: str = ""
    overflow: str = "padded"  # above the largest capacity: "padded" (eagerly, 128-row capacities) or "eager"
    # "auto": the graphs hold the dispatch around the experts where each rank holds whole experts;
    # "experts": the experts alone; "dispatch": refuse a layer whose dispatch cannot go in
    moe_span: str = "auto"
    # "host": the capacity's graph is picked on the host from the routing counts (a sync per
    # layer call); "device": a conditional node picks it on the GPU, inside the graph of the
    # whole layer (with an empty --graph-modules; the last capacity holds every token)
    choose: str = "host"
    switch_recompute: bool = False  # --choose device: the node's backward runs the bucket's program again
    # "eager", "te_graph" (the helper, te_graph's graphs), "te_graph_replay" (te_graph's eager
    # replay), "te" (the helper, Transformer Engine's graphs), "te_graph_step" (the whole step as
    # one graph: te_graph.integrations.megatron.make_graphed_train_step, plain SGD inside it,
    # Megatron's optimizer eagerly after it) or "te_graph_step_replay" (its eager replay)
    graphs: str = "te_graph"
    step_verify: bool = False  # te_graph_step: te_graph's verifier compares every step with the eager one
    # Graphed runs (te_graph, te, te_graph_step): the forward and backward of each step after the
    # one that made the graphs run under torch.cuda.set_sync_debug_mode("error"), so a host
    # sync in them fails the run (eager runs and eager replays read the routing on the host).
    sync_check: bool = False
    steps: int = 4
    warmup_steps: int = 1  # eager steps before the helper makes the graphs
    # Before this step (0: never), delete the graphs (the helper's delete_cuda_graphs, which
    # resets each graphed callable) and make them again with a new helper, as a loop that
    # turns graphs off and on would.
    regraph_at: int = 0
    seed: int = 1234
    lr: float = 1e-3


def setup_process(cfg: RunConfig | None = None) -> None:
    """The NCCL group (one rank on GPU 0, or torchrun's ranks, one GPU each) and Megatron's
    parallel state for ``cfg``'s sizes (tensor, context and pipeline parallel,
    ``virtual_pipeline`` model chunks per stage, data parallel over the ranks left, experts
    split over ``expert_parallel`` ranks; one rank of each by default); idempotent."""
    from megatron.core import parallel_state  # noqa: PLC0415

    cfg = cfg or RunConfig()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if world == 1:
            # One rank needs no rendezvous: an in-process store, no port to race other runs for.
            torch.distributed.init_process_group("nccl", store=torch.distributed.HashStore(), rank=0, world_size=1)
        else:
            torch.distributed.init_process_group("nccl", rank=rank, world_size=world)  # torchrun's address
    world = torch.distributed.get_world_size()
    model_parallel = cfg.tensor_parallel * cfg.context_parallel * cfg.pipeline_parallel
    if world % cfg.expert_parallel or world % model_parallel:
        raise ValueError(f"--expert-parallel {cfg.expert_parallel}, --tensor-parallel {cfg.tensor_parallel} x "
                         f"--context-parallel {cfg.context_parallel} x --pipeline-parallel {cfg.pipeline_parallel}: "
                         f"each must divide the {world} ranks.")
    virtual = cfg.virtual_pipeline if cfg.virtual_pipeline > 1 else None
    sizes = (cfg.expert_parallel, cfg.expert_tensor_parallel, cfg.tensor_parallel, cfg.context_parallel,
             cfg.pipeline_parallel, virtual)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            cfg.tensor_parallel, cfg.pipeline_parallel, virtual_pipeline_model_parallel_size=virtual,
            context_parallel_size=cfg.context_parallel, expert_model_parallel_size=cfg.expert_parallel,
            expert_tensor_parallel_size=cfg.expert_tensor_parallel)
    elif (parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_tensor_parallel_world_size(),
          parallel_state.get_tensor_model_parallel_world_size(),
          parallel_state.get_context_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
          parallel_state.get_virtual_pipeline_model_parallel_world_size()) != sizes:
        raise ValueError("setup_process: Megatron's parallel state was made for other parallel sizes.")


def _build(cfg: RunConfig) -> tuple[list, Any, Any]:
    """Seed, then the model (GPTModel, one per model chunk, with the TE or the local layer
    spec) wrapped as Megatron trains it, and its Megatron optimizer (None for plain SGD)."""
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: PLC0415
    from megatron.core.distributed import finalize_model_grads  # noqa: PLC0415
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: PLC0415
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec, get_gpt_mtp_block_spec)
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
    fp8 = {}
    if cfg.fp8:
        fp8 = dict(fp8="hybrid", fp8_recipe=cfg.fp8, fp8_amax_history_len=cfg.fp8_amax_history,
                   fp8_amax_compute_algo=cfg.fp8_amax_algo)
    moe = {}
    if cfg.experts:
        moe = dict(num_moe_experts=cfg.experts, moe_router_topk=cfg.topk, moe_grouped_gemm=True,
                   expert_model_parallel_size=cfg.expert_parallel,
                   expert_tensor_parallel_size=cfg.expert_tensor_parallel,
                   add_bias_linear=cfg.expert_tensor_parallel == 1,  # megatron-core: "Bias in Moe is only supported when ETP==1"
                   moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=cfg.aux_loss,
                   moe_permute_fusion=cfg.permute_fusion,
                   moe_ffn_hidden_size=cfg.moe_ffn or 4 * cfg.hidden)
        if cfg.capacity:
            moe.update(moe_expert_capacity_factor=cfg.capacity, moe_pad_expert_input_to_capacity=True)
    if cfg.graph_modules:
        moe["cuda_graph_modules"] = cfg.graph_modules.split(",")
    if cfg.spec not in ("te", "local"):
        raise ValueError(f"--spec is 'te' or 'local', not {cfg.spec!r}.")
    if cfg.spec == "local" and (cfg.fusion or cfg.fp8 or cfg.experts):
        raise ValueError("--spec local runs megatron-core's own layers: bf16, dense, --fusion 0 (their fused "
                         "weight-gradient kernels are NVIDIA apex's).")
    parallel = dict(tensor_model_parallel_size=cfg.tensor_parallel, sequence_parallel=cfg.sequence_parallel,
                    context_parallel_size=cfg.context_parallel,
                    pipeline_model_parallel_size=cfg.pipeline_parallel,
                    pipeline_dtype=torch.bfloat16 if cfg.pipeline_parallel > 1 else None,
                    virtual_pipeline_model_parallel_size=cfg.virtual_pipeline if cfg.virtual_pipeline > 1 else None)
    config = TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads, **parallel,
        bf16=True, params_dtype=torch.bfloat16, hidden_dropout=cfg.dropout, attention_dropout=cfg.dropout,
        # The same in every run (the eager one never makes graphs): DDP and the layers then
        # take the same paths, and only the helper differs.
        cuda_graph_impl="transformer_engine",
        cuda_graph_warmup_steps=cfg.warmup_steps, gradient_accumulation_fusion=cfg.fusion,
        transformer_impl="local" if cfg.spec == "local" else "transformer_engine",
        mtp_num_layers=cfg.mtp or None, **fp8, **moe,
    )
    if cfg.recompute == "full":
        # Megatron's __post_init__ refuses full recompute with per-layer graphs (its own
        # checkpoint would draw other dropout masks); te_graph's is exact. Set after the check.
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
    elif cfg.recompute == "selective":
        # Refused there too with attention dropout ("attention dropout is not supported with
        # graphed attention recomputation"), for the same reason.
        config.recompute_granularity, config.recompute_modules = "selective", ["core_attn"]
    # The output layer is Megatron's ColumnParallelLinear: its fused weight-gradient kernel
    # is NVIDIA apex's. Let it be built, then turn its fusion off (the same in every run).
    available = tp_layers._grad_accum_fusion_available
    tp_layers._grad_accum_fusion_available = True
    try:
        if cfg.spec == "local":
            spec = get_gpt_layer_local_spec()
        else:
            spec = get_gpt_layer_with_transformer_engine_spec(num_experts=cfg.experts or None,
                                                              moe_grouped_gemm=bool(cfg.experts))
        # Each pipeline stage holds its share of the layers (in --virtual-pipeline chunks), the
        # first chunk of the first stage the embedding, the last of the last the output layer
        # and the loss.
        chunks = []
        for vp_stage in range(cfg.virtual_pipeline) if cfg.virtual_pipeline > 1 else [None]:
            mtp = None
            if cfg.mtp:
                mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=cfg.spec == "te", vp_stage=vp_stage)
            chunks.append(GPTModel(
                config, spec, vocab_size=cfg.vocab, max_sequence_length=cfg.seq, vp_stage=vp_stage, mtp_block_spec=mtp,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                position_embedding_type="rope" if cfg.rope else "learned_absolute"))
    finally:
        tp_layers._grad_accum_fusion_available = available
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=cfg.overlap_grad_reduce,
                                        use_distributed_optimizer=cfg.dist_opt,
                                        overlap_param_gather=cfg.overlap_param_gather)
    model = []
    for index, gpt in enumerate(chunks):
        if gpt.post_process:
            gpt.output_layer.gradient_accumulation_fusion = False
        # One gradient bucket for the chunks after the first, as Megatron-LM builds them.
        model.append(DistributedDataParallel(config, ddp, Float16Module(config, gpt.cuda()), disable_bucketing=index > 0))
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = None
    if cfg.optimizer == "megatron" or cfg.dist_opt:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: PLC0415

        optimizer = get_megatron_optimizer(
            # Adam: the distributed optimizer takes no other of Megatron's built-in ones.
            OptimizerConfig(optimizer="adam", lr=cfg.lr, bf16=True, params_dtype=torch.bfloat16,
                            use_distributed_optimizer=cfg.dist_opt), model, use_gloo_process_groups=False)
    return model, config, optimizer


def _batches(cfg: RunConfig) -> Iterator[dict]:
    """Random token batches with a causal mask, from a generator of their own (each
    data-parallel rank its own batches; the tensor-, context- and pipeline-parallel ranks of
    one model replica the same ones), each context-parallel rank keeping its share of the
    sequence (megatron-core's zigzag split: 2 of 2 x CP chunks, the mask's rows likewise)."""
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: PLC0415

    rank = parallel_state.get_data_parallel_rank()
    g = torch.Generator(device="cuda").manual_seed(cfg.seed + 1 + 1000 * rank)
    positions = torch.arange(cfg.seq, device="cuda").expand(cfg.micro_batch, cfg.seq).contiguous()
    mask = torch.ones(cfg.seq, cfg.seq, dtype=torch.bool, device="cuda").triu(1)
    mask = mask[None, None].expand(cfg.micro_batch, 1, cfg.seq, cfg.seq).contiguous()
    while True:
        tokens = torch.randint(0, cfg.vocab, (cfg.micro_batch, cfg.seq), device="cuda", generator=g)
        batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "position_ids": positions,
                 "attention_mask": mask}
        if cfg.context_parallel > 1:
            batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                              cp_group=parallel_state.get_context_parallel_group())
        yield batch


def _forward_step(data: Iterator[dict], model: Any) -> tuple:
    batch = next(data)
    losses = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

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

    if cfg.overlap_param_gather and not cfg.dist_opt:
        raise ValueError("--overlap-param-gather needs --dist-opt 1 (DDP overlaps the all-gathers of the "
                         "distributed optimizer's parameter shards).")
    if cfg.regraph_at and cfg.regraph_at <= cfg.warmup_steps:
        raise ValueError(f"--regraph-at {cfg.regraph_at} must come after the graphs are first made (step "
                         f"{cfg.warmup_steps}, --warmup-steps).")
    if (cfg.expert_parallel > 1 or cfg.expert_tensor_parallel > 1) and not cfg.experts:
        raise ValueError("--expert-parallel and --expert-tensor-parallel split the experts over ranks: they need "
                         "--experts.")
    setup_process(cfg)
    integration.disable()
    whole = cfg.graphs in WHOLE_STEP
    if cfg.graphs in ("te_graph", "te_graph_replay") or whole:
        integration.enable()
    elif cfg.recompute != "none" and cfg.graphs == "eager":
        integration.enable(recompute=True)  # the eager reference recomputes exactly too
    model, config, optimizer = _build(cfg)
    params = [p for chunk in model for p in chunk.parameters() if p.requires_grad]
    def new_helper() -> Any:
        return TECudaGraphHelper(model=model, config=config, seq_length=cfg.seq, micro_batch_size=cfg.micro_batch,
                                 optimizers=[optimizer] if optimizer is not None else [])

    helper = new_helper() if cfg.graphs != "eager" and not whole else None
    graphed_step = None

    def sgd() -> None:
        with torch.no_grad():
            for p in params:  # plain SGD on main_grad, in place
                p.add_(p.main_grad.to(p.dtype), alpha=-cfg.lr)
    step_fn = get_forward_backward_func()
    # One iterator per model chunk (the interleaved schedule takes a list), each over the same
    # batches: the first chunk reads the tokens, the last the labels.
    data = [_batches(cfg) for _ in model] if len(model) > 1 else _batches(cfg)
    record: dict = {"losses": [], "main_grads": [], "weights": [], "step_ms": [], "config": asdict(cfg)}
    routed = _count_routed() if cfg.experts and cfg.count_dropped else None
    dropless: list = []
    made_at = None  # the step that last made the graphs
    for step in range(cfg.steps):
        event = graph_event(cfg, step)
        made_at = step if event is not None else made_at
        if event is not None and whole:
            if graphed_step is not None:
                graphed_step.reset()
            started = time.perf_counter()
            graphed_step = _graph_step(cfg, model, sgd if optimizer is None else None)
            torch.cuda.synchronize()
            record.setdefault("capture_s", time.perf_counter() - started)
            record["graphed_with"] = type(graphed_step).__module__
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        elif event == "make":
            started = time.perf_counter()
            dropless = _make_graphs(cfg, model, helper)
            torch.cuda.synchronize()
            record["capture_s"] = time.perf_counter() - started
            record["graphed_with"] = type(model[0].module.module.decoder.layers[0].cuda_graphs[0]).__module__
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        elif event == "remake":
            for d in dropless:
                d.remove()
            helper.delete_cuda_graphs()
            helper = new_helper()  # megatron-core 0.19's helper captures once (_capture_finished stays set)
            dropless = _make_graphs(cfg, model, helper)
        for chunk in model if graphed_step is None else ():  # the graphed step zeroes them itself
            chunk.zero_grad_buffer()
        if optimizer is not None:
            optimizer.zero_grad()
        if torch.distributed.get_world_size() > 1:
            # Start every rank's clock together: a rank's step time is then not its wait for
            # another still recording the step before (a sync point of all ranks, off the clock).
            torch.distributed.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
        started = time.perf_counter()
        replayed = cfg.graphs in ("te_graph", "te", "te_graph_step") and made_at is not None and step > made_at
        with _no_host_sync(cfg.sync_check and replayed):
            if graphed_step is not None:
                out = graphed_step(data)
            else:
                out = step_fn(forward_step_func=_forward_step, data_iterator=data, model=model,
                              num_microbatches=cfg.microbatches, seq_length=cfg.seq,
                              micro_batch_size=cfg.micro_batch, forward_only=False)
        paused, main_grads = 0.0, None
        if optimizer is not None:
            # Its gradient clipping may scale main_grad in place: keep a copy first, off the
            # clock (two sync points the plain-SGD runs do not have: compare like with like).
            torch.cuda.synchronize()
            pause = time.perf_counter()
            main_grads = [p.main_grad.detach().clone() for p in params]
            torch.cuda.synchronize()
            paused = time.perf_counter() - pause
            optimizer.step()  # fp32 main weights, copied into the model's weights in place
        elif graphed_step is None:  # else the graph stepped
            sgd()
        torch.cuda.synchronize()
        record["step_ms"].append((time.perf_counter() - started - paused) * 1e3)
        # The losses, on the last pipeline stage (the others record an empty tensor).
        record["losses"].append(torch.stack([o["lm loss"] for o in out]).cpu() if out else torch.empty(0))
        main_grads = main_grads or [p.main_grad.detach() for p in params]
        record["main_grads"].append([g.cpu() for g in main_grads])
        del main_grads
        record["weights"].append([p.detach().cpu().clone() for p in params])
    record["footprint_mib"] = torch.cuda.max_memory_reserved() / 2**20
    if routed is not None:
        record["tokens_dropped"] = routed.dropped_fraction()
        routed.remove()
    if dropless:
        record["expert_calls"] = {"graphed": {c: sum(d.calls[c] for d in dropless) for c in dropless[0].capacities},
                                  "eager": sum(d.eager_calls for d in dropless),
                                  "spans": sorted({d.span for d in dropless})}
        for d in dropless:
            d.remove()
    if helper is not None:
        helper.delete_cuda_graphs()
    if graphed_step is not None:
        graphed_step.reset()
    te_graph.reset()
    integration.disable()
    return record


WHOLE_STEP = ("te_graph_step", "te_graph_step_replay")


def _graph_step(cfg: RunConfig, model: list, update: Any) -> Any:
    """The whole step as one graph (``make_graphed_train_step``), captured on batches of the
    run's shapes (a generator of their own: the run's data is not consumed); ``update``: the
    plain SGD step inside the graph (None: Megatron's optimizer, eagerly after each call)."""
    from te_graph.integrations.megatron import make_graphed_train_step  # noqa: PLC0415

    if len(model) > 1:
        raise ValueError("--graphs te_graph_step graphs forward_backward_no_pipelining: one model chunk.")
    sample = _batches(cfg)
    return make_graphed_train_step(_forward_step, model, [next(sample) for _ in range(cfg.microbatches)],
                                   num_microbatches=cfg.microbatches, seq_length=cfg.seq,
                                   micro_batch_size=cfg.micro_batch, update=update,
                                   eager_replay=cfg.graphs == "te_graph_step_replay",
                                   verify=True if cfg.step_verify else None)


@contextlib.contextmanager
def _no_host_sync(checked: bool) -> Iterator[None]:
    """Where ``checked``, a host sync inside fails (torch raises at the call that syncs)."""
    if not checked:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def graph_event(cfg: RunConfig, step: int) -> Optional[str]:
    """What happens to the graphs before ``step`` of a graphed run: ``"make"`` after the
    eager warmup steps, ``"remake"`` at ``--regraph-at`` (0: never), else None (and always
    None for the eager run)."""
    if cfg.graphs == "eager":
        return None
    if step == cfg.warmup_steps:
        return "make"
    if cfg.regraph_at and step == cfg.regraph_at:
        return "remake"
    return None


def _make_graphs(cfg: RunConfig, model: list, helper: Any) -> list:
    """The helper's graphs of every layer (and with ``--buckets`` te_graph's capacity graphs of
    the dropless experts, whose installations it returns), made as Megatron-LM's training.py
    makes them: with DDP's forward pre-hooks off around capture, then on again and run by
    hand before each replay."""
    replay = cfg.graphs == "te_graph_replay"  # te_graph's eager replay: the graphs' mirror
    previous = os.environ.get("TE_GRAPH_EAGER_REPLAY")
    os.environ["TE_GRAPH_EAGER_REPLAY"] = "1" if replay else "0"
    dropless: list = []
    try:
        if cfg.overlap_param_gather:
            for chunk in model:
                chunk.disable_forward_pre_hook(param_sync=False)
        choose_on_device = cfg.buckets and cfg.graphs != "te" and cfg.choose == "device"
        if choose_on_device:  # the layers' graphs then hold the node that picks the capacity
            dropless = _graph_dropless(cfg, model)
        with _thread_local_capture() if cfg.graphs == "te" else contextlib.nullcontext():
            helper.create_cudagraphs()
        if cfg.buckets and cfg.graphs != "te" and not choose_on_device:
            dropless = _graph_dropless(cfg, model)
        if cfg.overlap_param_gather:
            for chunk in model:
                chunk.enable_forward_pre_hook()
            helper.cuda_graph_set_manual_hooks()  # DDP's pre-hooks, run before each replay
    finally:
        if previous is None:
            del os.environ["TE_GRAPH_EAGER_REPLAY"]
        else:
            os.environ["TE_GRAPH_EAGER_REPLAY"] = previous
    return dropless


def _graph_dropless(cfg: RunConfig, model: list) -> list:
    """te_graph's dropless experts for ``--buckets`` (``--choose``: where the capacity is picked)."""
    from te_graph.integrations.megatron.moe import capacities_for, graph_dropless_experts  # noqa: PLC0415

    # A layer call routes its rank's share of the sequence (context and sequence parallel); an
    # expert's rank receives the tokens of every rank of its expert- and expert-tensor-parallel group.
    tokens = cfg.seq // cfg.context_parallel // (cfg.tensor_parallel if cfg.sequence_parallel else 1)
    tokens *= cfg.micro_batch
    capacities = capacities_for(tokens * cfg.expert_parallel * cfg.expert_tensor_parallel, cfg.topk, cfg.experts,
                                [float(f) for f in cfg.buckets.split(",")])
    options = ({"choose": "device", "recompute": cfg.switch_recompute} if cfg.choose == "device"
               else {"overflow": cfg.overflow})
    return [d for chunk in model for d in graph_dropless_experts(chunk, capacities, tokens=tokens, span=cfg.moe_span,
                                                                 **options)]


class _count_routed:
    """The share of (token, expert) assignments the routers drop (drop-and-pad beyond the
    capacity): what top-k routing chose against what megatron-core's
    ``apply_router_token_dropping`` kept (padding it adds is not a choice), over the eager
    calls of the run (counts are sync points: for a counting run only)."""

    def __init__(self):
        from megatron.core.transformer.moe import router  # noqa: PLC0415

        self.router, self.original = router, router.apply_router_token_dropping
        self.chosen, self.dropped = 0, 0

        def counted(probs: torch.Tensor, routing_map: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
            probs, kept = self.original(probs, routing_map, *args, **kwargs)
            if not torch.cuda.is_current_stream_capturing():
                self.chosen += int(routing_map.sum())
                self.dropped += int((routing_map & ~kept).sum())
            return probs, kept

        router.apply_router_token_dropping = counted

    def dropped_fraction(self) -> float:
        return self.dropped / self.chosen if self.chosen else 0.0

    def remove(self) -> None:
        self.router.apply_router_token_dropping = self.original


@contextlib.contextmanager
def _thread_local_capture() -> Iterator[None]:
    """Transformer Engine's graphs capture with ``torch.cuda.graph``'s default, CUDA's global
    capture mode; TE's rows capture with ``thread_local``, the mode te_graph captures in, so
    that the two differ in nothing but the graphs. (Added when TE's capture failed with
    "operation would make the legacy stream depend on a capturing blocking stream", before
    that failure was traced to the legacy default stream, see ``_side_stream``; whether
    global mode works on a side stream was not tried.)"""
    original = torch.cuda.graph.__init__

    def init(self: Any, cuda_graph: Any, pool: Any = None, stream: Any = None,
             capture_error_mode: str = "thread_local") -> None:
        original(self, cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode)

    torch.cuda.graph.__init__ = init
    try:
        yield
    finally:
        torch.cuda.graph.__init__ = original


@contextlib.contextmanager
def _side_stream() -> Iterator[None]:
    """The whole run on a stream of its own instead of the legacy default stream, for
    Transformer Engine's graphs: TE captures each backward with ``torch.autograd.backward``,
    which runs the ``AccumulateGrad`` of every parameter, and the autograd engine syncs
    that node with the stream it was made on, for Megatron's DDP the stream current when
    DDP was built (it reaches each parameter's accumulator to hook it). A capture may not
    make the legacy default stream wait on it (cudaErrorStreamCaptureImplicit; H100, torch
    2.11, TE 2.20). te_graph's capture accumulates into stand-in parameters made for it
    (``te_graph/parameters.py``) and needs no such stream."""
    with torch.cuda.stream(torch.cuda.Stream()):
        yield
    torch.cuda.synchronize()


def timing(record: dict) -> float:
    """Median step time (ms) over the graphed steps."""
    graphed = record["step_ms"][record["config"]["warmup_steps"] + 1:]
    return statistics.median(graphed or record["step_ms"])


def command(arguments: list[str], ranks: int = 1) -> list[str]:
    """The command line that runs this example with ``arguments`` in a process of its own,
    or under torchrun on ``ranks`` GPUs of this host (run it from the repository's root)."""
    if ranks == 1:
        return [sys.executable, "-m", "examples.megatron_gpt", *arguments]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "examples.megatron_gpt", *arguments]


def rank_path(path: str, rank: int, world: int) -> str:
    """Where rank ``rank`` of ``world`` saves the records of ``--out path``: ``path`` itself
    on one rank, else with the rank before the suffix (``run.pt`` -> ``run.rank1.pt``)."""
    if world == 1:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.rank{rank}{suffix}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graphs", default="eager,te_graph", help="comma-separated: eager, te_graph, te_graph_replay, te, te_graph_step, te_graph_step_replay")
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
    setup_process(base)  # this rank's GPU is current before _side_stream makes a stream
    for graphs in args.graphs.split(","):
        with _side_stream() if graphs == "te" else contextlib.nullcontext():
            records[graphs] = train(replace(base, graphs=graphs))
        print(f"{graphs}: median step {timing(records[graphs]):.2f} ms, footprint "
              f"{records[graphs]['footprint_mib']:.0f} MiB, losses {records[graphs]['losses'][-1].tolist()}", flush=True)
    if args.out:
        torch.save(records, rank_path(args.out, torch.distributed.get_rank(), torch.distributed.get_world_size()))
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
