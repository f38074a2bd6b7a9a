"""Pure schedule planning for per-layer CUDA graph capture (no CUDA, no torch).

Plain Python, so CPU tests cover it.

* :func:`plan_schedule` turns Transformer Engine's ``_order`` / ``_num_layers_per_chunk``
  description of a (possibly interleaved) pipeline schedule into the list of graphs to
  build and the sequence in which their forwards and backwards run. Warmup and capture
  both follow that sequence, so the shared memory pool sees allocations in the same order
  as training replays them.
* ``planning.buffers`` decides from it which static buffers graphs share.

Layout (the same as TE's, so callers written for TE index results unchanged):

* ``callables`` are grouped by model chunk: chunk 0's layers, then chunk 1's, ...
* ``sample_args`` (and the returned graphed callables) are grouped by chunk, then
  microbatch, then layer::

      flat_index = prefix_layers[chunk] * num_microbatches
                   + microbatch * layers_per_chunk[chunk] + layer

* ``order`` lists 1-based chunk ids; ``c > 0`` runs the forward of chunk ``c`` for its
  next microbatch (all of its layers, first to last), ``c < 0`` the backward of chunk
  ``-c`` for its next microbatch (its layers last to first). Backwards of a chunk take
  microbatches in the same order as its forwards did.
* ``-c - 0.5`` (TE's wgrad-split schedule) runs the weight-gradient pass of chunk ``c``
  (``backward_dw()``) for the oldest microbatch whose backward ran without it. As in TE,
  such an order needs ``num_layers_per_chunk`` with one layer per chunk. Without an order,
  a graph whose modules delay their weight gradients gets that pass after every backward
  (:func:`with_wgrad_passes_last`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import (
    List,
    Literal,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

from .order import (
    Wgrad,
    as_layer_list,
    as_order_entries,
    check_count,
    check_sample_count,
    check_wgrad_entries,
    resolve_layers_per_chunk,
    validate_order,
)

__all__ = [
    "FORWARD",
    "BACKWARD",
    "WGRAD",
    "with_wgrad_passes_last",
    "GraphSlot",
    "Step",
    "Schedule",
    "plan_schedule",
]

StepKind = Literal["forward", "backward", "wgrad"]
FORWARD: StepKind = "forward"
BACKWARD: StepKind = "backward"
WGRAD: StepKind = "wgrad"  # the weight-gradient pass a backward left out (backward_dw())


@dataclass(frozen=True)
class GraphSlot:
    """One graph to build: a (layer, microbatch) pair, at ``flat_index`` in the results."""

    flat_index: int
    callable_index: int
    chunk: int  # 0-based model chunk
    microbatch: int
    layer: int  # 0-based position of the layer inside its chunk


@dataclass(frozen=True)
class Step:
    """Run (warm up, capture) the forward, the backward or the weight-gradient pass of
    graph ``flat_index``."""

    kind: StepKind
    flat_index: int


@dataclass(frozen=True)
class Schedule:
    """What to capture and in which sequence.

    ``graphs[i].flat_index == i``; ``steps`` holds every graph's forward once and its
    backward once, each backward after its forward, and, where the order splits weight
    gradients out, its weight-gradient pass once, after its backward.
    """

    num_chunks: int
    num_microbatches: int
    layers_per_chunk: Tuple[int, ...]
    graphs: Tuple[GraphSlot, ...]
    steps: Tuple[Step, ...]
    has_order: bool  # TE returns plain functions (not modules) when an order was given

    @property
    def num_graphs(self) -> int:
        """Number of graphs (= expected number of sample args = results returned)."""
        return len(self.graphs)

    @property
    def chunk_prefix(self) -> Tuple[int, ...]:
        """Index of each chunk's first callable; one more entry holding the total."""
        return _prefix_sums(self.layers_per_chunk)

    def flat_index(self, chunk: int, microbatch: int, layer: int) -> int:
        """Flat index of (0-based chunk, microbatch, layer), TE's sample_args layout."""
        return _flat_index(self.chunk_prefix, self.layers_per_chunk, self.num_microbatches,
                           chunk, microbatch, layer)


# --------------------------------------------------------------------------- planning


def plan_schedule(
    num_callables: int,
    num_sample_args: int,
    order: Optional[Sequence[int]] = None,
    num_layers_per_chunk: Optional[Union[int, Sequence[int]]] = None,
) -> Schedule:
    """Plan graphs and run sequence from TE's ``_order`` / ``_num_layers_per_chunk``.

    Without ``order``: one microbatch, one graph per callable, forwards ``0..N-1`` then
    backwards ``N-1..0`` (what ``torch.cuda.make_graphed_callables`` does).
    With ``order``: ``num_chunks = max(order)``, ``num_microbatches =
    len(order) // (2 * num_chunks)``, one graph per (layer, microbatch).
    ``num_layers_per_chunk`` may be one int for every chunk or a list (uneven allowed);
    when omitted, the callables are split evenly over the chunks.

    Raises ValueError (TypeError for non-int entries) naming the mismatch and the fix.
    """
    check_count("num_callables", num_callables, minimum=1)
    check_count("num_sample_args", num_sample_args, minimum=0)
    if order is None:
        return _plan_without_order(num_callables, num_sample_args, num_layers_per_chunk)
    entries = as_order_entries(order)
    integers = [c for c in entries if isinstance(c, int)]
    num_chunks, num_microbatches = validate_order(integers)
    if len(integers) < len(entries):
        check_wgrad_entries(entries, num_chunks, num_microbatches, num_layers_per_chunk)
    layers = resolve_layers_per_chunk(num_layers_per_chunk, num_chunks, num_callables)
    check_sample_count(num_sample_args, num_microbatches, layers)
    graphs = _graph_slots(layers, num_microbatches)
    steps = _steps_from_order(entries, layers, num_microbatches)
    return Schedule(num_chunks, num_microbatches, layers, graphs, steps, has_order=True)


