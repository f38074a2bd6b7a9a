"""The small pieces the per-call check (``frozen``) is made of: a slot of a module's tables,
a TorchScript module's attributes read as a table, and how two values compare there."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["Slot", "ScriptAttributes", "GONE", "equal_is_identity", "same_memory", "qualified"]


class Slot:
    """An entry of a module's ``__dict__``, ``_parameters``, ``_buffers`` or ``_modules``."""

    __slots__ = ("table", "key", "what")

    def __init__(self, table: dict, key: str, what: str):
        self.table, self.key, self.what = table, key, what


class ScriptAttributes:
    """A TorchScript module's attributes as a table: they live in its C++ object, not in
    its ``__dict__`` (its ``training`` flag, for one), so they are read through ``getattr``."""

    __slots__ = ("module",)

    def __init__(self, module: torch.jit.ScriptModule):
        self.module = module

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self.module, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self.module, key, default)


GONE = object()


def equal_is_identity(value: Any) -> bool:
    """Whether ``value == other`` can only hold for ``other is value``, or raise: an object
    with object's ==, or a tensor of several elements (a one-element tensor's == would
    compare its value)."""
    if isinstance(value, torch.Tensor):
        return value.numel() > 1 and type(value) in (torch.Tensor, torch.nn.Parameter)
    return type(value).__eq__ is object.__eq__


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` lies where ``b`` does, laid out alike (what a graph reads of it)."""
    return (a.data_ptr(), a.shape, a.stride(), a.dtype, a.device) == (b.data_ptr(), b.shape, b.stride(), b.dtype,
                                                                         b.device)


def qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
