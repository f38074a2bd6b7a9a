"""te_graph on megatron-core's real ``TransformerLayer``: speed and footprint against eager,
Megatron's own full recompute and torch's graphed callables.

Run from the repository root on a CUDA machine with megatron-core importable (the GPU
machine has no network: carry the wheel in ``.whl/``, as the device README says)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/bench_megatron.py --out /tmp/megatron.json

Where megatron-core cannot be imported the script prints why and exits 0 (skipped).

``--path gpt`` (first on the command line) times megatron-core's own path instead:
GPTModel through Megatron's schedule, DDP and ``TECudaGraphHelper``, eager vs Transformer
Engine's graphs vs te_graph's (``bench_megatron_gpt.py``; its options follow).

The model: 12 ``TransformerLayer``s built from ``get_gpt_layer_local_spec()`` (Megatron's
own modules, no Transformer Engine, no apex), h 1024, 16 heads, s 512, micro-batch 2, bf16
(the layers cast to bf16 as Megatron's ``Float16Module`` does), hidden and attention
dropout 0.1, tensor-parallel size 1 in a one-rank NCCL group, Megatron's RNG tracker seeded
with ``use_cudagraphable_rng=True``; a bool ``[1, 1, s, s]`` causal mask (True = masked).
A layer's forward takes ``hidden_states`` and ``attention_mask`` and returns
``(hidden_states, context)`` with ``context`` None. Rows:

* ``eager``                    the layers run eagerly;
* ``megatron full recompute``  each layer under Megatron's ``tensor_parallel.checkpoint(
                               layer, False, hidden, mask)`` (its argument order);
* ``kernel floor`` / ``forward kernels``  GPU time of one eager step / one forward;
* ``te_graph``                 ``te_graph.make_graphed_callables(tuple(layers), sample_args,
                               sample_kwargs=..., get_rng_state_tracker=Megatron's tracker)``;
* ``te_graph+recompute``       each layer wrapped in a module whose forward is our
                               ``checkpointing.checkpoint(layer, hidden, mask,
                               get_rng_state_tracker=Megatron's tracker)``, graphed the same way;
* ``torch graphed``            ``torch.cuda.make_graphed_callables`` (expected to fail on the
                               ``(hidden, None)`` output: its error is the row).

Steps, timing and footprint are measured as in ``bench_step.py`` (``_measure.py``). Note
that Megatron's checkpoint with graph-safe RNG restores state *references*, so its
recompute draws other dropout masks than its forward (DESIGN.md); it is timed here as
users run it. For context only, an outside run measured: eager 32.2 ms, Megatron recompute
54.9, te_graph 7.8, te_graph+recompute 10.6 ms per step.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback
from types import SimpleNamespace
from typing import Any, Sequence

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
    make_forward,
    make_train_step,
    run_rows,
    settings_from,
    synchronised,
)
from _report import JsonReport, add_output_args, finish  # noqa: E402
from _targets import (  # noqa: E402
    EAGER,
    FORWARD_KERNELS,
    KERNEL_FLOOR,
    TE_GRAPH,
    TE_GRAPH_RECOMPUTE,
    TORCH_GRAPHED,
    Targets,
)
from torch import nn  # noqa: E402

import te_graph  # noqa: E402
from checkpointing import checkpoint  # noqa: E402

MEGATRON_RECOMPUTE = "megatron full recompute"
VARIANTS = (EAGER, MEGATRON_RECOMPUTE, TE_GRAPH, TE_GRAPH_RECOMPUTE, TORCH_GRAPHED,
            KERNEL_FLOOR, FORWARD_KERNELS)
CONFIG = "megatron"
LAYERS, HIDDEN, HEADS, SEQ, BATCH, DROPOUT = 12, 1024, 16, 512, 2, 0.1
SEED = 1234
DEVICE = "cuda"  # a module constant so a CPU dry run of the plumbing can change it
NUM_INPUTS = 4
DEFAULT_ITERS = 100
DEFAULT_WARMUP = 10
# The small config's shape: its step targets apply, peers paired by recompute setting.
TARGETS = {CONFIG: Targets(floor_ratio=1.08, recompute_peer=MEGATRON_RECOMPUTE)}


# --------------------------------------------------------------------------- megatron


def import_megatron() -> SimpleNamespace:
    """The megatron-core names this benchmark uses (raises where it is not importable)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return SimpleNamespace(
        parallel_state=parallel_state, tensor_parallel=tensor_parallel,
        get_gpt_layer_local_spec=get_gpt_layer_local_spec, get_cuda_rng_tracker=get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed=model_parallel_cuda_manual_seed,
        TransformerConfig=TransformerConfig, TransformerLayer=TransformerLayer,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_rank(mc: SimpleNamespace) -> None:
    """A one-rank NCCL group and Megatron's model-parallel state (TP = PP = 1)."""
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="nccl", world_size=1, rank=0, init_method=f"tcp://127.0.0.1:{_free_port()}")
    if not mc.parallel_state.model_parallel_is_initialized():
        mc.parallel_state.initialize_model_parallel(1, 1)


