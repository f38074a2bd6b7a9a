"""No silent wrong results: graphs on = graphs off bit for bit, or a clear error.

Rows of tests/harness.py. Each case (tests/silent_cases.py) is a small setup a user can
reach: a few linears, hidden 16, seq 8, batch 2, float32, 3 steps of 2 microbatches. It
runs eagerly (the reference) and through ``make_graphed_callables`` in one mode, from the
same seeds; the only difference is that the graphed run wraps the modules after building
them. Every observable is compared by the harness's ``difference`` (``torch.equal``, NaN
equal to NaN): outputs, input
grads, each parameter's ``.grad`` at each step (None-ness included), weights after each
optimizer step (SGD, or AdamW with weight decay), module buffers, and whatever the case
observes (plain attributes, counters, grads of keyword tensors).

Outcome of one (case, mode):

- ``equal``: it ran and every observable equals eager's.
- ``refused``: te_graph raised a clear error (its message starts with
  ``make_graphed_callables``, ``te_graph`` or the callable's name, ``callable 0 (Net)``) and
  nothing changed: the harness's ``Snapshot`` (parameters and buffers, objects and values,
  ``.grad``s, the forwards set on the modules, the random streams) taken just before the
  ``make_graphed_callables`` call, call, backward or optimizer step that raised is unchanged.
- ``documented``: it ran and differs from eager's by rounding only, in a case whose exact
  condition the guarantee states (``Case.documented``, checked to be in the docs).
- ``silent``: it ran and some observable differs from eager's.
- ``crash``: any other exception (torch's or the user code's, or a te_graph error that
  left the state changed).

Where eager code itself raises (``Case.eager_refuses``, a phrase of its error: an output
the backward reads updated in place, a reentrant checkpoint fed no input requiring grad),
the graphed run must raise too, at the same point (a call, a backward), having observed
what eager did until then: ``refused`` then, ``silent`` where it ran on.

Modes (the harness's): eager replay (CPU and CUDA, ids ``eager_replay``) and graphs (CUDA only). The tests assert
``equal`` or ``refused`` for every case and mode, and, on a GPU, that graphs and eager
replay land in the same outcome class (eager replay is the debugging mirror of graphs).
``python -m tests.test_silent`` (from the repository root) prints the table for the device this
machine has.
"""
from __future__ import annotations

import collections
import functools
import os
import re
import sys
import warnings
from dataclasses import dataclass, field

import pytest
import torch

import rng
import te_graph
from te_graph import make_graphed_callables
from tests import harness
from tests.graph_helpers import weighted_loss
from tests.harness import EAGER, EAGER_REPLAY, GRAPHS
from tests.silent_cases import CASES, Case

MODES = {"cpu": (EAGER_REPLAY,), "cuda": (EAGER_REPLAY, GRAPHS)}
MODE_IDS = {EAGER_REPLAY: "eager_replay", GRAPHS: "graphs"}
OUTCOMES = ("equal", "refused", "documented", "silent", "crash")
CLEAR = re.compile(r"(make_graphed_callables|te_graph|callable \d+ \()")


class CaseError(Exception):
    """The eager reference itself failed: a bug of the case, not of te_graph."""


@dataclass
class Outcome:
    kind: str  # one of OUTCOMES
    detail: str = ""

    def __str__(self) -> str:
        return self.kind + (f" ({self.detail})" if self.detail else "")


