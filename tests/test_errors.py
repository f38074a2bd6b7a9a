"""Bad input to make_graphed_callables: the exact error, raised before anything changes."""
from __future__ import annotations

import dataclasses
import gc
import re

import pytest
import torch
from torch import nn

import rng
from checkpointing import checkpoint
from te_graph import make_graphed_callables
from tests import harness
from tests.harness import refused

CUDA = torch.cuda.is_available()


class Lin(nn.Module):
    def __init__(self, device="cpu"):
        super().__init__()
        self.lin = nn.Linear(4, 4, device=device)

    def forward(self, x, scale=1.0):
        return self.lin(x) * scale


def _x(device="cpu", requires_grad=True):
    return torch.randn(3, 4, device=device, requires_grad=requires_grad)


def test_a_positional_none_is_baked_in():
    """A positional None in the samples (Hugging Face's layer(h, mask, None, ...)) is a
    constant of the capture: a call passes None there, and a tensor there is refused, as is
    None where a tensor was."""
    class Optional_(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, extra=None, mask=None):
            y = self.lin(x) if extra is None else self.lin(x) + extra
            return y if mask is None else y * mask

    m = Optional_()
    make_graphed_callables(m, (_x(), None, _x(requires_grad=False)), eager_replay=True)
    m(_x(), None, _x(requires_grad=False)).sum().backward()
    x, extra, mask = _x(), _x(), _x(requires_grad=False)
    with refused(ValueError, re.escape("callable 0 (Optional_): positional argument 1 is a tensor (shape (3, 4), "
                                       "dtype torch.float32, device cpu), but was None at capture; a graph bakes a "
                                       "None in."), m):
        m(x, extra, mask)
    with refused(ValueError, re.escape("callable 0 (Optional_): positional input 2 has NoneType, but the graph was "
                                       "captured with shape (3, 4)"), m):
        m(x, None, None)


@pytest.mark.parametrize("make", [lambda: nn.GRU(4, 4, batch_first=True), lambda: nn.LSTM(4, 4, bidirectional=True)],
                         ids=["gru", "lstm"])
def test_torchs_recurrent_layers_are_refused_with_their_reason(make):
    """torch's RNN modules re-point their weights whenever their parameters change: refused
    by name, with nothing changed."""
    m, sample = make(), torch.randn(2, 3, 4, requires_grad=True)
    with refused(ValueError, re.escape(f"make_graphed_callables: callable 0 is a torch.nn.{type(m).__name__}, which "
                                       "te_graph does not graph"), m):
        make_graphed_callables(m, (sample,), eager_replay=True)


def test_reset_and_verify_check_every_argument_before_acting():
    """te_graph.reset(m, 5) and te_graph.verify(m, 5) refuse the 5 before m is reset or
    switched."""
    import te_graph
    from te_graph.resources import graphed_callable_of

    m = Lin()
    make_graphed_callables(m, (_x(),), eager_replay=True)
    graphed = graphed_callable_of(m)
    kind = type(graphed)
    for call, name in ((lambda: te_graph.reset(m, 5), "reset"), (lambda: te_graph.verify(m, 5), "verify")):
        with pytest.raises(TypeError, match=re.escape(f"te_graph.{name}(): int is not a graphed callable")):
            call()
        assert graphed_callable_of(m) is graphed and type(graphed) is kind, f"{name} acted before refusing"
    with pytest.raises(TypeError, match=re.escape("te_graph.verify(): options must be a te_graph.Verify, got int.")):
        te_graph.verify(m, options=5)
    m(_x()).sum().backward()


@pytest.mark.parametrize("bad", [5, "a", {1: 2}, [("y", 1)]], ids=["int", "str", "int-key", "pairs"])
def test_sample_kwargs_of_the_wrong_type_are_refused_clearly(bad):
    import te_graph

    m, x = Lin(), _x()
    with refused(TypeError, re.escape("make_graphed_callables: sample_kwargs holds "), m):
        make_graphed_callables(m, (x,), sample_kwargs=bad, eager_replay=True)
    with refused(TypeError, re.escape("make_graphed_step: sample_kwargs must be a dict of keyword name -> sample"), m):
        te_graph.make_graphed_step(lambda x: m(x).sum(), (x,), sample_kwargs=bad, modules=m, eager_replay=True)


def test_a_tracker_getter_returning_no_tracker_is_refused_clearly():
    import te_graph

    m, x = Lin(), _x()
    for who, call in (("make_graphed_callables", lambda: make_graphed_callables(
            m, (x,), get_rng_state_tracker=lambda: 5, eager_replay=True)),
            ("make_graphed_step", lambda: te_graph.make_graphed_step(
                lambda x: m(x).sum(), (x.detach(),), modules=m, get_rng_state_tracker=lambda: 5, eager_replay=True))):
        with refused(TypeError, re.escape(f"{who}: get_rng_state_tracker() returned 5 (int), which has no "
                                          "get_states, set_states, fork"), m):
            call()


def test_order_and_megatron_enable_arguments_of_the_wrong_type_are_refused_clearly():
    from te_graph.integrations import megatron

    m, x = Lin(), _x()
    with refused(TypeError, re.escape("make_graphed_callables: order must be a list or tuple of ints (TE's _order: "
                                      "+c the forward of chunk c, -c its backward, in the order they run), got 5 "
                                      "(int)."), m):
        make_graphed_callables((m,), ((x,),), order=5, eager_replay=True)
    with pytest.raises(TypeError, match=re.escape("te_graph.integrations.megatron.enable(): recompute must be True or "
                                                  "False, got 'no' (str).")):
        megatron.enable(recompute="no")


def test_non_tensor_positional_sample_arg():
    m = Lin()
    sample = (_x(), 2.0)
    with refused(TypeError, r"positional sample arg 1 of callable 0 \(Lin\) is a float; positional sample args must be tensors .* Pass constants as sample_kwargs instead", m):
        make_graphed_callables(m, sample, eager_replay=True)


def test_hooks_on_a_submodule():
    m = Lin()
    m.lin.register_forward_hook(lambda *a: None)
    sample = (_x(),)
    with refused(ValueError, r"submodule 'lin' of callable 0 has hooks registered \(_forward_hooks\); hooks would run only during capture, never at replay\. Remove them before graphing .*or pass them as capture_time_hooks=\.\.\.", m):
        make_graphed_callables(m, sample, eager_replay=True)


def test_buffer_requiring_grad():
    m = Lin()
    m.register_buffer("running", torch.zeros(4, requires_grad=True))
    with pytest.raises(ValueError, match=r"buffer 'running' of callable 0 requires grad; only parameters may be trainable in a graphed module\. Make it a Parameter or call \.requires_grad_\(False\)"):
        make_graphed_callables(m, (_x(),), eager_replay=True)


