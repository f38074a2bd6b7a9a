"""make_graphed_callables: keyword tensors, eval and no-grad graphs, and the lifecycle
rules (stale and second backwards, freeing, reset, pools). Training parity with eager over
a matrix of setups is tests/test_parity.py."""
from __future__ import annotations

import re

import pytest
import torch

import rng
import te_graph
from examples.gpt import causal_mask
from te_graph import make_graphed_callables
from tests import harness
from tests.graph_helpers import clone_modules, make_blocks, run_layers
from tests.harness import EAGER, EAGER_REPLAY, GRAPHS, Trace

SHAPE = (16, 2, 64)  # [s, b, h]


def _mask_run(device, mode) -> Trace:
    """Three calls, each with another attention mask: outputs and input grads."""
    layers = make_blocks(device=device)
    mask = causal_mask(SHAPE[0], device)
    if mode != EAGER:
        sample = tuple((torch.randn(SHAPE, device=device, requires_grad=True),) for _ in layers)
        kwargs = tuple({"attention_mask": mask.clone()} for _ in layers)
        layers = make_graphed_callables(tuple(layers), sample, sample_kwargs=kwargs, eager_replay=harness.eager_replay(mode))
    g = torch.Generator(device="cpu").manual_seed(3)
    trace = Trace()
    for _ in range(3):
        # A different mask at every replay: random extra masked positions on top of causal.
        mask_now = mask | (torch.rand(1, 1, *SHAPE[:1] * 2, generator=g) < 0.2).to(device)
        mask_now[..., 0] = False  # every query keeps one key
        x = torch.randn(SHAPE, generator=g).to(device).requires_grad_(True)
        y = run_layers(layers, x, attention_mask=mask_now)
        y.sum().backward()
        trace.microbatch(y, x)
    return trace


@pytest.mark.gpu
def test_attention_mask_kwarg_changes_every_replay():
    harness.differential(lambda mode: _mask_run("cuda", mode), [GRAPHS])


def test_attention_mask_kwarg_eager_replay_cpu():
    harness.differential(lambda mode: _mask_run("cpu", mode), [EAGER_REPLAY])


def _eval_test(device, eager_replay):
    """Eval mode with grad enabled differentiates like eager; graphed under no_grad, the
    graphs are forward-only and a call that would need grads is refused."""
    blocks = make_blocks(device=device, dropout=0.1)
    reference = clone_modules(blocks)
    for b in blocks + reference:
        b.eval()
    with torch.no_grad():
        sample = tuple((torch.randn(SHAPE, device=device),) for _ in blocks)
        graphed = make_graphed_callables(tuple(blocks), sample, eager_replay=eager_replay)
    assert all(g is b for g, b in zip(graphed, blocks)), "modules keep their identity"
    x = torch.randn(SHAPE, device=device)
    with torch.no_grad():
        y = run_layers(graphed, x)
        assert torch.equal(y, run_layers(reference, x))
    with pytest.raises(ValueError, match=re.escape(
            "callable 0 (GPTBlock): called with grad enabled where its result would require grad "
            "(an input requires grad, or the module has trainable parameters), but it was graphed "
            "without a backward (under torch.no_grad(), or with nothing requiring grad). Call it "
            "under torch.no_grad()")):
        run_layers(graphed, x)
    # Back in train mode the module runs its eager forward (dropout 0.1 under the tracker).
    for b in blocks + reference:
        b.train()
    rng.model_parallel_cuda_manual_seed(99)
    torch.manual_seed(99)  # CPU dropout draws from the CPU generator
    y_train = run_layers(graphed, x)
    rng.model_parallel_cuda_manual_seed(99)
    torch.manual_seed(99)
    y_ref = run_layers(reference, x)
    assert torch.equal(y_train, y_ref)
    assert not torch.equal(y_train, y), "train mode ran with dropout, not the eval graph"


@pytest.mark.gpu
def test_no_grad_capture_makes_forward_only_graphs():
    _eval_test("cuda", eager_replay=False)


def test_no_grad_capture_eager_replay_cpu():
    _eval_test("cpu", eager_replay=True)


class _TwoInputs(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, device=device)

    def forward(self, x, unused):
        return self.lin(x)


