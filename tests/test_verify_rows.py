"""The runtime verifier on the differential harness's equal rows, and the switch that runs them verified.

``and_verified`` gives a row table a second copy of its rows, id ``<row>-verified`` (``VERIFIED``:
the switch alone, for a test without rows), which
tests/test_parity.py, test_hf_layers.py, test_te_layers.py and test_megatron_path.py run
inside ``verifying``: every call of every callable graphed in the row is verified
(``TE_GRAPH_VERIFY`` set to more calls than any row makes; a difference raises, and a
warning of the verifier is an error), and the row must still equal eager bitwise (the
eager shadow leaves no trace) after at least one verified forward and backward. The rows
that refuse are other tests, unchanged: verification does not change which setups refuse
(``test_a_refusal_at_a_call_is_the_same_verified``).
"""
from __future__ import annotations

import contextlib
import re
import warnings
from typing import Any, Iterator, Optional

import pytest
import torch
from torch import nn

import te_graph
from te_graph.verify.shadow import Shadow
from tests import harness
from tests.graph_helpers import main_grad_steps, megatron_ddp_hooks, weighted_loss
from tests.harness import DEVICE_MODES, Trace, refused

VERIFY_EVERY_CALL = "1000000"  # TE_GRAPH_VERIFY: the first calls verified, more than any row makes
VERIFIER_WARNING = r"(?s).*te_graph's verifier"  # what every report of the verifier says
VERIFIED = [pytest.param(False, id="verify-off"), pytest.param(True, id="verified")]  # ``verified`` alone


def and_verified(params: list, only: Optional[set] = None, known_bugs: Optional[dict] = None) -> list:
    """``params`` (pytest parameters of one value each) as ``(value, False)`` with their
    ids, then those whose id is in ``only`` (default: all) as ``(value, True)``, id
    ``<id>-verified``: the parameters of ``"<name>, verified"``. ``known_bugs``: id ->
    why its verified run fails today (a strict xfail, which fails once it passes)."""
    known_bugs = known_bugs or {}
    plain = [pytest.param(*p.values, False, id=p.id, marks=p.marks) for p in params]
    return plain + [pytest.param(*p.values, True, id=f"{p.id}-verified", marks=tuple(p.marks) + (
        (pytest.mark.xfail(strict=True, reason=known_bugs[p.id]),) if p.id in known_bugs else ()))
        for p in params if only is None or p.id in only]


@contextlib.contextmanager
def shadows_counted() -> Iterator[dict]:
    """Inside: ``counts["forwards"]`` and ``counts["backwards"]`` count the verifier's eager
    shadows and their backwards (in this process), and a warning of the verifier is an error."""
    counts = {"forwards": 0, "backwards": 0}
    init, backward = Shadow.__init__, Shadow.backward

    def counted_init(self: Shadow, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        counts["forwards"] += 1

    def counted_backward(self: Shadow, grads: Any) -> Any:
        counts["backwards"] += 1
        return backward(self, grads)

    Shadow.__init__, Shadow.backward = counted_init, counted_backward
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=VERIFIER_WARNING)
            yield counts
    finally:
        Shadow.__init__, Shadow.backward = init, backward


@contextlib.contextmanager
def verifying(verified: bool, monkeypatch: pytest.MonkeyPatch, backward: bool = True) -> Iterator[Optional[dict]]:
    """With ``verified``: inside, every call of every callable graphed here is verified
    (``TE_GRAPH_VERIFY``; a difference raises; ``shadows_counted``); on leaving, at least
    one call was, and, with ``backward``, at least one backward. Without: nothing."""
    if not verified:
        yield None
        return
    monkeypatch.setenv("TE_GRAPH_VERIFY", VERIFY_EVERY_CALL)
    with shadows_counted() as counts:
        yield counts
    assert counts["forwards"] > 0, "no call was verified: the row graphs nothing through TE_GRAPH_VERIFY"
    assert counts["backwards"] > 0 or not backward, f"no backward was verified ({counts})"


