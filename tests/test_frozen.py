"""What a graph cannot follow is refused, each with its exact class and message, and what must
not be refused trains as eager (eager replay on the CPU; tests/test_silent.py runs the same
classes of setups eagerly, in eager replay and in graphs, and compares every observable).

* what a graph froze, checked at every call (``te_graph/guards/frozen.py``);
* forwards with side effects, compared between warmup passes (``te_graph/capture/module_state.py``);
* calls a graph cannot serve (a second call before its backward), losses leaving outputs out
  (trained as eager), bad call forms named before warmup, keywords that may differ from the capture;
* the RNG tracker found without being told (``rng.process_tracker``).
"""
from __future__ import annotations

import re
import sys
import types

import pytest
import torch
from torch import nn

import rng
import te_graph
from te_graph import make_graphed_callables
from tests import harness
from tests.graph_helpers import NoGrad, weighted_loss
from tests.harness import refused

H, S, B = 8, 4, 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2, self.drop = nn.Linear(H, H), nn.Linear(H, H), nn.Dropout(0.1)

    def forward(self, x):
        return self.lin2(self.drop(torch.tanh(self.lin1(x))))


def _x(grad: bool = True) -> torch.Tensor:
    return torch.randn(S, B, H, requires_grad=grad)


def _graphed(module: nn.Module | None = None, **kwargs) -> nn.Module:
    module = module or Net()
    return make_graphed_callables(module, (_x(),), eager_replay=True, **kwargs)


def _refused(module: nn.Module, message: str, error: type = RuntimeError, call=None) -> None:
    """The next call, ``module(x)`` or ``call(x)``, is refused with ``error`` and ``message`` and
    changes nothing (tests/harness.py)."""
    x = _x()
    with refused(error, re.escape(message), module):
        (call or module)(x)


_REGRAPH = ("A graph replays what it captured, so this call would not follow the change. Graph it again after "
            "changing the model: te_graph.reset(...) frees the graphs and gives a module its eager forward back; "
            "then call make_graphed_callables again.")


# -- what a graph froze --------------------------------------------------------------------------
def test_a_frozen_parameter_is_refused_at_the_next_call():
    m = _graphed()
    m.lin1.weight.requires_grad_(False)
    _refused(m, "callable 0 (Net): since graphing, parameter 'lin1.weight' no longer requires grad. " + _REGRAPH)


def test_a_parameter_in_other_memory_is_refused():
    m = _graphed()
    m.lin1.weight.data = torch.randn(H, H)
    _refused(m, "callable 0 (Net): since graphing, parameter 'lin1.weight' now lies at another address "
                "(p.data = ..., or the module was moved or cast). " + _REGRAPH)


def test_a_replaced_parameter_or_submodule_is_refused():
    m = _graphed()
    m.lin1.weight = nn.Parameter(torch.randn(H, H))
    _refused(m, "callable 0 (Net): since graphing, parameter 'lin1.weight' was replaced by another object "
                "(a new nn.Parameter or tensor, load_state_dict(assign=True), or None)")
    m = _graphed()
    m.lin2 = nn.Linear(H, H)
    _refused(m, "callable 0 (Net): since graphing, submodule 'lin2' was replaced by another module.")


def test_hooks_on_submodules_are_refused_and_hooks_on_the_module_run():
    m = _graphed()
    seen = []
    handle = m.register_forward_hook(lambda *_: seen.append(1))  # around the graphed forward
    m(_x())
    assert seen == [1]
    handle.remove()
    m.lin1.register_forward_hook(lambda *_: None)
    _refused(m, "callable 0 (Net): since graphing, forward hooks on submodule 'lin1' changed (0 -> 1); hooks on a "
                "submodule run only while a graph is captured, never at replay (hooks on the graphed module itself "
                "run around the graphed forward). " + _REGRAPH)


def test_a_global_hook_added_after_graphing_is_refused():
    m = _graphed()
    m(_x()).sum().backward()
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda *_: None)
    try:
        _refused(m, "callable 0 (Net): since graphing, global module forward_pre_hooks "
                    "(torch.nn.modules.module.register_module_forward_pre_hook) changed (0 -> 1); ")
    finally:
        hook.remove()


