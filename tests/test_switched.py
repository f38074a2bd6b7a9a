"""``conditional.switched``: one of several differentiable programs, chosen on the GPU.

A dropless mixture of experts in plain PyTorch picks its capacity bucket on the device and
runs that bucket's padded experts through ``switched``, inside one graphed layer with its
router and dropout: graphs and eager replay train bitwise as eager over steps whose routing
takes every bucket (the last holds every token routed to one expert), with no host sync in
the graphed steps. On the CPU: the eager path and the refusals.
"""
from __future__ import annotations

import functools
import math
import re

import pytest
import torch
from torch import nn

import te_graph
from te_graph.capture import conditional
from tests.harness import EAGER, EAGER_REPLAY, GRAPHED, Trace, assert_same

TOKENS, HIDDEN, FFN, EXPERTS, TOPK = 64, 32, 48, 4, 2


class DroplessMoE(nn.Module):
    """Top-2 routing over 4 experts without dropping: the tokens laid out ``capacity`` rows per
    expert for the smallest capacity that holds the busiest expert (chosen on the device),
    the experts' two GEMMs on that layout, the real rows gathered back and combined, then
    dropout (outside the node)."""

    def __init__(self, factors: tuple = (1.1, 1.25), recompute: bool = False):
        super().__init__()
        self.recompute = recompute
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ParameterDict({"w1": torch.randn(EXPERTS, HIDDEN, FFN) / math.sqrt(HIDDEN),
                                         "w2": torch.randn(EXPERTS, FFN, HIDDEN) / math.sqrt(FFN)})
        even = TOKENS * TOPK // EXPERTS
        self.capacities = sorted({min(TOKENS, math.ceil(f * even)) for f in factors} | {TOKENS})
        self.register_buffer("bounds", torch.tensor(self.capacities))
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, chosen = self.router(x).softmax(dim=-1).topk(TOPK, dim=-1)
        expert, token = chosen.reshape(-1), torch.arange(TOKENS, device=x.device).repeat_interleave(TOPK)
        order = torch.argsort(expert * TOKENS + token)  # grouped by expert, in token order
        counts = torch.zeros(EXPERTS, dtype=torch.long, device=x.device).index_add_(
            0, expert, torch.ones_like(expert))
        bucket = torch.searchsorted(self.bounds, counts.max().view(1)).view(())
        programs = [functools.partial(self.bucket, c) for c in self.capacities]
        rows = conditional.switched(bucket, programs, (x.index_select(0, token[order]), probs.reshape(-1)[order],
                                                       counts), module=self.experts,
                                    recompute=self.recompute)
        return self.dropout(torch.zeros_like(x).index_add(0, token[order], rows))

    def bucket(self, capacity: int, tokens: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ends = counts.cumsum(dim=0)
        position = torch.arange(tokens.shape[0], device=tokens.device)
        expert = torch.searchsorted(ends, position, right=True)
        rows = expert * capacity + position - (ends - counts).index_select(0, expert)
        padded = tokens.new_zeros(EXPERTS * capacity, HIDDEN).index_copy(0, rows, tokens)
        hidden = torch.bmm(padded.view(EXPERTS, capacity, HIDDEN), self.experts["w1"]).relu()
        out = torch.bmm(hidden, self.experts["w2"]).view(EXPERTS * capacity, HIDDEN)
        return out.index_select(0, rows) * weights.unsqueeze(-1)


def bucket_of(model: DroplessMoE, x: torch.Tensor) -> int:
    """The bucket the model picks for ``x``, on the host."""
    chosen = model.router(x).topk(TOPK, dim=-1).indices.reshape(-1)
    busiest = int(torch.bincount(chosen, minlength=EXPERTS).max())
    return next(i for i, c in enumerate(model.capacities) if c >= busiest)


def batches(model: DroplessMoE, steps: int = 9) -> list:
    """Inputs whose routing takes every bucket: random ones, and every token pulled to one
    expert (the last bucket) by a component along its router row."""
    torch.manual_seed(1)
    xs = []
    for step in range(steps):
        x = torch.randn(TOKENS, HIDDEN)
        if step % 3 == 2:
            row = model.router.weight[step % EXPERTS].detach().cpu()
            x = x + 12 * row / row.norm()
        xs.append(x.to(model.router.weight.device))
    return xs


def train(mode: str, device: str, recompute: bool = False) -> tuple[Trace, list]:
    torch.manual_seed(0)
    model = DroplessMoE(recompute=recompute).to(device)
    xs = batches(model)
    buckets = [bucket_of(model, x) for x in xs[:1]]
    layer = model
    if mode != EAGER:
        layer = te_graph.make_graphed_callables(model, (xs[0].clone(),), eager_replay=mode == EAGER_REPLAY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trace = Trace()
    torch.manual_seed(2)
    for step, x in enumerate(xs):
        if step:
            buckets.append(bucket_of(model, x))
        out = layer(x)
        (out * torch.linspace(-1, 1, HIDDEN, device=device)).square().mean().backward()
        trace.microbatch(out)
        trace.step(model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    trace.end(model.parameters())
    return trace, buckets


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_bucket_chosen_on_the_device_trains_as_eager(device, recompute):
    """With ``recompute`` too: the node's backward runs the bucket's program again, bitwise
    as the saved activations."""
    want, buckets = train(EAGER, device)
    assert set(buckets) == {0, 1, 2}, buckets  # every bucket, the last (every token to one expert) included
    for mode in (EAGER,) * recompute + GRAPHED[device]:
        got, got_buckets = train(mode, device, recompute)
        assert got_buckets == buckets
        assert_same(got, want, f"{mode}{', recomputed' if recompute else ''} against eager")


@pytest.mark.gpu
def test_graphed_steps_wait_for_nothing_on_the_host():
    """Replays of the layer's graphs, its backward and the optimizer, under
    ``set_sync_debug_mode("error")``: no host sync, and the bucket each step picked ran."""
    torch.manual_seed(0)
    model = DroplessMoE().cuda()
    xs = batches(model)
    layer = te_graph.make_graphed_callables(model, (xs[0].clone(),))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, foreach=True)
    scale = torch.linspace(-1, 1, HIDDEN, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs:
            (layer(x) * scale).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


class WritesWhatAnotherSaved(nn.Module):
    """Program 1 writes in place a tensor that program 0 saves for its backward. Under a capture
    body 1 is captured after body 0, but one body runs per replay: no error at body 0's
    backward, and the graphs train as eager."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(HIDDEN))
        self.programs = [lambda t, u: t * u * self.w, lambda t, u: t * u.mul_(2) * self.w]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = (x.sum() > 0).long()  # on the device
        return conditional.switched(index, self.programs, (x, x.detach().abs() + 1), module=self)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_body_writing_what_another_saved_trains_as_eager(device):
    def run(mode: str) -> Trace:
        torch.manual_seed(0)
        model = WritesWhatAnotherSaved().to(device)
        xs = [torch.randn(TOKENS, HIDDEN, device=device) + (-1) ** step for step in range(4)]
        layer = model if mode == EAGER else te_graph.make_graphed_callables(
            model, (xs[0].clone().requires_grad_(),), eager_replay=mode == EAGER_REPLAY)
        trace = Trace()
        for x in xs:
            out = layer(x.requires_grad_())
            out.square().mean().backward()
            trace.microbatch(out, x)
            trace.step(model.parameters())
            with torch.no_grad():
                model.w.sub_(0.1 * model.w.grad)
            model.w.grad = None
        trace.end(model.parameters())
        return trace

    want = run(EAGER)
    for mode in GRAPHED[device]:
        assert_same(run(mode), want, f"{mode} against eager")


# -- CPU: the eager path and the refusals -----------------------------------------------------------
def test_outside_a_capture_the_host_reads_the_index_and_runs_that_program():
    x = torch.randn(3, requires_grad=True)
    programs = [lambda t, k=k: t * (k + 1) for k in range(3)]
    out = conditional.switched(torch.tensor(2), programs, (x,))
    out.sum().backward()
    assert_same(out, x.detach() * 3)
    assert_same(x.grad, torch.full((3,), 3.0))


@pytest.mark.parametrize("index, error, match", [
    (torch.tensor(3), IndexError, r"switched: index 3 is out of range for 3 programs"),
    (torch.tensor(-1), IndexError, r"switched: index -1 is out of range for 3 programs"),
    (torch.tensor(1.0), TypeError, r"switched: index must be a tensor of one int64, int32 or uint8 element"),
    (torch.tensor(True), TypeError, r"switched: index must be a tensor of one int64, int32 or uint8 element"),
    (torch.tensor([0, 1]), TypeError, r"switched: index must be a tensor of one int64, int32 or uint8 element"),
    (1, TypeError, r"switched: index must be a tensor of one int64, int32 or uint8 element"),
])
def test_a_bad_index_is_refused(index, error, match):
    with pytest.raises(error, match=match):
        conditional.switched(index, [lambda t: t] * 3, (torch.zeros(2),))


def test_bad_programs_and_inputs_are_refused():
    with pytest.raises(ValueError, match="switched: give at least one program"):
        conditional.switched(torch.tensor(0), [], (torch.zeros(2),))
    with pytest.raises(TypeError, match="switched: programs must be callables"):
        conditional.switched(torch.tensor(0), [3], (torch.zeros(2),))
    with pytest.raises(TypeError, match="switched: inputs must be tensors, got int; close over the rest"):
        conditional.switched(torch.tensor(0), [lambda t, k: t], (torch.zeros(2), 3))
    with pytest.raises(TypeError, match="switched: module must be a torch.nn.Module, not list"):
        conditional.switched(torch.tensor(0), [lambda t: t], (torch.zeros(2),), module=[])


class TwoLinears(nn.Module):
    """Program 0 reads ``a`` only, program 1 ``a`` then ``b``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.programs = [lambda x: self.a(x).tanh(), lambda x: self.b(self.a(x)).tanh()]

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return conditional.switched(index, self.programs, (x,), module=self)


def test_every_parameter_of_the_module_gets_a_gradient_zeros_where_the_program_left_it_unused():
    """As under a capture, where one gradient buffer serves every program: ``b``, unread by
    program 0, gets zeros (warmup's eager run then counts it as trained, and the graphs
    deliver it)."""
    torch.manual_seed(0)
    model = TwoLinears()
    x = torch.randn(3, 4, requires_grad=True)
    model(x, torch.tensor(0)).sum().backward()
    assert_same(model.b.weight.grad, torch.zeros(4, 4))
    assert_same(model.b.bias.grad, torch.zeros(4))
    direct = TwoLinears()
    direct.load_state_dict(model.state_dict())
    y = x.detach().clone().requires_grad_()
    direct.programs[0](y).sum().backward()
    assert_same(x.grad, y.grad)
    assert_same(model.a.weight.grad, direct.a.weight.grad)


def test_a_tensor_the_program_trains_outside_its_module_is_refused():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(conditional.ConditionalCaptureError, match=re.escape(
            "switched: program 0 trains a tensor it closes over ((4, 4) float32), whose gradient the node would "
            "lose: pass it as an input, or its module as module=")):
        conditional.switched(torch.tensor(0), [lambda t: t @ w], (x,))
    outside = x * 2  # an activation made outside the node, read from within
    with pytest.raises(conditional.ConditionalCaptureError, match=r"switched: program 1 trains a tensor it closes"):
        conditional.switched(torch.tensor(1), [lambda t: t, lambda t: t + outside], (x,))


def test_a_recomputed_node_takes_two_backwards():
    torch.manual_seed(0)
    model, direct = TwoLinears(), TwoLinears()
    direct.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    for net, run in ((model, lambda y: conditional.switched(torch.tensor(1), model.programs, (y,), module=model,
                                                              recompute=True)),
                     (direct, direct.programs[1])):
        y = x.clone().requires_grad_()
        out = run(y)
        out.sum().backward(retain_graph=True)
        out.square().sum().backward()
        net.grads = [y.grad] + [p.grad for p in net.parameters()]
    assert_same(model.grads, direct.grads)
    with pytest.raises(TypeError, match="switched: recompute must be a bool, not str"):
        conditional.switched(torch.tensor(0), model.programs, (x,), module=model, recompute="yes")


def test_a_second_backward_is_refused_and_te_graphs_retained_backward_takes_it():
    torch.manual_seed(0)
    model = TwoLinears()
    x = torch.randn(3, 4, requires_grad=True)
    loss = model(x, torch.tensor(1)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"switched: its backward ran a second time"):
        loss.backward()
    # te_graph's eager replay with retain_graph_in_backward: two backwards, as the direct program
    direct = TwoLinears()
    direct.load_state_dict(model.state_dict())
    graphed = te_graph.make_graphed_callables(model, (x.detach().clone().requires_grad_(), torch.tensor(1)),
                                              eager_replay=True, retain_graph_in_backward=True)
    model.zero_grad(set_to_none=True)
    for net, call in ((model, graphed), (direct, None)):
        y = x.detach().clone().requires_grad_()
        out = call(y, torch.tensor(1)) if call else direct.programs[1](y)
        out.sum().backward(retain_graph=True)
        out.sum().backward()
        net.grads = [y.grad] + [p.grad for p in net.parameters()]
    assert_same(model.grads, direct.grads)


def _recompute_against_direct(make, x: torch.Tensor) -> None:
    """``make()``'s module through switched(recompute=True) and called directly: outputs, input
    and parameter grads and buffers bitwise alike (the run again starts from the buffers the
    forward found, and leaves them as the forward did)."""
    torch.manual_seed(0)
    node = make()
    torch.manual_seed(0)
    direct = make()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = conditional.switched(torch.tensor(0), [lambda t: node(t)], (xa,), module=node, recompute=True)
    yb = direct(xb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert_same([ya, xa.grad, *[p.grad for p in node.parameters()], *node.buffers()],
                [yb, xb.grad, *[p.grad for p in direct.parameters()], *direct.buffers()])


@pytest.mark.parametrize("make", [lambda: nn.BatchNorm1d(4),
                                  lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4))],
                         ids=["batch-norm", "spectral-norm"])
def test_a_recomputed_program_runs_again_from_the_buffers_its_forward_found(make):
    _recompute_against_direct(make, torch.randn(8, 4))


def test_outputs_are_new_tensors_even_where_a_program_returns_its_input():
    """Under a capture the outputs are buffers of the node; outside one, an output sharing
    memory with an input is copied: an in-place change of it leaves the input as it was, and
    the gradients follow that."""
    x = torch.ones(4, 3, requires_grad=True)
    h = x * 1.0
    out = conditional.switched(torch.tensor(0), [lambda t: t[:2]], (h,))
    out.mul_(2)
    (h.sum() + out.sum()).backward()
    assert_same(h, torch.ones(4, 3, requires_grad=True) * 1.0)
    assert_same(x.grad, torch.tensor([[3.0] * 3] * 2 + [[1.0] * 3] * 2))


def test_a_gradient_of_a_gradient_is_refused():
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    y = conditional.switched(torch.tensor(0), [lambda t: t ** 3], (x,))
    with pytest.raises(RuntimeError, match=re.escape("switched: a backward with create_graph=True (a gradient of a "
                                                     "gradient) is not supported")):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_a_reentrant_checkpoint_in_a_program_is_refused_and_a_refusal_leaves_the_buffers():
    norm = nn.BatchNorm1d(4)
    x = torch.randn(8, 4, requires_grad=True)
    program = [lambda t: torch.utils.checkpoint.checkpoint(norm, t, use_reentrant=True)]
    with pytest.raises(conditional.ConditionalCaptureError, match=re.escape(
            "switched: program 0 holds a reentrant checkpoint (CheckpointFunctionBackward), whose backward refuses "
            "the torch.autograd.grad the node's backward asks with: use a non-reentrant checkpoint")):
        conditional.switched(torch.tensor(0), program, (x,), module=norm)
    assert norm.num_batches_tracked.item() == 0 and torch.equal(norm.running_mean, torch.zeros(4))


def test_the_call_grad_mode_and_saved_tensor_hooks_around_the_node_stay_outside_its_programs():
    """Under no_grad the programs build no graph (a closed-over tensor is no refusal then); a
    non-reentrant checkpoint around the node leaves the programs' saved tensors to the node,
    so nothing runs again inside the node's backward (under a capture: no node inside a
    body); every floating output takes a gradient whichever program ran."""
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    ran = []
    programs = [lambda t: (ran.append("program"), t @ w.detach())[1], lambda t: t * 2]
    with torch.no_grad():
        assert not conditional.switched(torch.tensor(0), [lambda t: t @ w], (x,)).requires_grad
    assert conditional.switched(torch.tensor(0), [lambda t: t.detach() * 1, lambda t: t], (x,)).requires_grad
    region = [lambda t: conditional.switched(torch.tensor(0), programs, (t,))]
    out = torch.utils.checkpoint.checkpoint(region[0], x, use_reentrant=False)
    out.sum().backward()
    assert ran == ["program"]
    assert_same(x.grad, torch.ones(3, 4) @ w.detach().t())


def _written_after_save(case: str, run, recompute: bool) -> None:
    """``case``'s in-place write to a tensor the backward reads, through ``run`` (a program
    runner): the backward raises autograd's in-place error."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=case != "input")
    programs = {"output": lambda t: t.exp().add_(1), "weight": lambda t: lin(t).tanh(), "input": lambda t: lin(t)}
    out = run(programs[case], x, lin, recompute)
    if case == "weight":
        with torch.no_grad():
            lin.weight.mul_(2)
    if case == "input":
        x.mul_(2)
    out.sum().backward()


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
@pytest.mark.parametrize("case", ["output", "weight", "input"])
def test_a_tensor_written_in_place_after_the_backward_saved_it_fails_as_in_eager(case, recompute):
    """The node's saved-tensor hooks turn off autograd's version check; the node makes it
    itself: where eager raises, switched raises too, instead of a silently wrong gradient."""
    message = "one of the variables needed for gradient computation has been modified by an inplace operation"
    with pytest.raises(RuntimeError, match=message):
        _written_after_save(case, lambda program, x, lin, _: program(x), recompute)
    with pytest.raises(RuntimeError, match=message):
        _written_after_save(case, lambda program, x, lin, r: conditional.switched(
            torch.tensor(0), [program], (x,), module=lin, recompute=r), recompute)


def test_a_program_writing_its_input_in_place_trains_as_eager_and_recompute_refuses_it():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)
    program = lambda t: lin(t.mul_(2))  # noqa: E731
    eager_x, node_x = x.clone(), x.clone()
    program(eager_x).sum().backward()
    eager = lin.weight.grad.clone()
    lin.zero_grad(set_to_none=True)
    conditional.switched(torch.tensor(0), [program], (node_x,), module=lin).sum().backward()
    assert_same([node_x, lin.weight.grad], [eager_x, eager])
    with pytest.raises(conditional.ConditionalCaptureError, match=re.escape(
            "switched(recompute=True): program 0 writes its input 0 in place, so the backward's run again would "
            "start from the written value. Write it out of place, or use recompute=False")):
        conditional.switched(torch.tensor(0), [program], (x.clone(),), module=lin, recompute=True)
    with pytest.raises(conditional.ConditionalCaptureError, match=re.escape(
            "switched: program 0 writes in place a tensor requiring grad that is a leaf of its graph: inside the "
            "node each input requiring grad is one. Write it out of place (t = t * 2, not t.mul_(2))")):
        conditional.switched(torch.tensor(0), [program], (x.clone().requires_grad_() * 1,), module=lin)


def test_with_recompute_a_program_drawing_random_numbers_is_refused_and_the_generator_put_back():
    """The run again would draw other numbers (under a capture a body refuses the draw)."""
    x = torch.randn(3, 4, requires_grad=True)
    state = torch.get_rng_state()
    with pytest.raises(conditional.ConditionalCaptureError, match=re.escape(
            "switched(recompute=True): program 1 draws random numbers, so the backward's run again would draw "
            "others (and a body refuses them under a capture). Draw before the node, into a tensor the program "
            "reads, or use recompute=False")):
        conditional.switched(torch.tensor(1), [lambda t: t, lambda t: nn.functional.dropout(t, 0.5)], (x,),
                             recompute=True)
    assert torch.equal(torch.get_rng_state(), state)


def test_with_recompute_the_parameters_a_program_reads_are_checked_those_it_does_not_are_free():
    """A weight the program does not read may change before the backward (eager trains); one
    it reads may not (the run again would read the new value); a run again that writes one
    (an embedding's max_norm) takes a second backward."""
    torch.manual_seed(0)
    model, direct = TwoLinears(), TwoLinears()
    direct.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    for net, run in ((model, lambda t: conditional.switched(torch.tensor(0), model.programs, (t,), module=model,
                                                              recompute=True)), (direct, direct.programs[0])):
        y = x.clone().requires_grad_()
        out = run(y)
        with torch.no_grad():
            net.b.weight.mul_(2)  # program 0 reads a only
        out.sum().backward()
        net.grads = [y.grad, net.a.weight.grad]
    assert_same(model.grads, direct.grads)
    out = conditional.switched(torch.tensor(0), model.programs, (x,), module=model, recompute=True)
    with torch.no_grad():
        model.a.weight.mul_(2)
    with pytest.raises(RuntimeError, match=re.escape(
            "one of the variables needed for gradient computation has been modified by an inplace operation: a "
            "parameter of module, which switched(recompute=True) reads again ((4, 4) float32)")):
        out.sum().backward()
    embedding = nn.Embedding(10, 4, max_norm=1.0)
    with torch.no_grad():
        embedding.weight.mul_(3)
    out = conditional.switched(torch.tensor(0), [embedding], (torch.tensor([1, 2, 1]),), module=embedding,
                               recompute=True)
    out.sum().backward(retain_graph=True)
    out.sum().backward()


def test_a_parameter_read_through_a_reference_taken_before_the_call_is_refused_by_name():
    experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    weights = [e.weight for e in experts]
    with pytest.raises(conditional.ConditionalCaptureError, match=re.escape(
            "switched: program 1 reads a parameter of module ((4, 4) float32) through a reference taken before the "
            "call; while a program runs the node puts aliases of them in module's slots: read it from the module "
            "inside the program")):
        conditional.switched(torch.tensor(1), [lambda t: t @ w for w in weights], (torch.randn(3, 4),),
                             module=experts)