# -- one run --------------------------------------------------------------------------------------
def _seed(seed: int) -> None:
    rng.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def _tensors(value):
    """The tensors of an output: a tensor, or a tuple/list of them (others skipped)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


class Tracked:
    """What the user calls (a module, or a graphed callable): marks the state, then calls."""

    def __init__(self, st: "State", f):
        self.st, self.f = st, f

    def __call__(self, *args, **kwargs):
        self.st.mark("a call")
        return self.f(*args, **kwargs)


class State:
    """One run of one case: its modules and everything a case function may use."""

    def __init__(self, case: Case, mode: str, device: str):
        self.case, self.mode, self.device = case, mode, device
        self.graphing = mode != EAGER
        self.data = torch.Generator().manual_seed(7)  # inputs: the same in every run
        self.sample_gen = torch.Generator().manual_seed(5)  # samples: no draw from the live streams
        self.observed: list = []
        self.kept: list = []
        self.graphed: list = []  # what each make_graphed_callables call returned
        self.dtype = torch.float32
        self.step_i = self.mb = 0
        self._opt = None
        self.where, self.before = "building", None

    def set(self, built) -> None:
        attrs = built if isinstance(built, dict) else {"layers": built}
        self.__dict__.update(attrs)
        if "model" not in attrs:
            self.model = torch.nn.ModuleList([m for m in self.layers if isinstance(m, torch.nn.Module)])
        self.calls = [Tracked(self, f) for f in self.layers]

    # tensors
    def randn(self, *shape, grad=False):
        return torch.randn(*shape, generator=self.data).to(self.device).requires_grad_(grad)

    def sample(self, *shape, grad=True):
        return torch.randn(*shape, generator=self.sample_gen).to(self.device).requires_grad_(grad)

    def autocast(self, **kwargs):
        dtype = torch.bfloat16 if self.device == "cpu" else torch.float16
        return torch.autocast(self.device, dtype=dtype, **kwargs)

    # graphing and training
    def make_graphed(self, modules, samples, **kwargs):
        self.mark("make_graphed_callables")
        graphed = make_graphed_callables(tuple(modules), tuple(samples),
                                         eager_replay=harness.eager_replay(self.mode), **kwargs)
        self.graphed.append(graphed)
        return [Tracked(self, f) for f in graphed]

    @property
    def opt(self):
        if self._opt is None:
            params = list(self.model.parameters())
            self._opt = (torch.optim.AdamW(params, lr=0.01, weight_decay=0.1) if self.case.opt == "adamw"
                         else torch.optim.SGD(params, lr=0.1))
        return self._opt

    def reset_opt(self) -> None:
        self._opt = None

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def loss(self, y):
        return sum(weighted_loss(t) for t in _tensors(y) if t.is_floating_point())

    def backward(self, loss, **kwargs) -> None:
        self.mark("a backward")
        loss.backward(**kwargs)

    def autograd_grad(self, loss, inputs, **kwargs):
        self.mark("a backward")
        return torch.autograd.grad(loss, inputs, **kwargs)

    def step(self) -> None:
        """The optimizer step, observing grads before it and weights, buffers after."""
        self.mark("an optimizer step")
        params = list(self.model.named_parameters(remove_duplicate=False))
        where = f"step {self.step_i}"
        for name, p in params:
            self.log(f"grad {name}", p.grad, where)
        self.opt.step()
        for name, p in params:
            self.log(f"weight {name}", p, where)
        for name, b in self.model.named_buffers(remove_duplicate=False):
            self.log(f"buffer {name}", b, where)
        for name, value in (self.case.observe(self) if self.case.observe else {}).items():
            self.log(name, value, where)

    def log(self, name: str, value, where: str | None = None) -> None:
        """Observe ``value`` (a tensor is cloned now; tuples and lists element-wise)."""
        where = where or f"step {self.step_i} mb {self.mb}"
        if isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                self.log(f"{name}[{i}]", v, where)
            return
        if isinstance(value, torch.Tensor):
            value = value.detach().clone()
        self.observed.append((f"{where} {name}", value))

    def mark(self, where: str) -> None:
        """The state a refusal must leave untouched (the harness's ``Snapshot`` of every module
        the case holds, and the random streams): taken before each graphing, call, backward
        and optimizer step."""
        modules = [self.model] + [m for m in self.layers if isinstance(m, torch.nn.Module)]
        self.where, self.before = where, harness.Snapshot(*modules)


def compare(got: list, want: list):
    """None if the observations are equal (the harness's ``difference``, NaN equal to NaN),
    else what differs first."""
    for (name, g), (wname, w) in zip(got, want):
        if name != wname:
            return f"observed {name!r} where eager observed {wname!r}"
        diff = harness.difference(g, w, name, nan_equal=True)
        if diff:
            return diff
    if len(got) != len(want):
        return f"{len(got)} observations, eager has {len(want)}"
    return None


def _error(e: BaseException, st: State) -> Outcome:
    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = f"at {st.where}: {type(e).__name__}: {message}"
    if not CLEAR.match(message):
        return Outcome("crash", text)
    if "this output was overwritten by a later call" in message:
        return Outcome("refused", text)  # raised by the read of the stale value itself, wherever it comes
    changed = st.before.changes()
    if changed:
        return Outcome("crash", f"{text} [but it changed {'; '.join(changed[:3])}]")
    return Outcome("refused", text)


@dataclass
class Run:
    observed: list = field(default_factory=list)
    error: Outcome | None = None


def run(case: Case, mode: str, device: str) -> Run:
    """Build, graph (unless mode is "eager"), train; what it observed, or how it failed."""
    st = State(case, mode, device)
    try:
        _seed(1234)
        st.set(case.build(device))
        try:
            if st.graphing:
                st.calls = case.graph(st)
            _seed(77)  # every run draws the same random numbers from here
            case.train(st)
        except Exception as e:  # noqa: BLE001 - classified
            if mode == EAGER:
                if case.eager_refuses and case.eager_refuses in str(e):
                    return Run(st.observed, Outcome("refused", f"at {st.where}: {type(e).__name__}"))
                raise CaseError(f"case {case.id}: the eager reference failed: {type(e).__name__}: {e}") from e
            return Run(st.observed, _error(e, st))
        return Run(st.observed)
    finally:
        for graphed in st.graphed:
            try:
                te_graph.reset(graphed)
            except Exception:  # noqa: BLE001 - already freed, or never made
                pass


@functools.lru_cache(maxsize=None)
def eager_run(case_id: str, device: str) -> Run:
    return run(BY_ID[case_id], EAGER, device)


def reference(case_id: str, device: str) -> list:
    return eager_run(case_id, device).observed


def outcome(case: Case, mode: str, device: str) -> Outcome:
    got = run(case, mode, device)
    want = eager_run(case.id, device)
    if want.error is not None:  # eager code refuses the case: so must the graphed run, alike
        if got.error is None:
            return Outcome("silent", f"eager code refused it {want.error.detail}, but it ran")
        where = want.error.detail.split(":")[0]
        if got.error.kind == "refused" and not got.error.detail.startswith(where):
            return Outcome("crash", f"refused {got.error.detail}, where eager code refused it {where}")
        diff = compare(got.observed, want.observed)
        return got.error if diff is None else Outcome("silent", f"before the refusal: {diff}")
    if got.error is not None:
        return got.error
    diff = compare(got.observed, reference(case.id, device))
    if diff is None:
        return Outcome("equal")
    if case.documented and case.same_as is not None:
        twin = compare(got.observed, reference(case.same_as.id, device))
        if twin is None:
            return Outcome("documented", f"as the guarantee states for {case.documented}: bitwise equal to "
                                         f"{case.same_as.doc!r}; {diff}")
        return Outcome("silent", f"{diff}; and against {case.same_as.id!r}: {twin}")
    if case.documented and _rounding_only(got.observed, reference(case.id, device)):
        return Outcome("documented", f"rounding, as the guarantee states for {case.documented}: {diff}")
    return Outcome("silent", diff)


def _rounding_only(got: list, want: list) -> bool:
    """Every observation close to eager's, relative to its tensor's scale (a different
    summation order, grown by a few optimizer steps), never NaN where eager is finite."""
    for (_, g), (_, w) in zip(got, want):
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and g.shape == w.shape and g.is_floating_point():
            scale = w.double().abs().max().item() if w.numel() else 0.0
            # 1e-3 of the scale: float32 summation order, or TF32 kernels (cuDNN's default) for
            # another layout; NaN or a wrong value is far beyond it.
            if not torch.allclose(g.double(), w.double(), rtol=0, atol=1e-3 * scale + 1e-6):
                return False
        elif harness.difference(g, w, nan_equal=True):
            return False
    return len(got) == len(want)


BY_ID = {case.id: case for case in CASES + [c.same_as for c in CASES if c.same_as is not None]}


# -- tests ------------------------------------------------------------------------------------------
def _check(case: Case, mode: str, device: str) -> Outcome:
    result = outcome(case, mode, device)
    allowed = ("equal", "refused", "documented") if case.documented else ("equal", "refused")
    assert result.kind in allowed, f"case {case.id} ({case.cls}: {case.doc}), {mode} on {device}: {result}"
    return result


def test_documented_differences_are_in_the_guarantee():
    """Each documented difference names its exact condition where the guarantee is stated."""
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "capture-and-replay.md")
    text = " ".join(open(docs, encoding="utf-8").read().split())
    for case in CASES:
        if case.documented:
            assert case.documented in text, f"{case.id}: docs/capture-and-replay.md does not state {case.documented!r}"


@pytest.mark.parametrize("case", harness.params(CASES, "cpu"))
def test_eager_replay_cpu(case):
    _check(case, EAGER_REPLAY, "cpu")


@pytest.mark.parametrize("mode", MODES["cuda"], ids=MODE_IDS.get)
@pytest.mark.parametrize("case", harness.params(CASES, "cuda"))
def test_cuda(case, mode):
    _check(case, mode, "cuda")


@pytest.mark.parametrize("case", harness.params(CASES, "cuda"))
def test_graphs_and_eager_replay_agree(case):
    graphs, replay = outcome(case, GRAPHS, "cuda"), outcome(case, EAGER_REPLAY, "cuda")
    assert graphs.kind == replay.kind, (
        f"case {case.id} ({case.doc}) on cuda: graphs {graphs}, but eager replay {replay}")


def test_cases_are_well_formed():
    assert len(CASES) >= 48
    assert len({case.id for case in CASES}) == len(CASES), "two cases share an id"
    classes = {"changed", "grads", "side-effects", "shared-samples", "nested", "outputs", "rounding", "other"}
    assert {case.cls for case in CASES} == classes
    assert all(case.doc for case in CASES)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_eager_reference_is_deterministic(case):
    """Two eager runs of a case are equal, so any difference the harness reports is te_graph's."""
    assert compare(run(case, EAGER, "cpu").observed, reference(case.id, "cpu")) is None, case.id


def test_harness_tells_outcomes_apart():
    want = [("w", torch.tensor([1.0, float("nan")])), ("g", None)]
    assert compare(list(want), want) is None
    assert "differs" in compare([("w", torch.tensor([1.0, 2.0])), ("g", None)], want)
    assert "eager None" in compare([want[0], ("g", torch.zeros(1))], want)
    st = State(CASES[0], EAGER_REPLAY, "cpu")
    st.set([torch.nn.Linear(2, 2)])
    st.mark("a call")
    assert _error(RuntimeError("callable 0 (Linear): no"), st).kind == "refused"
    assert _error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), st).kind == "crash"
    with torch.no_grad():
        st.layers[0].weight.add_(1)
    assert _error(ValueError("make_graphed_callables: no"), st).kind == "crash"


