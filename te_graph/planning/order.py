"""Transformer Engine's ``_order`` and ``_num_layers_per_chunk``, read and checked: every
mistake is a clear error naming the fix, before anything is planned (plain Python)."""
from __future__ import annotations

import math
import numbers
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

__all__ = ["Wgrad", "as_order_entries", "check_wgrad_entries", "validate_order", "resolve_layers_per_chunk",
           "as_layer_list", "check_sample_count", "check_count"]


# A weight-gradient entry: chunk c's is -c - 0.5, kept as this marker with its chunk.
@dataclass(frozen=True)
class Wgrad:
    chunk: int  # 1-based


def as_order_entries(order: Sequence[object]) -> List[Union[int, Wgrad]]:
    """Ints, and TE's weight-gradient entries ``-c - 0.5`` (floats equal to ints count as
    ints, as in TE)."""
    entries: List[Union[int, Wgrad]] = []
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
        entries.append(Wgrad(chunk))
    return entries


def check_wgrad_entries(entries: List[Union[int, Wgrad]], num_chunks: int, num_microbatches: int,
                         num_layers_per_chunk: Optional[Union[int, Sequence[int]]]) -> None:
    """TE's rules for a wgrad-split order: one layer per chunk, each -c-0.5 after a
    backward of chunk c still waiting for it, and every backward of such a chunk gets one."""
    if num_layers_per_chunk is None:
        raise ValueError(
            "order holds weight-gradient entries (-c-0.5), which need num_layers_per_chunk "
            "(TE's _num_layers_per_chunk) with one layer per chunk; pass it."
        )
    layers = as_layer_list(num_layers_per_chunk, num_chunks)
    if any(n != 1 for n in layers):
        raise ValueError(
            f"order holds weight-gradient entries (-c-0.5), so each chunk must hold exactly one "
            f"layer (as in TE), but num_layers_per_chunk={list(layers)}. Make each layer its "
            f"own chunk."
        )
    waiting: Dict[int, int] = defaultdict(int)
    passes: Dict[int, int] = defaultdict(int)
    for position, entry in enumerate(entries):
        if isinstance(entry, Wgrad):
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


def validate_order(order: List[int]) -> Tuple[int, int]:
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


def resolve_layers_per_chunk(
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
    layers = as_layer_list(num_layers_per_chunk, num_chunks)
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


def as_layer_list(value: Union[int, Sequence[int]], num_chunks: int) -> Tuple[int, ...]:
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


def check_sample_count(
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


def check_count(name: str, value: int, minimum: int) -> None:
    """Counts passed in by the engine must be ints >= minimum."""
    if _as_int(value, name) < minimum:
        raise ValueError(f"{name} is {value}; it must be at least {minimum}.")

