"""How a graphed callable's arguments map onto its static input tensors, and its static
output tensors back onto what it returns. Pure Python (no CUDA calls): CPU tests cover it.

The replay path calls ``InputLayout.flatten`` and ``OutputLayout.build`` on every call, so
both have a fast path for the common Megatron shape: positional tensors, keyword tensors
or constants, and a flat tuple (or single tensor) out.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from .records_tree import closed, opened, tensor_attribute

__all__ = ["InputLayout", "OutputLayout", "describe", "describe_value"]


def describe(t: torch.Tensor) -> str:
    """``shape/dtype/device`` of a tensor, for error messages."""
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def describe_value(value: Any) -> str:
    """A short description of an argument value for error messages (never a tensor dump)."""
    if isinstance(value, torch.Tensor):
        return f"a tensor ({describe(value)})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def same_constant(now: Any, then: Any) -> bool:
    """Whether a keyword constant equals the one baked into the graph, as the forward would
    see it: the same type (``1``, ``1.0`` and ``True`` are equal in Python, but give a
    tensor product another dtype) and an equal value, floats to the bit (``-0.0`` and
    ``0.0`` are equal, but ``copysign`` tells them apart; a NaN equals a NaN)."""
    if type(now) is not type(then) or isinstance(now, torch.Tensor):
        return False
    if isinstance(now, float):
        return now.hex() == then.hex()
    if type(now) in (tuple, list):
        return len(now) == len(then) and all(map(same_constant, now, then))
    if type(now) is dict:
        return now.keys() == then.keys() and all(same_constant(now[k], then[k]) for k in now)
    try:
        return bool(now == then)
    except Exception:  # noqa: BLE001 - a value without a plain equality: changed unless identical
        return False


def _structure(spec: Any) -> str:
    """A pytree structure drawn with ``*`` for each leaf: ``(*, [*, *])``."""
    return repr(pytree.tree_unflatten([_Leaf()] * spec.num_leaves, spec))


class _Leaf:
    def __repr__(self) -> str:
        return "*"


class InputLayout:
    """Positional args (pytrees of tensors) and keyword args (pytrees of tensors and
    constants: a tensor, ``None``, a flag, a tuple ``(cos, sin)``, a dict of tensors).

    The tensors, positional first then each keyword's tensor leaves in a fixed key order,
    are the graph's static inputs. Every non-tensor leaf of a keyword is part of the
    capture: at replay it must equal its capture-time value. A keyword the callable
    declares with a default of ``None`` may be left out of the call when it was ``None``
    at capture, or passed as ``None`` when it was left out: the call is then the captured
    one (Megatron passes every optional keyword, mostly ``None``; ``optional`` names them).
    """

    def __init__(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], optional: frozenset = frozenset()):
        self.name = name
        leaves, self.args_spec = pytree.tree_flatten(tuple(args))
        for index, leaf in enumerate(leaves):
            if leaf is not None and not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"make_graphed_callables: positional sample arg {index} of {name} is a "
                    f"{type(leaf).__name__}; positional sample args must be tensors or None (pytrees "
                    "of tensors). Pass constants as sample_kwargs instead."
                )
        # A positional None (Hugging Face's layers are called as layer(h, mask, None, ...)) is
        # baked in, as a keyword constant is: each call must pass None there.
        self.arg_nones = frozenset(i for i, leaf in enumerate(leaves) if leaf is None)
        self.num_arg_leaves = len(leaves)
        leaves = [leaf for leaf in leaves if leaf is not None]
        self.flat_args = not self.arg_nones and self.args_spec == pytree.tree_flatten(tuple(leaves))[1]
        self.num_args = len(leaves)
        self.kw_keys = tuple(kwargs)
        self.optional = frozenset(optional)
        # Per keyword: a tensor (fast path), a constant, or a nested value (its tree
        # structure and its constant leaves; its tensor leaves are static inputs).
        self.tensor_keys = tuple(k for k in self.kw_keys if isinstance(kwargs[k], torch.Tensor))
        self.constants: dict[str, Any] = {}
        self.nested: dict[str, tuple[Any, tuple]] = {}  # key -> (spec, leaves, _TENSOR for a tensor)
        kw_tensors: list[torch.Tensor] = []
        self._labels: list[str] = [f"positional input {i}" for i in range(self.num_arg_leaves) if i not in self.arg_nones]
        for key in self.kw_keys:
            value = kwargs[key]
            if isinstance(value, torch.Tensor):
                kw_tensors.append(value)
                self._labels.append(f"keyword argument {key!r}")
                continue
            value_leaves, spec = pytree.tree_flatten(value)
            if spec.is_leaf():  # a constant: None, a flag, a number, a string
                held = tensor_attribute(value)
                if held is not None:
                    raise TypeError(
                        f"make_graphed_callables: keyword argument {key!r} of {name} is a {type(value).__name__} "
                        f"holding tensors (its {held!r}), which is not a pytree: the graph would read those "
                        "tensors at their capture-time addresses at every call, whatever object the call "
                        "passes. Pass the tensors as keyword arguments of their own, or register the class "
                        "as a pytree node (torch.utils._pytree.register_pytree_node), so that its tensors "
                        "become the graph's inputs."
                    )
                self.constants[key] = value
                continue
            shape = tuple(_TENSOR if isinstance(v, torch.Tensor) else v for v in value_leaves)
            self.nested[key] = (spec, shape)
            for position, v in enumerate(value_leaves):
                if isinstance(v, torch.Tensor):
                    kw_tensors.append(v)
                    self._labels.append(f"keyword argument {key!r} (leaf {position} of {_structure(spec)})")
        self._kw_order = tuple(k for k in self.kw_keys if k not in self.constants)
        self.samples: tuple[torch.Tensor, ...] = tuple(leaves) + tuple(kw_tensors)
        self._meta = tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in self.samples)
        self._kw_set = frozenset(self.kw_keys)
        self._plain_kwargs = not self.nested

    def flatten(self, args: tuple, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
        """The call's tensors in static-input order, after checking they fit the capture."""
        tensors = self.gather(args, kwargs)
        self.check(tensors)
        return tensors

    def gather(self, args: tuple, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
        """The call's tensors in static-input order, after checking the argument structure,
        the keywords and the constants (not the tensors themselves: see ``check``)."""
        if self.flat_args and len(args) == self.num_args:
            tensors = list(args)
        else:
            leaves, spec = pytree.tree_flatten(tuple(args))
            if spec != self.args_spec:
                if self.flat_args and spec == pytree.tree_flatten(tuple(leaves))[1]:
                    got = f"{len(args)} positional argument(s)"
                    want = f"{self.num_args}"
                else:
                    got = f"positional arguments shaped {_structure(spec)}"
                    want = f"{_structure(self.args_spec)} (* = a tensor)"
                raise ValueError(
                    f"{self.name}: called with {got}, but the graph was captured with {want}; "
                    "pass positional arguments as in sample_args."
                )
            tensors = self._without_nones(leaves) if self.arg_nones else leaves
        if kwargs.keys() != self._kw_set:
            kwargs = self._as_captured(kwargs)
        for key, value in self.constants.items():
            now = kwargs[key]
            if now is not value and not same_constant(now, value):
                raise self._constant_changed(repr(key), now, value)
        if self._plain_kwargs:
            for key in self.tensor_keys:
                tensors.append(kwargs[key])
            return tensors
        for key in self._kw_order:
            value = kwargs[key]
            if key not in self.nested:
                tensors.append(value)
                continue
            spec, captured = self.nested[key]
            leaves, now_spec = pytree.tree_flatten(value)
            if now_spec != spec:
                raise ValueError(
                    f"{self.name}: keyword argument {key!r} is shaped {_structure(now_spec)} "
                    f"but was {_structure(spec)} at capture (* = a leaf); pass it in the "
                    "captured structure."
                )
            for position, (now, then) in enumerate(zip(leaves, captured)):
                if then is _TENSOR:  # checked with the other tensors (``check``)
                    tensors.append(now)
                elif now is not then and not same_constant(now, then):
                    raise self._constant_changed(f"{key!r} (leaf {position} of {_structure(spec)})", now, then)
        return tensors

    def _without_nones(self, leaves: list) -> list:
        """The call's positional tensors, where each positional None of the capture is None."""
        for index in sorted(self.arg_nones):
            if leaves[index] is not None:
                raise ValueError(
                    f"{self.name}: positional argument {index} is {describe_value(leaves[index])}, but was None "
                    "at capture; a graph bakes a None in. Pass None there, as in sample_args, or capture with "
                    "a tensor there."
                )
        return [leaf for index, leaf in enumerate(leaves) if index not in self.arg_nones]

    def _as_captured(self, kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
        """``kwargs`` with the keywords that differ from the capture's only by a ``None`` the
        callable defaults to dropped or added; anything else is refused."""
        extra = kwargs.keys() - self._kw_set
        missing = self._kw_set - kwargs.keys()
        droppable = {k for k in extra if kwargs[k] is None and k in self.optional}
        addable = {k for k in missing if k in self.optional and self.constants.get(k, _ABSENT) is None}
        if extra - droppable or missing - addable:
            hint = ""
            if extra - droppable:
                hint = (
                    f" Keywords left out at capture are accepted only as None where the "
                    f"callable defaults them to None; {sorted(extra - droppable)} are not."
                )
            if {"cuda_graph_stream", "cuda_graph_event"} & (extra - droppable):
                hint += (
                    " (megatron-core passes cuda_graph_stream and cuda_graph_event with its fine-grained "
                    "activation offloading, to replay the graphs on a stream of its own: te_graph does not "
                    "support that yet; offload no module inside the graphs' scopes, or turn "
                    "fine_grained_activation_offloading off.)"
                )
            raise ValueError(
                f"{self.name}: called with keyword arguments {sorted(kwargs)}, but the graph was "
                f"captured with {sorted(self.kw_keys)}; pass the same keywords as sample_kwargs."
                + hint
            )
        result = {k: v for k, v in kwargs.items() if k not in droppable}
        result.update(dict.fromkeys(addable))
        return result

    def _constant_changed(self, key: str, now: Any, value: Any) -> ValueError:
        return ValueError(
            f"{self.name}: keyword argument {key} is {describe_value(now)} but was "
            f"{describe_value(value)} at capture; non-tensor keyword arguments are baked "
            "into the graph. Pass the captured value, or pass this argument as a tensor "
            "(tensors are inputs the graph reads at every call)."
        )

    def check(self, tensors: Sequence[Any]) -> None:
        """Each tensor has the shape, dtype and device of its sample, and requires grad only
        where its sample did."""
        if len(tensors) != len(self._meta):
            self._raise_mismatch(tensors)
        for t, (shape, dtype, device, grad) in zip(tensors, self._meta):
            # One check per tensor on the hot path; the slow path says what differs.
            if not (
                isinstance(t, torch.Tensor) and t.shape == shape and t.dtype == dtype
                and t.device == device and (grad or not t.requires_grad)
            ):
                self._raise_mismatch(tensors)

    def _raise_mismatch(self, tensors: Sequence[Any]) -> None:
        for index, (t, (shape, dtype, device, grad)) in enumerate(zip(tensors, self._meta)):
            if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or t.device != device:
                raise self._mismatch(index, t)
            if t.requires_grad and not grad:
                raise ValueError(
                    f"{self.name}: {self.label(index)} requires grad, but its sample did not, so "
                    "the graph computes no gradient for it. Capture with a sample that requires "
                    "grad (the requires_grad of each sample must match the real inputs)."
                )
        raise ValueError(f"{self.name}: called with {len(tensors)} tensors, but the graph was captured with {len(self._meta)}.")

    def unflatten(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple, dict]:
        """Inverse of ``flatten``: call arguments built from static-input tensors."""
        positional = iter(tensors[: self.num_args])
        leaves = [None if i in self.arg_nones else next(positional) for i in range(self.num_arg_leaves)]
        args = pytree.tree_unflatten(leaves, self.args_spec)
        rest = iter(tensors[self.num_args:])
        kwargs: dict[str, Any] = {}
        for key in self.kw_keys:
            if key in self.constants:
                kwargs[key] = self.constants[key]
            elif key in self.nested:
                spec, captured = self.nested[key]
                kwargs[key] = pytree.tree_unflatten([next(rest) if c is _TENSOR else c for c in captured], spec)
            else:
                kwargs[key] = next(rest)
        return args, kwargs

    def label(self, index: int) -> str:
        """How error messages name static input ``index``."""
        return self._labels[index]

    def _mismatch(self, index: int, t: Any) -> ValueError:
        got = describe(t) if isinstance(t, torch.Tensor) else type(t).__name__
        return ValueError(
            f"{self.name}: {self.label(index)} has {got}, but the graph was captured with "
            f"{describe(self.samples[index])}. A graph replays fixed shapes: pass a matching "
            "tensor or capture a graph for this shape."
        )


_ABSENT = object()
_TENSOR = object()  # marks a tensor leaf among a nested keyword's captured leaves


class OutputLayout:
    """What the callable returned at capture: its tensors become static outputs. A
    dataclass instance holding tensors (an output record of the user's) is opened like a
    tuple, and handed out as a copy of the captured one with the call's tensors."""

    def __init__(self, name: str, outputs: Any):
        self.templates: dict = {}
        tree = opened(outputs, self.templates)
        self.records = tree is not outputs and bool(self.templates)
        outputs = tree if self.records else outputs
        leaves, self.spec = pytree.tree_flatten(outputs)
        if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise ValueError(
                f"make_graphed_callables: {name} returned {describe_value(outputs)}, which holds "
                "no tensor; a graphed callable must return a tensor, or a tuple, list or dict "
                "holding tensors (its results are the graph's static outputs)."
            )
        self.tensor_slots = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        self.leaves = list(leaves)
        self.single = isinstance(outputs, torch.Tensor)
        self.flat_tuple = isinstance(outputs, tuple) and self.spec == pytree.tree_flatten(tuple(leaves))[1]
        # A tensor returned in several places is one output (one autograd output, so the
        # gradients of all its uses are summed as eager sums them): ``picks`` gives, per
        # tensor slot, which of ``tensors`` fills it.
        first: dict[int, int] = {}
        self.picks = tuple(first.setdefault(id(leaves[i]), len(first)) for i in self.tensor_slots)
        unique = {id(leaves[i]): leaves[i] for i in self.tensor_slots}
        self.tensors: tuple[torch.Tensor, ...] = tuple(unique.values())
        self._plain = self.picks == tuple(range(len(self.tensor_slots)))
        self.devices = tuple(t.device for t in self.tensors)  # kept when the memory is not

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> "OutputLayout":
        """The same layout with ``tensors`` as its output tensors (a new object)."""
        leaves = list(self.leaves)
        for slot, pick in zip(self.tensor_slots, self.picks):
            leaves[slot] = tensors[pick]
        clone = object.__new__(OutputLayout)
        clone.__dict__.update(self.__dict__, leaves=leaves, tensors=tuple(tensors))
        return clone

    def without_memory(self) -> "OutputLayout":
        """The same layout with meta tensors (shape, strides, dtype, requires_grad) in place
        of the outputs: warmup's layout is kept until capture, and real tensors would pin
        their allocator segments past ``empty_cache()``."""
        def meta(t: torch.Tensor) -> torch.Tensor:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)

        return self.with_tensors([meta(t) for t in self.tensors])

    def tensors_of(self, outputs: Any) -> tuple[torch.Tensor, ...]:
        """The tensors of a later call's return value (same structure as at capture)."""
        leaves, spec = pytree.tree_flatten(opened(outputs, {}) if self.records else outputs)
        if spec != self.spec:
            raise ValueError(
                f"graphed callable returned structure {spec}, but {self.spec} at capture; a "
                "graphed callable must return the same structure every call."
            )
        if self._plain:
            return tuple(leaves[i] for i in self.tensor_slots)
        unique = {pick: leaves[slot] for slot, pick in zip(self.tensor_slots, self.picks)}
        return tuple(unique[i] for i in range(len(self.tensors)))

    def build(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The callable's return value with ``tensors`` in place of the captured ones."""
        if self.single:
            return tensors[0]
        leaves = list(self.leaves)
        if not self._plain:
            tensors = [tensors[pick] for pick in self.picks]
        for slot, t in zip(self.tensor_slots, tensors):
            leaves[slot] = t
        if self.flat_tuple:
            return tuple(leaves)
        built = pytree.tree_unflatten(leaves, self.spec)
        return closed(built, self.templates) if self.records else built
