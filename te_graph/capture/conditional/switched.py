"""``switched``: one of several differentiable programs, chosen by the GPU, forward and backward.

Under a CUDA graph capture, ``switched(index, programs, inputs)`` captures program ``k`` into
body ``k`` of a SWITCH node, and its backward into body ``k`` of a second SWITCH node in the
backward's capture, on the same index tensor: at each replay the GPU runs program ``index``
and then its backward, and no host waits. Outside a capture the host reads ``index`` (a sync)
and runs that program itself: the eager mirror, bitwise the same program.

What it takes: programs that return tensors of the same shapes and dtypes (one output buffer
serves every body), inputs as tensors, and the module whose parameters the programs train
(``module``): inside the bodies its parameters are aliases made for the node (the same
memory and Python attributes, Megatron's ``main_grad`` included), so that autograd's
accumulation of the real ones stays on the capturing stream, where the node hands their
gradients over; the bodies run on a stream of their own, and autograd would otherwise join
the two captures by an event (torch 2.11 then crashes in the driver). Everything a body may
not hold (random numbers, collectives, events, host waits: see ``nodes``) stays out of the
programs.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from checkpointing.recompute_state import cuda_stream_capturing

from ... import compat
from .guards import ConditionalCaptureError
from .nodes import switch
from .runtime import capture_pool, prepare, runtime

__all__ = ["switched"]

Outputs = Union[torch.Tensor, tuple]


def switched(index: torch.Tensor, programs: Sequence[Callable[..., Outputs]], inputs: Sequence[torch.Tensor], *,
             module: Optional[torch.nn.Module] = None, pool: Any = None) -> Outputs:
    """``programs[index](*inputs)``, differentiable in ``inputs`` and in the trainable parameters
    of ``module`` (those the programs read; other tensors requiring grad that the programs
    close over get no gradient under a capture, so pass them as inputs). Under a capture
    each program is captured into a body of a SWITCH node (forward) and its backward into a
    body of another (backward), chosen at each replay from ``index`` on the GPU; where ``index``
    is out of range no body runs and the outputs keep their last values, so keep it in range.
    Outside a capture ``index`` is read on the host, which refuses one out of range, and the
    device is prepared for conditional nodes (``prepare``) where it is not yet.
    ``pool``: the capture's memory pool (default: the pool of the te_graph capture under way,
    else, where torch has it, of torch's current capture). Under a capture every parameter of
    ``module`` gets a gradient from the node, zeros where the program that ran left it unused
    (eager code leaves such a ``.grad`` as it was): let every program read the same ones."""
    programs, inputs = tuple(programs), tuple(inputs)
    if not programs:
        raise ValueError("switched: give at least one program")
    if not all(callable(p) for p in programs):
        raise TypeError("switched: programs must be callables")
    bad = [type(t).__name__ for t in inputs if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"switched: inputs must be tensors, got {', '.join(bad)}; close over the rest")
    if module is not None and not isinstance(module, torch.nn.Module):
        raise TypeError(f"switched: module must be a torch.nn.Module, not {type(module).__name__}")
    if not isinstance(index, torch.Tensor) or index.numel() != 1 or index.dtype.is_floating_point:
        raise TypeError("switched: index must be a tensor of one integer element")
    if not cuda_stream_capturing():
        chosen = int(index)
        if not 0 <= chosen < len(programs):
            raise IndexError(f"switched: index {chosen} is out of range for {len(programs)} programs "
                             "(under a capture no program would run)")
        if index.device.type == "cuda" and not runtime(index.device.index).ready():
            with contextlib.suppress(ImportError):  # without cuda-bindings a capture names the extra
                prepare(index.device.index)  # here, outside any capture, for the capture to come
        return programs[chosen](*inputs)
    pool = pool if pool is not None else capture_pool()
    if pool is None:
        raise ConditionalCaptureError(
            "switched: pass pool=, the memory pool of the capture under way (torch.cuda.graph(g, pool=pool))")
    slots = _trained_slots(module)
    state = _State(index, programs, pool, len(inputs), slots)
    outputs = _Switched.apply(state, *inputs, *_unique(p for _, _, p in slots))
    return outputs if state.tupled else outputs[0]


class _State:
    """What the forward's node leaves for the backward's: each body's leaves and outputs."""

    def __init__(self, index: torch.Tensor, programs: tuple, pool: Any, inputs: int, slots: list):
        self.index, self.programs, self.pool, self.inputs = index, programs, pool, inputs
        self.slots = slots  # (module, name, parameter) of each trainable parameter slot
        self.bodies: Optional[list] = None  # per body: (its leaves, its outputs)
        self.tupled = False