def test_mixed_training_modes():
    a, b = Lin(), Lin().eval()
    with pytest.raises(ValueError, match=r"callables are in mixed training modes \(callable 0 is in train mode, callable 1 in eval mode\).*Call \.train\(\) or \.eval\(\) on all of them"):
        make_graphed_callables((a, b), ((_x(),), (_x(),)), eager_replay=True)


def test_sample_count_mismatch():
    with pytest.raises(ValueError, match=r"Got 2 callables but 1 sample_args; without an order each callable takes exactly one sample args tuple"):
        make_graphed_callables((Lin(), Lin()), ((_x(),),), eager_replay=True)
    with pytest.raises(ValueError, match=r"got 1 sample_args but 2 sample_kwargs; give one dict of sample kwargs per tuple of sample args"):
        make_graphed_callables((Lin(),), ((_x(),),), sample_kwargs=({}, {}), eager_replay=True)


def test_zero_warmup_iterations():
    with pytest.raises(ValueError, match=r"num_warmup_iters=0; at least 1 warmup pass is needed"):
        make_graphed_callables(Lin(), (_x(),), num_warmup_iters=0, eager_replay=True)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda: torch.randn(5, 4, requires_grad=True), r"positional input 0 has shape \(5, 4\), dtype torch.float32, device cpu, but the graph was captured with shape \(3, 4\)"),
        (lambda: torch.randn(3, 4, dtype=torch.float64, requires_grad=True), r"positional input 0 has shape \(3, 4\), dtype torch.float64, device cpu, but the graph was captured with shape \(3, 4\), dtype torch.float32"),
    ],
    ids=["shape", "dtype"],
)
def test_replay_input_mismatch(bad, message):
    graphed = make_graphed_callables(Lin(), (_x(),), eager_replay=True)
    with pytest.raises(ValueError, match=message + r".*A graph replays fixed shapes"):
        graphed(bad())


def test_replay_input_requiring_grad_that_the_sample_did_not():
    graphed = make_graphed_callables(Lin(), (_x(requires_grad=False),), eager_replay=True)
    graphed(_x(requires_grad=False))
    with pytest.raises(ValueError, match=r"positional input 0 requires grad, but its sample did not, so the graph computes no gradient for it\. Capture with a sample that requires grad"):
        graphed(_x())


def test_replay_constant_kwarg_must_match():
    graphed = make_graphed_callables(Lin(), (_x(),), sample_kwargs={"scale": 2.0}, eager_replay=True)
    graphed(_x(), scale=2.0)
    with pytest.raises(ValueError, match=r"keyword argument 'scale' is 3.0 but was 2.0 at capture; non-tensor keyword arguments are baked into the graph"):
        graphed(_x(), scale=3.0)
    with pytest.raises(ValueError, match=r"called with keyword arguments \[\], but the graph was captured with \['scale'\]"):
        graphed(_x())


@pytest.mark.parametrize("captured, called", [(1, 1.0), (1.0, 1), (1, True), (0.0, -0.0)],
                         ids=["int-then-float", "float-then-int", "int-then-bool", "zero-then-minus-zero"])
def test_replay_constant_kwarg_equal_in_python_but_not_to_the_forward_is_refused(captured, called):
    """1, 1.0 and True are equal in Python, but a tensor times each has another dtype; 0.0 and
    -0.0 are equal, but copysign tells them apart: the forward would see another value."""
    graphed = make_graphed_callables(Lin(), (_x(),), sample_kwargs={"scale": captured}, eager_replay=True)
    graphed(_x(), scale=captured)
    with pytest.raises(ValueError, match=r"keyword argument 'scale'.* is .* but was .* at capture; non-tensor keyword "
                                         r"arguments are baked into the graph"):
        graphed(_x(), scale=called)


def test_replay_constant_kwarg_nan_is_the_captured_nan():
    graphed = make_graphed_callables(Lin(), (_x(),), sample_kwargs={"scale": float("nan")}, eager_replay=True)
    graphed(_x(), scale=float("nan"))  # another NaN object, the same value


@pytest.mark.skipif(CUDA, reason="checks the CPU-only machine's error")
def test_cuda_unavailable_points_to_eager_replay():
    with pytest.raises(RuntimeError, match=r"CUDA is not available, and capturing CUDA graphs needs a CUDA device\. To debug on a machine without graphs, pass eager_replay=True \(or set TE_GRAPH_EAGER_REPLAY=1\)"):
        make_graphed_callables(Lin(), (_x(),))


def test_order_spellings_and_unknown_keywords_are_named():
    with pytest.raises(TypeError, match=r"got both order= and _order=; pass one of them"):
        make_graphed_callables((Lin(),), ((_x(),),), order=[1, -1], _order=[1, -1], eager_replay=True)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bogus'; see help\(te_graph.make_graphed_callables\)"):
        make_graphed_callables(Lin(), (_x(),), bogus=1, eager_replay=True)
    # A misspelt keyword gets the close name.
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'num_warmup_iter'; did you mean 'num_warmup_iters'\?"):
        make_graphed_callables(Lin(), (_x(),), num_warmup_iter=2, eager_replay=True)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'reuse_graph_input_output_buffer'; did you mean 'reuse_graph_input_output_buffers'\?"):
        make_graphed_callables(Lin(), (_x(),), reuse_graph_input_output_buffer=True, eager_replay=True)
    # TE's spelling of the order works the same as ours (one layer, two microbatches).
    assert len(make_graphed_callables((Lin(),), ((_x(),), (_x(),)), _order=[1, 1, -1, -1], eager_replay=True)) == 2


def test_failed_capture_leaves_process_and_model_as_they_were():
    class Fails(Lin):
        calls = 0

        def forward(self, x):
            Fails.calls += 1
            y = torch.nn.functional.dropout(self.lin(x), 0.5)
            if Fails.calls == 2:
                raise RuntimeError("boom in the second warmup pass")
            return y

    rng.model_parallel_cuda_manual_seed(3)
    m = Fails()
    m.lin.weight.grad = torch.ones_like(m.lin.weight)
    sample = (_x(),)
    with refused(RuntimeError, "boom in the second warmup pass", m):  # grads and RNG put back
        make_graphed_callables(m, sample, eager_replay=True)
    assert torch.equal(m.lin.weight.grad, torch.ones_like(m.lin.weight)), "grads put back"
    assert m.lin.bias.grad is None
    assert gc.isenabled()


