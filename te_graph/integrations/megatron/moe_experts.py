"""Dropless mixture-of-experts experts inside graphs: one graph per token capacity
(:func:`.moe.graph_dropless_experts` installs them).

With dropless routing, how many tokens each expert gets is known only after routing, on the
host (megatron-core's dispatcher brings the counts there), so the experts' computation has no
static shape, and peers run it eagerly or drop tokens beyond a fixed capacity. Here it is
captured for a few token capacities instead: per expert ``C`` rows, the real tokens first and
zero rows after them (largest capacity first, one pool per layer). At each call the counts pick the
smallest capacity that holds every expert's tokens; the tokens are laid out ``C`` rows per
expert, that graph replays and the real rows are gathered back. No token is ever dropped:
above the largest capacity the same padded program runs eagerly (``overflow``), as it does
while an earlier call of the layer still waits for its backward (several microbatches in
flight, a pipeline schedule: the graphs of a layer share their buffers), and outside
training the experts' own forward runs.

Numerics: a call equals te_graph's eager replay of the same program bitwise (the padded
layout, run without graphs). Against the unpadded eager experts, the real rows see other GEMM
shapes (``C`` rows per expert instead of the count), so cuBLAS may pick other kernels and
round differently; benchmarks/bench_moe.py and tests/test_megatron_path.py report by how much.

FP8 (megatron-core's ``fp8`` config, any recipe TE graphs): the graphs are made with the
layer's recipe and amax reduction group, as Megatron's own autocast uses them, and each call
does around its replay the per-call Python state the eager TE wrappers would have changed
(the weight-cache flag, ``is_first_microbatch``): see :meth:`DroplessExperts._replay`.

The graphs can hold the dispatcher's work around the experts too (the padding's row indices,
the pad and gather, with expert parallelism the alltoalls, the un-permutation, and their
backward): ``span="dispatch"``, in :mod:`.moe_dispatch`, taken by default where a layer
allows it (megatron-core's alltoall dispatcher, whole experts on each rank).

The experts module keeps its identity, parameters and names: only its ``forward`` (the
dispatch span: three ``MoELayer`` methods) is replaced on the instance, and
:meth:`DroplessExperts.remove` puts it back.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch

from checkpointing.recompute_state import cuda_stream_capturing

from ... import compat
from ...api import reset
from ...extension import SEAM
from ...resources import graphed_callable_of
from ..transformer_engine.modules import keeps_weight_cache

__all__ = ["DroplessExperts", "PaddedExperts", "padded_layout", "skips_weight_update", "fp8_state"]

class PaddedExperts(torch.nn.Module):
    """The experts on a padded layout: ``hidden`` holds ``C`` rows per local expert.
    ``ddp_hook``: a forward pre-hook made by the megatron-core DDP wrapping the model (its
    code tells DDP's hooks apart), else None; then ``owner``, the megatron-core layer holding
    the experts (or None), tells them apart by its helper's manual hooks."""

    # Graphed alone (span "experts"), these graphs replay inside the experts module's own
    # forward, which megatron-core calls through nn.Module.__call__: hooks on that module run
    # around the replay as they run around its eager forward (``frozen.hooks_outside_graphs``).
    # Inside the dispatch span's graphs the experts are not called at all: there this does
    # not apply (it is read of the graphed module only).
    _hooks_run_around = ("experts",)

    def __init__(self, experts: torch.nn.Module, forward: Callable, num_experts: int,
                 owner: Optional[torch.nn.Module] = None, ddp_hook: Optional[Callable] = None):
        super().__init__()
        self.experts = experts
        self._forward = forward  # the class's forward, bound (the instance's is replaced)
        self.num_experts = num_experts
        self._by_hand = _DDPHooksByHand(owner, ddp_hook, modules_with_parameters(experts))

    @property
    def cuda_graph_manual_hooks(self) -> Optional[list]:
        """The forward pre-hooks of megatron-core's DDP these graphs run by hand
        (:class:`_DDPHooksByHand`), as megatron-core's helper lists its own."""
        return self._by_hand.listed()

    def forward(self, hidden: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        capacity = hidden.shape[0] // self.num_experts
        counts = torch.full((self.num_experts,), capacity, dtype=torch.long)  # on the host, as dispatch gives it
        output, bias = self._forward(hidden, counts, probs)
        if bias is not None:
            raise ValueError("te_graph.graph_dropless_experts: the experts return a bias; only experts without "
                             "one (add_bias_linear=False, as megatron-core's alltoall dispatcher requires) are graphed.")
        return output


class _DDPHooksByHand:
    """The forward pre-hooks of megatron-core's DDP (``overlap_param_gather``) that the
    capacity graphs run by hand before each replay (:meth:`DroplessExperts._run_ddp_pre_hooks`),
    listed as megatron-core's helper lists its own (``cuda_graph_manual_hooks``): DDP's hook with
    each of the experts' submodules with parameters of their own, so that DDP's hooks there
    pass the per-call check (``helper.hooks_run_by_hand``). DDP's hook is one
    made by the DDP wrapping the model (``ddp_hook``), else one the helper of the layer
    holding the experts (``owner``) runs; no list without either. One list object per hook:
    the per-call check goes by its identity."""

    def __init__(self, owner: Optional[torch.nn.Module], ddp_hook: Optional[Callable], modules: list):
        self.owner, self.ddp_hook, self.modules = owner, ddp_hook, modules
        self._listed: Optional[list] = None

    def listed(self) -> Optional[list]:
        hook = self.ddp_hook
        if hook is None:
            owners = SEAM.manual_hooks(self.owner)
            hook = owners[0][0] if owners else None
        if hook is None:
            return None
        if self._listed is None or (self._listed and self._listed[0][0] is not hook):
            self._listed = [(hook, (m,)) for m in self.modules]
        return self._listed


class DroplessExperts:
    """What :func:`graph_dropless_experts` installed on one MoE layer: its capacity graphs
    (``graphed``), the count of calls served by each capacity's graph (``calls``) and
    eagerly (``eager_calls``), and ``span``: ``"experts"`` (the experts' forward replays a
    graph of the experts alone) or ``"dispatch"`` (:class:`moe_dispatch.DroplessDispatch`:
    from the permuted tokens to the combined output)."""

    span = "experts"

    def __init__(self, experts: torch.nn.Module, graphed: torch.nn.Module, padded: Callable,
                 capacities: Sequence[int], num_experts: int, dtypes: tuple, fp8: bool, overflow_rows: Optional[int]):
        self.experts = experts
        self.graphed = graphed
        self.padded = padded  # the padded program, run eagerly (above the largest capacity)
        self.overflow_rows = overflow_rows  # None: the experts' own forward there
        self.capacities = tuple(sorted(capacities))
        self.num_experts = num_experts
        self.dtypes = dtypes  # (tokens, probabilities) as captured
        self.fp8 = fp8  # graphed with FP8: each replay sets TE's weight-cache flag
        self.calls = {c: 0 for c in self.capacities}
        self.eager_calls = 0
        # megatron-core's TE wrappers keep an ``is_first_microbatch`` flag that their eager
        # forward clears (``TEGroupedLinear.forward``) and that Megatron sets again at each
        # step's first microbatch under FP8 (``MegatronModule.set_is_first_microbatch``).
        self._first_microbatch_flags = [m for m in experts.modules() if hasattr(m, "is_first_microbatch")]
        self._install()

    def _install(self) -> None:
        self.experts.forward = self.forward

    def forward(self, hidden: torch.Tensor, tokens_per_expert: Any, probs: torch.Tensor, **kwargs: Any) -> tuple:
        counts = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else list(tokens_per_expert)
        capacity = self._capacity(max(counts, default=0))
        # The experts' own forward: outside training, with keywords the graphs do not take,
        # inside another capture (a graph cannot replay inside a capture), above the largest
        # capacity where overflow="eager", and for rows the counts do not add up to (a router
        # of one's own sending fewer than top-k assignments, where megatron-core 0.19 permutes
        # tokens x top-k rows): the experts fail on those as they do eagerly, where the padded
        # layout would index past the last expert (on a GPU, a device-side assert).
        if (kwargs or not self.experts.training or cuda_stream_capturing()
                or (capacity is None and self.overflow_rows is None) or sum(counts) != hidden.shape[0]):
            self.eager_calls += 1
            return type(self.experts).forward(self.experts, hidden, tokens_per_expert, probs, **kwargs)
        self._check_call(counts, hidden, probs)
        run, capacity = self._runner(capacity, max(counts))
        on_device = torch.tensor(counts, dtype=torch.long).to(hidden.device, non_blocking=True)
        padded, padded_probs, rows = padded_layout(hidden, probs, on_device, capacity)
        return self._replay(run, padded, padded_probs).index_select(0, rows), None

    def block_rows(self, capacity: int) -> int:
        """The rows of one block of the padded layout at ``capacity`` (rows per local expert):
        each expert's block here (the dispatch span with expert parallelism overrides it)."""
        return capacity

    def _capacity(self, largest: int) -> Optional[int]:
        """The smallest capacity whose blocks hold ``largest`` tokens, the most of any block of
        this call (None: above the largest capacity)."""
        return next((c for c in self.capacities if self.block_rows(c) >= largest), None)

    def _check_call(self, counts: Sequence[int], hidden: torch.Tensor, probs: torch.Tensor) -> None:
        if len(counts) != self.num_experts:
            raise ValueError(
                f"te_graph.graph_dropless_experts: the experts got token counts for {len(counts)} experts, but "
                f"they hold {self.num_experts} local experts (their graphs lay the tokens out that many blocks "
                "of rows): pass one count per local expert, as megatron-core's dispatcher does.")
        self._check_dtypes(hidden, probs)

    def _check_dtypes(self, hidden: torch.Tensor, probs: torch.Tensor) -> None:
        if hidden.dtype != self.dtypes[0]:
            raise ValueError(
                f"te_graph.graph_dropless_experts: the experts got tokens in {hidden.dtype}, but their graphs "
                f"were captured for {self.dtypes[0]}, their parameters' dtype at graphing: graph them after the "
                "model is cast (megatron-core's Float16Module, .to(dtype)), then call them in that dtype.")
        if probs.dtype != self.dtypes[1]:
            raise ValueError(
                f"te_graph.graph_dropless_experts: the experts got tokens in {hidden.dtype} and routing "
                f"probabilities in {probs.dtype}, but their graphs were captured for {self.dtypes[0]} and "
                f"{self.dtypes[1]}: pass probs_dtype={probs.dtype} to graph_dropless_experts (the "
                "probabilities' dtype is megatron-core's moe_router_dtype where set).")

    def _runner(self, capacity: Optional[int], largest: int) -> tuple[Callable, int]:
        """The capacity's graph and its block rows, or the same padded program run eagerly:
        above the largest capacity at blocks of ``largest`` rows (the most tokens of any block)
        rounded up to overflow_rows, so that such calls repeat a few
        GEMM shapes (a GEMM shape new to cuBLASLt costs a host-side algorithm search at every
        call); and while an earlier call of this layer still waits for its backward (several
        microbatches in flight: pipeline schedules), whose activations a replay would
        overwrite (the graphs of one layer share their buffers). Counted."""
        if capacity is None:
            self.eager_calls += 1
            return self.padded, self.overflow_rows * math.ceil(largest / self.overflow_rows)
        graphed = graphed_callable_of(self.graphed)  # None after reset(): the eager program runs
        # Not in a backward: a recompute there (a checkpoint around the experts) must repeat the
        # forward it recomputes, which the graphs' own refusal names.
        if graphed is not None and graphed.awaits_backward() and not compat.in_backward():
            self.eager_calls += 1
            return self.padded, self.block_rows(capacity)
        self.calls[capacity] += 1
        return self.graphed, self.block_rows(capacity)

    def _replay(self, run: Callable, *inputs: torch.Tensor) -> torch.Tensor:
        """``run(*inputs)`` with the per-call Python state the eager TE wrappers keep."""
        flags = self._first_microbatch_flags
        if run is self.graphed:
            self._run_ddp_pre_hooks()
        if self.fp8 and run is self.graphed:
            # The captured weight casts read TE's device flag "skip the weight update": set it
            # as the eager wrappers would decide, whoever else set it last (one fill kernel).
            fp8_state().set_skip_fp8_weight_update_tensor(skips_weight_update(flags))
        output = run(*inputs)
        # A replay runs no Python: clear the flag as the eager forward does, so that a later
        # eager call of this step does not take itself for the step's first. Under FP8 that
        # call would overwrite main_grad instead of adding to it (megatron-core sets the flag
        # again at each step's first microbatch, MegatronModule.set_is_first_microbatch).
        for module in flags:
            module.is_first_microbatch = False
        return output

    def _run_ddp_pre_hooks(self) -> None:
        """megatron-core DDP's forward pre-hooks on the experts' submodules with parameters
        (``overlap_param_gather``: each waits for its parameters' all-gather), which a replay
        would skip: run by hand before it, as megatron-core's helper runs those of the layer's
        own graphs (told apart by their code, ``helper.hooks_run_by_hand``:
        where the helper runs none, none is run here, and the per-call check refuses them)."""
        codes = SEAM.hooks_run_by_hand(self.graphed)
        for _, modules in SEAM.manual_hooks(self.graphed) or ():  # the experts' modules with parameters
            for module in modules:
                for hook in tuple(module._forward_pre_hooks.values()):
                    if getattr(hook, "__code__", None) in codes:
                        hook(module, ())

    def remove(self) -> None:
        """Put the experts' own forward back and free the graphs."""
        self.experts.__dict__.pop("forward", None)
        reset(self.graphed)


def modules_with_parameters(module: torch.nn.Module) -> list:
    """``module`` and its submodules that hold parameters of their own."""
    return [m for m in module.modules() if next(m.parameters(recurse=False), None) is not None]


def skips_weight_update(wrappers: Sequence[Any]) -> bool:
    """Whether a replay may reuse the FP8 weights cached at the step's first microbatch, as
    megatron-core's TE wrappers decide from ``is_first_microbatch`` (False: reuse; True:
    quantize again). They pass None, and TE quantizes at every call, where they keep no
    weight cache (``disable_parameter_transpose_cache``) or there is no such wrapper."""
    return bool(wrappers) and keeps_weight_cache(wrappers) and wrappers[0].is_first_microbatch is False


def padded_layout(tokens: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor, capacity: int) -> tuple:
    """Tokens grouped by expert (``counts`` per expert, a tensor on their device) laid out
    ``capacity`` rows per expert: expert ``e``'s ``i``-th token at row ``e * capacity + i``,
    zero rows after the real ones. Returns the padded tokens and probabilities and each
    token's row (to gather the real rows back)."""
    ends = counts.cumsum(dim=0)
    position = torch.arange(tokens.shape[0], device=tokens.device)
    # Position j belongs to the first expert whose group ends after it.
    expert = torch.searchsorted(ends, position, right=True)
    rows = expert * capacity + position - (ends - counts).index_select(0, expert)
    size = counts.shape[0] * capacity
    padded = tokens.new_zeros(size, tokens.shape[-1]).index_copy(0, rows, tokens)
    padded_probs = probs.new_zeros(size, *probs.shape[1:]).index_copy(0, rows, probs)
    return padded, padded_probs, rows


def fp8_state() -> Any:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: PLC0415

    return FP8GlobalStateManager


