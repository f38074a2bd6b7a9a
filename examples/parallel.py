"""Megatron-style tensor and sequence parallelism in plain torch.distributed.

A tensor-parallel (TP) group of ``TP`` ranks shares each transformer layer:

* ``ColumnParallelLinear`` splits the weight by output features: every rank holds
  ``out / TP`` rows and computes its slice of the output from the whole input.
* ``RowParallelLinear`` splits the weight by input features: every rank multiplies its
  slice of the input and the partial outputs are summed over the group (all-reduce).

QKV and fc1 are column-parallel, proj and fc2 row-parallel, so a block needs one
all-reduce after attention and one after the MLP in the forward, and their conjugates
(an all-reduce of the input gradient of QKV and fc1) in the backward. With
``sequence_parallel`` the activations between those linears are split along the sequence
instead of replicated: an all-gather replaces the identity before a column-parallel linear
and a reduce-scatter replaces the all-reduce after a row-parallel one (same communication
volume, 1/TP of the LayerNorm and dropout work and memory).

``ParallelGPTBlock`` is ``examples/gpt.py``'s ``GPTBlock`` with these linears; everything
else (attention math, dropout streams, recompute) is inherited. Random streams keep their
Megatron meaning: attention dropout under the tracker's ``'model-parallel-rng'`` fork
(each rank holds other heads, so other masks), hidden dropout from the default generator
(identical on every rank, as the activations it drops are replicated). Under sequence
parallelism each rank holds other positions, so hidden dropout moves under the fork too,
as in Megatron.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import rng
from examples.gpt import GPT, GPTBlock

# Recent torch names the single-tensor collectives *_single (and deprecates the older
# *_into_tensor / *_tensor names, which are all that earlier releases have).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- collectives along the first (sequence) dimension ---------------------------------------
def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over the group, into a new tensor (a gradient may be shared with other nodes)."""
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[s, ...]`` on each rank -> ``[TP * s, ...]``, rank 0's part first."""
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[TP * s, ...]`` on each rank -> this rank's ``[s, ...]`` part of the sum."""
    world = dist.get_world_size(group)
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def _own_part(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's ``[s / TP, ...]`` part of a replicated ``[s, ...]`` tensor."""
    return x.chunk(dist.get_world_size(group))[dist.get_rank(group)].contiguous()


def _check_splits(x: torch.Tensor, group: Any, what: str) -> None:
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(
            f"{what}: the sequence length {x.shape[0]} is not divisible by the "
            f"tensor-parallel size {world}; sequence parallelism splits it evenly."
        )


# -- the regions, as autograd Functions: what the forward does, and its conjugate -------------
class _CopyToTensorParallel(torch.autograd.Function):
    """Into a column-parallel linear: identity forward, all-reduce of the gradient.

    Every rank uses the whole input, so the input's gradient is the sum of every rank's
    contribution."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Out of a row-parallel linear: all-reduce forward (sums the partial products),
    identity backward (each rank's part of the sum had gradient 1)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        dist.all_reduce(x, group=group)  # in place: x is the matmul's fresh output
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """Sequence-parallel into a column-parallel linear: all-gather the sequence shards
    forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence-parallel out of a row-parallel linear: reduce-scatter forward (sum, keep
    this rank's positions), all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        _check_splits(x, group, "RowParallelLinear(sequence_parallel=True)")
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return _all_gather(grad, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    """Replicated activations into the sequence-parallel region (after the embedding): keep
    this rank's positions forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        _check_splits(x, group, "scatter_sequence")
        ctx.group = group
        return _own_part(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return _all_gather(grad, ctx.group), None


class _GatherSequenceToReplicated(torch.autograd.Function):
    """Out of the sequence-parallel region to replicated work (the output layer, run whole
    on every rank): all-gather forward; backward keeps this rank's part of the gradient,
    which every rank computed identically."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return _own_part(grad, ctx.group), None


# ``f(x, group) -> tensor``: the regions as functions.
copy_to_tensor_parallel = _CopyToTensorParallel.apply
reduce_from_tensor_parallel = _ReduceFromTensorParallel.apply
gather_sequence = _GatherSequence.apply
reduce_scatter_sequence = _ReduceScatterSequence.apply
scatter_sequence = _ScatterSequence.apply
gather_sequence_to_replicated = _GatherSequenceToReplicated.apply


# -- the linears -------------------------------------------------------------------------------
class _ParallelLinear(nn.Module):
    """What both parallel linears share: the group, a weight split along ``split_dim``
    (0: output features, 1: input features), and ``nn.Linear``'s initialisation."""

    split_dim: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_group: Any = None,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        world = dist.get_world_size(tp_group)
        shape = [out_features, in_features]
        if shape[self.split_dim] % world:
            raise ValueError(
                f"{type(self).__name__}: {('out_features', 'in_features')[self.split_dim]} "
                f"{shape[self.split_dim]} is not divisible by the tensor-parallel size {world}."
            )
        shape[self.split_dim] //= world
        self.in_features, self.out_features = in_features, out_features
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype))
        self.reset_parameters()

    def sharded_parameters(self) -> list[nn.Parameter]:
        """Parameters of which this rank holds a slice (the bias only when split by output)."""
        return [self.weight, self.bias] if self.split_dim == 0 else [self.weight]

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation of the whole layer, sliced: the same seed on every
        rank gives the same whole weight, so the shards fit together."""
        dense = nn.Linear(self.in_features, self.out_features, device=self.weight.device, dtype=self.weight.dtype)
        self.load_dense(dense)

    @torch.no_grad()
    def load_dense(self, linear: nn.Linear) -> None:
        """Copy this rank's slice of a whole ``nn.Linear`` (its bias: sliced with the
        output features, else whole)."""
        own = _own_rows(self.weight.shape[self.split_dim], self.tp_group)
        self.weight.copy_(linear.weight[own] if self.split_dim == 0 else linear.weight[:, own])
        self.bias.copy_(linear.bias[own] if self.split_dim == 0 else linear.bias)


class ColumnParallelLinear(_ParallelLinear):
    """``nn.Linear`` split by output features: this rank holds ``out / TP`` rows of the
    weight and bias, takes the whole input (with ``sequence_parallel``: its sequence shard,
    all-gathered first) and returns its ``[..., out / TP]`` slice of the output.

    ``ColumnParallelLinear(in_features, out_features, tp_group=None, sequence_parallel=False,
    device=None, dtype=None)``; ``tp_group=None`` is the default process group."""

    split_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_sequence(x, self.tp_group)
        else:
            x = copy_to_tensor_parallel(x, self.tp_group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(_ParallelLinear):
    """``nn.Linear`` split by input features: this rank holds ``in / TP`` columns of the
    weight, multiplies its slice of the input (a column-parallel output) and the partial
    products are all-reduced (with ``sequence_parallel``: reduce-scattered along the
    sequence). The bias is whole on every rank and added once, after the sum.

    Arguments as ``ColumnParallelLinear``."""

    split_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(y, self.tp_group)
        else:
            y = reduce_from_tensor_parallel(y, self.tp_group)
        return y + self.bias


def _own_rows(size: int, group: Any) -> slice:
    rank = dist.get_rank(group)
    return slice(rank * size, (rank + 1) * size)


# -- the block and the model -------------------------------------------------------------------
class ParallelGPTBlock(GPTBlock):
    """``GPTBlock`` split over a tensor-parallel group: column-parallel QKV and fc1,
    row-parallel proj and fc2, ``heads / TP`` attention heads per rank.

    Args:
        hidden, heads, dropout: as ``GPTBlock`` (``heads`` divisible by the group size).
        tp_group: the tensor-parallel process group (``None``: the default group).
        sequence_parallel: activations between the linears are split along the sequence:
            the block takes and returns this rank's ``[s / TP, b, h]`` shard.
        recompute: wrap the whole block in ``checkpoint()``.
        distribute_saved_activations: with ``recompute``, keep only 1/TP of the block's
            input between forward and backward (``checkpoint(distribute_saved_activations=
            True, tp_group=...)``). The input must be the same on every rank, so not with
            ``sequence_parallel``: ``checkpoint`` refuses the shards with a ValueError.

    Forward: ``(hidden_states [s, b, h] or its shard, attention_mask=None) ->
    (hidden_states, None)``, like ``GPTBlock``.
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        dropout: float = 0.0,
        tp_group: Any = None,
        sequence_parallel: bool = False,
        recompute: bool = False,
        distribute_saved_activations: bool = False,
        attention_dropout: float | None = None,
        use_reentrant: bool = True,
        get_rng_tracker: Callable[[], object] = rng.get_cuda_rng_tracker,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        world = dist.get_world_size(tp_group)
        if heads % world:
            raise ValueError(
                f"ParallelGPTBlock: heads {heads} is not divisible by the tensor-parallel size {world}."
            )
        split = {"tp_group": tp_group, "sequence_parallel": sequence_parallel}
        super().__init__(
            hidden, heads, dropout, attention_dropout, recompute, use_reentrant, get_rng_tracker,
            device, dtype,
            column_linear=functools.partial(ColumnParallelLinear, **split),
            row_linear=functools.partial(RowParallelLinear, **split),
        )
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.distribute_saved_activations = distribute_saved_activations

    def sequence_parallel_parameters(self) -> list[nn.Parameter]:
        """Whole parameters that, under sequence parallelism, each rank applies to its own
        positions only, so each rank's gradient is a partial sum: the LayerNorms and the
        row-parallel biases (added after the reduce-scatter)."""
        if not self.sequence_parallel:
            return []
        return [*self.ln_attn.parameters(), *self.ln_mlp.parameters(), self.proj.bias, self.fc2.bias]

    @classmethod
    def from_dense(cls, block: GPTBlock, tp_group: Any = None, **options: Any) -> "ParallelGPTBlock":
        """This rank's shard of a whole ``GPTBlock`` (its weights sliced, its settings kept
        unless ``options`` override them); draws no random numbers."""
        settings = dict(
            dropout=block.dropout, attention_dropout=block.attention_dropout,
            recompute=block.recompute, use_reentrant=block.use_reentrant,
            get_rng_tracker=block.get_rng_tracker,
        )
        settings.update(options)
        weight = block.qkv.weight
        # Built on the meta device (no memory, no initialisation draws), then filled in.
        parallel = cls(block.ln_attn.normalized_shape[0], block.heads, tp_group=tp_group,
                       device="meta", dtype=weight.dtype, **settings)
        parallel = parallel.to_empty(device=weight.device)
        parallel.load_dense(block)
        return parallel.train(block.training)

    @torch.no_grad()
    def load_dense(self, block: GPTBlock) -> None:
        """Copy this rank's shard of a whole ``GPTBlock``'s weights."""
        for norm in ("ln_attn", "ln_mlp"):
            getattr(self, norm).load_state_dict(getattr(block, norm).state_dict())
        for linear in ("qkv", "proj", "fc1", "fc2"):
            getattr(self, linear).load_dense(getattr(block, linear))

    def _checkpoint_options(self) -> dict:
        options = super()._checkpoint_options()
        if self.distribute_saved_activations:
            options.update(distribute_saved_activations=True, tp_group=self.tp_group)
        return options

    def _bias_dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return super()._bias_dropout(x)  # replicated: the default stream, same everywhere
        with self.get_rng_tracker().fork():  # this rank's positions: its own stream
            return super()._bias_dropout(x)