# -- parameter gradients the graph adds to .grad itself ---------------------------------------
# Where nothing observes a parameter's gradient at a call's forward, the graph (and eager
# replay's nested backward) adds it to .grad without autograd. What would need autograd's own
# accumulation later in that call's life is refused at its backward; the same programs pass
# with accumulate_grads_in_graph=False, bitwise equal to eager.


def _two_layers(device):
    torch.manual_seed(0)
    return Lin(device), Lin(device)


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_a_parameter_hook_registered_after_the_forward_is_refused_at_the_backward(device, eager_replay):
    m = Lin(device)
    graphed = make_graphed_callables(m, (_x(device),), eager_replay=eager_replay)
    y = graphed(_x(device))
    m.lin.weight.register_hook(lambda g: g * 0)
    with refused(RuntimeError, r"callable 0 \(Lin\): a gradient hook \(or main_grad\) was put on one of "
                 r"its parameters after this call's forward and before its backward; .* Register parameter "
                 r"hooks before the forward, or pass accumulate_grads_in_graph=False", m):
        y.sum().backward()
    del y  # the refused call's result (its backward would be refused again)
    # Registered before the next forward, the hook runs, as in eager.
    y = graphed(_x(device))
    y.sum().backward()
    assert torch.equal(m.lin.weight.grad, torch.zeros_like(m.lin.weight))
    assert m.lin.bias.grad.abs().sum() > 0


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
@pytest.mark.parametrize("use", ["regulariser", "input"])
def test_a_parameter_reached_outside_the_call_in_its_backward_is_refused_unless_through_autograd(
        device, eager_replay, use):
    """An L2 term on a graphed layer's weight in the loss, or the weight passed to the call as
    an input: eager autograd sums the gradient of each use before adding it to .grad."""

    def loss_of(m, call):
        penalty = (m.lin.weight ** 2).sum() * 0.1
        x = _x(device)
        y = call(x, scale=m.lin.weight[0]) if use == "input" else call(x)
        return (y * torch.linspace(-1, 1, 4, device=device)).sum() + penalty

    class Scaled(Lin):
        def forward(self, x, scale=None):
            return self.lin(x) * (1.0 if scale is None else scale)

    torch.manual_seed(0)
    m = Scaled(device)
    kwargs = {"scale": m.lin.weight[0].detach().clone().requires_grad_()} if use == "input" else {}
    graphed = make_graphed_callables(m, (_x(device),), sample_kwargs=kwargs, eager_replay=eager_replay)
    # Autograd adds the other use's gradient to the .grad the graph filled: found when the backward ends.
    with pytest.raises(RuntimeError, match=r"callable 0 \(Scaled\): this backward reaches parameter 'lin\.weight' by "
                       r"another way too .*\(the \.grad this backward left is not eager's: zero the gradients before "
                       r"training on\)\. Pass accumulate_grads_in_graph=False"):
        loss_of(m, graphed).backward()
    # Through autograd, every use's gradient is summed first: bitwise eager.
    torch.manual_seed(0)
    m, reference = Scaled(device), Scaled(device)
    reference.load_state_dict(m.state_dict())
    graphed = make_graphed_callables(m, (_x(device),), sample_kwargs=kwargs, eager_replay=eager_replay,
                                     accumulate_grads_in_graph=False)
    for step in range(2):
        torch.manual_seed(10 + step)
        loss_of(m, graphed).backward()
        torch.manual_seed(10 + step)
        loss_of(reference, reference).backward()
        harness.assert_same([p.grad for p in m.parameters()], [q.grad for q in reference.parameters()],
                            f"step {step}: parameter grads")


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_a_weight_tied_across_two_graphing_calls_trains_exactly(device, eager_replay):
    """Tied in one call, exact (tests/test_silent.py); graphed by two calls, the second call's
    gradient goes through autograd, and so does the first call's from then on: autograd sums
    both uses first, as in eager code. Three steps of gradient accumulation, bitwise."""
    first, second = _two_layers(device)
    second.lin.weight = first.lin.weight
    ref_first, ref_second = _two_layers(device)
    ref_second.lin.weight = ref_first.lin.weight
    ref_first.load_state_dict(first.state_dict())
    ref_second.lin.bias = nn.Parameter(second.lin.bias.detach().clone())
    a = make_graphed_callables(first, (_x(device),), eager_replay=eager_replay)
    b = make_graphed_callables(second, (_x(device),), eager_replay=eager_replay)
    for step in range(3):
        for f, g in ((a, b), (ref_first, ref_second)):
            torch.manual_seed(step)
            (g(torch.tanh(f(_x(device)))) * torch.linspace(-1, 1, 4, device=device)).sum().backward()
    harness.assert_same([p.grad for p in (first.lin.weight, first.lin.bias, second.lin.bias)],
                        [p.grad for p in (ref_first.lin.weight, ref_first.lin.bias, ref_second.lin.bias)],
                        "a weight tied across two graphing calls, three accumulated backwards")


def _selective_backwards(device):
    """Backwards asked for some tensors' gradients, each as a function of (loss, model, x)."""
    return [
        lambda loss, m, x: loss.backward(inputs=[m[1].lin.weight]),
        lambda loss, m, x: loss.backward(inputs=[x, m[0].lin.bias]),
        lambda loss, m, x: [setattr(p, "grad", g) for p, g in zip(
            (m[0].lin.weight, m[1].lin.bias), torch.autograd.grad(loss, [m[0].lin.weight, m[1].lin.bias]))],
        lambda loss, m, x: setattr(x, "grad", torch.autograd.grad(loss, [x])[0]),
        lambda loss, m, x: loss.backward(),
    ]


