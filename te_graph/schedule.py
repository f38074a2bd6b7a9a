"""Pure schedule planning for per-layer CUDA graph capture (no CUDA, no torch).

Two planners live here, both plain Python so CPU tests cover them:

* :func:`plan_schedule` turns Transformer Engine's ``_order`` / ``_num_layers_per_chunk``
  description of a (possibly interleaved) pipeline schedule into the list of graphs to
  build and the sequence in which their forwards and backwards run. Warmup and capture
  both follow that sequence, so the shared memory pool sees allocations in the same order
  as training replays them.
* :func:`plan_buffer_reuse` decides, for ``reuse_graph_input_output_buffers``, which
  earlier graph's static buffers a forward can take over.

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

import math
import numbers
import operator
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import (
    Deque, Dict, Hashable, List, Literal, Mapping, Optional, Sequence, Set, Tuple, Union,
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
    "plan_buffer_reuse",
    "resolve_buffer_owners",
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
    _check_count("num_callables", num_callables, minimum=1)
    _check_count("num_sample_args", num_sample_args, minimum=0)
    if order is None:
        return _plan_without_order(num_callables, num_sample_args, num_layers_per_chunk)
    entries = _as_order_entries(order)
    integers = [c for c in entries if isinstance(c, int)]
    num_chunks, num_microbatches = _validate_order(integers)
    if len(integers) < len(entries):
        _check_wgrad_entries(entries, num_chunks, num_microbatches, num_layers_per_chunk)
    layers = _resolve_layers_per_chunk(num_layers_per_chunk, num_chunks, num_callables)
    _check_sample_count(num_sample_args, num_microbatches, layers)
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
        layers = _as_layer_list(num_layers_per_chunk, 1)
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


# A weight-gradient entry: chunk c's is -c - 0.5, kept as this marker with its chunk.
@dataclass(frozen=True)
class _Wgrad:
    chunk: int  # 1-based


def _as_order_entries(order: Sequence[object]) -> List[Union[int, _Wgrad]]:
    """Ints, and TE's weight-gradient entries ``-c - 0.5`` (floats equal to ints count as
    ints, as in TE)."""
    entries: List[Union[int, _Wgrad]] = []
    for position, value in enumerate(order):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or isinstance(value, numbers.Integral):
            entries.append(_as_int(value, "order"))  # refuses bools and non-numbers
            continue
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"order[{position}] = {value!r}: entries are chunk ids (ints) or -c-0.5.")
        if number.is_integer():
            entries.append(int(number))
            continue
        if number > 0:
            raise ValueError(
                f"order[{position}] = {value!r}: only backward entries split; the weight-"
                f"gradient pass of chunk c is -c-0.5 (after its backward -c). Forwards are "
                f"positive ints."
            )
        if number - math.floor(number) != 0.5:
            raise ValueError(
                f"order[{position}] = {value!r}: the weight-gradient pass of chunk c is "
                f"-c-0.5 (0.5 below its backward -c, as in TE), got {value!r}."
            )
        chunk = -math.ceil(number)
        if chunk < 1:
            raise ValueError(
                f"order[{position}] = {value!r}: chunk ids are 1-based, so the weight-"
                f"gradient passes are -1.5, -2.5, ...; {value!r} names no chunk."
            )
        entries.append(_Wgrad(chunk))
    return entries


def _check_wgrad_entries(entries: List[Union[int, _Wgrad]], num_chunks: int, num_microbatches: int,
                         num_layers_per_chunk: Optional[Union[int, Sequence[int]]]) -> None:
    """TE's rules for a wgrad-split order: one layer per chunk, each -c-0.5 after a
    backward of chunk c still waiting for it, and every backward of such a chunk gets one."""
    if num_layers_per_chunk is None:
        raise ValueError(
            "order holds weight-gradient entries (-c-0.5), which need num_layers_per_chunk "
            "(TE's _num_layers_per_chunk) with one layer per chunk; pass it."
        )
    layers = _as_layer_list(num_layers_per_chunk, num_chunks)
    if any(n != 1 for n in layers):
        raise ValueError(
            f"order holds weight-gradient entries (-c-0.5), so each chunk must hold exactly one "
            f"layer (as in TE), but num_layers_per_chunk={list(layers)}. Make each layer its "
            f"own chunk."
        )
    waiting: Dict[int, int] = defaultdict(int)
    passes: Dict[int, int] = defaultdict(int)
    for position, entry in enumerate(entries):
        if isinstance(entry, _Wgrad):
            if entry.chunk > num_chunks:
                raise ValueError(
                    f"order[{position}] = {-entry.chunk - 0.5}: chunk {entry.chunk} does not "
                    f"exist (the order has {num_chunks} chunk(s))."
                )
            if waiting[entry.chunk] == 0:
                raise ValueError(
                    f"order[{position}] = {-entry.chunk - 0.5} runs the weight-gradient pass of "
                    f"chunk {entry.chunk} before a backward of it (-{entry.chunk}) that waits "
                    f"for one; put it after that backward."
                )
            waiting[entry.chunk] -= 1
            passes[entry.chunk] += 1
        elif entry < 0:
            waiting[-entry] += 1
    for chunk in range(1, num_chunks + 1):
        if passes[chunk] not in (0, num_microbatches):
            raise ValueError(
                f"order runs chunk {chunk}'s backward {num_microbatches} time(s) but its "
                f"weight-gradient pass (-{chunk}.5) {passes[chunk]} time(s); give every backward "
                f"of a chunk with delayed weight gradients its own -{chunk}.5 entry."
            )


def _validate_order(order: List[int]) -> Tuple[int, int]:
    """Check ``order`` is a complete, causal schedule; return (chunks, microbatches)."""
    if not order:
        raise ValueError(
            "order is empty; pass at least one forward and one backward, e.g. [1, -1]."
        )
    if 0 in order:
        raise ValueError(
            f"order contains chunk id 0 at position {order.index(0)}; chunk ids are 1-based "
            f"(+c = forward of chunk c, -c = its backward). Add 1 to 0-based chunk ids."
        )
    num_chunks = max(abs(c) for c in order)
    if max(order) != num_chunks:
        raise ValueError(
            f"order has a backward of chunk {num_chunks} (-{num_chunks}) but no forward of it; "
            f"every chunk id c in 1..max needs both +c and -c entries."
        )
    if len(order) % (2 * num_chunks) != 0:
        raise ValueError(
            f"order has {len(order)} entries, not a multiple of 2 * num_chunks = "
            f"{2 * num_chunks} (num_chunks = max(order) = {num_chunks}); each chunk needs one "
            f"forward and one backward per microbatch. Add the missing entries."
        )
    num_microbatches = len(order) // (2 * num_chunks)
    _check_chunk_counts(order, num_chunks, num_microbatches)
    _check_causal(order)
    return num_chunks, num_microbatches


def _check_chunk_counts(order: List[int], num_chunks: int, num_microbatches: int) -> None:
    """Every chunk must run exactly ``num_microbatches`` forwards and backwards."""
    missing = [c for c in range(1, num_chunks + 1) if c not in order and -c not in order]
    if missing:
        raise ValueError(
            f"order never mentions chunk(s) {missing}; chunk ids must cover 1..{num_chunks} "
            f"(num_chunks = max(order)). Renumber the chunks to 1..N without gaps."
        )
    for c in range(1, num_chunks + 1):
        fwd, bwd = order.count(c), order.count(-c)
        if fwd != num_microbatches or bwd != num_microbatches:
            raise ValueError(
                f"order runs chunk {c} forward {fwd} time(s) and backward {bwd} time(s), but "
                f"{len(order)} entries over {num_chunks} chunk(s) mean {num_microbatches} "
                f"microbatch(es): each chunk needs exactly {num_microbatches} forwards (+{c}) "
                f"and {num_microbatches} backwards (-{c}). Balance the order."
            )


def _check_causal(order: List[int]) -> None:
    """A chunk's backward for a microbatch must come after that microbatch's forward."""
    outstanding: Dict[int, int] = defaultdict(int)
    for position, c in enumerate(order):
        if c > 0:
            outstanding[c] += 1
        elif outstanding[-c] == 0:
            raise ValueError(
                f"order[{position}] = {c} runs a backward of chunk {-c} before any pending "
                f"forward of it (more backwards than forwards so far); move the forward "
                f"+{-c} earlier or this backward later."
            )
        else:
            outstanding[-c] -= 1


def _resolve_layers_per_chunk(
    num_layers_per_chunk: Optional[Union[int, Sequence[int]]],
    num_chunks: int,
    num_callables: int,
) -> Tuple[int, ...]:
    """Layers in each chunk: given (int or list) or an even split of the callables."""
    if num_layers_per_chunk is None:
        if num_callables % num_chunks != 0:
            raise ValueError(
                f"{num_callables} callables cannot be split evenly over {num_chunks} chunk(s) "
                f"(num_chunks = max(order)); pass num_layers_per_chunk=[...] with one count "
                f"per chunk."
            )
        return (num_callables // num_chunks,) * num_chunks
    layers = _as_layer_list(num_layers_per_chunk, num_chunks)
    if len(layers) != num_chunks:
        raise ValueError(
            f"num_layers_per_chunk has {len(layers)} entries but order has {num_chunks} "
            f"chunk(s) (max(order)); give one layer count per chunk, or a single int."
        )
    if sum(layers) != num_callables:
        raise ValueError(
            f"num_layers_per_chunk={list(layers)} sums to {sum(layers)} layers but "
            f"{num_callables} callables were passed; the callables are the layers of all "
            f"chunks in chunk order, so the counts must add up to the number of callables."
        )
    return layers


def _as_layer_list(value: Union[int, Sequence[int]], num_chunks: int) -> Tuple[int, ...]:
    """Normalise ``num_layers_per_chunk`` (int for all chunks, or a list) to a tuple."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        layers = tuple(_as_int_list(value, "num_layers_per_chunk"))
    else:
        layers = (_as_int(value, "num_layers_per_chunk"),) * num_chunks
    if any(n < 0 for n in layers):
        raise ValueError(
            f"num_layers_per_chunk={list(layers)} has a negative count; use counts >= 0."
        )
    return layers