# -- the verifier's own rows -----------------------------------------------------------------------
class Cache(nn.Module):
    """Reads a running state passed in and updates it in place (a KV cache, a counter)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, cache):
        y = self.lin(x) + cache
        with torch.no_grad():
            cache.mul_(0.5).add_(y.mean(dim=0))
        return torch.tanh(y)


def _cached_run(device: str, mode: str, calls: int = 3) -> Trace:
    torch.manual_seed(0)
    m = Cache().to(device)
    cache = torch.zeros(8, device=device)
    if mode != harness.EAGER:
        te_graph.make_graphed_callables(m, (torch.randn(4, 8, device=device, requires_grad=True),
                                            torch.zeros(8, device=device)),
                                        eager_replay=harness.eager_replay(mode), verify=calls)
    trace = Trace()
    for i in range(calls):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).to(device).requires_grad_()
        y = m(x, cache)
        weighted_loss(y).backward()
        trace.microbatch(y, x)
        trace.updated_inputs.append(cache.clone())
    trace.step(m.parameters())
    return trace


@pytest.mark.parametrize("device, eager_replay", DEVICE_MODES)
def test_an_input_the_call_updates_in_place_reaches_the_shadow_as_the_call_got_it(device, eager_replay):
    """The shadow runs from copies of the call's tensors taken before the graph ran: the
    graph's update of the input in place is not the shadow's input, nor is the shadow's
    update the caller's."""
    mode = harness.EAGER_REPLAY if eager_replay else harness.GRAPHS
    with shadows_counted() as counts:
        harness.assert_same(_cached_run(device, mode), _cached_run(device, harness.EAGER), "verified, in place")
    assert counts == {"forwards": 3, "backwards": 3}, counts


