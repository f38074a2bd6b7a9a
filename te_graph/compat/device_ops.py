"""Watching a forward's device ops: which draw random numbers, and which write tensors their
schema does not mark (part of ``compat``)."""
from __future__ import annotations

from typing import Any

import torch

# ``TorchDispatchMode`` (``torch.utils._python_dispatch``, private, torch >= 1.13; torch's own
# FlopCounterMode and checkpoint's selective recompute build on it; imported in compat) sees every
# device op a forward dispatches; ops tagged ``nondeterministic_seeded`` (``torch.Tag``,
# torch >= 2.0) draw random numbers.

_SEEDED = getattr(getattr(torch, "Tag", None), "nondeterministic_seeded", None)


# torch 2.4-2.13: the batch-norm ops update running_mean and running_var in place without
# saying so in their schema (no ``(a!)``; pytorch/pytorch#73050, #65563), where training=True.
_BATCH_NORM_WRITES = frozenset({"aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm"})


def written_tensors(op: Any, args: tuple, kwargs: dict) -> list:
    """The tensors ``op`` updates in place: the arguments its schema marks as written (``out=``
    keywords and tensor lists, ``_foreach_*_``, included) and those it does not mark."""
    found = []
    for index, argument in enumerate(op._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        found += [t for t in (value if isinstance(value, (list, tuple)) else (value,)) if isinstance(t, torch.Tensor)]
    return found + list(unannotated_writes(op, args))


def is_view(op: Any) -> bool:
    """Whether ``op`` returns a view of an argument (it reads no element)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


def unannotated_writes(op: Any, args: tuple) -> tuple:
    """The tensors ``op`` updates in place that its schema does not mark as written."""
    if op._schema.name in _BATCH_NORM_WRITES and len(args) > 5 and args[5] is True:
        return tuple(t for t in args[3:5] if isinstance(t, torch.Tensor))
    return ()


def draws_random(op: Any) -> bool:
    """Whether the aten overload ``op`` draws random numbers."""
    return _SEEDED is not None and _SEEDED in getattr(op, "tags", ())