def test_global_module_hooks_at_graphing_are_refused_where_they_would_run_only_at_capture():
    """A hook for every module (register_module_forward_hook, ...) runs for a graphed module's
    submodules only while its graphs are captured, and would be skipped at every replay:
    refused at graphing, before anything runs. A module without submodules is called through
    nn.Module.__call__: there it runs around each call, as in eager."""
    seen = []
    hook = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: seen.append(type(module)))
    try:
        with pytest.raises(ValueError, match=re.escape(
                "make_graphed_callables: global module hooks are registered (forward_hooks: "
                "torch.nn.modules.module.register_module_*); they run for the submodules of callable 0 only "
                "while its graphs are captured, never at replay.")):
            _graphed()
        assert seen == []
        leaf = make_graphed_callables(nn.Linear(H, H), (_x(),), eager_replay=True)
        seen.clear()
        leaf(_x()).sum().backward()
        assert seen == [nn.Linear]
    finally:
        hook.remove()
    leaf(_x()).sum().backward()  # around a leaf they come and go as they like
    assert seen == [nn.Linear]


def test_a_one_element_parameter_replaced_by_an_equal_one_is_refused():
    """A one-element tensor's == compares values: the check compares such objects by identity."""
    class Gate(Net):
        def __init__(self):
            super().__init__()
            self.gate = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return super().forward(x) * self.gate

    m = _graphed(Gate())
    weighted_loss(m(_x())).backward()  # the check's steady state
    m.gate = nn.Parameter(torch.ones(1))
    _refused(m, "callable 0 (Gate): since graphing, parameter 'gate' was replaced by another object "
                "(a new nn.Parameter or tensor, load_state_dict(assign=True), or None)")


def test_a_submodule_mode_or_hyperparameter_changed_is_refused_and_one_set_again_is_not():
    m = _graphed()
    m.drop.p = 0.1  # a new float object, equal to the old one: the same program
    m(_x())
    m.drop.eval()
    _refused(m, "callable 0 (Net): since graphing, submodule 'drop' is in eval mode, but was in train mode at capture.")
    m.drop.train()
    m.drop.p = 0.3
    _refused(m, "callable 0 (Net): since graphing, attribute 'p' of submodule 'drop' is 0.3, but was 0.1 at capture.")


class _Clamp(nn.Module):
    """Reads ``window`` in its forward: None (no clamp) or a bound."""

    def __init__(self):
        super().__init__()
        self.window = None

    def forward(self, x):
        return x if self.window is None else x.clamp(-self.window, self.window)


def test_an_attribute_that_was_none_at_capture_is_named_with_its_values():
    m = Net()
    m.drop = nn.Sequential(_Clamp(), nn.Dropout(0.1))
    m = _graphed(m)
    m.drop[0].window = 4.0
    _refused(m, "callable 0 (Net): since graphing, attribute 'window' of submodule 'drop.0' is 4.0, but was None at capture.")


def test_autocast_and_numerics_settings_that_differ_from_the_capture_are_refused():
    m = _graphed()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _refused(m, "callable 0 (Net): since graphing, autocast on cpu is on (torch.bfloat16), but the graph was "
                    "captured with off.")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(not previous)
    try:
        _refused(m, f"callable 0 (Net): since graphing, torch.are_deterministic_algorithms_enabled() is {not previous}, "
                    f"but was {previous} at capture.")
    finally:
        torch.use_deterministic_algorithms(previous)
    m(_x())  # settings back as captured: the call goes on


def test_reset_gives_the_module_its_eager_forward_back_and_it_can_be_graphed_again():
    m = _graphed()
    te_graph.reset(m)
    assert "forward" not in m.__dict__
    m.lin1.weight.requires_grad_(False)  # a change is fine once the graphs are gone
    assert _graphed(m) is m


# -- forwards with side effects ------------------------------------------------------------------
class Effect(Net):
    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.calls, self.log = kind, 0, []
        self.w = nn.Parameter(torch.ones(H))

    def forward(self, x):
        self._pre()
        y = super().forward(x) * self.w
        if self.kind == "counter":
            self.calls += 1
        elif self.kind == "new-tensor":
            self.aux = y.sum()
        elif self.kind == "keeps-input":
            self.last = x
        elif self.kind == "cache":
            self.cache = self.cache if getattr(self, "cache", None) is not None else y
            return self.cache
        elif self.kind == "input-hook":
            x.register_hook(lambda g: g)
        elif self.kind == "returns-input":
            return y, x
        elif self.kind == "log":
            self.log.append(1)
        return y

    def _pre(self) -> None:
        if self.kind == "param-update":
            with torch.no_grad():
                self.w.mul_(0.5)


