"""The capture plan (``records.GraphPlan``): which static buffers graphs share, decided
before anything is captured from tensor layouts alone. Two kinds of sharing:

* **Buffer reuse** (``reuse_graph_input_output_buffers`` under an ``order``): a forward that
  runs after an earlier graph's backward takes over that graph's static inputs and
  grad-output buffers when their layouts match (:func:`plan_buffer_reuse`), and the
  earlier graph's outputs and input grads go back to the pool once its backward is captured.
* **Gradient chaining** (the plain schedule): in a stack, layer i's output is layer i+1's
  input, and the gradient autograd hands layer i's backward is the one layer i+1's backward
  just wrote. Layer i's backward graph reads it where it lies (layer i+1's input-grad
  buffer), which saves a copy and a buffer per layer. Replay keeps this exact: the buffer is
  handed on uncopied only to the graph it is lent to (``replay.graph_runner``).

And the memory the graphs share through their one pool: a forward or backward captured
while another graph's backward had already run, or its forward not yet, may have been given
that graph's activation memory. Each plan names what the other graphs may hold when its
forward and its backward replay (``activations_at_*``, ``queued_at_*``: bitmasks over the
graphs' indices): what they held at that capture. Replay refuses any other order
(``replay.order.ReplayOrder``).
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, Hashable, Mapping, Optional, Sequence, Set, Union

from ..records import GraphPlan
from .schedule import BACKWARD, FORWARD, WGRAD, Step

__all__ = ["TensorMeta", "GraphLayout", "plan_capture", "plan_buffer_reuse", "resolve_buffer_owners"]


@dataclass(frozen=True)
class TensorMeta:
    """A tensor's layout: what must match for one buffer to stand in for another."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any
    device: Any
    requires_grad: bool

    @classmethod
    def of(cls, t: Any, device: Any = None) -> "TensorMeta":
        """``t``'s layout; ``device`` stands in for a meta tensor's."""
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, device or t.device, bool(t.requires_grad))

    def same_layout(self, other: "TensorMeta") -> bool:
        return (self.shape, self.stride, self.dtype, self.device) == (other.shape, other.stride, other.dtype, other.device)


@dataclass(frozen=True)
class GraphLayout:
    """One graph as the planner sees it (from its spec and its warmup record)."""

    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    unused: tuple[int, ...]  # inputs requiring grad that no output depends on
    needs_backward: bool
    retains_graph: bool = False  # its backward keeps its activations (retain_graph_in_backward)

    def reuse_signature(self) -> tuple:
        def key(m: TensorMeta) -> tuple:
            return (m.shape, m.stride, m.dtype, m.requires_grad)

        return (tuple(map(key, self.inputs)), tuple(map(key, self.outputs)))


def plan_capture(
    steps: Sequence[Step], layouts: Sequence[GraphLayout], *, reuse_buffers: bool, chain_grads: bool
) -> tuple[GraphPlan, ...]:
    """One plan per graph (``layouts[i]`` is graph ``i`` of ``steps``)."""
    donors = plan_buffer_reuse(steps, [g.reuse_signature() for g in layouts]) if reuse_buffers else {}
    passed_on = {d for d in donors.values() if d is not None}
    backward_position = {s.flat_index: n for n, s in enumerate(steps) if s.kind == BACKWARD}
    lenders = {}
    if chain_grads:
        for index in range(len(layouts) - 1):
            if _chains(layouts[index], layouts[index + 1], backward_position, index):
                lenders[index] = index + 1
    borrowed = set(lenders.values())
    held = _held(steps, layouts, passed_on)
    return tuple(
        GraphPlan(
            donor=donors.get(index),
            grad_output_from=lenders.get(index),
            lends_grad_buffer=index in borrowed,
            releases_buffers=index in passed_on,
            activations_at_forward=held.get((FORWARD, index), (0, 0))[0],
            activations_at_backward=held.get((BACKWARD, index), (0, 0))[0],
            queued_at_forward=held.get((FORWARD, index), (0, 0))[1],
            queued_at_backward=held.get((BACKWARD, index), (0, 0))[1],
        )
        for index in range(len(layouts))
    )


def _held(steps: Sequence[Step], layouts: Sequence[GraphLayout], passed_on: set) -> dict[tuple, tuple[int, int]]:
    """Per (forward or backward, graph): what the other graphs held when it was captured, in
    ``steps`` order (capture follows it), as bitmasks (activations, queued for a
    weight-gradient pass). A backward that keeps the autograd graph keeps the activations,
    unless the graph passes its buffers on (buffer reuse: its record lets go of them)."""
    passes = {step.flat_index for step in steps if step.kind == WGRAD}
    activations, queued, held = 0, 0, {}
    for step in steps:
        index, layout = step.flat_index, layouts[step.flat_index]
        bit = 1 << index
        if step.kind == FORWARD:
            held[(FORWARD, index)] = (activations, queued)
            if layout.needs_backward:
                activations |= bit
        elif step.kind == BACKWARD and layout.needs_backward:
            held[(BACKWARD, index)] = (activations & ~bit, queued)
            if not layout.retains_graph or index in passed_on:
                activations &= ~bit
            if index in passes:
                queued |= bit
        elif step.kind == WGRAD:
            queued &= ~bit
    return held