class ParallelGPT(GPT):
    """``GPT`` with its layers split over a tensor-parallel group.

    The whole model is built first, exactly as ``GPT`` builds it from the same seed, and
    each layer is then replaced by this rank's shard, so a TP run starts from the weights a
    single-GPU run starts from. The embedding and the output layer stay whole on every
    rank (not vocabulary-parallel), which keeps the loss an ordinary cross entropy.
    """

    def __init__(
        self,
        *args: Any,
        tp_group: Any = None,
        sequence_parallel: bool = False,
        distribute_saved_activations: bool = False,
        **kwargs: Any,
    ):
        """``GPT``'s arguments, then the group and how the layers are split (as
        ``ParallelGPTBlock``)."""
        super().__init__(*args, **kwargs)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.layers = nn.ModuleList(
            ParallelGPTBlock.from_dense(
                block, tp_group, sequence_parallel=sequence_parallel,
                distribute_saved_activations=distribute_saved_activations,
            )
            for block in self.layers
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.sequence_parallel:
            x = scatter_sequence(x, self.tp_group)
        for layer in self.layers:
            x, _ = layer(x)
        if self.sequence_parallel:
            x = gather_sequence_to_replicated(x, self.tp_group)
        return self.head(x)


# -- gradients ---------------------------------------------------------------------------------
def sharded_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Every parameter of ``module`` of which this rank holds only a slice."""
    return [p for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
            for p in m.sharded_parameters()]


def allreduce_sequence_parallel_grads(module: nn.Module, tp_group: Any = None) -> None:
    """Sum over the group the gradients of whole parameters that each rank applied to its
    own positions only (LayerNorms and row-parallel biases under sequence parallelism).
    Call after the backward, before clipping and the optimizer step (Megatron does it in
    ``finalize_model_grads``)."""
    params = [p for m in module.modules() if isinstance(m, ParallelGPTBlock)
              for p in m.sequence_parallel_parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))


def clip_grad_norm_(module: nn.Module, max_norm: float, tp_group: Any = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a tensor-parallel model: the norm of the whole
    model's gradient, counting the slices of sharded parameters from every rank and each
    whole parameter once, so every rank scales by the same factor and whole parameters stay
    identical across the group. Returns the total norm."""
    params = [p for p in module.parameters() if p.grad is not None]
    is_sharded = {id(p) for p in sharded_parameters(module)}
    sharded = [p.grad for p in params if id(p) in is_sharded]
    whole = [p.grad for p in params if id(p) not in is_sharded]
    device = params[0].grad.device

    def sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=device, dtype=torch.float32)
        return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum()

    sharded_squares = sum_of_squares(sharded)
    dist.all_reduce(sharded_squares, group=tp_group)
    total = (sum_of_squares(whole) + sharded_squares).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_([p.grad for p in params], scale)
    return total