class LiveRecompute(nn.Module):
    """A checkpoint whose recompute draws its dropout from the live stream (no RNG state kept,
    as Transformer Engine's checkpoint with graph-safe streams): what the backward computes
    depends on when it runs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def _body(self, x):
        return nn.functional.dropout(self.lin(x), 0.5, self.training)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False, preserve_rng_state=False)


def _live_run(mode: str) -> Trace:
    torch.manual_seed(0)
    m = LiveRecompute()
    if mode != harness.EAGER:
        te_graph.make_graphed_callables(m, (torch.randn(4, 8, requires_grad=True),),
                                        eager_replay=harness.eager_replay(mode), verify=True)
    torch.manual_seed(5)
    return _three_steps(m, lambda i: torch.randn(4, 8, requires_grad=True))


def _three_steps(m: nn.Module, x_of) -> Trace:
    """Three training steps of ``m`` on ``x_of(step)``: outputs, input and parameter grads."""
    trace = Trace()
    for i in range(3):
        x = x_of(i)
        y = m(x)
        weighted_loss(y).backward()
        trace.microbatch(y, x)
        trace.step(m.parameters())
    return trace


def test_the_shadows_backward_runs_when_eager_codes_would():
    """The shadow's backward runs right before the graph's, from the same random state, and
    leaves the streams as it found them: a backward drawing from the live stream finds
    nothing, and the run equals eager (eager replay on the CPU, the graphs' mirror)."""
    with shadows_counted() as counts:
        harness.assert_same(_live_run(harness.EAGER_REPLAY), _live_run(harness.EAGER), "verified, live recompute")
    assert counts == {"forwards": 3, "backwards": 3}, counts


@pytest.mark.parametrize("device, eager_replay", DEVICE_MODES)
def test_a_refusal_at_a_call_is_the_same_verified(device, eager_replay, monkeypatch):
    """A call the guards refuse is refused verified too, with the same error, before the
    graph or the shadow runs (nothing changed, no shadow made)."""
    with verifying(True, monkeypatch, backward=False) as counts:
        m, cache = Cache().to(device), torch.zeros(8, device=device)
        te_graph.make_graphed_callables(m, (torch.randn(4, 8, device=device, requires_grad=True), cache.clone()),
                                        eager_replay=eager_replay)
        m(torch.randn(4, 8, device=device, requires_grad=True), cache)
        m.lin.register_forward_hook(lambda *args: None)
        x = torch.randn(4, 8, device=device, requires_grad=True)
        with refused(RuntimeError, re.escape("callable 0 (Cache): since graphing, forward hooks on submodule 'lin' "
                                             "changed (0 -> 1)"), m, x, cache):
            m(x, cache)
        assert counts["forwards"] == 1, counts


def test_and_verified_adds_a_verified_copy_of_the_rows_named():
    params = [pytest.param("a", id="a"), pytest.param("b", id="b", marks=pytest.mark.gpu)]
    got = and_verified(params, only={"b"})
    assert [(p.values, p.id) for p in got] == [(("a", False), "a"), (("b", False), "b"), (("b", True), "b-verified")]
    assert got[2].marks == got[1].marks


def test_and_verified_marks_a_known_bug_a_strict_xfail_on_its_verified_copy_only():
    got = and_verified([pytest.param("a", id="a")], known_bugs={"a": "why"})
    assert got[0].marks == ()
    (mark,) = got[1].marks
    assert (mark.name, mark.kwargs) == ("xfail", {"strict": True, "reason": "why"})


class _Fuser:
    """What te.ops.Sequential builds at its first call: an object holding the parameters."""

    def __init__(self, params):
        self.params = list(params)


class KeepsItsParameters(nn.Module):
    """Holds the parameters it was first called with in a fuser of its own, as Transformer
    Engine's te.ops.Sequential does; an integration drops the fuser
    (``Extension.forget_stand_in_caches``) and the next call makes it again."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fuser = None

    def forward(self, x):
        if self.fuser is None:
            self.fuser = _Fuser(self.lin.parameters())
        weight, bias = self.fuser.params
        return nn.functional.linear(x, weight, bias)


class _DropsTheCache(te_graph.extension.Extension):
    name = "keeps-its-parameters"

    def forget_stand_in_caches(self, modules):
        for module in modules:
            for m in module.modules():
                if isinstance(m, KeepsItsParameters):
                    m.fuser = None


def _kept_run(mode: str) -> Trace:
    torch.manual_seed(0)
    m = KeepsItsParameters()
    m(torch.randn(4, 8))  # the cache made around the real parameters, as by an eager step
    if mode != harness.EAGER:
        te_graph.make_graphed_callables(m, (torch.randn(4, 8, requires_grad=True),),
                                        eager_replay=harness.eager_replay(mode), verify=True)
    return _three_steps(m, lambda i: torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).requires_grad_())


def test_the_shadow_reaches_no_real_gradient_through_a_cache_of_the_parameters():
    """The shadow's forward runs on stand-ins of the parameters; a module that cached the real
    ones has its cache made again around the stand-ins (the integration's
    ``forget_stand_in_caches``), so the shadow's backward adds nothing to the real .grad,
    and the call's own cache is back afterwards (eager replay on the CPU)."""
    te_graph.extension.register(_DropsTheCache())
    try:
        with shadows_counted() as counts:
            harness.assert_same(_kept_run(harness.EAGER_REPLAY), _kept_run(harness.EAGER), "verified, cached parameters")
    finally:
        te_graph.extension.unregister(_DropsTheCache.name)
    assert counts == {"forwards": 3, "backwards": 3}, counts


# -- a kernel that accumulates the weight gradient into main_grad itself ---------------------------
class _WgradIntoMainGrad(torch.autograd.Function):
    """What Transformer Engine's ``fuse_wgrad_accumulation`` does in its backward: the weight
    gradient added into ``weight.main_grad`` by the kernel, the weight flagged
    ``grad_added_to_main_grad``, and an uninitialised dummy (NaN here) returned as its .grad."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        weight.main_grad.add_(grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))
        weight.grad_added_to_main_grad = True
        return grad @ weight, torch.full_like(weight, float("nan"))


class WgradIntoMainGradLinear(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _WgradIntoMainGrad.apply(x, self.weight).tanh()


def _main_grad_run(device: str, mode: str) -> Trace:
    torch.manual_seed(0)
    layers = [WgradIntoMainGradLinear(8).to(device) for _ in range(2)]
    params = [p for m in layers for p in m.parameters()]
    keep = megatron_ddp_hooks(params)
    if mode != harness.EAGER:
        samples = tuple((torch.zeros(4, 8, device=device, requires_grad=True),) for _ in layers)
        layers = list(te_graph.make_graphed_callables(tuple(layers), samples, eager_replay=harness.eager_replay(mode)))
    trace = main_grad_steps(layers, params, lambda data: torch.randn(4, 8, device=device, generator=data,
                                                                     requires_grad=True), Trace(), lr=0.1)
    del keep
    return trace


@pytest.mark.parametrize("device, replay", DEVICE_MODES + [pytest.param("cuda", True, id="eager-replay-cuda",
                                                                        marks=pytest.mark.gpu)])
@pytest.mark.parametrize("verified", [False, True], ids=["plain", "verified"])
def test_a_kernel_that_accumulates_into_main_grad_trains_as_eager(device, replay, verified, monkeypatch):
    """The weight flagged by the kernel that wrote its main_grad keeps that flag where te_graph
    runs the call on parameter stand-ins (verified calls): Megatron DDP's hook then leaves the
    dummy .grad out of main_grad, as in eager code."""
    mode = harness.EAGER_REPLAY if replay else harness.GRAPHS
    with verifying(verified, monkeypatch):
        want, got = _main_grad_run(device, harness.EAGER), _main_grad_run(device, mode)
    harness.assert_same(got, want, f"{mode}, verified {verified}")