@pytest.mark.parametrize("observed", ["hook", "regulariser-and-hook", "tied-across-callables", "none"])
@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_backwards_asked_for_some_gradients_equal_eager(device, eager_replay, observed):
    """torch.autograd.grad and backward(inputs=...) over parameters and inputs of graphed layers,
    where a hook observes a parameter's gradient (the graphs hand the gradients to autograd),
    where weights are tied across the callables, and where nothing observes them (the graph
    adds them to .grad itself): each parameter's and the input's gradient as eager's, bitwise."""
    def build():
        first, second = _two_layers(device)
        if observed == "tied-across-callables":
            second.lin.weight = first.lin.weight
        model = nn.ModuleList([first, second])
        if observed != "none" and observed != "tied-across-callables":
            model[0].lin.weight.register_hook(lambda g: g * 1.0)
        return model

    def loss_of(m, calls, x):
        y = calls[1](torch.tanh(calls[0](x)))
        extra = (m[0].lin.weight ** 2).sum() * 1e-3 if observed == "regulariser-and-hook" else 0.0
        return (y * torch.linspace(-1, 1, 4, device=device)).sum() + extra

    graphed_model, reference = build(), build()
    reference.load_state_dict(graphed_model.state_dict())
    calls = make_graphed_callables(tuple(graphed_model), ((_x(device),), (_x(device),)), eager_replay=eager_replay)
    for step, backward in enumerate(_selective_backwards(device)):
        for m, f in ((graphed_model, calls), (reference, list(reference))):
            torch.manual_seed(step)
            x = _x(device)
            backward(loss_of(m, f, x), m, x)
            m.x = x
        harness.assert_same([p.grad for p in graphed_model.parameters()] + [graphed_model.x.grad],
                            [p.grad for p in reference.parameters()] + [reference.x.grad], f"backward {step}")


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_inputs_sharing_memory_with_one_the_forward_updates_are_refused(device, eager_replay):
    class Accumulates(Lin):
        def forward(self, x, acc=None, bias=None):
            acc.add_(1.0)  # a running statistic passed in, then the other keyword read
            return self.lin(x) + bias

    m = Accumulates(device)
    samples = {"acc": torch.zeros(4, device=device), "bias": torch.zeros(4, device=device)}
    graphed = make_graphed_callables(m, (_x(device),), sample_kwargs=samples, eager_replay=eager_replay)
    t = torch.zeros(4, device=device)
    with pytest.raises(RuntimeError, match=r"callable 0 \(Accumulates\): inputs 1 and 2 share memory, and the forward "
                       r"updates input 1 in place; .* Pass tensors that do not share memory"):
        graphed(_x(device), acc=t, bias=t)
    assert torch.equal(t, torch.zeros(4, device=device)), "nothing ran"
    acc, bias = torch.zeros(4, device=device), torch.zeros(4, device=device)
    graphed(_x(device), acc=acc, bias=bias)
    assert torch.equal(acc, torch.ones(4, device=device))
    # Disjoint slices of one buffer share no bytes: accepted, as in eager.
    buffer = torch.zeros(8, device=device)
    y = graphed(_x(device), acc=buffer[:4], bias=buffer[4:])
    assert torch.equal(buffer, torch.tensor([1.0] * 4 + [0.0] * 4, device=device))
    del y


class TwoHeads(nn.Module):
    """Output 0's backward reads it (ReLU's keeps its result); output 1's does not."""

    def __init__(self, device="cpu"):
        super().__init__()
        self.lin = nn.Linear(4, 4, device=device)

    def forward(self, x):
        h = self.lin(x)
        return torch.relu(h), h * 2.0


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
@pytest.mark.parametrize("warmup", [3, 1], ids=["warmup3", "warmup1"])
def test_an_output_the_backward_reads_updated_in_place_is_refused_as_eager_autograd_refuses_it(
        device, eager_replay, warmup):
    torch.manual_seed(0)
    m = TwoHeads(device)
    eager = TwoHeads(device)
    eager.load_state_dict(m.state_dict())
    graphed = make_graphed_callables(m, (_x(device),), eager_replay=eager_replay, num_warmup_iters=warmup)
    weights = torch.linspace(-1, 1, 4, device=device)

    def step(call, update):
        a, b = call(_x(device))
        update(a, b)
        ((a * weights).sum() + (b * weights).sum()).backward()

    def update_a(a, b):
        a.add_(1.0)

    def update_b(a, b):
        b.mul_(3.0)

    # Output 0 updated in place: eager autograd refuses the backward, and so does te_graph.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step(eager, update_a)
    # the refused backward changes nothing (the step draws its own input: the streams move)
    with refused(RuntimeError, r"callable 0 \(TwoHeads\): an output of this call was updated in place "
                 r"after its forward, and the backward reads that output.*modified by an inplace operation.*"
                 r"Update a copy of the output", m, random=False):
        step(graphed, update_a)
    eager.zero_grad(set_to_none=True)
    # Output 1 updated in place: its backward does not read it, so eager trains on, and so
    # does te_graph, bitwise, where warmup could find that out (two passes or more).
    for _ in range(2):
        torch.manual_seed(1)
        step(eager, update_b)
        torch.manual_seed(1)
        if warmup == 1:
            with pytest.raises(RuntimeError, match=r"an output of this call was updated in place .* \(with "
                               r"num_warmup_iters=1 te_graph cannot tell which outputs the backward reads, and "
                               r"takes every one as read; graph with num_warmup_iters >= 2"):
                step(graphed, update_b)
            return
        step(graphed, update_b)
    harness.assert_same([p.grad for p in m.parameters()], [q.grad for q in eager.parameters()])


class Router(nn.Module):
    """Returns top-k values and indices: the indices need no grad, and the backward reads them."""

    def __init__(self, device="cpu"):
        super().__init__()
        self.lin = nn.Linear(4, 4, device=device)

    def forward(self, x):
        return self.lin(x).topk(2, dim=-1)


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_an_output_without_grad_the_backward_reads_updated_in_place_is_refused(device, eager_replay):
    """An MoE router shifting its expert indices in place (indices += offset) after the call:
    eager autograd refuses the backward, which scatters by those indices."""
    torch.manual_seed(0)
    m = Router(device)
    eager = Router(device)
    eager.load_state_dict(m.state_dict())
    graphed = make_graphed_callables(m, (_x(device),), eager_replay=eager_replay)

    def step(call):
        values, indices = call(_x(device))
        indices.add_(1)
        values.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step(eager)
    with refused(RuntimeError, r"callable 0 \(Router\): an output of this call was updated in place", m, random=False):
        step(graphed)  # draws its own input


class Checkpointed(Lin):
    def forward(self, x):
        return checkpoint(self.lin, x, use_reentrant=True)


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_a_reentrant_checkpoint_fed_an_input_without_grad_is_refused_as_eager_refuses_it(device, eager_replay):
    """The graphs run no checkpoint code at replay: te_graph raises what eager code raises,
    before anything runs; under no_grad the call runs, as in eager."""
    torch.manual_seed(0)
    m = Checkpointed(device)
    eager = Checkpointed(device)
    eager.load_state_dict(m.state_dict())
    graphed = make_graphed_callables(m, (_x(device),), eager_replay=eager_replay)
    x = _x(device, requires_grad=False)
    with pytest.raises(ValueError, match=r"checkpoint\(use_reentrant=True\): no tensor argument requires grad"):
        eager(x)
    with pytest.raises(ValueError, match=r"callable 0 \(Checkpointed\): no input its outputs are computed from "
                       r"requires grad at this call, and its forward runs checkpoint\(use_reentrant=True\)"):
        graphed(x)
    with torch.no_grad():
        assert torch.equal(graphed(x), eager(x))


