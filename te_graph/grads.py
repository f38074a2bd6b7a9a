"""Where gradients go while a backward is captured and replayed.

Inputs: during a captured backward every static input's ``.grad`` is set to None, the
backward runs through ``torch.autograd.backward`` (reentrant checkpoint refuses
``torch.autograd.grad``), and the new ``.grad``s are the static grad inputs; the old
values are put back afterwards.

Parameters: each trainable parameter has one persistent gradient buffer at a fixed address,
shared by every graph that uses the parameter, and the captured backward accumulates into
it (autograd's in-place ``grad += new``, captured inside the graph). A replay then takes
one of two paths, chosen at each call:

* **in the graph** (the fast path): the parameter's ``.grad`` *is* its buffer, so the
  replay leaves the gradient where eager code would, with no per-parameter work outside
  the graph and no graph memory handed to autograd (PyTorch issue 181723);
* **through autograd**, when something observes per-parameter gradients: DDP (its reducer
  hooks the gradient accumulators), hooks on the parameter (``register_hook``,
  ``register_post_accumulate_grad_hook``), parameters with Megatron's ``main_grad`` (its
  DDP hooks the accumulators too; attached before or after graphing) or
  ``accumulate_grads_in_graph=False``; or when a parameter's ``.grad`` is a tensor subclass
  (an FP8 ``.grad`` of a Transformer Engine FP8 weight, made by ``torch.empty_like``), which
  eager autograd accumulates into with the subclass's own arithmetic. The buffer is
  zeroed, the replay leaves the fresh gradient in it, and the graphed call hands it to
  autograd as the parameter's gradient, so accumulation and every hook run exactly as in
  eager code, once per backward.

The path is chosen at the forward; what comes to need autograd's accumulation before that
call's backward is refused: a hook on a parameter (``replay.refusals.check_in_graph_backward``),
another use of a parameter in the same backward (``replay.in_graph``). A backward asked for
some tensors' gradients only (``torch.autograd.grad``, ``backward(inputs=...)``) hands the
parameters it names theirs through autograd (``replay.runner.Runner._asked``).
"""
from __future__ import annotations

import contextlib
import operator
from typing import Iterator, Sequence

import torch

from . import compat

_grad_of = operator.attrgetter("grad")
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_GRAD = (type(None), torch.Tensor)


def has_main_grad(param: torch.Tensor) -> bool:
    """Whether ``param`` carries Megatron's ``main_grad``."""
    return "main_grad" in param.__dict__


def _tensor_hooked(params: Sequence[torch.Tensor]) -> bool:
    """Whether one of ``params`` has a hook (``register_hook``,
    ``register_post_accumulate_grad_hook``)."""
    return any(map(compat.tensor_hooks, params)) or (
        compat.HAS_POST_ACCUMULATE_HOOKS and any(map(compat.post_accumulate_hooks, params)))


def hooked(params: Sequence[torch.Tensor]) -> bool:
    """Whether something outside autograd's own accumulation observes one of ``params``'
    gradients: hooks on it, or Megatron's ``main_grad`` (its DDP hooks the gradient
    accumulator). A few C-level attribute reads per parameter."""
    return _tensor_hooked(params) or any(map(has_main_grad, params))


@contextlib.contextmanager
def grads_redirected(
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] = (),
    buffers: Sequence[torch.Tensor | None] | None = None,
) -> Iterator[None]:
    """Inside: inputs' ``.grad`` is None and each param's is its buffer (None if no buffers).

    Everything is put back on exit, also when the block raises.
    """
    saved_inputs = [t.grad for t in inputs]
    saved_params = [p.grad for p in params]
    buffers = buffers if buffers is not None else [None] * len(params)
    try:
        for t in inputs:
            t.grad = None
        for p, b in zip(params, buffers):
            p.grad = b
        yield
    finally:
        for t, g in zip(inputs, saved_inputs):
            t.grad = g
        for p, g in zip(params, saved_params):
            p.grad = g


