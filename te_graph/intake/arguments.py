"""The arguments of ``make_graphed_callables`` in one shape: the call forms (torch's and
TE's), the sample sets (``sample_args``/``sample_kwargs`` and ``more_shapes``) and the
pool. Nothing here changes any state (the specs are ``specs``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from ..resources import graphed_callable_of
from .checks import check_sample_kwargs

__all__ = ["Samples", "call_form", "sample_sets", "pool_handle", "is_mempool"]


@dataclass(frozen=True)
class Samples:
    """One more shape to capture (``more_shapes=``): sample args laid out like
    ``sample_args``, and optionally sample kwargs laid out like ``sample_kwargs``."""

    args: Any
    kwargs: Any = None


def call_form(modules: Any, callables: Any, sample_args: Any, sample_kwargs: Any, pool: Any) -> tuple[Any, Any, Any]:
    """``(modules, sample_kwargs, pool)`` from any accepted call form: ``callables=``
    (torch's name) and torch's pool as the 5th positional argument."""
    if callables is not None:
        if modules is not None:
            raise TypeError("make_graphed_callables: got both modules and callables=; pass one of them.")
        modules = callables
    if modules is None or sample_args is None:
        raise TypeError("make_graphed_callables() needs the callables and their sample_args.")
    if sample_kwargs is not None and _looks_like_pool(sample_kwargs):
        # torch.cuda.make_graphed_callables takes the pool as its 5th positional argument.
        if pool is not None:
            raise TypeError("make_graphed_callables: got a pool positionally and pool=; pass one.")
        sample_kwargs, pool = None, sample_kwargs
    return modules, sample_kwargs, pool


def sample_sets(sample_args: Any, sample_kwargs: Any, more_shapes: Sequence[Any], single: bool, num_callables: int) -> list[tuple[tuple, tuple]]:
    """Per sample set (``sample_args`` first, then each ``more_shapes`` entry): a tuple of
    sample args per graph and a dict of sample kwargs per graph."""
    variants = [(sample_args, sample_kwargs)] + [_variant(v) for v in more_shapes]
    normalised = [_normalise_samples(a, k, single, num_callables) for a, k in variants]
    normalised = _same_keywords(normalised, [k is None for _, k in variants])
    for args, kwargs in normalised:
        if len(args) != len(normalised[0][0]):
            raise ValueError(
                f"make_graphed_callables: a more_shapes entry has {len(args)} sample args but "
                f"sample_args has {len(normalised[0][0])}; lay each entry out like sample_args."
            )
        check_sample_kwargs(args, kwargs)
    return normalised


def _variant(entry: Any) -> tuple[Any, Any]:
    return (entry.args, entry.kwargs) if isinstance(entry, Samples) else (entry, None)


def _normalise_samples(sample_args: Any, sample_kwargs: Any, single: bool, num_callables: int) -> tuple[tuple, tuple]:
    """Per graph, a tuple of sample args and a dict of sample kwargs."""
    if isinstance(sample_args, torch.Tensor) and not single:
        raise TypeError(
            f"make_graphed_callables: sample_args is a single tensor for {num_callables} "
            "callables; give a tuple with one tuple of sample tensors per callable, e.g. "
            "tuple((x,) for _ in modules)."
        )
    if single:
        sample_args = (sample_args,)
        sample_kwargs = (sample_kwargs,) if sample_kwargs is not None else None
    elif isinstance(sample_kwargs, Mapping):
        raise TypeError(
            "make_graphed_callables: sample_kwargs is one dict, but several callables were "
            "given; pass a tuple with one dict per callable (the same layout as sample_args)."
        )
    if not isinstance(sample_args, (tuple, list)):
        raise TypeError(
            f"make_graphed_callables: sample_args is a {type(sample_args).__name__}; give a "
            "tuple with one tuple of sample tensors per callable."
        )
    args = tuple(tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in sample_args)
    if sample_kwargs is None:
        return args, ({},) * len(args)
    if not isinstance(sample_kwargs, (tuple, list)):
        raise TypeError(
            f"make_graphed_callables: sample_kwargs is a {type(sample_kwargs).__name__}; give a "
            "tuple with one dict per callable."
        )
    for k in sample_kwargs:
        if k is not None and not (isinstance(k, Mapping) and all(isinstance(key, str) for key in k)):
            shown = repr(k) if len(repr(k)) <= 60 else repr(k)[:57] + "..."
            raise TypeError(
                f"make_graphed_callables: sample_kwargs holds {shown} ({type(k).__name__}); give a dict of "
                "keyword name -> sample per callable (one dict for one callable, a tuple of dicts for several)."
            )
    return args, tuple(dict(k or {}) for k in sample_kwargs)


def _same_keywords(normalised: list[tuple[tuple, tuple]], plain: list[bool]) -> list[tuple[tuple, tuple]]:
    """Every sample set has the keywords of ``sample_kwargs``: a ``more_shapes`` entry
    without kwargs takes them when they hold no tensor (tensors change shape with the
    sample set); keys and constants must match, since a call's keywords pick no graph."""
    base_args, base_kwargs = normalised[0]
    result = [normalised[0]]
    for number, ((args, kwargs), no_kwargs) in enumerate(zip(normalised[1:], plain[1:]), start=1):
        if no_kwargs and any(base_kwargs):
            if any(isinstance(leaf, torch.Tensor) for k in base_kwargs for leaf in pytree.tree_leaves(k)):
                raise ValueError(
                    f"make_graphed_callables: more_shapes entry {number - 1} has no sample kwargs, "
                    "but sample_kwargs holds tensors, whose shapes follow the sample set; give "
                    "that entry as te_graph.Samples(args, kwargs)."
                )
            kwargs = base_kwargs
        for slot, (mine, base) in enumerate(zip(kwargs, base_kwargs)):
            if mine.keys() != base.keys() or _constants_of(mine) != _constants_of(base):
                raise ValueError(
                    f"make_graphed_callables: the sample kwargs of more_shapes entry {number - 1} "
                    f"(graph {slot}) have keys {sorted(mine)} and constants {_constants_of(mine)}, but "
                    f"sample_kwargs has {sorted(base)} and {_constants_of(base)}; every shape must take "
                    "the same keywords and the same constant values (only tensor shapes may differ)."
                )
        result.append((args, kwargs))
    return result


def _constants_of(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The non-tensor part of sample kwargs: each keyword that is not a tensor, with the
    tensors inside it drawn as ``*`` (comparable with ``==``, printable in an error)."""
    return {
        key: pytree.tree_map(lambda leaf: _TensorLeaf() if isinstance(leaf, torch.Tensor) else leaf, value)
        for key, value in kwargs.items()
        if not isinstance(value, torch.Tensor)
    }


class _TensorLeaf:
    """A tensor's place in a nested keyword value, for comparing and printing the rest."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _TensorLeaf)

    def __repr__(self) -> str:
        return "*"


def _looks_like_pool(value: Any) -> bool:
    return (
        _is_handle(value)
        or is_mempool(value)
        or graphed_callable_of(value) is not None
    )


def _is_handle(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value)


def is_mempool(value: Any) -> bool:
    """Whether ``value`` is a ``torch.cuda.MemPool`` (torch >= 2.5; absent before)."""
    mempool = getattr(torch.cuda, "MemPool", None)
    return mempool is not None and isinstance(value, mempool)


def pool_handle(pool: Any, eager_replay: bool) -> Optional[tuple[int, int]]:
    """A capture pool handle from anything ``pool=`` accepts (None in eager replay)."""
    if pool is None or _is_handle(pool):
        return None if eager_replay else pool
    if is_mempool(pool):
        return None if eager_replay else pool.id
    graphed = graphed_callable_of(pool)
    if graphed is not None:
        if eager_replay:
            return None
        if graphed.pool is None:
            raise ValueError(
                "make_graphed_callables: pool= names a graphed callable made in eager replay, "
                "which has no memory pool; pass a graph_pool_handle() instead."
            )
        return graphed.pool
    raise TypeError(
        f"make_graphed_callables: pool is a {type(pool).__name__}; pass te_graph.graph_pool_handle(), "
        "a torch.cuda.MemPool, or a graphed callable whose pool to share."
    )