def test_a_keyword_object_holding_tensors_is_refused_at_graphing():
    """Not a pytree, such an object (Megatron's PackedSeqParams, a dataclass of cu_seqlens)
    would be compared as a constant while the graph reads its tensors by address."""

    @dataclasses.dataclass
    class SequenceInfo:
        cu_seqlens: torch.Tensor

    class Packed(Lin):
        def forward(self, x, info=None):
            return self.lin(x) * info.cu_seqlens[-1]

    m = Packed()
    sample = (_x(),)
    with refused(TypeError, r"keyword argument 'info' of callable 0 \(Packed\) is a SequenceInfo holding "
                 r"tensors \(its 'cu_seqlens'\), which is not a pytree: .* register the class as a pytree node", m):
        make_graphed_callables(m, sample, sample_kwargs={"info": SequenceInfo(torch.tensor([0, 3]))},
                               eager_replay=True)
    # A module passed along is model state, read by address like the callable's own: accepted.

    class Activated(Lin):
        def forward(self, x, act=None):
            return act(self.lin(x))

    m, act, x = Activated(), nn.Tanh(), torch.ones(3, 4)
    want = m(x, act=act)
    graphed = make_graphed_callables(m, (_x(),), sample_kwargs={"act": act}, eager_replay=True)
    assert torch.equal(graphed(x, act=act), want)

    # So is a framework object that is no dataclass, whatever tensors it keeps of its own
    # (a DeviceMesh's rank map): only dataclass records are taken for data.
    class Mesh:
        def __init__(self):
            self.rank_map = torch.arange(2)

    class Meshed(Lin):
        def forward(self, x, mesh=None):
            return self.lin(x)

    mesh, m = Mesh(), Meshed()
    graphed = make_graphed_callables(m, (_x(),), sample_kwargs={"mesh": mesh}, eager_replay=True)
    assert torch.equal(graphed(x, mesh=mesh), m.lin(x))


# -- GPU-only errors --------------------------------------------------------------------
@pytest.mark.gpu
def test_cpu_tensors_to_graph_capture():
    with pytest.raises(ValueError, match=r"callable 0 \(Lin\) has a tensor on cpu .*CUDA graphs capture CUDA tensors only\. Move the module and its inputs to CUDA\. To debug on a machine without graphs, pass eager_replay=True"):
        make_graphed_callables(Lin("cpu"), (_x("cpu"),))


@pytest.mark.gpu
def test_autocast_cache_enabled():
    m = Lin("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match=r"autocast is enabled with its cache.*Use torch\.autocast\(\.\.\., cache_enabled=False\)"):
            make_graphed_callables(m, (_x("cuda"),))
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        graphed = make_graphed_callables(m, (_x("cuda"),))
        y = graphed(_x("cuda"))
    assert y.dtype == torch.bfloat16


@pytest.mark.gpu
def test_replay_input_on_another_device():
    graphed = make_graphed_callables(Lin("cuda"), (_x("cuda"),))
    here = f"cuda:{torch.cuda.current_device()}"
    with pytest.raises(ValueError, match=r"positional input 0 has shape \(3, 4\), dtype torch.float32, device cpu, but the graph was captured with shape \(3, 4\), dtype torch.float32, device " + here):
        graphed(_x("cpu"))


@pytest.mark.gpu
def test_failed_graph_capture_leaves_process_usable():
    """A capture that fails inside the graph (a host sync is illegal while capturing)
    leaves the model, RNG and CUDA usable; graphing a good module afterwards works."""

    class Syncs(Lin):
        def forward(self, x):
            y = self.lin(x)
            if torch.cuda.is_current_stream_capturing():
                y.sum().item()  # illegal during capture
            return y

    rng.model_parallel_cuda_manual_seed(4)
    m = Syncs("cuda")
    forward = m.forward
    sample = (_x("cuda"),)
    before = rng.get_rng_state("cuda").get_offset()
    with pytest.raises(RuntimeError):
        make_graphed_callables(m, sample)
    assert m.forward == forward
    assert all(p.grad is None for p in m.parameters())
    assert rng.get_rng_state("cuda").get_offset() == before
    assert gc.isenabled()
    good = make_graphed_callables(Lin("cuda"), (_x("cuda"),))
    good(_x("cuda")).sum().backward()
    torch.cuda.synchronize()


# -- host waits inside a graphed callable ----------------------------------------------------------
def _event_wait(y):
    event = torch.cuda.Event()
    event.record()
    event.synchronize()


# What the forward does after its linear, and how the refusal names it: the waits te_graph
# refuses before CUDA sees them by name; the implicit ones through CUDA's capture error.
HOST_WAITS = {
    "item": (lambda y: y.sum().item(), "an operation CUDA does not allow during capture"),
    "cpu": (lambda y: y.cpu(), "an operation CUDA does not allow during capture"),
    "tolist": (lambda y: y[0].tolist(), "an operation CUDA does not allow during capture"),
    "nonzero": (lambda y: torch.nonzero(y > 0), "an operation CUDA does not allow during capture"),
    "boolean-mask": (lambda y: y[y > 0], "an operation CUDA does not allow during capture"),
    "event-synchronize": (_event_wait, "torch.cuda.Event.synchronize()"),
    "stream-synchronize": (lambda y: torch.cuda.current_stream().synchronize(), "torch.cuda.Stream.synchronize()"),
    "device-synchronize": (lambda y: torch.cuda.synchronize(), "torch.cuda.synchronize()"),
}


class Waits(nn.Module):
    """A linear, dropout, then a host wait (``wait``), always or only outside a capture."""

    def __init__(self, wait, guarded=False):
        super().__init__()
        self.lin, self.drop, self.wait, self.guarded = nn.Linear(4, 4, device="cuda"), nn.Dropout(0.5), wait, guarded

    def forward(self, x):
        y = self.drop(self.lin(x))
        if not (self.guarded and torch.cuda.is_current_stream_capturing()):
            self.wait(y)
        return y


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(HOST_WAITS))
def test_a_host_wait_is_refused_by_name_and_the_layer_then_trains_eagerly(kind):
    from te_graph.capture.host_sync import HostSyncError  # noqa: PLC0415

    wait, op = HOST_WAITS[kind]
    rng.model_parallel_cuda_manual_seed(4)
    m = Waits(wait)
    sample = (_x("cuda"),)
    offset = torch.cuda.default_generators[torch.cuda.current_device()].get_offset()
    with refused(HostSyncError, "", m) as raised:
        make_graphed_callables(m, sample)
    text = str(raised.value)
    assert text.startswith(f"make_graphed_callables: callable 0 (Waits) waits for the GPU from the host while it "
                           f"is captured: {op}"), text
    assert re.search(r" at tests/test_errors\.py:\d+ \(`", text), text
    assert "Graph the parts before and after it separately" in text and "were left as they were" in text
    assert torch.cuda.default_generators[torch.cuda.current_device()].get_offset() == offset
    assert gc.isenabled()
    # The layer trains eagerly, dropout included (the generators left capture mode).
    m(_x("cuda")).sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    good = make_graphed_callables(Lin("cuda"), (_x("cuda"),))
    good(_x("cuda")).sum().backward()
    torch.cuda.synchronize()


