"""The arguments and methods Transformer Engine's and torch's callers use, and several
shapes per callable: each exercised through eager replay on the CPU and through graphs on
a GPU, against the eager module (bitwise)."""
from __future__ import annotations

import gc
import re
import warnings

import pytest
import torch
from torch import nn

import rng
import te_graph
from te_graph import Samples, make_graphed_callables
from tests import harness
from tests.graph_helpers import clone_modules, make_blocks, run_layers, weighted_loss
from tests.harness import Trace

SHAPE = (16, 2, 64)


def _sample(device, seq=SHAPE[0]):
    return torch.randn(seq, *SHAPE[1:], device=device, requires_grad=True)


def _train(layers, inputs) -> Trace:
    """One call per input (leaf copies), each backpropagated: outputs, input grads and the
    parameter grads accumulated over all of them."""
    trace = Trace()
    for x in inputs:
        x = x.detach().clone().requires_grad_(True)
        y = run_layers(layers, x)
        weighted_loss(y).backward()
        trace.microbatch(y, x)
    trace.step(p for layer in layers for p in layer.parameters())
    return trace


def _train_and_compare(graphed, reference, device, seqs=(SHAPE[0],), steps=2):
    inputs = [torch.randn(seqs[step % len(seqs)], *SHAPE[1:], device=device) for step in range(steps)]
    harness.assert_same(_train(graphed, inputs), _train(reference, inputs))


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_capture_time_hooks_run_while_preparing_and_never_at_replay(device, eager_replay):
    blocks = make_blocks(n=2, device=device)
    calls = []

    def record(kind, index):
        def hook(module):  # Transformer Engine's form: the module alone, returning None
            assert module is blocks[index]
            if device == "cuda":
                assert not torch.cuda.is_current_stream_capturing(), "hooks run outside the graph"
            calls.append((kind, index))
        return hook

    def hooks_of(index):
        return {
            "forward_pre_hooks": {0: record("fwd-pre", index), 1: record("fwd-pre-2", index)},
            "forward_hooks": {0: record("fwd", index)},
            "backward_pre_hooks": {0: record("bwd-pre", index)},
            "backward_hooks": {0: record("bwd", index)},
        }

    phases = []
    graphed = make_graphed_callables(
        tuple(blocks), tuple((_sample(device),) for _ in blocks), num_warmup_iters=2,
        capture_time_hooks=[hooks_of(0), hooks_of(1)], eager_replay=eager_replay,
        pre_warmup_hook=lambda: phases.append(("pre", len(calls))),
        post_warmup_hook=lambda: phases.append(("post", len(calls))),
    )
    def forward(i):
        return [("fwd-pre", i), ("fwd-pre-2", i), ("fwd", i)]

    def backward(i):
        return [("bwd-pre", i), ("bwd", i)]

    # Warmup runs each graph's forward and backward together; capture goes in run order.
    # Eager replay makes one more warmup pass where graphs capture (so that both see a
    # forward's Python side effects as many times).
    warmup_pass = forward(0) + backward(0) + forward(1) + backward(1)
    capture_pass = forward(0) + forward(1) + backward(1) + backward(0)
    expected = warmup_pass * 2 + (warmup_pass if eager_replay else capture_pass)
    assert calls == expected
    warmed = (3 if eager_replay else 2) * len(warmup_pass)
    assert phases == [("pre", 0), ("post", warmed)], "once around the whole warmup"
    run_layers(graphed, _sample(device)).sum().backward()
    assert calls == expected, "never replayed"


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_torch_keywords_and_reset(device, eager_replay):
    blocks = make_blocks(n=2, device=device)
    reference = clone_modules(blocks)
    graphed = make_graphed_callables(
        callables=tuple(blocks), sample_args=tuple((_sample(device),) for _ in blocks),
        capture_error_mode="global", eager_replay=eager_replay,
    )
    _train_and_compare(graphed, reference, device)
    callable_ = graphed[0].forward
    graphed[0].reset()  # TE's method on the module: the module gets its eager forward back
    assert all(name not in graphed[0].__dict__ for name in ("forward", "backward_dw", "reset"))
    with pytest.raises(RuntimeError, match=re.escape(
            "callable 0 (GPTBlock): this graphed callable was reset(), which freed its graphs and "
            "buffers. Graph it again with make_graphed_callables (a module that was graphed has its "
            "eager forward back: call the module itself).")):
        callable_(_sample(device))
    te_graph.reset(graphed)  # everything the call made (the first one again: nothing to do)
    x = _sample(device)
    assert torch.equal(graphed[0](x)[0], reference[0](x)[0]), "the eager forward is back"
    assert torch.equal(graphed[1](x)[0], reference[1](x)[0]), "the eager forward is back"
    again = make_graphed_callables(graphed[0], (_sample(device),), eager_replay=eager_replay)
    assert again is graphed[0] and "forward" in again.__dict__, "a reset module can be graphed again"


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_several_shapes_with_dropout_and_recompute_equal_eager(device, eager_replay):
    """Each call's shape picks its graph; masks are eager's for every shape (the RNG
    contract holds per shape); an unseen shape names the captured ones."""
    blocks = make_blocks(n=2, device=device, dropout=0.1, recompute=True)
    reference = clone_modules(blocks)
    graphed = make_graphed_callables(
        tuple(blocks), tuple((_sample(device, 16),) for _ in blocks),
        more_shapes=[tuple((_sample(device, 8),) for _ in blocks), Samples(tuple((_sample(device, 4),) for _ in blocks))],
        eager_replay=eager_replay,
    )
    seqs = (16, 8, 4, 8, 16)
    runs = []
    for layers in (graphed, reference):
        rng.model_parallel_cuda_manual_seed(3)
        data = torch.Generator().manual_seed(5)
        run = Trace()
        for seq in seqs:
            x = torch.randn(seq, *SHAPE[1:], generator=data).to(device).requires_grad_(True)
            y = run_layers(layers, x)
            weighted_loss(y * y).backward()
            run.microbatch(y, x)
        run.step(p for b in layers for p in b.parameters())
        runs.append(run)
    harness.assert_same(*runs, f"shapes {seqs}")
    with pytest.raises(ValueError, match=re.escape(
            "callable 0 (GPTBlock): called with tensor shapes (5, 2, 64), but graphs were captured "
            "for (16, 2, 64); (8, 2, 64); (4, 2, 64). Pass more_shapes=[...]")):
        graphed[0](_sample(device, 5))


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_unseen_shape_runs_eagerly_when_asked(device, eager_replay):
    blocks = make_blocks(n=2, device=device)
    reference = clone_modules(blocks)
    graphed = make_graphed_callables(
        tuple(blocks), tuple((_sample(device, 16),) for _ in blocks),
        more_shapes=[tuple((_sample(device, 8),) for _ in blocks)], unseen_shape="eager",
        eager_replay=eager_replay,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_and_compare(graphed, reference, device, seqs=(16, 8, 12), steps=6)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages  # once per callable
    assert messages[0].startswith("callable 0 (GPTBlock): no graph for tensor shapes (12, 2, 64) "
                                  "(captured: (16, 2, 64); (8, 2, 64)); running it eagerly")


@pytest.mark.parametrize("device, eager_replay", harness.DEVICE_MODES)
def test_mixing_shapes_before_their_backwards_is_refused(device, eager_replay):
    blocks = make_blocks(n=1, device=device)
    graphed = make_graphed_callables(
        tuple(blocks), ((_sample(device, 16),),), more_shapes=[((_sample(device, 8),),)],
        eager_replay=eager_replay,
    )
    y16, _ = graphed[0](_sample(device, 16))
    y8, _ = graphed[0](_sample(device, 8))
    y8.sum().backward()  # the latest shape's backward is fine
    with pytest.raises(RuntimeError, match=re.escape(
            "callable 0 (GPTBlock): this backward belongs to a forward replay of shape (16, 2, 64), "
            "but since then graphs of another sample set (shape (8, 2, 64)) replayed, and the graphs "
            "of every shape share one memory pool")):
        y16.sum().backward()


# -- GPU only: pools ------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["handle-positional", "mempool", "graphed-callable"])
def test_pool_forms(kind):
    first = make_blocks(n=1, device="cuda")
    graphed_first = make_graphed_callables(tuple(first), ((_sample("cuda"),),))
    blocks = make_blocks(n=2, device="cuda")
    reference = clone_modules(blocks)
    samples = tuple((_sample("cuda"),) for _ in blocks)
    if kind == "handle-positional":  # torch's call: callables, sample_args, iters, unused, pool
        graphed = make_graphed_callables(tuple(blocks), samples, 2, False, te_graph.graph_pool_handle())
    elif kind == "mempool":
        if not hasattr(torch.cuda, "MemPool"):
            pytest.skip("this torch has no torch.cuda.MemPool")
        graphed = make_graphed_callables(tuple(blocks), samples, pool=torch.cuda.MemPool())
    else:
        graphed = make_graphed_callables(tuple(blocks), samples, pool=graphed_first[0])
        assert graphed[0].forward.pool == graphed_first[0].forward.pool
    _train_and_compare(graphed, reference, "cuda")


@pytest.mark.gpu
def test_reset_gives_the_pool_memory_back():
    def footprint():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    warm = make_blocks(n=1, device="cuda")  # the capture stream's workspaces, once per process
    te_graph.reset(make_graphed_callables(tuple(warm), ((_sample("cuda"),),)))
    blocks = make_blocks(n=4, device="cuda", hidden=256)
    samples = tuple((torch.randn(128, 4, 256, device="cuda", requires_grad=True),) for _ in blocks)
    before = footprint()
    graphed = make_graphed_callables(tuple(blocks), samples)
    run_layers(graphed, torch.randn(128, 4, 256, device="cuda", requires_grad=True)).sum().backward()
    for p in (p for b in blocks for p in b.parameters()):
        p.grad = None
    during = footprint()
    te_graph.reset(graphed)
    after = footprint()
    assert during > before, "the graphs hold pool memory"
    assert after == before, f"reset left {(after - before) / 2**20:.1f} MiB reserved"


class _Widen(nn.Module):
    def __init__(self, width_in, width_out):
        super().__init__()
        self.lin = nn.Linear(width_in, width_out)

    def forward(self, x, scale=1.0):
        return self.lin(x) * scale


def test_several_shapes_with_layers_of_different_widths_and_constants():
    """The shape-mixing check follows sample sets, not shapes (layers differ in width);
    a more_shapes entry without kwargs takes sample_kwargs' constants."""
    layers = [_Widen(4, 8), _Widen(8, 4)]
    reference = clone_modules(layers)

    def samples(seq):
        return ((torch.randn(seq, 4, requires_grad=True),), (torch.randn(seq, 8, requires_grad=True),))

    kwargs = ({"scale": 2.0}, {"scale": 2.0})
    graphed = make_graphed_callables(tuple(layers), samples(6), sample_kwargs=kwargs,
                                     more_shapes=[samples(3)], eager_replay=True)
    for seq in (6, 3, 6):
        x = torch.randn(seq, 4, requires_grad=True)
        y = run_layers(graphed, x, scale=2.0)
        y_ref = run_layers(reference, x, scale=2.0)
        assert torch.equal(y, y_ref)
        y.sum().backward()
    with pytest.raises(ValueError, match=re.escape(
            "the sample kwargs of more_shapes entry 0 (graph 0) have keys ['scale'] and constants "
            "{'scale': 3.0}, but sample_kwargs has ['scale'] and {'scale': 2.0}; every shape must "
            "take the same keywords and the same constant values")):
        make_graphed_callables(tuple(clone_modules(reference)), samples(6), sample_kwargs=kwargs,
                               more_shapes=[Samples(samples(3), ({"scale": 3.0}, {"scale": 3.0}))], eager_replay=True)


def test_reset_without_arguments_frees_every_graphed_callable():
    first = make_graphed_callables(tuple(make_blocks(n=1, device="cpu")), ((_sample("cpu"),),), eager_replay=True)
    second = make_graphed_callables(_Widen(4, 4), (torch.randn(3, 4, requires_grad=True),), eager_replay=True)
    callables = (first[0].forward, second.forward)
    te_graph.reset()
    for graphed, x in zip(callables, (_sample("cpu"), torch.randn(3, 4))):
        with pytest.raises(RuntimeError, match=re.escape("this graphed callable was reset()")):
            graphed(x)
    assert "forward" not in first[0].__dict__ and "forward" not in second.__dict__, "eager forwards are back"