@pytest.mark.parametrize("kind, message", [
    ("counter", "make_graphed_callables: the forward of callable 0 (Effect) changes its attribute 'calls' at every "
                "call (1, then 2); a graph replays GPU work only, so at replay it would keep its value. Keep such "
                "state in a tensor buffer updated in place (register_buffer and `.add_(1)`), or change it outside the "
                "graphed forward."),
    ("new-tensor", "make_graphed_callables: the forward of callable 0 (Effect) assigns a new tensor to its attribute "
                   "'aux' at every call; at replay it would keep the tensor of the capture (and autograd could not go "
                   "back through it). Return the tensor as an output, or update one tensor in place (`.copy_(...)`)."),
    ("keeps-input", "make_graphed_callables: the forward of callable 0 (Effect) keeps a reference to its input in "
                    "'last'; at every replay that would be te_graph's static input buffer, not the tensor you pass"),
    ("cache", "make_graphed_callables: the forward of callable 0 (Effect) keeps an output it made in 'cache' (a cache "
              "of results?)"),
    ("input-hook", "make_graphed_callables: the forward of callable 0 (Effect) registers a hook on its positional "
                   "input 0 (register_hook, retain_grad, ...)"),
    ("returns-input", "make_graphed_callables: callable 0 (Effect) returns its positional input 0 (or a view of it) "
                      "as output 1; a graph's outputs are buffers of its own"),
    ("log", "make_graphed_callables: the forward of callable 0 (Effect) changes its attribute 'log' (list) at every "
            "call (its length or items change between warmup passes)"),
    ("param-update", "make_graphed_callables: the forward of callable 0 (Effect) updates its parameter 'w' in place; a "
                     "graph would repeat that update at every replay, and warmup has already made it"),
])
def test_side_effects_a_graph_cannot_replay_are_refused_and_the_module_is_put_back(kind, message):
    m = Effect(kind)
    sample = (_x(),)
    # Nothing changes, but warmup's update of a parameter in place, which the message says
    # te_graph cannot take back (the module is checked below).
    with refused(ValueError, re.escape(message), *(() if kind == "param-update" else (m,))):
        make_graphed_callables(m, sample, eager_replay=True)
    assert "forward" not in m.__dict__ and m.calls == 0 and m.log == []
    assert not hasattr(m, "aux") and not hasattr(m, "last") and not hasattr(m, "cache")


def test_buffers_and_tensor_attributes_updated_in_place_are_followed_and_warmup_is_undone():
    class Stat(Net):
        def __init__(self):
            super().__init__()
            self.stat = torch.zeros(H)  # a plain attribute, not a buffer

        def forward(self, x):
            y = super().forward(x)
            with torch.no_grad():
                self.stat.add_(y.mean(dim=(0, 1)))
            return y

    torch.manual_seed(0)
    m = make_graphed_callables(Stat(), (_x(),), eager_replay=True)
    assert torch.equal(m.stat, torch.zeros(H)), "warmup's updates are undone"
    x = _x()
    m(x)
    assert not torch.equal(m.stat, torch.zeros(H)), "the call updates it"


def test_an_embedding_renormalising_rows_is_graphed_and_warmup_renormalises_nothing():
    torch.manual_seed(0)
    emb = nn.Embedding(16, H, max_norm=1.0)
    before = emb.weight.detach().clone()
    make_graphed_callables(emb, (torch.randint(0, 16, (S, B)),), eager_replay=True)
    assert torch.equal(emb.weight, before)


# -- calls a graph cannot serve ------------------------------------------------------------------
def test_a_second_call_before_the_first_ones_backward_is_refused_at_the_call():
    m = _graphed()
    y = m(_x())
    _refused(m, "callable 0 (Net): called again while the backward of its previous call has not run; a graph reuses "
                "its activations at every call, so that backward would read this call's.")
    weighted_loss(y).backward()
    m(_x())


def _trains_as_eager(make, inputs, loss_of, steps: int = 2) -> None:
    """``make()`` trained eagerly and through eager replay on the same inputs and loss
    ``loss_of(outputs)``: outputs, input and parameter gradients equal bit for bit."""
    torch.manual_seed(0)
    eager, module = make(), make()
    module.load_state_dict(eager.state_dict())
    graphed = make_graphed_callables(module, inputs(), eager_replay=True)
    for step in range(steps):
        seen = []
        for m in (eager, graphed):
            torch.manual_seed(step)
            args = inputs()
            out = m(*args)
            loss_of(out).backward()
            seen.append(([o.detach() for o in out], [a.grad for a in args],
                         [None if p.grad is None else p.grad.clone() for p in m.parameters()]))
        harness.assert_same(seen[1], seen[0], f"step {step}: outputs, input grads, parameter grads")