class _WaitsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, g):
        torch.cuda.synchronize()  # runs on autograd's worker thread, in the captured backward
        return g * 2


class _BackwardWaits(Lin):
    def forward(self, x):
        return _WaitsInBackward.apply(self.lin(x))


@pytest.mark.gpu
def test_a_host_wait_in_a_backward_is_refused_by_name():
    from te_graph.capture.host_sync import HostSyncError  # noqa: PLC0415

    with pytest.raises(HostSyncError, match=re.escape(
            "make_graphed_callables: callable 0 (_BackwardWaits) waits for the GPU from the host while it is captured")):
        make_graphed_callables(_BackwardWaits("cuda"), (_x("cuda"),))


@pytest.mark.gpu
def test_a_host_wait_skipped_while_capturing_is_not_refused():
    """Code that skips its host read under capture graphs (and trains as eager)."""
    rng.model_parallel_cuda_manual_seed(4)
    eager, graphed = Waits(HOST_WAITS["item"][0], guarded=True), Waits(HOST_WAITS["item"][0], guarded=True)
    graphed.load_state_dict(eager.state_dict())
    make_graphed_callables(graphed, (_x("cuda"),))
    x = _x("cuda")
    for m in (eager, graphed):
        rng.model_parallel_cuda_manual_seed(5)
        m(x).sum().backward()
    harness.assert_same([p.grad for p in graphed.parameters()], [p.grad for p in eager.parameters()], "parameter grads")


def test_only_cuda_stream_capture_errors_are_told_as_host_waits():
    from te_graph.capture.host_sync import HostSyncError, refusal_of  # noqa: PLC0415

    def raised(text):
        try:
            raise RuntimeError(text)  # this line is where the "wait" happens
        except RuntimeError as error:
            return error

    told = refusal_of("callable 0 (Net)", raised("CUDA error: operation not permitted when stream is capturing"))
    assert isinstance(told, HostSyncError)
    assert str(told).startswith(
        "make_graphed_callables: callable 0 (Net) waits for the GPU from the host while it is captured: an operation "
        "CUDA does not allow during capture (CUDA error: operation not permitted when stream is capturing) at "
        "tests/test_errors.py:"), str(told)
    assert "raise RuntimeError(text)" in str(told)
    assert refusal_of("callable 0 (Net)", raised(
        "Cannot call CUDAGeneratorImpl::current_seed during CUDA graph capture")) is None
    assert refusal_of("callable 0 (Net)", ValueError("stream is capturing")) is None
    # A refusal raised on autograd's worker thread, where the graph's name is unknown, is named again.
    import traceback  # noqa: PLC0415

    unnamed = HostSyncError("make_graphed_callables: a graphed callable waits ...",
                            ("torch.cuda.synchronize()", traceback.extract_stack()))
    assert str(refusal_of("callable 2 (Block)", unnamed)).startswith(
        "make_graphed_callables: callable 2 (Block) waits for the GPU from the host while it is captured: "
        "torch.cuda.synchronize() at tests/test_errors.py:")


def test_host_wait_patches_are_owned_once_and_put_back_when_the_last_capture_window_closes():
    """The patched waits (refused on a GPU while a stream captures: the tests above) are
    installed once for overlapping capture windows, even of two threads interleaving, and
    the originals are back when the last window closes; outside a capture they go through."""
    import threading  # noqa: PLC0415

    from te_graph.capture.host_sync import waits_refused  # noqa: PLC0415

    original = torch.cuda.synchronize
    a_open, b_open, a_closed = threading.Event(), threading.Event(), threading.Event()

    def window_b():
        with waits_refused("callable 1 (B)"):
            b_open.set()
            a_closed.wait(10)

    with waits_refused("callable 0 (A)"):
        patched = torch.cuda.synchronize
        assert patched is not original and patched.__wrapped__ is original
        worker = threading.Thread(target=window_b)
        worker.start()
        b_open.wait(10)
        assert torch.cuda.synchronize is patched  # not stacked
        a_open.set()
    assert torch.cuda.synchronize is patched  # B's window is still open
    a_closed.set()
    worker.join()
    assert torch.cuda.synchronize is original
    if not torch.cuda.is_available():
        with waits_refused("callable 0 (A)"):
            with pytest.raises(Exception) as outside:  # not capturing: torch's own call ran
                torch.cuda.synchronize()
            assert "waits for the GPU" not in str(outside.value)


# -- refused before anything changes: the module, its grads and buffers, the RNG ------------------
def _refused(error, message, call, *things):
    """``call()`` is refused as tests/harness.py defines it, with streams in the RNG tracker
    for the snapshot to compare."""
    rng.model_parallel_cuda_manual_seed(11)
    with refused(error, message, *things):
        call()


X = _x()  # samples made once: a refused call must not even move the CPU generator
X1 = (X,)
X2 = ((X,), (_x(),))


def test_bad_call_forms_are_refused():
    a, b = Lin(), Lin()
    _refused(TypeError, re.escape("sample_kwargs is one dict, but several callables were given; pass a tuple with one dict per callable"),
             lambda: make_graphed_callables((a, b), (X2), sample_kwargs={"scale": 1.0}, eager_replay=True), a, b)
    _refused(TypeError, re.escape("modules is an nn.ModuleList, which has no forward to graph; pass tuple(module_list)"),
             lambda: make_graphed_callables(nn.ModuleList([a, b]), (X2), eager_replay=True), a, b)
    _refused(TypeError, re.escape("modules is a generator; pass a tuple (tuple(...))"),
             lambda: make_graphed_callables((m for m in (a, b)), (X2), eager_replay=True), a, b)
    _refused(TypeError, re.escape("sample_args is a single tensor for 2 callables; give a tuple with one tuple of sample tensors per callable"),
             lambda: make_graphed_callables((a, b), X, eager_replay=True), a, b)
    _refused(TypeError, re.escape("num_warmup_iters must be an int, got '3' (str)."),
             lambda: make_graphed_callables(a, X1, num_warmup_iters="3", eager_replay=True), a)
    _refused(TypeError, re.escape("pool is a str; pass te_graph.graph_pool_handle(), a torch.cuda.MemPool, or a graphed callable"),
             lambda: make_graphed_callables(a, X1, pool="mine"), a)
    _refused(TypeError, re.escape("got both modules and callables=; pass one of them."),
             lambda: make_graphed_callables(a, X1, callables=a, eager_replay=True), a)


