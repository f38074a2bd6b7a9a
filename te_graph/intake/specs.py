"""The frozen spec of each graph (``records.GraphSpec``): a callable, one set of its samples
turned into static inputs, its parameters and what the call asks, for every graph of the
schedule and every sample set. Nothing here changes any state."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..extension import SEAM
from ..layout import InputLayout
from ..planning.schedule import Schedule
from ..records import GraphSpec
from ..resources import RESOURCES
from .hooks import CaptureTimeHooks, normalise_capture_time_hooks
from .options import GraphOptions

__all__ = ["make_specs", "make_spec", "SpecContext", "largest_first", "none_default_keywords", "SampleMemory", "callable_name", "device_type"]


def make_specs(
    callables: Sequence[Callable], sets: Sequence[tuple[tuple, tuple]], schedule: Schedule, options: GraphOptions,
    fp8: Any,
) -> list[list[GraphSpec]]:
    """One frozen spec per graph of the schedule, per sample set."""
    owners = [callable_name(c, i) for i, c in enumerate(callables)]
    hooks = normalise_capture_time_hooks(options.capture_time_hooks, owners)
    grad_enabled = torch.is_grad_enabled()
    ordered = options.order is not None
    # Tied weights: parameters several of these callables use, or that graphs made by an
    # earlier call accumulate (this call's gradients then go through autograd, and the
    # earlier graphs' too once this call has made its graphs: ``Runner.share``).
    memory = SampleMemory(RESOURCES.static_input_storages())
    context = SpecContext(grad_enabled, options.retain_graph_in_backward, memory,
                          _shared_parameters(callables) | RESOURCES.parameters_in_graphs())
    spec_sets = [
        [
            make_spec(owners[slot.callable_index], callables[slot.callable_index], args[slot.flat_index],
                      kwargs[slot.flat_index], context, microbatch=slot.microbatch if ordered else None,
                      hooks=hooks[slot.callable_index], fp8=fp8.enabled[slot.callable_index])
            for slot in schedule.graphs
        ]
        for args, kwargs in sets
    ]
    _check_distinct_shapes(spec_sets)
    return spec_sets


def _shared_parameters(callables: Sequence[Callable]) -> frozenset:
    """Ids of the trainable parameters that more than one callable holds (tied weights)."""
    seen: dict[int, int] = {}
    for index, c in enumerate(callables):
        if isinstance(c, torch.nn.Module):
            for p in c.parameters():
                if p.requires_grad and seen.setdefault(id(p), index) != index:
                    seen[id(p)] = -1
    return frozenset(key for key, owner in seen.items() if owner == -1)


def largest_first(spec_sets: Sequence[Sequence[GraphSpec]]) -> list[int]:
    """The sample sets' indices, largest first: later (smaller) captures then fit into the
    memory the first one freed."""
    return sorted(range(len(spec_sets)), key=lambda i: _size(spec_sets[i]), reverse=True)


def _check_distinct_shapes(spec_sets: list[list[GraphSpec]]) -> None:
    for i in range(len(spec_sets[0])):
        shapes = [tuple(t.shape for t in specs[i].layout.samples) for specs in spec_sets]
        if len(set(shapes)) != len(shapes):
            raise ValueError(
                f"make_graphed_callables: more_shapes repeats the sample shapes of "
                f"{spec_sets[0][i].name}; each sample set must have its own shapes (the shapes "
                "pick the graph at call time)."
            )


def _size(specs: list[GraphSpec]) -> int:
    return sum(t.numel() for s in specs for t in s.layout.samples)


def callable_name(func: Callable, index: int) -> str:
    kind = type(func).__name__ if isinstance(func, torch.nn.Module) else getattr(func, "__name__", "function")
    return f"callable {index} ({kind})"



@dataclass(frozen=True)
class SpecContext:
    """What every spec of one call shares."""

    grad_enabled: bool  # torch.is_grad_enabled() at graphing
    retain_graph: bool  # retain_graph_in_backward
    memory: "SampleMemory"  # the static inputs' memory so far
    shared: frozenset = frozenset()  # ids of the parameters that several callables use


def make_spec(owner: str, func: Callable, args: Sequence, kwargs: dict, context: SpecContext, *,
              microbatch: Optional[int] = None, hooks: Optional[CaptureTimeHooks] = None,
              fp8: bool = False) -> GraphSpec:
    """The spec of ``func`` (named ``owner``, and its ``microbatch`` under an order) called
    with ``args`` and ``kwargs``.

    Static inputs are detached leaves sharing the sample tensors' memory, except where
    that memory is already another static input's (``SampleMemory``).

    A backward graph is captured when grad is enabled and something requires grad (an
    input or a parameter), in train and in eval mode alike, as eager autograd would
    differentiate either; graphing under ``torch.no_grad()`` makes forward-only graphs.
    """
    name = owner if microbatch is None else f"{owner}, microbatch {microbatch}"
    call = _entry(func)
    optional = none_default_keywords(call)
    routed = isinstance(func, torch.nn.Module) and call != func.forward
    if routed:  # the forward's keywords too
        optional |= none_default_keywords(func.forward)
    layout = InputLayout(name, args, kwargs, optional)
    params: tuple = ()
    training = True
    if isinstance(func, torch.nn.Module):
        params = tuple(p for p in func.parameters() if p.requires_grad)
        training = func.training
    needs_backward = context.grad_enabled and (any(t.requires_grad for t in layout.samples) or bool(params))
    own = context.memory.own
    static = tuple(own(t.detach()).requires_grad_(t.requires_grad and needs_backward) for t in layout.samples)
    tied = frozenset(i for i, p in enumerate(params) if id(p) in context.shared)
    return GraphSpec(
        name, owner, func, call, layout, static, params, training, needs_backward, context.retain_graph, hooks,
        fp8, SEAM.holds_modules(func), tied, routed,
    )


class SampleMemory:
    """The memory the static inputs of one ``make_graphed_callables`` call take.

    A static input is its sample's memory, so that a call passing the sample itself copies
    nothing. Where two samples share memory (one tensor as every layer's sample, one mask
    in every layer's kwargs, views of one buffer), their graphs would share one static
    buffer, and a call of one would overwrite what another's backward (its recompute)
    still reads; so each later one in the same storage gets a copy of its own, also where
    the other is a static input of graphs an earlier call made (``taken``). A sample
    whose elements overlap each other (an expanded tensor) cannot take a copy-in: it gets a
    contiguous copy.
    """

    def __init__(self, taken: Iterable[tuple[torch.device, int]] = ()) -> None:
        self._taken: set[tuple[torch.device, int]] = set(taken)  # (device, storage address)

    def own(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 0 or t.device.type == "meta":
            return t
        if torch._debug_has_internal_overlap(t) == 1:  # 1: its elements overlap (0 no, 2 unknown)
            t = t.contiguous()
        key = (t.device, t.untyped_storage().data_ptr())
        if key in self._taken:
            # Another static input lives in this storage: even disjoint views of one storage
            # share a version counter, which autograd reads.
            t = t.clone()
            key = (t.device, t.untyped_storage().data_ptr())
        self._taken.add(key)
        return t


def _entry(func: Callable) -> Callable:
    """What graphing calls: a function itself; a module's ``forward`` (module hooks are
    refused, so ``__call__`` would add nothing), except where its class routes capture in
    ``__call__``, as megatron-core's layers do while Megatron's capture flag is set
    (Transformer Engine's graphs call ``__call__`` and get the routed function; te_graph
    calls that function itself, so that eager replay does not route a call back to the
    replay)."""
    if not isinstance(func, torch.nn.Module):
        return func
    routed = SEAM.capture_entry(func)
    return routed if routed is not None else func.forward


def none_default_keywords(call: Callable) -> frozenset:
    """The keyword parameters ``call`` declares with a default of ``None`` (a call may then
    leave them out, or pass None, where they were None at capture)."""
    try:
        parameters = inspect.signature(call).parameters.values()
    except (TypeError, ValueError):  # builtins and C callables may have no signature
        return frozenset()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in parameters if p.kind in keyword and p.default is None)


def device_type(specs: Sequence[GraphSpec]) -> str:
    """The device type the callables run on (their inputs' or parameters'), whose autocast
    state and random streams their graphs depend on."""
    for spec in specs:
        for t in spec.static_inputs + spec.params:
            return t.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"