def build_layers(mc: SimpleNamespace) -> list[nn.Module]:
    """12 local-spec TransformerLayers on the GPU in bf16, Megatron's RNG freshly seeded
    (a new tracker holding graph-safe generator states, whatever was made before)."""
    mc.model_parallel_cuda_manual_seed(SEED, use_cudagraphable_rng=True, force_reset_rng=True)
    torch.manual_seed(SEED)
    config = mc.TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        hidden_dropout=DROPOUT, attention_dropout=DROPOUT, bf16=True,
        params_dtype=torch.bfloat16, use_cpu_initialization=DEVICE == "cpu")
    spec = mc.get_gpt_layer_local_spec()
    return [
        mc.TransformerLayer(config, spec.submodules, layer_number=i + 1).to(
            device=DEVICE, dtype=torch.bfloat16)
        for i in range(LAYERS)
    ]


class MegatronRecompute(nn.Module):
    """A layer under Megatron's own full recompute, ``checkpoint(fn, distribute, *args)``."""

    def __init__(self, layer: nn.Module, mc: SimpleNamespace):
        super().__init__()
        self.layer = layer
        self._checkpoint = mc.tensor_parallel.checkpoint

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self._checkpoint(self.layer, False, hidden_states, attention_mask)


class OurRecompute(nn.Module):
    """A layer under ``checkpointing.checkpoint`` with Megatron's tracker: the module
    te_graph graphs for ``te_graph+recompute`` (recompute inside the graphs)."""

    def __init__(self, layer: nn.Module, mc: SimpleNamespace):
        super().__init__()
        self.layer = layer
        self._tracker = mc.get_cuda_rng_tracker

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return checkpoint(self.layer, hidden_states, attention_mask,
                          get_rng_state_tracker=self._tracker)


