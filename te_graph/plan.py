"""The capture plan: which static buffers graphs share, decided before anything is captured.

Pure (no CUDA calls), like ``schedule``: it reads tensor layouts only, so CPU tests cover
every decision. Two kinds of sharing:

* **Buffer reuse** (``reuse_graph_input_output_buffers`` under an ``order``): a forward that
  runs after an earlier graph's backward takes over that graph's static inputs and
  grad-output buffers when their layouts match (``schedule.plan_buffer_reuse``), and the
  earlier graph's outputs and input grads go back to the pool once its backward is captured.
* **Gradient chaining** (the plain schedule): in a stack, layer i's output is layer i+1's
  input, and the gradient autograd hands layer i's backward is the one layer i+1's backward
  just wrote. Layer i's backward graph reads it where it lies (layer i+1's input-grad
  buffer), which saves a copy and a buffer per layer. Replay keeps this exact: the buffer is
  handed on uncopied only to the graph it is lent to (``replay.GraphRunner``).

And the memory the graphs share through their one pool: a forward or backward captured
while another graph's backward had already run, or its forward not yet, may have been given
that graph's activation memory. Each plan names what the other graphs may hold when its
forward and its backward replay (``activations_at_*``, ``queued_at_*``: bitmasks over the
graphs' indices): what they held at that capture. Replay refuses any other order
(``replay.ReplayOrder``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .schedule import BACKWARD, FORWARD, WGRAD, Step, plan_buffer_reuse

__all__ = ["TensorMeta", "GraphLayout", "GraphPlan", "plan_capture"]


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


@dataclass(frozen=True)
class GraphPlan:
    """How one graph shares buffers with others."""

    donor: Optional[int] = None  # graph whose static inputs and grad-output buffers it takes over
    grad_output_from: Optional[int] = None  # graph whose input-grad buffer is its grad output
    lends_grad_buffer: bool = False  # its input-grad buffer is another graph's grad output
    releases_buffers: bool = False  # outputs and input grads go back to the pool after its backward
    # What the other graphs held when its forward, and its backward, were captured (bit i:
    # graph i): activations (from a forward to its backward; for good where the backward
    # keeps the autograd graph) and what a backward queued for its weight-gradient pass
    # (to backward_dw()). At replay, a graph may hold only what it held then.
    activations_at_forward: int = 0
    activations_at_backward: int = 0
    queued_at_forward: int = 0
    queued_at_backward: int = 0


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
