"""The dispatch span's padded layout over expert-parallel ranks (``moe_dispatch.PaddedDispatch``
with its ``ExpertExchange``), on a 2-rank gloo group on the CPU, in float64.

Each rank routes its own tokens top-2 over 4 experts, 2 local to each rank; the program pads
every (rank, expert) block, exchanges the blocks with two equal-split alltoalls and
un-permutes. Its output and the gradients of each rank's expert weights must equal a direct
per-token computation over every rank's experts (to float64 rounding: the sums run in another
order). megatron-core's own ``all_to_all`` needs CUDA to import, so the exchange gets an
equal-split alltoall of the same contract here; on GPUs megatron-core's own runs
(tests/test_megatron_path.py, EP=2). Also: every rank gets every rank's token counts (the
per-call decision, made alike on each), and a rank that cannot take the dispatch span
makes every rank refuse it (``agreed_refusal``).
"""
from __future__ import annotations

import datetime
import json
import os
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.graph_helpers import require
from tests.multi_gpu_helpers import free_port

require("te_graph.integrations.megatron.moe_dispatch", "megatron-core's integration, whose MoE code uses Transformer "
        "Engine's")

WORLD, EXPERTS, HIDDEN, TOKENS, TOPK = 2, 4, 3, 7, 2
LOCAL = EXPERTS // WORLD


class _AllToAll(torch.autograd.Function):
    """megatron-core's ``tensor_parallel.all_to_all`` with equal splits: the backward
    exchanges the gradients back."""

    @staticmethod
    def forward(ctx, group, x, output_splits, input_splits, use_nccl_stream=False):
        ctx.group = group
        out = torch.empty_like(x.contiguous())
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, _AllToAll.apply(ctx.group, grad, None, None), None, None, None


def _all_to_all(group, x, output_splits=None, input_splits=None, use_nccl_stream=False):
    return _AllToAll.apply(group, x, output_splits, input_splits, use_nccl_stream)


def _unpermute(output, mapping, restore_shape, routing_map, fused, drop_and_pad):
    return output.new_zeros(restore_shape).index_add(0, mapping, output)


class _Experts(torch.nn.Module):
    """``LOCAL`` experts on the padded layout (equal blocks per expert), the routing
    probabilities applied inside, as megatron-core's experts apply them."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, hidden, probs):
        rows = hidden.shape[0] // LOCAL
        out = torch.tanh(torch.bmm(hidden.view(LOCAL, rows, -1), self.weight)) * probs.view(LOCAL, rows, 1)
        return out.reshape(LOCAL * rows, -1)


class _Dispatcher:  # the attributes of megatron-core's alltoall dispatcher the exchange reads
    ep_size, num_local_experts, use_nccl_stream = WORLD, LOCAL, False
    ep_group = None


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    from te_graph.integrations.megatron.moe_dispatch import ExpertExchange, PaddedDispatch, agreed_refusal

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        g = torch.Generator().manual_seed(7)
        weights = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=g, dtype=torch.float64)
        g.manual_seed(100 + rank)  # each rank its own tokens and routing
        x = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
        scores = torch.rand(TOKENS, EXPERTS, generator=g, dtype=torch.float64)
        chosen = scores.topk(TOPK, dim=1).indices
        routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter_(1, chosen, True)
        # megatron-core's permutation: grouped by expert, in token order within each.
        expert, token = routing_map.T.nonzero().unbind(1)
        permuted = x.index_select(0, token).requires_grad_()
        probs = scores[token, expert].clone().requires_grad_()

        dispatcher = _Dispatcher()
        dispatcher.ep_group = dist.group.WORLD
        exchange = ExpertExchange(dispatcher, _all_to_all)
        experts = _Experts(weights[rank * LOCAL:(rank + 1) * LOCAL])
        program = PaddedDispatch(experts, _unpermute, False, exchange)
        counts = exchange.counts(routing_map, permuted.shape[0])
        block = counts.largest() + 1  # one padding row at least in every block
        out = program(permuted, probs, routing_map, token, torch.empty(block, 0))
        out.sum().backward()

        # Directly: each token through its experts, on whichever rank they live.
        reference_weights = weights.clone().requires_grad_()
        reference = torch.stack([
            sum(torch.tanh(x[t] @ reference_weights[e]) * scores[t, e] for e in chosen[t].tolist())
            for t in range(TOKENS)])
        reference.sum().backward()
        weight_grads = reference_weights.grad.clone()
        dist.all_reduce(weight_grads)  # every rank's tokens train every expert
        # Ranks routing other numbers of tokens see each other's (then megatron-core's own
        # dispatch serves the call on every rank); the span is taken by all ranks or none.
        other_rows = exchange.counts(routing_map[: TOKENS - rank], (TOKENS - rank) * TOPK)
        layer = types.SimpleNamespace(token_dispatcher=dispatcher, experts=experts)
        refusal = agreed_refusal(layer, "its experts module has hooks" if rank == 1 else None)
        result = {
            "counts": [list(row) for row in counts.per_expert],
            "sizes": [list(counts.tokens), list(counts.rows)],
            "other_sizes": [list(other_rows.tokens), list(other_rows.rows)],
            "refusal": refusal,
            "own_counts": routing_map.sum(dim=0).tolist(),
            "output": (out - reference).abs().max().item(),
            "weight_grad": (experts.weight.grad - weight_grads[rank * LOCAL:(rank + 1) * LOCAL]).abs().max().item(),
        }
        # The tokens' gradient (summed over their top-k rows), directly.
        xr = x.clone().requires_grad_()
        per_row = torch.stack([torch.tanh(xr[t] @ weights[e]) * scores[t, e] for e, t in zip(expert, token)])
        (row_grads,) = torch.autograd.grad(per_row.sum(), xr)
        result["input_grad"] = (permuted.grad.new_zeros(TOKENS, HIDDEN).index_add(0, token, permuted.grad)
                                - row_grads).abs().max().item()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_blocks_exchanged_over_two_ranks_compute_each_token_with_its_experts(tmp_path):
    mp.spawn(_rank_main, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    # Every rank holds the whole (rank, expert) matrix of counts (its own row its own counts)
    # and every rank's tokens and permuted tokens.
    assert results[0]["counts"] == results[1]["counts"]
    for rank, result in enumerate(results):
        assert result["counts"][rank] == result["own_counts"]
        assert sum(result["own_counts"]) == TOKENS * TOPK
        assert result["sizes"] == [[TOKENS, TOKENS], [TOKENS * TOPK, TOKENS * TOPK]]
        assert result["other_sizes"] == [[TOKENS, TOKENS - 1], [TOKENS * TOPK, (TOKENS - 1) * TOPK]]
        for name in ("output", "weight_grad", "input_grad"):
            assert result[name] < 1e-13, (rank, name, result)
    assert results[1]["refusal"] == "its experts module has hooks"
    assert results[0]["refusal"] == ("another rank of its expert-parallel group cannot take it (the reason is given "
                                     "there), and every rank must take the same span")