class MaskAsPositional(nn.Module):
    """``layer(h, attention_mask=mask)`` as ``f(h, mask)``: torch's make_graphed_callables
    takes no keyword arguments. The ``(hidden, None)`` output is left as it is."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self.layer(hidden_states, attention_mask=attention_mask)


# --------------------------------------------------------------------------- variants


def causal_mask() -> torch.Tensor:
    return torch.ones(SEQ, SEQ, dtype=torch.bool, device=DEVICE).triu(1)[None, None]


def _sample_args() -> tuple:
    return tuple(
        (torch.randn(SEQ, BATCH, HIDDEN, device=DEVICE, dtype=torch.bfloat16, requires_grad=True),)
        for _ in range(LAYERS)
    )


def _params(layers: Sequence[nn.Module]) -> list[torch.Tensor]:
    return [p for layer in layers for p in layer.parameters()]


def variants_for(mc: SimpleNamespace, mask: torch.Tensor) -> dict[str, Variant]:
    kwargs = {"attention_mask": mask}

    def eager(recompute: bool = False) -> Built:
        layers = build_layers(mc)
        callables = [MegatronRecompute(layer, mc) for layer in layers] if recompute else layers
        return Built(make_train_step(callables, _params(layers), kwargs), keep=layers)

    def forward_only() -> Built:
        layers = build_layers(mc)
        return Built(make_forward(layers, kwargs), keep=layers)

    def graphed(recompute: bool = False) -> Built:
        layers = build_layers(mc)
        modules = tuple(OurRecompute(layer, mc) for layer in layers) if recompute else tuple(layers)
        samples = _sample_args()
        out, seconds = synchronised(lambda: te_graph.make_graphed_callables(
            modules, samples, sample_kwargs=tuple(dict(kwargs) for _ in modules),
            get_rng_state_tracker=mc.get_cuda_rng_tracker))
        return Built(make_train_step(out, _params(layers), kwargs), keep=(layers, out),
                     capture_s=seconds, release=lambda: te_graph.reset(out))

    def torch_graphed() -> Built:
        layers = build_layers(mc)
        wrapped = tuple(MaskAsPositional(layer) for layer in layers)
        samples = tuple(args + (mask,) for args in _sample_args())
        out, seconds = synchronised(lambda: torch.cuda.make_graphed_callables(wrapped, samples))
        steps = [lambda h, attention_mask, g=g: g(h, attention_mask) for g in out]
        return Built(make_train_step(steps, _params(layers), kwargs), keep=(layers, out), capture_s=seconds)

    return {
        EAGER: Variant(eager),
        MEGATRON_RECOMPUTE: Variant(lambda: eager(recompute=True)),
        KERNEL_FLOOR: Variant(eager, profiled=True),
        FORWARD_KERNELS: Variant(forward_only, profiled=True),
        TE_GRAPH: Variant(graphed),
        TE_GRAPH_RECOMPUTE: Variant(lambda: graphed(recompute=True)),
        TORCH_GRAPHED: Variant(torch_graphed),
    }


def make_inputs() -> list[torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(SEED + 1)
    return [torch.randn(SEQ, BATCH, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=gen)
            for _ in range(NUM_INPUTS)]


# --------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Median ms per train step and memory footprint of 12 megatron-core "
                    "TransformerLayers (local spec): eager, Megatron's full recompute, te_graph "
                    "(with and without our recompute), torch's graphed callables, kernel floor.")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        type=csv_choice(VARIANTS, "variant"),
                        help="comma-separated variants, in the order to run (default: all)")
    add_measure_args(parser, DEFAULT_ITERS, DEFAULT_WARMUP)
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["--path", "gpt"]:  # megatron-core's own loop and CUDA-graph helper
        from bench_megatron_gpt import main as gpt_main  # noqa: PLC0415

        return gpt_main(argv[2:])
    args = parse_args(argv)
    settings = settings_from(args)
    try:
        mc = import_megatron()
    except Exception as error:  # noqa: BLE001 - any import failure means: skip
        print("bench_megatron.py: SKIPPED, megatron-core is not importable here: "
              f"{''.join(traceback.format_exception_only(type(error), error)).strip()}\n"
              "Install it (megatron-core 0.19.x; carried as a wheel to machines without a "
              "network) and run again.", flush=True)
        return 0
    if not torch.cuda.is_available():
        sys.exit("bench_megatron.py: CUDA is not available; this benchmark needs a CUDA GPU.")
    env = environment()
    import megatron.core as megatron_core

    env["megatron_core"] = getattr(megatron_core, "__version__", None)
    print(f"torch {env['torch']}, CUDA {env['cuda']}, {env['device']}, megatron-core "
          f"{env['megatron_core']}; iters {args.iters}, warmup {args.warmup}", flush=True)
    title = (f"{CONFIG}: {LAYERS} TransformerLayers (local spec), h {HIDDEN}, heads {HEADS}, "
             f"s {SEQ}, b {BATCH}, bf16, dropout {DROPOUT}")
    print(f"\n== {title} ==", flush=True)
    report = JsonReport(args.out, {**env, "benchmark": "bench_megatron", "iters": args.iters,
                                   "warmup": args.warmup, "timing": "sync" if args.sync else "events"})
    report.add_config(CONFIG, {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "seq": SEQ,
                               "batch": BATCH, "dropout": DROPOUT})
    init_single_rank(mc)
    try:
        variants = variants_for(mc, causal_mask())
        # Profiled rows last, as in bench_step.py.
        names = sorted(args.variants, key=lambda n: variants[n].profiled)
        run_rows(CONFIG, variants, names, lambda kind: make_inputs(), settings,
                 lambda name, row: report.add_row(CONFIG, name, row))
        finish(report, args.variants, TARGETS, args.png,
               f"bench_megatron on {env['device']} (torch {env['torch']}, megatron-core "
               f"{env['megatron_core']})")
    finally:
        mc.parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
