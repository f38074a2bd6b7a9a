"""The differential harness of the tests: graphs on = graphs off, bit for bit, or a clear refusal.

* Modes: a setup trains ``EAGER`` (the reference), ``EAGER_REPLAY`` (te_graph's wrapper
  without graphs, ``eager_replay=True``; CPU and GPU) or ``GRAPHS`` (CUDA graphs; GPU only).
  ``DEVICE_MODES`` parametrizes ``(device, eager_replay)`` with one graphed mode per device,
  ``ALL_DEVICE_MODES`` with every graphed mode of every device.
* ``Trace``: what a training run lets a user observe: outputs, input grads, parameter grads
  at every step, weights after the optimizer steps, module buffers, what hooks saw and how
  often they ran, ``main_grad``s, and the FP8 meta of Transformer Engine's modules.
* ``assert_same``: two traces (or any nesting of lists, tuples, dicts and tensors) bitwise
  equal, ``torch.equal`` after dtype, shape, device and layout, naming the first difference
  and its largest absolute difference; ``difference`` says the same without asserting.
* ``refused``: a call raises exactly the named exception class with the named message, and
  what it was handed (parameters, their grads and main_grads, buffers, the modules'
  forwards) and the random streams are as they were before it (``Snapshot``).
* Rows: each test module keeps its setups as data, one ``Row`` each, run in the modes of a
  device (``params``, ``differential``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import pytest
import torch
from torch import nn

import rng

EAGER, EAGER_REPLAY, GRAPHS = "eager", "eager-replay", "graphs"
MODES = (EAGER, EAGER_REPLAY, GRAPHS)
# The graphed modes each device runs, compared with EAGER in this order.
GRAPHED = {"cpu": (EAGER_REPLAY,), "cuda": (GRAPHS, EAGER_REPLAY)}
# (device, eager_replay) of the tests that run one graphed mode per device.
DEVICE_MODES = [
    pytest.param("cpu", True, id="eager-replay-cpu"),
    pytest.param("cuda", False, id="graphs", marks=pytest.mark.gpu),
]
# (device, eager_replay) of the tests that run every graphed mode of every device (GRAPHED).
ALL_DEVICE_MODES = DEVICE_MODES + [
    pytest.param("cuda", True, id="eager-replay-cuda", marks=pytest.mark.gpu),
]


def eager_replay(mode: str) -> bool:
    """``make_graphed_callables``'s ``eager_replay`` for a graphed mode."""
    if mode not in (EAGER_REPLAY, GRAPHS):
        raise ValueError(f"mode {mode!r} is not graphed; use {EAGER_REPLAY!r} or {GRAPHS!r}")
    return mode == EAGER_REPLAY


# -- the trace of a run ----------------------------------------------------------------------------
@dataclass
class Trace:
    """Everything a training run lets a user observe. Each field holds what its rows record
    (a list in record order, or a dict by name); ``assert_same`` compares every field."""

    outputs: Any = field(default_factory=list)
    input_grads: Any = field(default_factory=list)
    param_grads: Any = field(default_factory=list)  # per optimizer step, every parameter's .grad (None kept)
    weights: Any = field(default_factory=list)  # after the optimizer steps
    buffers: Any = field(default_factory=list)
    hook_grads: Any = field(default_factory=dict)  # per hook, what it saw, call by call
    hook_calls: Any = field(default_factory=dict)  # per hook kind, how often it ran
    main_grads: Any = field(default_factory=list)
    activation_grads: Any = field(default_factory=list)  # what hooks on activations saw
    updated_inputs: Any = field(default_factory=list)  # inputs the layers update in place
    fp8_meta: Any = field(default_factory=list)  # Transformer Engine's amax histories and scales

    def microbatch(self, output: torch.Tensor, input_: Optional[torch.Tensor] = None) -> None:
        """A microbatch's output and its input's grad, copied now (a graph's output buffer is
        written again by its next replay)."""
        self.outputs.append(output.detach().clone())
        if input_ is not None:
            self.input_grads.append(None if input_.grad is None else input_.grad.clone())

    def step(self, params: Iterable[torch.Tensor]) -> None:
        """Every parameter's .grad before an optimizer step (None where it has none)."""
        self.param_grads.append([None if p.grad is None else p.grad.clone() for p in params])

    def end(self, params: Iterable[torch.Tensor], modules: Iterable[nn.Module] = ()) -> None:
        """After the last step: the weights, the modules' buffers and every ``main_grad``."""
        params = list(params)
        self.weights = [p.detach().clone() for p in params]
        self.buffers = [b.clone() for module in modules for b in module.buffers()]
        self.main_grads = [p.main_grad.clone() for p in params if hasattr(p, "main_grad")]