def _unused_test(device, eager_replay):
    module = _TwoInputs(device)
    sample = (torch.randn(4, 8, device=device, requires_grad=True), torch.randn(4, 8, device=device, requires_grad=True))
    with harness.refused(ValueError, r"input 1 of callable 0 \(_TwoInputs\) requires grad, but no output depends on it\. Pass allow_unused_input=True",
                         module):  # a failed capture leaves the module, its grads and the RNG as they were
        make_graphed_callables(module, sample, eager_replay=eager_replay)
    graphed = make_graphed_callables(module, sample, allow_unused_input=True, eager_replay=eager_replay)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    u = torch.randn(4, 8, device=device, requires_grad=True)
    y = graphed(x, u)
    y.sum().backward()
    assert u.grad is None
    x_ref = x.detach().clone().requires_grad_(True)
    module.lin(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


@pytest.mark.gpu
def test_unused_input_needs_allow_unused_input():
    _unused_test("cuda", eager_replay=False)


def test_unused_input_needs_allow_unused_input_eager_replay_cpu():
    _unused_test("cpu", eager_replay=True)


@pytest.mark.gpu
def test_stale_backward_is_refused():
    blocks = make_blocks(n=1, device="cuda")
    sample = ((torch.randn(SHAPE, device="cuda", requires_grad=True),),)
    (graphed,) = make_graphed_callables(tuple(blocks), sample)
    x1 = torch.randn(SHAPE, device="cuda", requires_grad=True)
    y1, _ = graphed(x1)
    # A second forward while the first one's backward may still come: refused at the call,
    # before its replay overwrites the first call's activations.
    with pytest.raises(RuntimeError, match=re.escape(
            "callable 0 (GPTBlock): called again while the backward of its previous call has not run")):
        graphed(torch.randn(SHAPE, device="cuda", requires_grad=True))
    y1.sum().backward()  # the first call's backward is still right
    y2, _ = graphed(torch.randn(SHAPE, device="cuda", requires_grad=True))  # and the next call goes on
    with torch.no_grad(), pytest.raises(RuntimeError, match=re.escape(
            "callable 0 (GPTBlock): called again while the backward of its previous call has not run")):
        graphed(torch.randn(SHAPE, device="cuda"))  # a no-grad call would overwrite them too
    del y2  # a call whose result is dropped waits for no backward
    with torch.no_grad():
        graphed(torch.randn(SHAPE, device="cuda"))


@pytest.mark.gpu
def test_set_to_none_and_leaf_inputs_get_their_own_grads():
    """zero_grad(set_to_none=True) between steps, and a leaf input's .grad is a copy of the
    graph's static grad buffer, which the next replay does not overwrite."""
    blocks = make_blocks(n=2, device="cuda")
    reference = clone_modules(blocks)
    sample = tuple((torch.randn(SHAPE, device="cuda", requires_grad=True),) for _ in blocks)
    graphed = make_graphed_callables(tuple(blocks), sample)
    params_g = [p for b in graphed for p in b.parameters()]
    params_e = [p for b in reference for p in b.parameters()]
    kept = []
    for step in range(3):
        for p in params_g + params_e:
            p.grad = None
        x = torch.randn(SHAPE, device="cuda", requires_grad=True)
        run_layers(graphed, x).sum().backward()
        x_ref = x.detach().clone().requires_grad_(True)
        run_layers(reference, x_ref).sum().backward()
        kept.append((x.grad, x_ref.grad.clone()))
        harness.assert_same([p.grad for p in params_g], [p.grad for p in params_e], f"step {step} param grads")
    for step, (grad, expected) in enumerate(kept):
        assert torch.equal(grad, expected), f"leaf grad of step {step} was overwritten by a later replay"


@pytest.mark.gpu
def test_second_backward_needs_retain_graph_in_backward():
    blocks = make_blocks(n=1, device="cuda")
    sample = ((torch.randn(SHAPE, device="cuda", requires_grad=True),),)
    (graphed,) = make_graphed_callables(tuple(blocks), sample)
    y, _ = graphed(torch.randn(SHAPE, device="cuda", requires_grad=True))
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second backward through the same call needs the captured autograd graph.*retain_graph_in_backward=True"):
        y.sum().backward()


@pytest.mark.gpu
def test_graphs_and_their_memory_are_freed_with_the_module():
    import gc
    import weakref

    def capture_and_train():
        blocks = make_blocks(n=2, device="cuda")
        sample = tuple((torch.randn(SHAPE, device="cuda", requires_grad=True),) for _ in blocks)
        graphed = make_graphed_callables(tuple(blocks), sample)
        run_layers(graphed, torch.randn(SHAPE, device="cuda", requires_grad=True)).sum().backward()
        return weakref.ref(blocks[0])

    capture_and_train()  # the first capture creates the capture stream's library workspaces
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    ref = capture_and_train()
    gc.collect()
    torch.cuda.synchronize()
    assert ref() is None, "a graphed module stays alive after its last reference is gone"
    assert torch.cuda.memory_allocated() == baseline, "graph memory outlived the graphed module"


@pytest.mark.gpu
def test_torch_call_form_with_positional_pool():
    """torch.cuda.make_graphed_callables(callables, sample_args, num_warmup_iters,
    allow_unused_input, pool): the same positional call works."""
    blocks = make_blocks(n=2, device="cuda")
    reference = clone_modules(blocks)
    pool = torch.cuda.graph_pool_handle()
    sample = tuple((torch.randn(SHAPE, device="cuda", requires_grad=True),) for _ in blocks)
    graphed = make_graphed_callables(tuple(blocks), sample, 2, False, pool)
    assert graphed[0].forward.__wrapped__ is not None
    x = torch.randn(SHAPE, device="cuda", requires_grad=True)
    y = run_layers(graphed, x)
    y.sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    run_layers(reference, x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


# -- the replay order: graphs of one call share one pool --------------------------------------
_OUT_OF_ORDER = (
    "{name}: its {what} replays while {other} still waits for its backward, but when this {what} was "
    "captured that graph did not hold what its backward reads (its forward came later, or its backward "
    "earlier, in the captured order): the graphs share one memory pool, so this replay may overwrite it.")


def _blocks_and_reference(device, n=3):
    blocks = make_blocks(n=n, device=device)
    return blocks, clone_modules(blocks)


def _grads(modules):
    return [p.grad.clone() for m in modules for p in m.parameters()]


def _replay_order_test(device, eager_replay):
    """Orders that keep every pending backward's memory safe train as eager, bitwise; a
    forward or backward replayed while a graph its capture did not leave room for waits is
    refused before it runs, and the calls go on."""
    blocks, reference = _blocks_and_reference(device)
    sample = tuple((torch.randn(SHAPE, device=device, requires_grad=True),) for _ in blocks)
    graphed = make_graphed_callables(tuple(blocks), sample, eager_replay=eager_replay)
    g = torch.Generator(device="cpu").manual_seed(5)
    xs = [torch.randn(SHAPE, generator=g).to(device) for _ in range(4)]

    def run(layers, flow):
        """``flow``: (layer, x index) forwards, each backpropagated where the flow says."""
        outputs = {}
        for kind, i, n in flow:
            if kind == "f":
                outputs[i] = layers[i](xs[n].clone().requires_grad_(True))[0]
            else:
                outputs.pop(i).float().square().sum().backward()

    # Each layer on its own (F0 B0 F1 B1 F2 B2), and one layer left out (F0 F2 B2 B0):
    # at every replay only graphs captured as pending wait.
    for flow in ([("f", 0, 0), ("b", 0, 0), ("f", 1, 1), ("b", 1, 1), ("f", 2, 2), ("b", 2, 2)],
                 [("f", 0, 3), ("f", 2, 1), ("b", 2, 1), ("b", 0, 3)]):
        run(graphed, flow)
        run(reference, flow)
        harness.assert_same(_grads(blocks), _grads(reference), f"{flow}: parameter grads")
    # A forward whose result is dropped leaves nothing waiting.
    graphed[2](xs[0].clone().requires_grad_(True))
    y0 = graphed[0](xs[1].clone().requires_grad_(True))[0]
    # Layer 1 forward, then layer 0 forward again is "called again"; layer 0 before layer 1
    # the other way round: layer 1 waits while layer 0's forward, captured before layer 1's
    # existed, replays.
    y0.sum().backward()
    y1 = graphed[1](xs[1].clone().requires_grad_(True))[0]
    for call in (lambda: graphed[0](xs[2].clone().requires_grad_(True)),
                 lambda: torch.no_grad()(graphed[0])(xs[2])):
        with pytest.raises(RuntimeError, match=re.escape(_OUT_OF_ORDER.format(
                name="callable 0 (GPTBlock)", what="forward", other="callable 1 (GPTBlock)"))):
            call()
    y1.sum().backward()  # its backward is still right, and the calls go on
    graphed[0](xs[2].clone().requires_grad_(True))[0].sum().backward()



@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_replays_out_of_the_captured_order_are_refused_where_they_could_overwrite(device, eager_replay):
    _replay_order_test(device, eager_replay)


def _microbatch_order_test(device, eager_replay):
    """One layer, two microbatches captured F F B B: the second microbatch's backward,
    captured after the first's had run, is refused while the first waits (its replay may
    write where the first's activations lie); the captured order trains as eager."""
    blocks, reference = _blocks_and_reference(device, n=1)
    sample = tuple((torch.randn(SHAPE, device=device, requires_grad=True),) for _ in range(2))
    mb0, mb1 = make_graphed_callables(tuple(blocks), sample, _order=[1, 1, -1, -1], eager_replay=eager_replay)
    g = torch.Generator(device="cpu").manual_seed(6)
    x0, x1 = (torch.randn(SHAPE, generator=g).to(device) for _ in range(2))
    y0, y1 = mb0(x0.clone().requires_grad_(True))[0], mb1(x1.clone().requires_grad_(True))[0]
    with pytest.raises(RuntimeError, match=re.escape(_OUT_OF_ORDER.format(
            name="callable 0 (GPTBlock), microbatch 1", what="backward", other="callable 0 (GPTBlock), microbatch 0"))):
        y1.sum().backward()
    y0.sum().backward()
    del y1  # the refused backward's call: dropped, it waits for nothing, and the calls go on
    mb1(x1.clone().requires_grad_(True))[0].sum().backward()
    for x in (x0, x1):
        reference[0](x.clone().requires_grad_(True))[0].sum().backward()
    harness.assert_same(_grads(blocks), _grads(reference), "parameter grads")


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_a_microbatch_backward_out_of_the_captured_order_is_refused(device, eager_replay):
    _microbatch_order_test(device, eager_replay)


def _retained_test(device, eager_replay):
    """Graphs whose backward keeps the autograd graph (retain_graph_in_backward): their
    activations stay, so a backward captured after one may replay before it (no false
    refusal), and a replay of a graph captured before one marks it: a second backward
    through that call is refused."""
    blocks, reference = _blocks_and_reference(device, n=2)
    sample = tuple((torch.randn(SHAPE, device=device, requires_grad=True),) for _ in blocks)
    graphed = make_graphed_callables(tuple(blocks), sample, retain_graph_in_backward=True, eager_replay=eager_replay)
    g = torch.Generator(device="cpu").manual_seed(8)
    x0, x1 = (torch.randn(SHAPE, generator=g).to(device) for _ in range(2))
    for layers in (graphed, reference):  # layer 0's backward before layer 1's: both kept
        y0, y1 = layers[0](x0.clone().requires_grad_(True))[0], layers[1](x1.clone().requires_grad_(True))[0]
        y0.sum().backward()
        y1.sum().backward()
    harness.assert_same(_grads(blocks), _grads(reference), "parameter grads")
    y1 = graphed[1](x1.clone().requires_grad_(True))[0]
    y1.sum().backward(retain_graph=True)
    graphed[0](x0.clone().requires_grad_(True))[0].sum().backward()
    with pytest.raises(RuntimeError, match=re.escape(
            "callable 1 (GPTBlock): a second backward through this call, but since its first one callable 0 "
            "(GPTBlock) replayed, captured while this graph's activations were not kept")):
        y1.sum().backward()
    graphed[1](x1.clone().requires_grad_(True))[0].sum().backward()  # a new call goes on
    # A freed graph holds nothing: its waiting call does not stop the others.
    y1 = graphed[1](x1.clone().requires_grad_(True))[0]
    te_graph.reset(graphed[1])
    graphed[0](x0.clone().requires_grad_(True))[0].sum().backward()


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_a_second_backward_after_a_replay_that_may_have_overwritten_its_activations_is_refused(device, eager_replay):
    _retained_test(device, eager_replay)


def _shared_pool_test(device, eager_replay):
    """Two calls capturing into one pool (pool= the first's graphed callable): a graph of
    one replays only while no graph of the other waits for its backward."""
    blocks, _ = _blocks_and_reference(device, n=2)
    sample = lambda: (torch.randn(SHAPE, device=device, requires_grad=True),)  # noqa: E731
    (a,) = make_graphed_callables((blocks[0],), (sample(),), eager_replay=eager_replay)
    (b,) = make_graphed_callables((blocks[1],), (sample(),), pool=a, eager_replay=eager_replay)
    ya = a(sample()[0])[0]
    with pytest.raises(RuntimeError, match=re.escape(
            "callable 0 (GPTBlock): its forward replays while callable 0 (GPTBlock) of another "
            "make_graphed_callables call into the same pool still waits for its backward: the graphs of each "
            "call were captured while the other's held nothing")):
        b(sample()[0])
    ya.sum().backward()
    b(sample()[0])[0].sum().backward()
    a(sample()[0])[0].sum().backward()
    yb = b(sample()[0])[0]  # and the other way round
    with pytest.raises(RuntimeError, match=re.escape("of another make_graphed_callables call into the same pool")):
        a(sample()[0])
    yb.sum().backward()


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_calls_sharing_a_pool_replay_while_none_of_the_other_waits(device, eager_replay):
    _shared_pool_test(device, eager_replay)
