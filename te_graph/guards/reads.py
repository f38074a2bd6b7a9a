"""What a forward reads, learnt while warmup runs it: the guards check exactly that at each
call (``frozen``), instead of a hand-picked list.

* **Module attributes.** During the first warmup pass each module of the callable runs as
  an instance of a recording subclass of its own class, whose ``__getattribute__`` notes the
  names read from the instance ``__dict__`` (an activation function, a dtype, an enum, a
  submodule, a flag) and those resolved on the class (``forward``, methods, class
  constants), whose shadowing by a new instance attribute (a patched ``forward``) the
  per-call check then sees. The class is put back when the pass ends.
* **Torch functions** the forward calls (a ``TorchFunctionMode``): which process-wide
  settings it consults (scaled-dot-product attention reads the SDPA backend flags).

Modules an integration checks itself (``Extension.keeps_own_state``) and TorchScript
modules (their attributes are C++ properties) are not recorded: their Python attributes
stay out of the fingerprint.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode

from .. import compat
from ..compat import MODULE_INTERNALS
from ..extension import SEAM

__all__ = ["ForwardReads", "reads_recorded", "SDPA"]

SDPA = "sdpa"  # the forward calls scaled-dot-product attention: the SDPA backend flags are read
_SDPA_FUNCTIONS = frozenset({"scaled_dot_product_attention", "_native_multi_head_attention",
                             "_transformer_encoder_layer_fwd"})


@dataclass
class ForwardReads:
    """What the forwards of one callable read, filled while ``reads_recorded`` runs."""

    attributes: dict = field(default_factory=dict)  # id(module) -> names read from its __dict__
    class_names: dict = field(default_factory=dict)  # id(module) -> names read from its class
    consults: set = field(default_factory=set)  # process-wide settings read (``SDPA``)
    recorded: set = field(default_factory=set)  # ids of the modules whose reads were recorded


_RECORDING: dict[type, type] = {}  # class -> its recording subclass


def _recording_class(cls: type, reads: Callable[[], ForwardReads]) -> type:
    """A subclass of ``cls`` that notes each attribute read into ``reads()``."""
    found = _RECORDING.get(cls)
    if found is not None:
        return found

    def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807 - the hook itself
        record = reads()
        if record is not None and not name.startswith("__"):
            own = object.__getattribute__(self, "__dict__")
            table = record.attributes if name in own else record.class_names
            table.setdefault(id(self), set()).add(name)
        return super(recording, self).__getattribute__(name)

    recording = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                            "__qualname__": cls.__qualname__})
    _RECORDING[cls] = recording
    return recording


_CURRENT: list = [None]  # the ForwardReads being filled (recording classes are shared)


class _Functions(TorchFunctionMode):
    """Notes the torch functions a forward calls that consult process-wide settings."""

    def __init__(self, reads: ForwardReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", None) in _SDPA_FUNCTIONS:
            self.reads.consults.add(SDPA)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def reads_recorded(modules: Sequence[torch.nn.Module], reads: ForwardReads) -> Iterator[None]:
    """Inside: attribute reads of ``modules`` and their submodules, and the settings-reading
    functions called, go into ``reads``; every class is put back on exit."""
    swapped: list[tuple[torch.nn.Module, type]] = []
    seen: set[int] = set()
    for module in modules:
        for sub in module.modules():
            if id(sub) in seen or isinstance(sub, torch.jit.ScriptModule) or SEAM.keeps_own_state(sub):
                continue
            seen.add(id(sub))
            cls = type(sub)
            try:
                sub.__class__ = _recording_class(cls, lambda: _CURRENT[0])
            except TypeError:  # a class that cannot be subclassed or swapped: its reads stay unknown
                continue
            swapped.append((sub, cls))
            reads.recorded.add(id(sub))
    previous, _CURRENT[0] = _CURRENT[0], reads
    try:
        with compat.compiled_code_run_eagerly(), _Functions(reads):
            yield
    finally:
        _CURRENT[0] = previous
        for sub, cls in swapped:
            sub.__class__ = cls


def watched_names(reads: ForwardReads, module: torch.nn.Module, runtime: frozenset) -> tuple[str, ...]:
    """The instance attributes of ``module`` the per-call check compares: the ones its
    forward read, less nn.Module's bookkeeping and the forward's own per-call state."""
    names = reads.attributes.get(id(module), ())
    return tuple(sorted(n for n in names if n not in MODULE_INTERNALS and n != "training"
                        and (id(module), n) not in runtime and n in module.__dict__))