# -- one comparison --------------------------------------------------------------------------------
def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        layout = "" if value.layout == torch.strided else f" {str(value.layout).removeprefix('torch.')}"
        return f"tensor{tuple(value.shape)} {value.dtype}{layout}"
    return repr(value)


def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _tensors_equal(got: torch.Tensor, want: torch.Tensor, nan_equal: bool) -> bool:
    if torch.equal(got, want):
        return True
    return nan_equal and got.is_floating_point() and bool(((got == want) | (got.isnan() & want.isnan())).all())


def difference(got: Any, want: Any, path: str = "", *, nan_equal: bool = False,
               reference: str = "eager") -> Optional[str]:
    """None where ``got`` equals ``want`` bitwise, else what differs first: traces field by
    field, dicts key by key, lists and tuples entry by entry (their lengths too), tensors by
    dtype, shape, device, layout and ``torch.equal`` (sparse ones by their dense values, meta
    ones, which hold no values, by the rest; NaN equal to NaN with ``nan_equal``), None only
    against None, anything else by ``==``. ``reference`` names ``want`` in the message."""
    if isinstance(got, Trace) or isinstance(want, Trace):
        if type(got) is not type(want):
            return f"{path}: {_show(got)}, {reference} {_show(want)}"
        for f in dataclasses.fields(want):
            found = difference(getattr(got, f.name), getattr(want, f.name), _join(path, f.name),
                               nan_equal=nan_equal, reference=reference)
            if found:
                return found
        return None
    if isinstance(want, dict) and isinstance(got, dict):
        if got.keys() != want.keys():
            return f"{path}: keys {list(got)}, {reference} {list(want)}"
        for key in want:
            found = difference(got[key], want[key], _join(path, key), nan_equal=nan_equal, reference=reference)
            if found:
                return found
        return None
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(got) != len(want):
            return f"{path}: {len(got)} entries, {reference} has {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            found = difference(a, b, _join(path, i), nan_equal=nan_equal, reference=reference)
            if found:
                return found
        return None
    if isinstance(got, torch.Tensor) or isinstance(want, torch.Tensor):
        if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
            return f"{path}: {_show(got)}, {reference} {_show(want)}"
        if (got.dtype, got.shape, got.device, got.layout) != (want.dtype, want.shape, want.device, want.layout):
            return f"{path}: {_show(got)} on {got.device}, {reference} {_show(want)} on {want.device}"
        if got.is_meta:
            return None
        if got.layout != torch.strided:
            got, want = got.to_dense(), want.to_dense()
        if _tensors_equal(got, want, nan_equal):
            return None
        try:
            diff = (got.double() - want.double()).abs().nan_to_num(float("inf")).max().item() if got.numel() else 0.0
            nans = int(got.isnan().sum()), int(want.isnan().sum())
        except (RuntimeError, TypeError, NotImplementedError):  # a tensor subclass without these ops
            return f"{path} differs"
        return (f"{path} differs (max abs diff {diff:.3g}"
                + (f", NaNs {nans[0]}, {reference} {nans[1]})" if any(nans) else ")"))
    if got == want:
        return None
    return f"{path}: {_show(got)}, {reference} {_show(want)}"


def assert_same(got: Any, want: Any, what: str = "", **options: Any) -> None:
    """``got`` equals ``want`` bitwise (see ``difference``)."""
    found = difference(got, want, **options)
    assert found is None, f"{what}: {found}" if what else found


def differential(run: Callable[[str], Any], modes: Iterable[str], what: str = "") -> Any:
    """``run(mode)`` in each graphed mode, bitwise against ``run(EAGER)``; returns eager's."""
    want = run(EAGER)
    for mode in modes:
        assert_same(run(mode), want, f"{what}{', ' if what else ''}{mode}")
    return want


# -- one definition of a refusal -------------------------------------------------------------------
class _Same:
    """An object compared by identity (a parameter, a buffer, a forward set on a module)."""

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    def __repr__(self) -> str:
        return "None" if self.value is None else f"the {type(self.value).__name__} at {id(self.value):#x}"


MODULE_ATTRIBUTES = ("forward", "backward_dw", "reset")  # what graphing sets on a module