class _Switched(torch.autograd.Function):
    """The two SWITCH nodes. Each forward body runs its program on leaves of its own (detached
    inputs) with grad enabled, so that its autograd graph is whole and separate; its outputs
    are copied into buffers every body shares. The backward's body ``k`` asks that graph for
    the gradients of the leaves and the parameters, into buffers every body shares."""

    @staticmethod
    def forward(ctx: Any, state: _State, *tensors: torch.Tensor) -> tuple:
        inputs, params = tensors[:state.inputs], tensors[state.inputs:]
        aliases = tuple(_alias(p) for p in params)
        ctx.state, ctx.aliases = state, aliases
        shared: Optional[tuple] = None
        bodies = []
        node = switch(state.index, len(state.programs), pool=state.pool)
        with node, _installed(state.slots, params, aliases):
            for k, body in enumerate(node):
                with body, torch.enable_grad():
                    leaves = tuple(t.detach().requires_grad_(t.requires_grad) for t in inputs)
                    result = state.programs[k](*leaves)
                    state.tupled = isinstance(result, tuple)
                    outputs = result if state.tupled else (result,)
                    if shared is None:  # in the pool, like any of the body's allocations
                        shared = tuple(torch.empty_like(o, requires_grad=False) for o in outputs)
                    _check_like(k, outputs, shared)
                    for buffer, output in zip(shared, outputs):
                        buffer.copy_(output.detach())
                bodies.append((leaves, outputs))
        state.bodies = bodies
        ctx.mark_non_differentiable(*(b for b, o in zip(shared, bodies[0][1]) if not o.requires_grad))
        return shared

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple:
        state, aliases = ctx.state, ctx.aliases
        bodies, state.bodies = state.bodies, None  # each body's graph is freed with this node
        if bodies is None:
            raise RuntimeError("switched: its backward ran twice; a conditional node keeps no graph for a "
                               "second backward (retain_graph)")
        wanted = ctx.needs_input_grad[1:]
        sources = tuple(bodies[0][0]) + aliases
        shared = tuple(torch.empty_like(t) if w else None for t, w in zip(sources, wanted))
        with switch(state.index, len(state.programs), pool=state.pool) as node:
            for (leaves, outputs), body in zip(bodies, node):
                with body:
                    _body_backward(leaves + aliases, outputs, grads, wanted, shared)
        return (None, *shared)


def _body_backward(sources: tuple, outputs: tuple, grads: tuple, wanted: tuple, shared: tuple) -> None:
    """One body's backward: the gradients of ``sources`` (where wanted) into ``shared``."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
    asked = [s for s, w in zip(sources, wanted) if w and s.requires_grad]
    found = iter(torch.autograd.grad([o for o, _ in pairs], asked, [g for _, g in pairs], allow_unused=True)
                 if pairs and asked else [None] * len(asked))
    for source, w, buffer in zip(sources, wanted, shared):
        if not w:
            continue
        grad = next(found) if source.requires_grad else None
        if grad is None:
            buffer.zero_()
        else:
            buffer.copy_(grad)


def _trained_slots(module: Optional[torch.nn.Module]) -> list:
    """(submodule, name, parameter) of every slot holding a trainable parameter of ``module``."""
    if module is None:
        return []
    return [(sub, name, p) for sub in module.modules() for name, p in compat.parameter_slots(sub).items()
            if p is not None and p.requires_grad]


def _unique(params: Any) -> list:
    seen: dict[int, torch.Tensor] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def _alias(param: torch.Tensor) -> torch.nn.Parameter:
    """A leaf on ``param``'s memory sharing its Python attributes (``main_grad``, and the flags a
    fused weight-gradient kernel sets there)."""
    alias = torch.nn.Parameter(param.detach(), requires_grad=True)
    alias.__dict__ = param.__dict__
    return alias


@contextlib.contextmanager
def _installed(slots: list, params: tuple, aliases: tuple) -> Iterator[None]:
    """The aliases in the parameters' slots while the bodies are captured."""
    of = {id(p): a for p, a in zip(params, aliases)}
    try:
        for sub, name, p in slots:
            compat.parameter_slots(sub)[name] = of[id(p)]
        yield
    finally:
        for sub, name, p in slots:
            compat.parameter_slots(sub)[name] = p


def _check_like(k: int, outputs: tuple, shared: tuple) -> None:
    """Every program returns tensors of one structure, shapes and dtypes: the bodies share
    their output buffers."""
    if len(outputs) != len(shared) or any(not isinstance(o, torch.Tensor) for o in outputs):
        raise ConditionalCaptureError(f"switched: program {k} returns {len(outputs)} values, program 0 "
                                      f"{len(shared)} tensors; every program must return the same tensors")
    for i, (o, s) in enumerate(zip(outputs, shared)):
        if o.shape != s.shape or o.dtype != s.dtype or o.device != s.device:
            raise ConditionalCaptureError(
                f"switched: output {i} of program {k} is {tuple(o.shape)} {o.dtype} on {o.device}, program 0's "
                f"{tuple(s.shape)} {s.dtype} on {s.device}; every program must return the same shapes and dtypes")