@pytest.mark.parametrize("returns", [None, 3], ids=["None", "int"])
def test_callable_returning_no_tensor(returns):
    def f(x):
        x.sum()
        return returns

    _refused(ValueError, re.escape(f"callable 0 (f) returned {returns!r}, which holds no tensor; a graphed callable must return a tensor, or a tuple, list or dict holding tensors"),
             lambda: make_graphed_callables(f, X1, eager_replay=True))


def test_wrong_argument_count_and_tensor_constant_are_described():
    graphed = make_graphed_callables(Lin(), X1, sample_kwargs={"scale": 2.0}, eager_replay=True)
    with pytest.raises(ValueError, match=re.escape("callable 0 (Lin): called with 2 positional argument(s), but the graph was captured with 1; pass positional arguments as in sample_args.")):
        graphed(X, X, scale=2.0)
    with pytest.raises(ValueError, match=re.escape("callable 0 (Lin): keyword argument 'scale' is a tensor (shape (3,), dtype torch.float32, device cpu) but was 2.0 at capture")):
        graphed(X, scale=torch.ones(3))


def test_regraphing_is_refused():
    a = Lin()
    make_graphed_callables(a, X1, eager_replay=True)
    _refused(ValueError, re.escape("callable 0 (Lin) is already graphed, or holds a module that is (<graphed callable 0 (Lin)>); graphs cannot nest."),
             lambda: make_graphed_callables(a, X1, eager_replay=True), a)
    outer = nn.Sequential(a)
    _refused(ValueError, re.escape("callable 0 (Sequential) is already graphed, or holds a module that is"),
             lambda: make_graphed_callables(outer, X1, eager_replay=True), outer)
    b = Lin()
    _refused(ValueError, re.escape("callable 1 is the same object as callable 0; graph each module once (for several microbatches of one layer, pass order=..."),
             lambda: make_graphed_callables((b, b), (X2), eager_replay=True), b)


class _ReassignsBuffer(Lin):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count = self.count + 1
        return self.lin(x)


class _UpdatesBuffer(Lin):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(1)
        return self.lin(x)


def test_reassigned_buffer_is_refused_and_updated_buffers_are_restored():
    m = _ReassignsBuffer()
    _refused(ValueError, re.escape("the forward of callable 0 (_ReassignsBuffer) reassigns its buffer 'count' (like `self.count = self.count + 1`); a graph cannot replay that") + ".*" + re.escape("`self.count.add_(1)`"),
             lambda: make_graphed_callables(m, X1, eager_replay=True), m)
    m = _UpdatesBuffer()
    graphed = make_graphed_callables(m, X1, num_warmup_iters=3, eager_replay=True)
    assert m.count.item() == 0, "warmup's buffer updates were undone"
    graphed(X)
    assert m.count.item() == 1


class _BumpsInput(Lin):
    def forward(self, x, counter):
        with torch.no_grad():
            counter.add_(1)
        return self.lin(x) * counter


def test_inputs_updated_in_place_are_put_back_after_graphing_and_copied_back_at_each_call():
    m = _BumpsInput()
    counter_sample = torch.zeros(())
    graphed = make_graphed_callables(m, (X, counter_sample), num_warmup_iters=3, eager_replay=True)
    assert counter_sample.item() == 0, "warmup's updates of the sample were undone"
    counter = torch.zeros(())
    graphed(X, counter)
    graphed(X, counter)
    assert counter.item() == 2, "the caller's input got each call's update"
    held = counter_sample.item()  # the static buffer holds the last call's input, updated
    version = counter_sample._version
    graphed(X, counter_sample)  # the static buffer itself: updated in place, its version moves
    assert counter_sample.item() == held + 1 and counter_sample._version > version


def test_an_input_requiring_grad_updated_in_place_is_refused():
    m = _BumpsInput()
    counter = torch.zeros((), requires_grad=True)
    before = counter.detach().clone()
    _refused(ValueError, re.escape("callable 0 (_BumpsInput) updates its positional input 1 in place, and that sample requires grad. A graph cannot replay what autograd records") + ".*" + re.escape("Pass that input with requires_grad=False"),
             lambda: make_graphed_callables(m, (X, counter), eager_replay=True), m, counter)
    assert torch.equal(counter.detach(), before), "the sample was put back"


def test_tensor_closed_over_that_requires_grad_is_refused():
    w = torch.randn(4, 4, requires_grad=True)

    def f(x):
        return x @ w

    _refused(ValueError, re.escape("callable 0 (f) uses 1 tensor(s) that require grad but are neither its inputs nor parameters of a graphed module (shape (4, 4), dtype torch.float32, device cpu)") + ".*" + re.escape("Pass such a tensor as an input"),
             lambda: make_graphed_callables(f, X1, eager_replay=True), w)
    assert w.grad is None


def test_double_backward_is_refused():
    graphed = make_graphed_callables(Lin(), X1, eager_replay=True)
    x = X
    y = graphed(x)
    with pytest.raises(RuntimeError, match=re.escape("callable 0 (Lin): double backward (create_graph=True, or torch.autograd.grad(..., create_graph=True)) through a graphed callable is not supported")):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


def test_a_wgrad_split_order_for_a_plain_module_is_not_implemented():
    a = Lin()
    _refused(NotImplementedError, re.escape("the order gives callable 0 (Lin), microbatch 0 a weight-gradient pass (-c-0.5), but none of its modules delays its weight gradients: autograd computes input and weight gradients in the same nodes of a plain module"),
             lambda: make_graphed_callables((a,), (X1,), _order=[1, -1, -1.5], _num_layers_per_chunk=[1], eager_replay=True), a)


