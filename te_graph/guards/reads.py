"""What a forward reads, learnt while warmup runs it: the guards check exactly that at each
call (``frozen``), instead of a hand-picked list.

* **Module attributes.** During the first warmup pass each module of the callable runs as
  an instance of a recording subclass of its own class, whose ``__getattribute__`` notes the
  names read from the instance ``__dict__`` (an activation function, a dtype, an enum, a
  submodule, a flag) and those resolved on the class (``forward``, methods, class
  constants), whose shadowing by a new instance attribute (a patched ``forward``) the
  per-call check then sees. The class is put back when the pass ends.
* **Plain objects** the modules hold (a Hugging Face style ``config``, a namespace of
  options): recorded as the modules are, so the names the forward reads of them are known.
* **Module globals** the forward's own code reads (a flag, a dict of options): every
  Python function the pass runs outside torch, te_graph and the integrations' frameworks
  is noted (``sys.setprofile``), and the plain values among the global names its code
  uses are watched (``outside``). What the pass itself changes is the forward's own
  per-call state and is left out.
* **Torch functions** the forward calls (a ``TorchFunctionMode``): which process-wide
  settings it consults (scaled-dot-product attention reads the SDPA backend flags).

Modules an integration checks itself (``Extension.keeps_own_state``) and TorchScript
modules (their attributes are C++ properties) are not recorded: their Python attributes
stay out of the fingerprint.
"""
from __future__ import annotations

import contextlib
import enum
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode

from .. import compat
from ..compat import MODULE_INTERNALS
from ..extension import SEAM

__all__ = ["ForwardReads", "reads_recorded", "SDPA", "plain_value", "kept", "object_attribute"]

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
    objects: dict = field(default_factory=dict)  # id -> a plain object the modules hold, its reads recorded
    # (id of the globals or of the class, name) -> (table, name, what): plain values the
    # forward's code read outside the modules' own attributes (module globals, class attributes)
    globals: dict = field(default_factory=dict)
    changed: set = field(default_factory=set)  # (id(table), name) the pass itself changed: per-call state
    # (id(table), name) -> (table, name, what, value before the pass, value after it): the
    # plain values outside the modules the pass changed, put back when warmup ends (``put_back``)
    touched: dict = field(default_factory=dict)

    def check_per_call(self, owner: str) -> None:
        """After warmup: a value outside the modules that the later passes changed again is
        per-call state a graph cannot replay, refused as a module attribute's would be."""
        for table, name, what, _, first in self.touched.values():
            now = table.get(name, _GONE)
            if now != first:
                raise ValueError(
                    f"make_graphed_callables: the forward of {owner} changes {what} at every call ({first!r} after "
                    f"the first warmup pass, {now!r} after the last); a graph replays GPU work only, so at replay "
                    "it would keep its value. Keep such state in a tensor updated in place, or change it outside "
                    "the graphed forward."
                )

    def put_back(self) -> None:
        """What the passes changed outside the modules, as it was (warmup leaves the user's
        state as it found it)."""
        for table, name, _, before, _ in self.touched.values():
            table[name] = before


_SCALARS = frozenset({bool, int, float, complex, str, bytes, type(None), torch.dtype})
_CONTAINERS = (dict, list, tuple, set, frozenset)


def _scalar(value: Any) -> bool:
    return type(value) in _SCALARS or isinstance(value, enum.Enum)


def plain_value(value: Any) -> bool:
    """Whether the per-call check can compare ``value`` with ``==``: a scalar (a flag, a
    number, a string, a dtype, an enum member) or a small container of scalars."""
    if _scalar(value):
        return True
    if type(value) in _CONTAINERS and len(value) <= 64:
        items = value.items() if type(value) is dict else ((v, None) for v in value)
        return all(_scalar(k) and _scalar(v) for k, v in items)
    return False


def kept(value: Any) -> Any:
    """What the check compares a plain value with later: a copy of a mutable container (the
    object itself would always equal itself)."""
    return type(value)(value) if type(value) in (dict, list, set) else value


def object_attribute(obj: Any, name: str) -> str:
    """How messages name attribute ``name`` of a plain object the forward reads."""
    return f"attribute {name!r} of the {type(obj).__name__} object it reads"


def _plain_object(value: Any) -> bool:
    """An object of a Python class with a ``__dict__`` of its own (a config, a dataclass of
    options, a namespace): not a module, tensor, class, enum member or callable, and not of
    torch, of a framework an integration serves (``Extension.packages``) or of the standard
    library's machinery."""
    if callable(value) or isinstance(value, (torch.nn.Module, torch.Tensor, enum.Enum, type(sys))):
        return False
    package = type(value).__module__.partition(".")[0]
    if package in getattr(sys, "stdlib_module_names", ()) and package not in _NAMESPACES:
        return False  # a logger, a thread: the process's machinery, not options
    return hasattr(value, "__dict__") and package not in _FRAMEWORKS and package not in SEAM.packages()


_NAMESPACES = frozenset({"types", "argparse"})  # the standard library's holders of options


_FRAMEWORKS = frozenset({"torch", "te_graph", "rng", "checkpointing"})


