"""CPU tests for te_graph.planning.buffers: which graphs share buffers, decided before capture."""
from __future__ import annotations

import torch

from te_graph.planning.buffers import GraphLayout, TensorMeta, plan_capture
from te_graph.records import GraphPlan
from te_graph.planning.schedule import BACKWARD, FORWARD, WGRAD, Step, plan_schedule

CPU = torch.device("cpu")


def meta(shape=(4, 2, 8), stride=None, dtype=torch.float32, grad=True) -> TensorMeta:
    if stride is None:
        stride = torch.empty(shape).stride()
    return TensorMeta(tuple(shape), tuple(stride), dtype, CPU, grad)


def layer(inputs=(meta(),), outputs=(meta(),), unused=(), backward=True) -> GraphLayout:
    return GraphLayout(tuple(inputs), tuple(outputs), tuple(unused), backward)


def plain(n: int):
    return plan_schedule(n, n).steps


def sharing(plans) -> tuple:
    """The buffer-sharing part of each plan (the pending masks are tested on their own)."""
    return tuple(GraphPlan(p.donor, p.grad_output_from, p.lends_grad_buffer, p.releases_buffers) for p in plans)


def test_a_stack_chains_every_boundary_and_lends_every_buffer_but_the_first():
    plans = sharing(plan_capture(plain(3), [layer()] * 3, reuse_buffers=False, chain_grads=True))
    assert plans == (
        GraphPlan(grad_output_from=1),
        GraphPlan(grad_output_from=2, lends_grad_buffer=True),
        GraphPlan(lends_grad_buffer=True),
    )


def test_no_chaining_where_the_hand_over_is_not_plain():
    other_dtype = layer(outputs=(meta(dtype=torch.bfloat16),))
    transposed = layer(inputs=(meta(stride=(1, 32, 4)),))
    two_outputs = layer(outputs=(meta(), meta()))
    no_grad_input = layer(inputs=(meta(grad=False),))
    two_grad_inputs = layer(inputs=(meta(), meta()))
    unused_input = layer(unused=(0,))
    forward_only = layer(backward=False)
    cases = [
        [other_dtype, layer()],  # output dtype differs from the next input's
        [layer(), transposed],  # same shape, other strides
        [two_outputs, layer()],  # two differentiable outputs
        [layer(), no_grad_input],  # the next layer takes no grad
        [layer(), two_grad_inputs],  # the next layer takes two
        [layer(), unused_input],  # its one grad-taking input is unused (grad None)
        [layer(), forward_only],  # the next layer has no backward
    ]
    for number, layouts in enumerate(cases):
        plans = sharing(plan_capture(plain(2), layouts, reuse_buffers=False, chain_grads=True))
        assert plans == (GraphPlan(), GraphPlan()), f"case {number}"


def test_two_outputs_of_which_one_is_differentiable_chain():
    plans = plan_capture(plain(2), [layer(outputs=(meta(), meta(grad=False))), layer()], reuse_buffers=False, chain_grads=True)
    assert plans[0].grad_output_from == 1 and plans[1].lends_grad_buffer


def test_no_chaining_under_an_order_and_reuse_only_when_asked():
    steps = plan_schedule(2, 4, order=[1, 1, -1, -1]).steps  # 2 layers x 2 microbatches
    layouts = [layer()] * 4
    assert sharing(plan_capture(steps, layouts, reuse_buffers=False, chain_grads=False)) == (GraphPlan(),) * 4
    # With reuse: every forward runs before any backward, so no buffer is free to take over.
    assert sharing(plan_capture(steps, layouts, reuse_buffers=True, chain_grads=False)) == (GraphPlan(),) * 4


def test_buffer_reuse_takes_over_a_finished_microbatch_and_releases_its_buffers():
    # One layer, order F B F B: microbatch 1's forward runs after microbatch 0's backward.
    steps = plan_schedule(1, 2, order=[1, -1, 1, -1]).steps
    plans = sharing(plan_capture(steps, [layer(), layer()], reuse_buffers=True, chain_grads=False))
    assert plans == (GraphPlan(releases_buffers=True), GraphPlan(donor=0))
    # Another output layout: nothing to take over.
    other = layer(outputs=(meta(shape=(4, 2, 16)),))
    assert sharing(plan_capture(steps, [layer(), other], reuse_buffers=True, chain_grads=False)) == (GraphPlan(), GraphPlan())


def held(plans) -> list:
    """Per graph: (activations at its forward, at its backward, queued at its forward, at its backward)."""
    return [(p.activations_at_forward, p.activations_at_backward, p.queued_at_forward, p.queued_at_backward)
            for p in plans]