# -- the table ---------------------------------------------------------------------------------------
def table(device: str | None = None) -> dict:
    """Print case, class, the outcome per mode and, for each one not equal, why; then the
    counts per mode. Returns {mode: Counter}."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    modes = MODES[device]
    warnings.simplefilter("ignore")  # the table only
    counts = {mode: collections.Counter() for mode in modes}
    print(f"{'case':28} {'class':15}" + "".join(f" {MODE_IDS[mode] + '[' + device + ']':20}" for mode in modes) + " reason")
    for case in CASES:
        results = {mode: outcome(case, mode, device) for mode in modes}
        for mode, result in results.items():
            counts[mode][result.kind] += 1
        reasons = "; ".join(f"{mode}: {r.detail}" if len(modes) > 1 else r.detail
                            for mode, r in results.items() if r.kind != "equal")
        print(f"{case.id:28} {case.cls:15}" + "".join(f" {r.kind:20}" for r in results.values()) + f" {reasons[:220]}")
    for mode in modes:
        print(f"{MODE_IDS[mode]}[{device}]: " + ", ".join(f"{kind} {counts[mode][kind]}" for kind in OUTCOMES))
    return counts


if __name__ == "__main__":
    torch.manual_seed(0)
    table(sys.argv[1] if len(sys.argv) > 1 else None)