def with_wgrad_passes_last(steps: Sequence[Step], graphs: Set[int]) -> Tuple[Step, ...]:
    """``steps`` and then the weight-gradient pass of each graph in ``graphs``, in the order
    their backwards ran: captured after every backward, the passes may replay in any order
    once their own backward has (TE captures each right after its backward instead)."""
    passes = [Step(WGRAD, s.flat_index) for s in steps if s.kind == BACKWARD and s.flat_index in graphs]
    return tuple(steps) + tuple(passes)


def _plan_without_order(
    num_callables: int,
    num_sample_args: int,
    num_layers_per_chunk: Optional[Union[int, Sequence[int]]],
) -> Schedule:
    """torch's plain form: one chunk, one microbatch, all forwards then all backwards."""
    if num_sample_args != num_callables:
        raise ValueError(
            f"Got {num_callables} callables but {num_sample_args} sample_args; without an "
            f"order each callable takes exactly one sample args tuple. Pass one per callable, "
            f"or pass order=... (TE's _order) for several microbatches per callable."
        )
    if num_layers_per_chunk is not None:
        # TE ignores it here; accept only a value that agrees with the one-chunk layout.
        layers = as_layer_list(num_layers_per_chunk, 1)
        if list(layers) != [num_callables]:
            raise ValueError(
                f"num_layers_per_chunk={num_layers_per_chunk!r} was given without an order; "
                f"without an order all {num_callables} callables form one chunk. Pass "
                f"order=... as well, or drop num_layers_per_chunk."
            )
    layers = (num_callables,)
    graphs = _graph_slots(layers, 1)
    steps = tuple(Step(FORWARD, i) for i in range(num_callables)) + tuple(
        Step(BACKWARD, i) for i in reversed(range(num_callables))
    )
    return Schedule(1, 1, layers, graphs, steps, has_order=False)


# ----------------------------------------------------------------------- layout helpers


def _prefix_sums(counts: Sequence[int]) -> Tuple[int, ...]:
    """(0, c0, c0+c1, ...): start of each chunk's callables, then the total."""
    out = [0]
    for n in counts:
        out.append(out[-1] + n)
    return tuple(out)


def _flat_index(prefix: Sequence[int], layers: Sequence[int], num_microbatches: int,
                chunk: int, microbatch: int, layer: int) -> int:
    """TE's sample_args index of (chunk, microbatch, layer)."""
    return prefix[chunk] * num_microbatches + microbatch * layers[chunk] + layer


def _graph_slots(layers: Tuple[int, ...], num_microbatches: int) -> Tuple[GraphSlot, ...]:
    """All graphs in flat order (chunk, then microbatch, then layer)."""
    prefix = _prefix_sums(layers)
    slots = []
    for chunk, n in enumerate(layers):
        for mb in range(num_microbatches):
            for layer in range(n):
                flat = _flat_index(prefix, layers, num_microbatches, chunk, mb, layer)
                assert flat == len(slots)
                slots.append(GraphSlot(flat, prefix[chunk] + layer, chunk, mb, layer))
    return tuple(slots)


def _steps_from_order(
    order: List[Union[int, Wgrad]], layers: Tuple[int, ...], num_microbatches: int
) -> Tuple[Step, ...]:
    """Expand chunk-level ``order`` into per-layer forward/backward/weight-gradient steps."""
    prefix = _prefix_sums(layers)
    next_fwd = [0] * len(layers)
    next_bwd = [0] * len(layers)
    next_wgrad = [0] * len(layers)
    steps: List[Step] = []
    for c in order:
        if isinstance(c, Wgrad):  # one layer per chunk (checked): the oldest waiting microbatch
            chunk = c.chunk - 1
            mb, next_wgrad[chunk] = next_wgrad[chunk], next_wgrad[chunk] + 1
            steps.append(Step(WGRAD, _flat_index(prefix, layers, num_microbatches, chunk, mb, 0)))
            continue
        chunk = abs(c) - 1
        if c > 0:
            mb, next_fwd[chunk] = next_fwd[chunk], next_fwd[chunk] + 1
            layer_seq = range(layers[chunk])
        else:
            mb, next_bwd[chunk] = next_bwd[chunk], next_bwd[chunk] + 1
            layer_seq = reversed(range(layers[chunk]))
        kind = FORWARD if c > 0 else BACKWARD
        for layer in layer_seq:
            flat = _flat_index(prefix, layers, num_microbatches, chunk, mb, layer)
            steps.append(Step(kind, flat))
    return tuple(steps)