def test_a_loss_leaving_out_an_output_trains_as_eager():
    class Two(Net):
        def forward(self, x):
            y = super().forward(x)
            return y, torch.log(y.abs())

    _trains_as_eager(Two, lambda: (_x(),), lambda out: weighted_loss(out[0]))


def test_an_output_without_gradient_that_another_was_computed_from_trains_as_eager():
    """megatron-core's MoE layers, graphed up to token dispatch, return the router's
    probabilities beside the permuted ones computed from them and use only the latter: the
    zero gradient the graph takes for the former is added where the latter's arrives."""
    class Source(Net):
        def forward(self, x):
            h = torch.tanh(self.lin1(x))
            return self.lin2(self.drop(h)), h

    torch.manual_seed(0)
    eager, graphed = Source(), Source()
    graphed.load_state_dict(eager.state_dict())
    make_graphed_callables(graphed, (_x(),), eager_replay=True)
    for step in range(2):
        for m in (eager, graphed):
            torch.manual_seed(step)
            x = _x()
            weighted_loss(m(x)[0]).backward()
        harness.assert_same([p.grad for p in graphed.parameters()], [p.grad for p in eager.parameters()], f"step {step}")


class _WithMask(Net):
    """A second output computed from a second input only (a mask, with zeros), through log:
    zeros pushed through its backward turn into NaN there (0 / 0), in a node the first
    output's path shares."""

    def forward(self, x, mask):
        shared = mask * 2
        return super().forward(x) * shared, torch.log(shared)


def _mask(grad: bool = False) -> torch.Tensor:
    return torch.bernoulli(torch.full((S, B, H), 0.7)).requires_grad_(grad)


def test_an_output_computed_only_from_inputs_without_grad_takes_none_as_in_eager():
    """Eager autograd gives an output computed only from inputs that require no grad at a
    call no grad, and a loss may leave it out; so do the graphs at such a call, and train
    as eager. Where its input requires grad, the output does too, and a loss leaving it out
    trains as eager as well."""
    torch.manual_seed(0)
    eager, module = _WithMask(), _WithMask()
    module.load_state_dict(eager.state_dict())
    graphed = make_graphed_callables(module, (_x(), torch.rand(S, B, H, requires_grad=True) + 0.5),
                                     eager_replay=True)
    for step in range(2):
        for m in (eager, graphed):
            torch.manual_seed(step)
            x, mask = _x(), _mask()
            y, logged = m(x, mask)
            assert y.requires_grad and not logged.requires_grad
            weighted_loss(y).backward()
            m.seen = (y.detach().clone(), logged.clone(), x.grad)
        assert logged.isinf().any()  # the mask's zeros
        harness.assert_same(graphed.seen, eager.seen, f"step {step}: output, second output, input grad")
        for a, b in zip(eager.parameters(), module.parameters()):  # no NaN, no -0.0 for 0.0
            assert torch.equal(a.grad, b.grad) and torch.equal(a.grad.signbit(), b.grad.signbit())
    y, logged = graphed(_x(), _mask(grad=True))
    assert logged.requires_grad
    _trains_as_eager(_WithMask, lambda: (_x(), _mask(grad=True)), lambda out: weighted_loss(out[0]))


