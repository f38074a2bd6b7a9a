"""Tensor, sequence, data and pipeline parallelism through te_graph on 2 spawned ranks.

Every scenario (tests/multi_gpu_helpers.py) runs in two forms: gloo on the CPU with
te_graph's eager replay (here and in CI), and NCCL on 2 GPUs with CUDA graphs and the
collectives inside them (``-m multi_gpu``; skipped with a reason where fewer than 2 GPUs
exist). Each compares the te_graph run with the eager run of the same program bitwise
(tests/harness.py's ``assert_same``), on every rank, and checks what must hold across the
ranks.
"""
from __future__ import annotations

import pytest
import torch

from tests.harness import assert_same
from tests.multi_gpu_helpers import (
    CHUNKS,
    GLOO_CPU,
    LAYERS_PER_CHUNK,
    MICROBATCHES,
    NCCL_CUDA,
    SHARDED_DISTRIBUTE_ERROR,
    STEPS,
    data_parallel,
    interleaved_order,
    pipeline,
    pipeline_events,
    rng_streams,
    run_on_ranks,
    sequence_parallel_with_distributed_recompute,
    tensor_parallel,
)

BACKENDS = [
    pytest.param(GLOO_CPU, id="gloo-cpu"),
    pytest.param(NCCL_CUDA, id="nccl-cuda", marks=pytest.mark.multi_gpu),
]
# Parameters that every tensor-parallel rank holds whole (and must keep identical).
WHOLE = ("ln_attn.", "ln_mlp.", "proj.bias", "fc2.bias")


def _is_whole(name: str) -> bool:
    return name.split(".", 1)[1].startswith(WHOLE)


def _assert_tensor_parallel_results(results: list[dict], sequence_parallel: bool) -> None:
    for rank, result in enumerate(results):
        assert_same(result["graphed"], result["eager"], f"rank {rank}: te_graph vs eager")
        d = result["dense_difference"]
        assert d["output"] <= 1e-4 * max(1.0, d["scale"]) and d["input_grad"] <= 1e-4, (
            f"rank {rank}: the parallel blocks do not compute the whole blocks' function: {d}"
        )
    for run in ("eager", "graphed"):
        zero, one = results[0][run], results[1][run]
        for state in ("weights", "param_grads"):
            whole = {k: v for k, v in getattr(zero, state).items() if _is_whole(k)}
            assert whole, f"found the whole parameters' {state}"
            # Whole parameters (and their grads) stay identical on every rank; under sequence
            # parallelism only because allreduce_sequence_parallel_grads summed their grads.
            assert_same({k: getattr(one, state)[k] for k in whole}, whole, f"{run}: whole parameters' {state} across ranks",
                        reference="rank 0")
        assert not torch.equal(zero.weights["layer0.qkv.weight"], one.weights["layer0.qkv.weight"]), "shards differ"
        if sequence_parallel:  # each rank holds other positions
            assert not torch.equal(zero.outputs[0], one.outputs[0])
        else:
            # Replicated outputs are bitwise equal across ranks: hidden dropout drew the same
            # masks from the default stream on both (attention dropout differs per rank, but
            # is summed over the ranks by the row-parallel all-reduce).
            assert_same(one.outputs, zero.outputs, f"{run}: replicated outputs across ranks", reference="rank 0")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recompute", ["none", "distributed"])