def _check_sample_count(
    num_sample_args: int, num_microbatches: int, layers: Tuple[int, ...]
) -> None:
    """One sample args tuple per (layer, microbatch)."""
    expected = num_microbatches * sum(layers)
    if num_sample_args != expected:
        raise ValueError(
            f"Got {num_sample_args} sample_args but the order needs {expected} = "
            f"{num_microbatches} microbatch(es) x {sum(layers)} layer(s); pass one sample args "
            f"tuple per (layer, microbatch), laid out by chunk, then microbatch, then layer."
        )


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
    order: List[Union[int, _Wgrad]], layers: Tuple[int, ...], num_microbatches: int
) -> Tuple[Step, ...]:
    """Expand chunk-level ``order`` into per-layer forward/backward/weight-gradient steps."""
    prefix = _prefix_sums(layers)
    next_fwd = [0] * len(layers)
    next_bwd = [0] * len(layers)
    next_wgrad = [0] * len(layers)
    steps: List[Step] = []
    for c in order:
        if isinstance(c, _Wgrad):  # one layer per chunk (checked): the oldest waiting microbatch
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


# ------------------------------------------------------------------------ buffer reuse


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


# ----------------------------------------------------------------------- small checks


def _as_int(value: object, name: str) -> int:
    """``operator.index`` (accepts numpy ints), refusing bools and floats."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must hold ints, got the bool {value!r}.")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must hold ints, got {value!r} ({type(value).__name__}).") from None


def _as_int_list(values: Sequence[object], name: str) -> List[int]:
    """Validate and convert a sequence of ints."""
    return [_as_int(v, name) for v in values]


def _check_count(name: str, value: int, minimum: int) -> None:
    """Counts passed in by the engine must be ints >= minimum."""
    if _as_int(value, name) < minimum:
        raise ValueError(f"{name} is {value}; it must be at least {minimum}.")