@pytest.mark.parametrize("kind", ["one-node-two-outputs", "path-without-gradient"])
def test_an_output_without_gradient_that_no_used_output_feeds_trains_as_eager(kind):
    """Where the used output's backward reaches the unused one's node but delivers it no
    gradient (both outputs of one node; a Function handing back None), eager autograd skips
    the unused one's part of the backward, where zeros pushed through could give NaN (0/0 in
    eigh's backward for repeated eigenvalues, sqrt at 0); the graphed callable skips it too."""
    class Eig(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(H, H, bias=False)

        def forward(self, x):
            a = self.lin(x)
            return torch.linalg.eigh(a + a.mT)

    class Sqrt(Net):
        def forward(self, x):
            d = self.lin1(x) - self.lin1(x).detach()
            s = torch.sqrt(d * d)
            return s, NoGrad.apply(s) + self.lin2(x)

    if kind == "one-node-two-outputs":
        _trains_as_eager(Eig, lambda: (torch.randn(H, H, requires_grad=True),), lambda out: weighted_loss(out[0]))
    else:
        _trains_as_eager(Sqrt, lambda: (_x(),), lambda out: weighted_loss(out[1]))


# -- call forms and keywords ---------------------------------------------------------------------
def test_a_class_or_over_nested_samples_are_named_before_warmup():
    with pytest.raises(TypeError, match=re.escape(
            "make_graphed_callables: callable 0 is the class Net, not an instance of it; pass the module you train "
            "(Net(...)), not its class.")):
        make_graphed_callables(Net, (_x(),), eager_replay=True)
    with pytest.raises(TypeError, match=re.escape(
            "make_graphed_callables: one callable was given, and its sample_args is a tuple holding a tuple of 1 "
            "tensor(s), which the forward would get as one tuple argument. For a single callable, sample_args is the "
            "tuple of its arguments: pass (x,), not ((x,),).")):
        make_graphed_callables(Net(), ((_x(),),), eager_replay=True)


class Keywords(Net):
    def __init__(self):
        super().__init__()
        self.drop.p = 0.0

    def forward(self, x, mask=None, rope=None, scale=1.0):
        y = super().forward(x)
        if mask is not None:
            y = y * mask
        if rope is not None:
            y = y * rope[0] + rope[1]
        return y * scale


def test_keywords_none_by_default_may_be_left_out_or_passed_as_none_and_nothing_else():
    torch.manual_seed(0)
    m = make_graphed_callables(Keywords(), (_x(),), sample_kwargs={"mask": torch.ones(S, B, 1)}, eager_replay=True)
    y = m(_x(), mask=torch.ones(S, B, 1), rope=None)  # rope was left out at capture; None is its default
    weighted_loss(y).backward()
    _refused(m, "callable 0 (Keywords): called with keyword arguments ['mask', 'scale'], but the graph was captured "
                "with ['mask']; pass the same keywords as sample_kwargs. Keywords left out at capture are accepted only "
                "as None where the callable defaults them to None; ['scale'] are not.",
             ValueError, lambda x: m(x, mask=torch.ones(S, B, 1), scale=None))
    # megatron-core's replay keywords of its fine-grained activation offloading are named.
    _refused(m, "['cuda_graph_event', 'cuda_graph_stream'] are not. (megatron-core passes cuda_graph_stream and "
                "cuda_graph_event with its fine-grained activation offloading, to replay the graphs on a stream of its "
                "own: te_graph does not support that yet; offload no module inside the graphs' scopes, or turn "
                "fine_grained_activation_offloading off.)",
             ValueError, lambda x: m(x, mask=torch.ones(S, B, 1), cuda_graph_stream=object(), cuda_graph_event=None))


def test_nested_keywords_are_static_inputs_and_their_structure_is_checked():
    torch.manual_seed(0)
    rope = (torch.randn(S, B, H), torch.randn(S, B, H))
    m = make_graphed_callables(Keywords(), (_x(),), sample_kwargs={"rope": rope}, eager_replay=True)
    reference = Keywords()
    reference.load_state_dict(m.state_dict())
    cos_sin = (torch.randn(S, B, H), torch.randn(S, B, H))
    x = _x()
    assert torch.equal(m(x, rope=cos_sin), reference(x, rope=cos_sin)), "each call's (cos, sin) is read"
    _refused(m, "callable 0 (Keywords): keyword argument 'rope' is shaped (*, *, *) but was (*, *) at capture "
                "(* = a leaf); pass it in the captured structure.",
             ValueError, lambda x: m(x, rope=cos_sin + (cos_sin[0],)))


# -- the RNG tracker found without being told ----------------------------------------------------
def test_the_process_tracker_is_ours_when_seeded_else_megatrons_else_transformer_engines():
    ours = rng.get_cuda_rng_tracker()
    assert rng.process_tracker() is ours  # unseeded, and nobody else's: ours
    megatron = types.ModuleType("megatron.core.tensor_parallel.random")
    theirs = rng.CudaRNGStatesTracker()
    theirs.add("model-parallel-rng", 1)
    megatron._CUDA_RNG_STATE_TRACKER, megatron._CUDA_RNG_STATE_TRACKER_INITIALIZED = theirs, True
    te = types.ModuleType("transformer_engine.pytorch.distributed")
    registry = {"model-parallel-rng": torch.Generator().manual_seed(2)}
    te.get_all_rng_states = lambda: registry
    saved = {name: sys.modules.get(name) for name in (megatron.__name__, te.__name__)}
    sys.modules[te.__name__] = te
    try:
        found = rng.process_tracker()
        assert isinstance(found, rng.TERegistryTracker) and found.get_states() == registry
        found.set_states({"model-parallel-rng": registry["model-parallel-rng"], "other": torch.Generator()})
        assert set(registry) == {"model-parallel-rng", "other"}, "the registry (TE's tracker's own dict) is updated in place"
        sys.modules[megatron.__name__] = megatron
        assert rng.process_tracker() is theirs
        rng.model_parallel_cuda_manual_seed(5)
        assert rng.process_tracker() is ours
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