@pytest.mark.parametrize("order, layers, message", [
    ([1, -1.5, -1], [1], "order[1] = -1.5 runs the weight-gradient pass of chunk 1 before a backward of it (-1) that waits for one; put it after that backward."),
    ([1, -1, -1.5], None, "order holds weight-gradient entries (-c-0.5), which need num_layers_per_chunk (TE's _num_layers_per_chunk) with one layer per chunk; pass it."),
    ([1, -1, 1.5], [1], "order[2] = 1.5: only backward entries split; the weight-gradient pass of chunk c is -c-0.5 (after its backward -c). Forwards are positive ints."),
    ([1, -1, -1.25], [1], "order[2] = -1.25: the weight-gradient pass of chunk c is -c-0.5 (0.5 below its backward -c, as in TE), got -1.25."),
    ([1, 1, -1, -1.5, -1], [1], "order runs chunk 1's backward 2 time(s) but its weight-gradient pass (-1.5) 1 time(s); give every backward of a chunk with delayed weight gradients its own -1.5 entry."),
    ([1, -1, float("nan")], [1], "order[2] = nan: entries are chunk ids (ints) or -c-0.5."),
])
def test_bad_wgrad_split_orders_get_te_s_checks(order, layers, message):
    a = Lin()
    samples = tuple((_x(),) for _ in range(sum(1 for c in order if c > 0)))
    _refused(ValueError, re.escape(message),
             lambda: make_graphed_callables((a,), samples, _order=order, _num_layers_per_chunk=layers, eager_replay=True), a)


def test_bad_capture_time_hooks():
    a, b = Lin(), Lin()
    samples = (X2)
    _refused(ValueError, re.escape("capture_time_hooks has 1 entries for 2 callables; give one entry (None or a dict) per callable."),
             lambda: make_graphed_callables((a, b), samples, capture_time_hooks=[None], eager_replay=True), a, b)
    _refused(ValueError, re.escape("capture_time_hooks for callable 1 (Lin) has unknown key(s) ['forward'];"),
             lambda: make_graphed_callables((a, b), samples, capture_time_hooks=[None, {"forward": {}}], eager_replay=True), a, b)
    _refused(RuntimeError, re.escape("a capture-time forward hook of callable 0 (Lin) returned a value; capture-time hooks only observe"),
             lambda: make_graphed_callables((a, b), samples, capture_time_hooks=[{"forward_hooks": {0: lambda m: m}}, None], eager_replay=True), a, b)
    _refused(ValueError, re.escape("capture_time_hooks for callable 0 (Lin) has unknown key(s) ['forward_hooks_with_kwargs']; use forward_pre_hooks, forward_hooks, backward_pre_hooks, backward_hooks."),
             lambda: make_graphed_callables((a, b), samples, capture_time_hooks=[{"forward_hooks_with_kwargs": {0}}, None], eager_replay=True), a, b)


@pytest.mark.skipif(CUDA, reason="checks the CPU-only machine's error")
def test_graph_pool_handle_without_cuda():
    import te_graph

    with pytest.raises(RuntimeError, match=re.escape("te_graph.graph_pool_handle(): CUDA is not available, and a graph memory pool lives on a CUDA device. In eager replay (eager_replay=True) no pool is needed")):
        te_graph.graph_pool_handle()


class _LinearFunction(torch.autograd.Function):
    """Megatron's linear layer shape: weight.t() inside an autograd Function's forward
    (grad off there, so the view is a leaf that requires grad)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


class _MegatronStyleLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return _LinearFunction.apply(x, self.weight)


def test_a_view_of_a_parameter_inside_an_autograd_function_is_not_foreign():
    m = _MegatronStyleLinear()
    reference = _MegatronStyleLinear()
    reference.load_state_dict(m.state_dict())
    graphed = make_graphed_callables(m, X1, eager_replay=True)
    x = _x()
    graphed(x).sum().backward()
    reference(x.detach()).sum().backward()
    assert torch.equal(m.weight.grad, reference.weight.grad)


def test_a_weight_closed_over_inside_a_reentrant_checkpoint_is_refused_before_it_gets_a_grad():
    """The region runs under no_grad in the forward, so its autograd graph hides the weight;
    the recompute reports it before its backward runs."""
    from checkpointing import checkpoint

    w = torch.randn(4, 4, requires_grad=True)

    def f(x):
        return checkpoint(lambda t: t @ w, x)

    _refused(ValueError, re.escape("callable 0 (f) uses 1 tensor(s) that require grad but are neither its inputs nor parameters of a graphed module (shape (4, 4), dtype torch.float32, device cpu)"),
             lambda: make_graphed_callables(f, X1, eager_replay=True), w)
    assert w.grad is None


def test_a_weight_inside_another_librarys_reentrant_checkpoint_is_refused_and_grads_are_put_back():
    """torch.utils.checkpoint's reentrant region hides the weight and reports nothing: every
    other leaf's .grad is set aside for the first warmup backward and put back."""
    import torch.utils.checkpoint as torch_checkpoint

    w = torch.randn(4, 4, requires_grad=True)
    bystander = torch.randn(2, requires_grad=True)
    bystander.grad = torch.ones(2)
    kept = bystander.grad

    def f(x):
        return torch_checkpoint.checkpoint(lambda t: t @ w, x, use_reentrant=True)

    _refused(ValueError, re.escape("callable 0 (f) uses 1 tensor(s) that require grad but are neither its inputs nor parameters of a graphed module (shape (4, 4), dtype torch.float32, device cpu)"),
             lambda: make_graphed_callables(f, X1, eager_replay=True), w, bystander)
    assert w.grad is None and bystander.grad is kept


def test_leaves_used_only_under_no_grad_or_traced_by_compile_are_not_foreign():
    """The check walks what autograd would accumulate into: a tensor requiring grad that a
    forward only reads under no_grad trains nothing, and is no reason to refuse."""
    scale = torch.randn(4, requires_grad=True)
    m = Lin()

    class ReadsUnderNoGrad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = m.lin

        def forward(self, x):
            with torch.no_grad():
                s = scale.abs().max()
            return self.lin(x) * s

    graphed = make_graphed_callables(ReadsUnderNoGrad(), X1, eager_replay=True)
    graphed(_x()).sum().backward()
    assert scale.grad is None


class _Wrapped(torch.Tensor):
    """A tensor subclass with its own dispatch that is not one of TE's quantized tensors."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        out = func(*tree_map(lambda t: t.inner if isinstance(t, _Wrapped) else t, args), **(kwargs or {}))
        return tree_map(lambda t: _Wrapped(t) if isinstance(t, torch.Tensor) else t, out)


def test_a_parameter_that_is_a_dispatching_tensor_subclass_is_refused():
    m = Lin()
    m.lin.weight = nn.Parameter(_Wrapped(torch.randn(4, 4)))
    _refused(ValueError, re.escape("parameter 'lin.weight' of callable 0 is a _Wrapped, a tensor subclass with its own dispatch (a DTensor, ...); te_graph graphs plain parameters and Transformer Engine's quantized weights (quantized_model_init), not other tensor subclasses."),
             lambda: make_graphed_callables(m, X1, eager_replay=True), m)