def _chains(graph: GraphLayout, following: GraphLayout, backward_position: dict, index: int) -> bool:
    """Whether ``graph``'s backward can read its output grad from ``following``'s input-grad
    buffer: one differentiable output meets the one input of ``following`` that takes a grad,
    laid out alike (autograd lays a dense leaf's grad out like the leaf), and ``following``'s
    backward is captured first. Capture checks the real buffer's layout again."""
    if not (graph.needs_backward and following.needs_backward):
        return False
    mine, theirs = backward_position.get(index), backward_position.get(index + 1)
    if mine is None or theirs is None or theirs > mine:
        return False
    outputs = [m for m in graph.outputs if m.requires_grad]
    takers = [i for i, m in enumerate(following.inputs) if m.requires_grad]
    if len(outputs) != 1 or len(takers) != 1 or takers[0] in following.unused:
        return False
    return outputs[0].same_layout(following.inputs[takers[0]])


def plan_buffer_reuse(
    steps: Sequence[Step],
    signatures: Union[Sequence[Hashable], Mapping[int, Hashable]],
) -> Dict[int, Optional[int]]:
    """For each graph, the earlier graph whose static buffers its forward takes over.

    A graph's static input, output and grad buffers become free once its backward step has
    run (been captured), or its weight-gradient step where it has one; a later forward, in
    step order, whose ``signatures[flat_index]`` equals the freed graph's takes them over,
    oldest freed first (FIFO per signature).
    A graph that took over buffers passes them on again once its own backward has run,
    so the returned donor is the *immediate* previous holder; see
    :func:`resolve_buffer_owners` for the graph that first allocated them.

    The contract for users: a graphed callable's output is then valid only until its
    backward runs; after that a later forward may overwrite it in place.

    ``signatures``: any hashable per flat graph index describing its static inputs and
    outputs, e.g. a tuple of (shape, dtype, layout) per tensor.
    Returns ``{flat_index: donor flat_index or None}`` for every graph in ``steps``.

    Differs from TE on purpose: TE keeps one FIFO for all graphs (it assumes every layer
    has the same shapes) and frees a chunk's layers in ascending layer order when the
    chunk's backward starts; here the queue is per signature and graphs are freed in the
    order their backward steps run (last layer first).
    """
    free: Dict[Hashable, Deque[int]] = defaultdict(deque)
    donors: Dict[int, Optional[int]] = {}
    released: Set[int] = set()
    # A graph with a weight-gradient pass frees its buffers only after it: that pass reads
    # the input and the output grad the backward saw.
    split = {step.flat_index for step in steps if step.kind == WGRAD}
    for position, step in enumerate(steps):
        key = _signature(signatures, step.flat_index)
        if step.kind == FORWARD:
            if step.flat_index in donors:
                raise ValueError(
                    f"steps[{position}] runs the forward of graph {step.flat_index} twice; "
                    f"pass each graph's forward once (use plan_schedule(...).steps)."
                )
            queue = free[key]
            donors[step.flat_index] = queue.popleft() if queue else None
        elif step.kind == BACKWARD:
            if step.flat_index not in donors or step.flat_index in released:
                raise ValueError(f"steps[{position}] runs a backward of graph {step.flat_index} "
                                 f"without a pending forward of it; use plan_schedule(...).steps.")
            released.add(step.flat_index)
            if step.flat_index not in split:
                free[key].append(step.flat_index)
        elif step.kind == WGRAD:
            if step.flat_index not in released:
                raise ValueError(f"steps[{position}] runs the weight-gradient pass of graph "
                                 f"{step.flat_index} before its backward; use plan_schedule(...).steps.")
            free[key].append(step.flat_index)
        else:
            raise ValueError(
                f"steps[{position}].kind is {step.kind!r}; expected {FORWARD!r}, {BACKWARD!r} or {WGRAD!r}."
            )
    return dict(sorted(donors.items()))


def resolve_buffer_owners(donors: Mapping[int, Optional[int]]) -> Dict[int, int]:
    """Map each graph to the graph that first allocated the buffers it uses.

    Follows donor chains (``a <- b <- c``); a graph without a donor owns its buffers.
    """
    owners: Dict[int, int] = {}
    for flat in donors:
        current, seen = flat, {flat}
        while donors.get(current) is not None:
            current = donors[current]  # type: ignore[assignment]
            if current in seen:
                raise ValueError(f"donor chain of graph {flat} loops back to graph {current}.")
            seen.add(current)
        owners[flat] = current
    return owners


def _signature(
    signatures: Union[Sequence[Hashable], Mapping[int, Hashable]], flat: int
) -> Hashable:
    """Signature of graph ``flat``, with a clear error when it is missing."""
    try:
        return signatures[flat]
    except (IndexError, KeyError):
        raise ValueError(
            f"no signature for graph {flat}; pass one signature per flat graph index "
            f"({len(signatures)} given)."
        ) from None

