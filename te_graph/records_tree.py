"""What pytree does not open, opened: dataclass instances holding tensors (an output record
of the user's; megatron-core's ``PackedSeqParams`` among keyword arguments)."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["tensor_attribute", "is_record", "opened", "closed", "tensor_leaves", "Record"]


class Record:
    """A dataclass instance holding tensors (which pytree does not open) as a pytree node:
    its fields are children, its class and field names the context."""

    __slots__ = ("kind", "names", "values")

    def __init__(self, kind: tuple, values: list):
        self.kind, self.values = kind, values


def is_record(value: Any) -> bool:
    return tensor_attribute(value) is not None


def opened(outputs: Any, templates: dict) -> Any:
    """``outputs`` with each dataclass instance holding tensors as a ``Record`` (its first
    instance of each kind kept in ``templates``, to rebuild the others from)."""
    def open_(value: Any) -> Any:
        if not is_record(value):
            return value
        names = tuple(f.name for f in dataclasses.fields(value))
        kind = (type(value), names)
        templates.setdefault(kind, value)
        return Record(kind, [opened(getattr(value, n), templates) for n in names])

    return pytree.tree_map(open_, outputs, is_leaf=is_record)


def closed(tree: Any, templates: dict) -> Any:
    """The inverse of ``_opened``: each ``Record`` back as a copy of its template with the
    record's field values."""
    def close(value: Any) -> Any:
        if not isinstance(value, Record):
            return value
        record = copy.copy(templates[value.kind])
        for name, field_value in zip(value.kind[1], value.values):
            object.__setattr__(record, name, closed(field_value, templates))
        return record

    return pytree.tree_map(close, tree, is_leaf=lambda v: isinstance(v, Record))


def tensor_leaves(outputs: Any) -> list[torch.Tensor]:
    """The tensors of a return value, dataclass records opened (``OutputLayout``)."""
    return [leaf for leaf in pytree.tree_leaves(opened(outputs, {})) if isinstance(leaf, torch.Tensor)]


def tensor_attribute(value: Any) -> Any:
    """The name of a field of ``value``, a dataclass instance pytree does not open (a record
    of sequence metadata: megatron-core's ``PackedSeqParams``), that holds a tensor, directly
    or in a pytree; else None. Other objects are left alone: a module passed along is model
    state, read by address like the callable's own parameters, and framework objects keep
    tensors of their own that no forward reads as data (a ``DeviceMesh``'s rank map)."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return None
    for field in dataclasses.fields(value):
        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(getattr(value, field.name, None))):
            return field.name
    return None



pytree.register_pytree_node(
    Record, lambda r: (list(r.values), r.kind), lambda values, kind: Record(kind, list(values)))
