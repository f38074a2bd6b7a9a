"""Parameters during warmup and capture: stand-ins, and the check that nothing else trains.

Warmup and capture run each callable's backward with ``torch.autograd.backward`` (reentrant
checkpoint refuses ``torch.autograd.grad``), which accumulates into every leaf it reaches
and runs that leaf's hooks. On the real parameters this would fire user hooks, DDP's
reducer and Megatron's grad-accumulation hooks during warmup, and *capture* them into the
backward graph. So while warmup and capture run, each trainable parameter of the graphed
modules is replaced, in its module, by a stand-in: a new leaf ``Parameter`` on the same
storage (the graphs read the real parameter's memory by address) that carries the same
Python attributes (Megatron's ``main_grad`` and flags; a Transformer Engine FP8 weight's
whole attribute dict, shared) and no hooks. Autograd accumulates
into the stand-ins; the real parameters get their gradients at replay, in the graph or
through autograd, where their hooks run once per backward as in eager code.

A callable that trains a tensor the graph cannot see (a leaf requiring grad that is neither
a static input nor a parameter of a graphed module, e.g. a weight a function closes over)
would get its gradient accumulated into whatever ``.grad`` it had at capture, forever:
:class:`ForeignLeaves` finds such tensors in the first warmup pass and the capture refuses.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterable, Iterator, Optional, Sequence

import torch

from .. import compat
from ..extension import SEAM
from ..layout import describe

__all__ = ["StandIns", "ForeignLeaves"]


class StandIns:
    """Stand-ins for the trainable parameters of ``modules`` (shared parameters share one)."""

    def __init__(self, modules: Iterable[torch.nn.Module], only: Optional[Sequence[torch.Tensor]] = None,
                 share_attributes: bool = False):
        """``only``: stand in for these parameters alone (default: every trainable one).
        ``share_attributes``: every stand-in shares its parameter's attribute dict, so what a
        kernel sets on the weight it ran on (Transformer Engine's ``grad_added_to_main_grad``)
        is the parameter's (eager replay's stand-ins; warmup's keep copies, whose
        ``main_grad`` they swap for scratch)."""
        modules = list(modules)
        self._modules = modules
        wanted = None if only is None else {id(p) for p in only}
        self.of: dict[int, torch.nn.Parameter] = {}  # id(real parameter) -> stand-in
        self.real: dict[int, torch.Tensor] = {}  # id(stand-in) -> real parameter
        self._slots: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
        seen_modules: set[int] = set()
        for module in modules:
            for sub in module.modules():
                if id(sub) in seen_modules:
                    continue
                seen_modules.add(id(sub))
                for name, p in compat.parameter_slots(sub).items():
                    if p is None or not p.requires_grad or (wanted is not None and id(p) not in wanted):
                        continue
                    if id(p) not in self.of:
                        stand_in = _stand_in(p)
                        if share_attributes or SEAM.is_quantized_parameter(p):
                            # A TE quantized weight keeps its state in Python attributes
                            # that its ops reassign (the FP8 transpose, made at first use,
                            # and its valid flag): shared, so what warmup and capture make
                            # is the real parameter's, as in TE's own graphs.
                            stand_in.__dict__ = p.__dict__
                        else:
                            stand_in.__dict__.update(p.__dict__)
                        self.of[id(p)] = stand_in
                        self.real[id(stand_in)] = p
                    self._slots.append((sub, name, p))

    def __call__(self, params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The stand-ins of ``params`` (real parameters), in order (None where ``only``
        left one out)."""
        return tuple(self.of.get(id(p)) for p in params)

    @contextlib.contextmanager
    def scratch_main_grads(self) -> Iterator[None]:
        """Inside the block each stand-in's ``main_grad`` (Megatron's gradient buffer) is a
        scratch tensor of its shape and dtype, shared by the parameters alike, so that what
        warmup's kernels accumulate into it (Transformer Engine's fused weight-gradient GEMM,
        ``fuse_wgrad_accumulation=True``) leaves the real ``main_grad`` as it was. Capture runs
        outside the block: the captured kernels write the real one, at every replay."""
        scratch: dict[tuple, torch.Tensor] = {}
        swapped = []
        for stand_in in self.of.values():
            real = stand_in.__dict__.get("main_grad")
            if isinstance(real, torch.Tensor):
                key = (tuple(real.shape), real.dtype, real.device)
                if key not in scratch:
                    scratch[key] = torch.zeros(real.shape, dtype=real.dtype, device=real.device)
                stand_in.main_grad = scratch[key]
                swapped.append((stand_in, real))
        try:
            yield
        finally:
            for stand_in, real in swapped:
                stand_in.main_grad = real

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Inside the block the modules hold the stand-ins; the real parameters come back
        on exit, also when the block raises. What a module cached of its parameters (the
        fusers of Transformer Engine's te.ops.Sequential) is dropped on entry and on exit,
        so it is made again around the parameters the module holds then."""
        try:
            SEAM.forget_stand_in_caches(self._modules)
            for module, name, p in self._slots:
                compat.parameter_slots(module)[name] = self.of[id(p)]
            yield
        finally:
            for module, name, p in self._slots:
                compat.parameter_slots(module)[name] = p
            SEAM.forget_stand_in_caches(self._modules)


def _stand_in(p: torch.Tensor) -> torch.nn.Parameter:
    """A new leaf on ``p``'s memory, of ``p``'s class where that is a subclass of ``Parameter``
    (a forward may dispatch on it), made as ``Parameter`` makes itself, without the subclass's
    own constructor, whose arguments are its own: its attributes follow with the dict, its
    slots as copies."""
    data = p.detach()
    cls = type(p)
    if not (issubclass(cls, torch.nn.Parameter) and cls is not torch.nn.Parameter and type(data) is torch.Tensor):
        return torch.nn.Parameter(data, requires_grad=True)
    stand_in = torch.Tensor._make_subclass(cls, data, True)
    for klass in cls.__mro__:  # state in __slots__ is no part of the dict: copied
        slots = getattr(klass, "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(p, name):
                setattr(stand_in, name, getattr(p, name))
    return stand_in


# The backward nodes of reentrant checkpoints other than ours (torch.utils.checkpoint and
# Megatron-core's ``CheckpointFunction``; Transformer Engine's ``_CheckpointFunction``): they
# run their region under no_grad, so its leaves are not in the forward's autograd graph, and
# their recompute cannot report them (ours does, through ``checkpointing.capture_hook``).
OPAQUE_RECOMPUTE_NODES = frozenset({"CheckpointFunctionBackward", "_CheckpointFunctionBackward"})


class ForeignLeaves:
    """The leaves a graph's backward would accumulate into, other than ``allowed``; used
    around the first warmup forward and backward of one graph, and raising before any
    gradient reaches such a leaf.

    Exact: it walks the autograd graph of the forward's outputs (the leaves it reaches are
    those autograd accumulates into) and of each checkpointed region's recompute (reported by
    ``checkpointing`` before the region's backward runs), so tensors that only pass through a
    function under no_grad, the fake tensors of a ``torch.compile`` trace and views of
    parameters made inside an autograd Function are not counted. Where another library's
    reentrant checkpoint hides a region, every other leaf of the process has its ``.grad``
    set aside for the backward (a scan of the process's objects, paid only then): the leaves
    that get one are foreign, and every ``.grad`` is put back on exit.
    """

    def __init__(self, name: str, allowed: Iterable[torch.Tensor]):
        self.name = name
        self.allowed = {id(t) for t in allowed}
        self.found: dict[int, torch.Tensor] = {}
        self._set_aside: list[tuple[torch.Tensor, object]] = []

    def __enter__(self) -> "ForeignLeaves":
        return self

    def __exit__(self, *exc: object) -> None:
        for leaf, grad in self._set_aside:
            leaf.grad = grad
        self._set_aside = []

    def check_forward(self, outputs: Iterable[torch.Tensor]) -> None:
        """After the forward: raise for a foreign leaf its autograd graph reaches."""
        if self._walk(outputs, self.allowed):
            self._set_aside = [(leaf, leaf.grad) for leaf in _other_leaves(self.allowed)]
            for leaf, _ in self._set_aside:
                leaf.grad = None
        self._raise_if_any()

    def recomputed(self, outputs: Iterable[torch.Tensor], inputs: Iterable[torch.Tensor]) -> None:
        """A checkpointed region's recompute, before its backward: its inputs are fresh
        leaves whose grads it returns; anything else it reaches must be allowed."""
        differentiable = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        self._walk(differentiable, self.allowed | {id(t) for t in inputs})
        self._raise_if_any()

    def check_backward(self) -> None:
        """After the backward: where a hidden region was met, the leaves that got a grad."""
        for leaf, _ in self._set_aside:
            if leaf.grad is not None:
                self.found.setdefault(id(leaf), leaf)
        self._raise_if_any()

    def _walk(self, outputs: Iterable[torch.Tensor], allowed: set) -> bool:
        """Record the foreign leaves reached; True where a hidden region was met."""
        stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
        seen: set = set()
        opaque = False
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
            if variable is not None and id(variable) not in allowed:
                self.found.setdefault(id(variable), variable)
            opaque = opaque or type(node).__name__ in OPAQUE_RECOMPUTE_NODES
            stack.extend(next_node for next_node, _ in node.next_functions)
        return opaque

    def _raise_if_any(self) -> None:
        if not self.found:
            return
        what = "; ".join(describe(t) for t in list(self.found.values())[:3])
        raise ValueError(
            f"make_graphed_callables: {self.name} uses {len(self.found)} tensor(s) that require "
            f"grad but are neither its inputs nor parameters of a graphed module ({what}). The "
            "graph would accumulate their gradient into whatever .grad they had at capture. "
            "Pass such a tensor as an input, make it a parameter of the module you graph, or "
            "set requires_grad=False on it."
        )


def _other_leaves(allowed: set) -> list[torch.Tensor]:
    """Every leaf requiring grad in the process but ``allowed`` (a scan of gc's objects)."""
    return [
        obj for obj in gc.get_objects()
        # type(), not isinstance(): gc also holds weak proxies, whose referent may be gone
        if issubclass(type(obj), torch.Tensor) and not compat.is_fake(obj)
        and obj.requires_grad and obj.is_leaf and id(obj) not in allowed
    ]