class ParamGrads:
    """The parameters one backward graph accumulates into, and their persistent buffers
    (``RESOURCES.grad_buffer``: one per parameter, shared by every graph using it)."""

    def __init__(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], tied: bool = False):
        self.params = tuple(params)
        self.buffers = tuple(buffers)
        # A parameter another callable's graphs use too: its gradients always go through
        # autograd, which sums every use's gradient before adding it to .grad, as in eager.
        self.tied = tied
        # Only a tensor-subclass parameter (a TE FP8 weight) gets a subclass .grad from
        # torch.empty_like(param); plain ones skip that check on the hot path.
        self._subclass_params = tuple(p for p in self.params if type(p) not in _PLAIN)
        # torch's hook-handle count when the parameters last had no hook (-1: not yet seen).
        self._unhooked_at = -1

    def observed(self) -> bool:
        """Whether something observes a parameter's gradient: hooks on it, or Megatron's
        ``main_grad`` (its DDP hooks the gradient accumulator), attached before or after
        graphing; or a subclass ``.grad`` only autograd may accumulate into. On the hot
        path: one C-level attribute read per parameter (``main_grad``), the hooks' only
        where a hook was registered anywhere since they last had none
        (``compat.hook_handles_made``: every registration makes a handle)."""
        return (
            self.tied
            or self._hooked()
            or any(map(has_main_grad, self.params))
            or any(type(p.grad) not in _PLAIN_GRAD for p in self._subclass_params)
        )

    def _hooked(self) -> bool:
        made = compat.hook_handles_made()
        if made == self._unhooked_at and made >= 0:
            return False
        if _tensor_hooked(self.params):
            return True
        self._unhooked_at = made
        return False

    def prepare_in_graph(self) -> None:
        """Before an in-graph replay: make each ``param.grad`` its buffer, keeping its value.

        A grad set to None since (``zero_grad(set_to_none=True)``) starts from zero; a
        tensor the user (or the autograd path) left there is copied in. The common case
        costs one identity check per parameter.
        """
        params, buffers = self.params, self.buffers
        if all(map(operator.is_, map(_grad_of, params), buffers)):
            return
        stale = [i for i in range(len(params)) if params[i].grad is not buffers[i]]
        compat.zero_([buffers[i] for i in stale if params[i].grad is None])
        for i in stale:
            grad = params[i].grad
            if grad is not None:
                buffers[i].copy_(grad)
            params[i].grad = buffers[i]

    def prepare_autograd(self) -> None:
        """Before a replay whose parameter grads go through autograd: the buffers start from
        zero and are nobody's ``.grad`` (a gradient kept in one, by the in-graph path or
        handed out uncloned, is moved out first)."""
        for p, b in zip(self.params, self.buffers):
            grad = p.grad
            if type(grad) is torch.Tensor and grad.data_ptr() == b.data_ptr():
                p.grad = grad.clone()
        compat.zero_(self.buffers)

    def for_autograd(self, clone: bool, always: bool = False) -> tuple[torch.Tensor, ...]:
        """After the replay: each parameter's fresh gradient, to hand to autograd.

        With ``clone`` the gradient is copied wherever autograd or a hook could keep it (the
        parameter has no ``.grad`` yet, or tensor hooks see it); otherwise autograd adds it
        into the existing ``.grad`` and lets it go, so the buffer itself is handed over. A
        parameter with Megatron's ``main_grad`` gets the buffer itself too: the gradient hook
        of Megatron's DDP adds ``.grad`` into ``main_grad`` and drops it at once, and a
        ``.grad`` still viewing the buffer at the next replay is moved out first
        (``prepare_autograd``), so a copy would only cost a kernel per parameter per call.
        """
        if self.tied or always:
            # Another graph's backward in this same backward zeroes and refills the shared
            # buffer before autograd has summed this gradient with its (``always``: the
            # caller keeps them, ``torch.autograd.grad``).
            return tuple(b.clone() for b in self.buffers)
        if not clone:
            return tuple(b.detach() for b in self.buffers)
        return tuple(
            b.clone() if (p.grad is None and not has_main_grad(p)) or compat.tensor_hooks(p) else b.detach()
            for p, b in zip(self.params, self.buffers)
        )