def _excluded_packages() -> frozenset:
    """Packages whose code and objects keep their own state: torch, te_graph's, the Python
    standard library and the frameworks the integrations serve (``Extension.packages``)."""
    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    return _FRAMEWORKS | frozenset(("numpy", "_pytest", "pytest", "pluggy")) | stdlib | SEAM.packages()


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
    swapped: list[tuple[Any, type]] = []
    seen: set[int] = set()
    excluded = _excluded_packages()
    objects: list[Any] = []
    for module in modules:
        for sub in module.modules():
            if id(sub) in seen or isinstance(sub, torch.jit.ScriptModule) or SEAM.keeps_own_state(sub):
                continue
            seen.add(id(sub))
            if _swap(sub, swapped):
                reads.recorded.add(id(sub))
                objects.extend(v for v in sub.__dict__.values() if id(v) not in seen and _plain_object(v))
    for obj in objects:  # grows while walked: plain objects held by plain objects (a config's sub-config)
        if id(obj) not in seen and len(seen) < _MOST_OBJECTS:
            seen.add(id(obj))
            objects.extend(v for v in vars(obj).values() if id(v) not in seen and _plain_object(v))
            before = {k: kept(v) for k, v in vars(obj).items() if plain_value(v)}
            reads.objects[id(obj)] = (obj, before)
            if not _swap(obj, swapped) and type(obj) is types.SimpleNamespace:
                # Its C type takes no recording subclass, and it holds options only: all count.
                reads.attributes.setdefault(id(obj), set()).update(before)
    profiler = sys.getprofile()
    # A profiler set from C (cProfile and others on Python < 3.12) is no Python callable:
    # it can be neither called from ours nor put back with sys.setprofile, so it is left
    # running, and the globals the forward reads go unlearnt (with a warning).
    chained = profiler is None or callable(profiler)
    if not chained:
        warnings.warn(_PROFILER_ACTIVE.format(name=type(profiler).__name__), stacklevel=4)
    noted = _GlobalsNoted(reads, excluded, profiler)
    previous, _CURRENT[0] = _CURRENT[0], reads
    try:
        if chained:
            sys.setprofile(noted)
        with compat.compiled_code_run_eagerly(), _Functions(reads):
            yield
    finally:
        if chained:
            sys.setprofile(profiler)
        _CURRENT[0] = previous
        for sub, cls in swapped:
            object.__setattr__(sub, "__class__", cls)
        noted.close()
        for sub, cls in swapped:
            if isinstance(sub, torch.nn.Module):
                _class_values(reads, sub, cls)
        for obj, before in reads.objects.values():
            for name, value in vars(obj).items():
                if name in before and before[name] != value:
                    reads.changed.add((id(vars(obj)), name))
                    reads.touched.setdefault((id(vars(obj)), name), (
                        vars(obj), name, object_attribute(obj, name), before[name], kept(value)))


_MOST_OBJECTS = 10_000  # modules and plain objects walked, at most
_PROFILER_ACTIVE = (
    "te_graph: a profiler ({name}) is running while graphing: the module globals the forward reads "
    "are not learnt, so a change to one after graphing goes unseen. Graph outside the profiler "
    "(profile the training steps after it) for the full guards."
)


def _class_values(reads: ForwardReads, module: torch.nn.Module, cls: type) -> None:
    """The plain class attributes the forward read through the instance (``self.scale`` set
    on the class), watched where the class that defines them holds them."""
    for name in reads.class_names.get(id(module), ()):
        owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
        if owner is None or owner.__module__.partition(".")[0] in _FRAMEWORKS | SEAM.packages():
            continue
        if plain_value(owner.__dict__[name]):
            reads.globals.setdefault((id(owner), name), (owner.__dict__, name,
                                                         f"class attribute {owner.__name__}.{name}"))


def _swap(obj: Any, swapped: list) -> bool:
    """Make ``obj`` an instance of its class's recording subclass (its reads noted)."""
    cls = type(obj)
    try:
        object.__setattr__(obj, "__class__", _recording_class(cls, lambda: _CURRENT[0]))
    except Exception:  # a class that cannot be subclassed (a metaclass refuses) or swapped: its reads stay unknown
        return False
    swapped.append((obj, cls))
    return True


class _GlobalsNoted:
    """A ``sys.setprofile`` function: for each Python function run for the first time, the
    plain values among the global names its code uses (outside the excluded packages)."""

    def __init__(self, reads: ForwardReads, excluded: frozenset, profiler: Any):
        self.reads, self.excluded, self.profiler = reads, excluded, profiler  # profiler: the user's, still called
        self.codes: set = set()
        self.before: dict = {}  # (id(globals), name) -> the value when first noted

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.profiler is not None:
            self.profiler(frame, event, arg)
        if event != "call" or frame.f_code in self.codes:
            return
        code = frame.f_code
        self.codes.add(code)
        table = frame.f_globals
        module = table.get("__name__") or ""
        if module.partition(".")[0] in self.excluded:
            return
        for name in code.co_names:
            if name in table and (id(table), name) not in self.before and plain_value(table[name]):
                self.before[(id(table), name)] = kept(table[name])
                self.reads.globals[(id(table), name)] = (table, name, f"global {name!r} of module {module}")

    def close(self) -> None:
        """Note the globals the pass changed (the forward's own per-call state)."""
        for key, value in self.before.items():
            table, name, what = self.reads.globals[key]
            if table.get(name, _GONE) != value:
                self.reads.changed.add(key)
                self.reads.touched.setdefault(key, (table, name, what, value, kept(table.get(name, _GONE))))


_GONE = object()


def watched_names(reads: ForwardReads, module: torch.nn.Module, runtime: frozenset) -> tuple[str, ...]:
    """The instance attributes of ``module`` the per-call check compares: the ones its
    forward read, less nn.Module's bookkeeping and the forward's own per-call state."""
    names = reads.attributes.get(id(module), ())
    return tuple(sorted(n for n in names if n not in MODULE_INTERNALS and n != "training"
                        and (id(module), n) not in runtime and n in module.__dict__))
