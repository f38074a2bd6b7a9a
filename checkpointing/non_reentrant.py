"""Non-reentrant checkpoint: saved-tensor hooks drop what the forward saves and the first
unpack recomputes it all, with the forward's random numbers."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from .recompute_state import RecomputeState


class Recompute:
    """Saved tensors of one checkpointed call, recomputed on first use."""

    def __init__(self, function, args, kwargs, state: RecomputeState, recompute_context):
        self.function = function
        self.kwargs = kwargs
        self.state = state
        self.recompute_context = recompute_context
        # Inputs are kept (as the reentrant path keeps them); everything else is recomputed.
        self.args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        self.requires_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        self.count = 0
        self.saved: list[torch.Tensor] | None = None

    def pack(self, tensor: torch.Tensor) -> int:
        self.count += 1
        return self.count - 1

    def unpack(self, index: int) -> torch.Tensor:
        if self.saved is None:
            self._recompute()
        return self.saved[index]

    def _recompute(self) -> None:
        saved: list[torch.Tensor] = []
        inputs = [
            a.detach().requires_grad_(g) if isinstance(a, torch.Tensor) else a
            for a, g in zip(self.args, self.requires_grad)
        ]
        context = self.recompute_context or contextlib.nullcontext()
        with torch.enable_grad(), context, self.state.recompute():
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                self.function(*inputs, **self.kwargs)
        if len(saved) != self.count:
            raise RuntimeError(
                f"checkpoint(use_reentrant=False): the recompute saved {len(saved)} tensors but "
                f"the forward saved {self.count}; the checkpointed function must run the same "
                "operations both times."
            )
        self.saved = saved


def run_without_reentrant(
    function: Callable, args: tuple, kwargs: dict, state: RecomputeState,
    forward_context: Any, recompute_context: Any,
) -> Any:
    """Run ``function`` keeping no activations; its backward recomputes them."""
    recompute = Recompute(function, args, kwargs, state, recompute_context)
    context = forward_context or contextlib.nullcontext()
    with context, state.forward():
        with torch.autograd.graph.saved_tensors_hooks(recompute.pack, recompute.unpack):
            return function(*args, **kwargs)