def _state(things: tuple, random: bool) -> dict:
    state: dict = {}

    def tensor(name: str, t: Optional[torch.Tensor]) -> None:
        state[f"{name} (the object)"] = _Same(t)
        if isinstance(t, nn.parameter.UninitializedTensorMixin):  # a lazy module's: no values yet (made
            state[name] = "uninitialized"  # later, it is a Parameter with values: a difference)
            return
        state[name] = None if t is None else t.detach().clone()

    for i, thing in enumerate(things):
        prefix = f"{i}: " if len(things) > 1 else ""
        if isinstance(thing, nn.Module):
            for name, module in thing.named_modules(remove_duplicate=False):
                for attribute in MODULE_ATTRIBUTES:
                    state[f"{prefix}{attribute} of {name or 'the module'}"] = _Same(module.__dict__.get(attribute))
            named = [(f"parameter {name}", p) for name, p in thing.named_parameters(remove_duplicate=False)]
            for name, b in thing.named_buffers(remove_duplicate=False):
                tensor(f"{prefix}buffer {name}", b)
        elif isinstance(thing, torch.Tensor):
            named = [("tensor", thing)]
        else:
            raise TypeError(f"a snapshot takes modules and tensors, not {type(thing).__name__}")
        for name, p in named:
            tensor(f"{prefix}{name}", p)
            tensor(f"{prefix}grad of {name}", p.grad)
            if hasattr(p, "main_grad"):  # megatron-core DDP's gradient buffer
                tensor(f"{prefix}main_grad of {name}", p.main_grad)
    if random:
        state["the CPU generator"] = torch.get_rng_state()
        state["the RNG tracker's streams"] = {
            k: rng.to_byte_state(v) for k, v in rng.get_cuda_rng_tracker().get_states().items()}
    return state


class Snapshot:
    """What a refused call leaves as it was: for each module, every parameter and buffer (the
    object and its value), every parameter's .grad and ``main_grad`` where present (the
    object and its value, or None), and the forward, backward_dw and reset set on it and its
    submodules; for each tensor, the same as for a parameter; with ``random``, the CPU
    generator and the RNG tracker's streams."""

    def __init__(self, *things: Any, random: bool = True):
        self.things, self.random = things, random
        self.before = _state(things, random)

    def changes(self) -> list[str]:
        """What differs now, each named with the first difference."""
        now = _state(self.things, self.random)
        names = list(self.before) + [k for k in now if k not in self.before]
        found = []
        for name in names:
            if name not in self.before or name not in now:
                found.append(f"{name}: {'added' if name in now else 'gone'}")
                continue
            what = difference(now[name], self.before[name], name, nan_equal=True, reference="before")
            if what:
                found.append(what)
        return found

    def assert_unchanged(self) -> None:
        changes = self.changes()
        assert not changes, "the refusal changed: " + "; ".join(changes)


class refused:  # noqa: N801 - used as a function, in a with statement
    """``with refused(error, match, *things):`` -- the block raises exactly ``error`` (not a
    subclass) with a message ``re.search``-ing ``match`` (``re.escape`` a literal), and leaves
    ``things`` and, with ``random``, the random streams as they were (``Snapshot``). ``as``
    gives pytest's ``ExceptionInfo``."""

    def __init__(self, error: type, match: str, *things: Any, random: bool = True):
        self.error, self.snapshot = error, Snapshot(*things, random=random)
        self.raises = pytest.raises(error, match=match)

    def __enter__(self) -> Any:
        self.info = self.raises.__enter__()
        return self.info

    def __exit__(self, *raised: Any) -> bool:
        if not self.raises.__exit__(*raised):  # fails unless ``error`` with ``match``
            return False  # another exception: it goes on
        assert self.info.type is self.error, (
            f"raised {self.info.type.__name__}, not {self.error.__name__}: {self.info.value}")
        self.snapshot.assert_unchanged()
        return True


# -- rows --------------------------------------------------------------------------------------------
class Row:
    """A setup of the harness, as data: a dataclass with an ``id`` (its test id), run on
    every device unless ``runs_on`` says otherwise."""

    id: str
    gpu_only: bool = False

    def runs_on(self, device: str) -> bool:
        return device == "cuda" or not self.gpu_only

    def __str__(self) -> str:
        return self.id


def params(rows: Iterable[Row], device: str) -> list:
    """The rows that run on ``device``, as pytest parameters with their ids (marked ``gpu``
    on CUDA)."""
    marks = [pytest.mark.gpu] if device == "cuda" else []
    return [pytest.param(row, id=row.id, marks=marks) for row in rows if row.runs_on(device)]