def test_tensor_parallel_graphed_equals_eager(backend, recompute, tmp_path):
    """Column/row-parallel blocks with the all-reduces inside the graphs, attention dropout
    under the model-parallel fork; with and without checkpoint(distribute_saved_activations)."""
    results = run_on_ranks(tensor_parallel, backend, tmp_path, recompute=recompute)
    _assert_tensor_parallel_results(results, sequence_parallel=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_parallel_graphed_equals_eager(backend, tmp_path):
    """All-gather before and reduce-scatter after the parallel linears, inside the graphs,
    with full recompute."""
    results = run_on_ranks(tensor_parallel, backend, tmp_path, recompute="full", sequence_parallel=True)
    _assert_tensor_parallel_results(results, sequence_parallel=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_parallel_refuses_distributed_saved_activations(backend, tmp_path):
    """Sequence-parallel shards cannot be split over the ranks and gathered back: checkpoint
    refuses them eagerly and while te_graph warms up, before any wrong gradient."""
    for rank, errors in enumerate(run_on_ranks(sequence_parallel_with_distributed_recompute, backend, tmp_path)):
        for where, message in errors.items():
            assert message is not None, f"rank {rank}, {where}: the shards were accepted"
            assert message.startswith(SHARDED_DISTRIBUTE_ERROR), f"rank {rank}, {where}: {message}"
            assert "Pass distribute_saved_activations=False when the input is sharded." in message


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", ["graph-then-wrap", "wrap-then-graph"])
def test_ddp_around_graphed_layers_equals_eager_ddp(backend, order, tmp_path):
    """torch DDP around graphed GPTBlocks (dropout, recompute), each rank on its own data:
    after STEPS steps the outputs, grads and weights equal the eager DDP run's bitwise, and
    the replicas stay identical."""
    results = run_on_ranks(data_parallel, backend, tmp_path, order=order)
    for rank, result in enumerate(results):
        assert_same(result["graphed"], result["eager"], f"rank {rank}: te_graph DDP ({order}) vs eager DDP")
    for run in ("eager", "graphed"):
        zero, one = results[0][run], results[1][run]
        assert_same(one.param_grads, zero.param_grads, f"{run}: all-reduced grads across replicas", reference="rank 0")
        assert_same(one.weights, zero.weights, f"{run}: weights across replicas", reference="rank 0")
        assert not torch.equal(zero.outputs[0], one.outputs[0]), "each rank trained on its own data"
    assert len(results[0]["graphed"].outputs) == STEPS


def test_interleaved_schedule_orders_and_lockstep_sequence():
    """Megatron's interleaved schedule for 2 ranks, 2 chunks, 4 microbatches, and the global
    sequence the pipeline test walks (pure logic)."""
    orders = [interleaved_order(r, 2, CHUNKS, MICROBATCHES) for r in range(2)]
    assert orders[0] == [1, 1, 2, 2, 1, -2, 1, -2, 2, -1, 2, -1, -2, -2, -1, -1]
    assert orders[1] == [1, 1, 2, -2, 2, -2, 1, -1, 1, -1, 2, -2, 2, -2, -1, -1]
    events = pipeline_events(orders)
    assert len(events) == 2 * 2 * CHUNKS * MICROBATCHES
    for rank, order in enumerate(orders):
        mine = [(1 if kind == "F" else -1) * (chunk + 1) for r, kind, chunk, _ in events if r == rank]
        assert mine == order, f"rank {rank} keeps its order"
    with pytest.raises(ValueError, match="pipeline orders deadlock"):
        pipeline_events([[1, -1], [-1, 1]])  # rank 1 runs a backward before any forward
    with pytest.raises(ValueError, match="not a multiple of 2 stages"):
        interleaved_order(0, 2, 2, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_interleaved_pipeline_graphed_equals_eager(backend, tmp_path):
    """2 pipeline ranks, 2 model chunks each, 4 microbatches, activations and grads sent
    with P2P between the ranks; one te_graph callable per (chunk, microbatch, layer) via
    order= with buffer reuse, against the eager pipeline, bitwise (2 optimizer steps)."""
    results = run_on_ranks(pipeline, backend, tmp_path)
    for rank, result in enumerate(results):
        assert result["order"] == interleaved_order(rank, 2, CHUNKS, MICROBATCHES)
        assert_same(result["graphed"], result["eager"], f"rank {rank}: te_graph pipeline vs eager pipeline")
        stages = {key.split("/")[1] for key in result["eager"].outputs if key.startswith("step0/")}
        assert stages == {f"stage{c * 2 + rank}" for c in range(CHUNKS)}
        params = [k for k in result["eager"].weights if k.startswith("chunk")]
        assert len({k.split("/")[0] + k.split("/")[1] for k in params}) == CHUNKS * LAYERS_PER_CHUNK


@pytest.mark.parametrize("backend", BACKENDS)
def test_rng_streams_keep_their_meaning_across_tensor_parallel_ranks(backend, tmp_path):
    """Default-stream masks are equal on the TP ranks, model-parallel masks differ, and the
    recompute (with distributed saved activations) draws exactly the forward's masks;
    through te_graph as eagerly."""
    results = run_on_ranks(rng_streams, backend, tmp_path)
    for rank, result in enumerate(results):
        assert_same(result["graphed"], result["eager"], f"rank {rank}: te_graph masks vs eager masks")
        for run in ("eager", "graphed"):
            masks = result[run]
            for step in range(STEPS):
                assert torch.equal(masks["recompute"][step], masks["forward"][step]), (
                    f"rank {rank}, {run}, step {step}: the recompute drew other masks than the forward"
                )
            assert not torch.equal(masks["forward"][0], masks["forward"][1]), "each step draws new masks"
    for run in ("eager", "graphed"):
        for step in range(STEPS):
            default = [r[run]["forward"][step].chunk(2, dim=-1)[0] for r in results]
            parallel = [r[run]["forward"][step].chunk(2, dim=-1)[1] for r in results]
            assert torch.equal(default[0], default[1]), f"{run}, step {step}: default-stream masks differ across TP ranks"
            assert not torch.equal(parallel[0], parallel[1]), f"{run}, step {step}: model-parallel masks agree across TP ranks"