def test_each_plan_names_what_the_other_graphs_held_at_its_captures():
    """What the other graphs held (activations, work queued for a weight-gradient pass) when
    each forward and backward was captured, as bitmasks: all a replay may find held
    (replay.ReplayOrder refuses the rest)."""
    # Plain: F0 F1 F2 B2 B1 B0.
    assert held(plan_capture(plain(3), [layer()] * 3, reuse_buffers=False, chain_grads=True)) == [
        (0b000, 0b000, 0, 0), (0b001, 0b001, 0, 0), (0b011, 0b011, 0, 0)]
    # A forward-only graph holds nothing: F0 F1 B0 (graph 1 has no backward).
    assert held(plan_capture(plain(2), [layer(), layer(backward=False)], reuse_buffers=False, chain_grads=False)) == [
        (0b00, 0b00, 0, 0), (0b01, 0, 0, 0)]
    # One layer, 2 microbatches, order F F B B: microbatch 1's forward was captured while
    # microbatch 0 held activations; microbatch 1's backward after microbatch 0's had run.
    steps = plan_schedule(1, 2, order=[1, 1, -1, -1]).steps
    assert held(plan_capture(steps, [layer()] * 2, reuse_buffers=False, chain_grads=False)) == [
        (0b00, 0b10, 0, 0), (0b01, 0b00, 0, 0)]
    # Order F B F B: nothing is ever held.
    steps = plan_schedule(1, 2, order=[1, -1, 1, -1]).steps
    assert held(plan_capture(steps, [layer()] * 2, reuse_buffers=True, chain_grads=False)) == [(0, 0, 0, 0)] * 2
    # A backward queues work for its weight-gradient pass, held until the pass: F0 B0 F1 B1
    # W0 W1: microbatch 1 was captured while microbatch 0's work was queued (not its
    # activations).
    steps = [Step(FORWARD, 0), Step(BACKWARD, 0), Step(FORWARD, 1), Step(BACKWARD, 1), Step(WGRAD, 0), Step(WGRAD, 1)]
    assert held(plan_capture(steps, [layer()] * 2, reuse_buffers=False, chain_grads=False)) == [
        (0, 0, 0, 0), (0, 0, 0b01, 0b01)]
    # F0 F1 B0 W0 B1 W1: microbatch 1's forward saw microbatch 0's activations, its backward
    # neither.
    steps = [Step(FORWARD, 0), Step(FORWARD, 1), Step(BACKWARD, 0), Step(WGRAD, 0), Step(BACKWARD, 1), Step(WGRAD, 1)]
    assert held(plan_capture(steps, [layer()] * 2, reuse_buffers=False, chain_grads=False)) == [
        (0, 0b10, 0, 0), (0b01, 0, 0, 0)]
    # A backward that keeps the autograd graph keeps the activations: F0 F1 B1 B0 with layer
    # 1 kept, so only layer 0's forward, captured before, did not see them.
    kept = GraphLayout((meta(),), (meta(),), (), True, retains_graph=True)
    assert held(plan_capture(plain(2), [layer(), kept], reuse_buffers=False, chain_grads=False)) == [
        (0b00, 0b10, 0, 0), (0b01, 0b01, 0, 0)]
    # ... unless it passes its buffers on (buffer reuse drops what it kept): F B F B.
    steps = plan_schedule(1, 2, order=[1, -1, 1, -1]).steps
    assert held(plan_capture(steps, [kept, kept], reuse_buffers=True, chain_grads=False)) == [(0, 0, 0, 0), (0, 0, 0, 0)]
    assert held(plan_capture(steps, [kept, kept], reuse_buffers=False, chain_grads=False)) == [
        (0, 0, 0, 0), (0b01, 0b01, 0, 0)]


def test_a_warmed_up_stack_plans_its_chain():
    """The plan reads the warmup records (outputs kept as meta tensors, devices kept beside
    them): a GPTBlock stack chains every boundary."""
    import rng
    from te_graph.capture.prepare import prepare_graphs
    from te_graph.capture.session import CaptureOptions
    from te_graph.intake.specs import SampleMemory, SpecContext, make_spec
    from tests.graph_helpers import make_blocks

    blocks = make_blocks(n=3, device="cpu")
    specs = [
        make_spec(f"callable {i}", block, (torch.randn(16, 2, 64, requires_grad=True),), {},
                  SpecContext(True, False, SampleMemory()))
        for i, block in enumerate(blocks)
    ]
    options = CaptureOptions(num_warmup_iters=1, allow_unused_input=False, reuse_buffers=False, pool=None,
                             tracker=rng.get_cuda_rng_tracker(), eager_replay=True, chain_grads=True)
    prepared = prepare_graphs([specs], plan_schedule(3, 3).steps, options)
    assert prepared.captured is None
    assert [p.grad_output_from for p in prepared.plans[0]] == [1, 2, None]
    assert [p.lends_grad_buffer for p in prepared.plans[0]] == [False, True, True]
