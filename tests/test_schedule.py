"""CPU tests for te_graph.planning (schedule and buffer reuse): order expansion, layout, validation, buffer reuse."""
from __future__ import annotations

import random
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

from te_graph.planning.schedule import (
    BACKWARD,
    FORWARD,
    WGRAD,
    GraphSlot,
    Schedule,
    Step,
    with_wgrad_passes_last,
    plan_schedule,
)
from te_graph.planning.buffers import plan_buffer_reuse, resolve_buffer_owners

INTERLEAVED = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]
ONE_F_ONE_B = [1, 1, -1, 1, -1, 1, -1, -1]  # pipeline rank 0 of 2, 4 microbatches


def seq(text: str) -> List[Step]:
    """'F0 F1 B1' -> [Step(forward, 0), Step(forward, 1), Step(backward, 1)]."""
    kinds = {"F": FORWARD, "B": BACKWARD}
    return [Step(kinds[tok[0]], int(tok[1:])) for tok in text.split()]


def slots(schedule: Schedule) -> List[Tuple[int, int, int, int]]:
    """(callable_index, chunk, microbatch, layer) per flat index."""
    assert [g.flat_index for g in schedule.graphs] == list(range(schedule.num_graphs))
    return [(g.callable_index, g.chunk, g.microbatch, g.layer) for g in schedule.graphs]


def assert_well_formed(schedule: Schedule) -> None:
    """Every graph's forward once, backward once, backward after forward."""
    seen_fwd: set = set()
    seen_bwd: set = set()
    for step in schedule.steps:
        if step.kind == FORWARD:
            assert step.flat_index not in seen_fwd
            seen_fwd.add(step.flat_index)
        else:
            assert step.flat_index in seen_fwd and step.flat_index not in seen_bwd
            seen_bwd.add(step.flat_index)
    assert seen_fwd == seen_bwd == set(range(schedule.num_graphs))
    for g in schedule.graphs:
        assert schedule.flat_index(g.chunk, g.microbatch, g.layer) == g.flat_index


# ------------------------------------------------------------------------ schedules


def test_interleaved_two_chunks_three_microbatches() -> None:
    s = plan_schedule(4, 12, order=INTERLEAVED, num_layers_per_chunk=[2, 2])
    assert (s.num_chunks, s.num_microbatches, s.layers_per_chunk) == (2, 3, (2, 2))
    assert s.has_order and s.num_graphs == 12 and s.chunk_prefix == (0, 2, 4)
    assert slots(s) == [
        (0, 0, 0, 0), (1, 0, 0, 1), (0, 0, 1, 0), (1, 0, 1, 1), (0, 0, 2, 0), (1, 0, 2, 1),
        (2, 1, 0, 0), (3, 1, 0, 1), (2, 1, 1, 0), (3, 1, 1, 1), (2, 1, 2, 0), (3, 1, 2, 1),
    ]
    assert list(s.steps) == seq(
        "F0 F1 F6 F7 F2 F3 F8 F9 B7 B6 B1 B0 F4 F5 F10 F11 B9 B8 B3 B2 B11 B10 B5 B4"
    )
    assert_well_formed(s)


def test_int_and_default_layers_per_chunk_match_the_list() -> None:
    listed = plan_schedule(4, 12, order=INTERLEAVED, num_layers_per_chunk=[2, 2])
    assert plan_schedule(4, 12, order=INTERLEAVED, num_layers_per_chunk=2) == listed
    assert plan_schedule(4, 12, order=INTERLEAVED) == listed


def test_plain_1f1b_one_chunk_four_microbatches() -> None:
    s = plan_schedule(1, 4, order=ONE_F_ONE_B)
    assert (s.num_chunks, s.num_microbatches, s.layers_per_chunk) == (1, 4, (1,))
    assert slots(s) == [(0, 0, mb, 0) for mb in range(4)]
    assert list(s.steps) == seq("F0 F1 B0 F2 B1 F3 B2 B3")
    assert_well_formed(s)


def test_1f1b_two_layers_runs_backwards_in_reverse_layer_order() -> None:
    s = plan_schedule(2, 8, order=ONE_F_ONE_B)
    assert list(s.steps) == seq("F0 F1 F2 F3 B1 B0 F4 F5 B3 B2 F6 F7 B5 B4 B7 B6")
    assert_well_formed(s)


def test_uneven_layers_per_chunk() -> None:
    s = plan_schedule(4, 8, order=[1, 2, 1, 2, -2, -1, -2, -1], num_layers_per_chunk=[1, 3])
    assert (s.num_chunks, s.num_microbatches, s.layers_per_chunk) == (2, 2, (1, 3))
    assert s.chunk_prefix == (0, 1, 4)
    assert slots(s) == [
        (0, 0, 0, 0), (0, 0, 1, 0),
        (1, 1, 0, 0), (2, 1, 0, 1), (3, 1, 0, 2),
        (1, 1, 1, 0), (2, 1, 1, 1), (3, 1, 1, 2),
    ]
    assert list(s.steps) == seq("F0 F2 F3 F4 F1 F5 F6 F7 B4 B3 B2 B0 B7 B6 B5 B1")
    assert_well_formed(s)


def test_no_order_is_all_forwards_then_reverse_backwards() -> None:
    s = plan_schedule(3, 3)
    assert (s.num_chunks, s.num_microbatches, s.layers_per_chunk) == (1, 1, (3,))
    assert not s.has_order
    assert slots(s) == [(0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 0, 2)]
    assert list(s.steps) == seq("F0 F1 F2 B2 B1 B0")
    assert plan_schedule(3, 3, num_layers_per_chunk=[3]) == s  # consistent value accepted
    assert_well_formed(s)


def test_megatron_converted_order_pp2_vp2_five_microbatches() -> None:
    # Megatron's convert_schedule_table_to_order docstring example (PP2 N3 M5 VP2, 5 warmup).
    order = [1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1]
    s = plan_schedule(6, 30, order=order)
    assert (s.num_chunks, s.num_microbatches, s.layers_per_chunk) == (2, 5, (3, 3))
    assert_well_formed(s)


@pytest.mark.parametrize("seed", range(20))
def test_random_valid_orders_are_well_formed(seed: int) -> None:
    rnd = random.Random(seed)
    layers = [rnd.randint(0, 3) for _ in range(rnd.randint(1, 4))]
    layers[0] = max(layers[0], 1)
    order = random_order(rnd, len(layers), rnd.randint(1, 5))
    s = plan_schedule(sum(layers), sum(layers) * len(order) // (2 * len(layers)), order, layers)
    assert_well_formed(s)


# ---------------------------------------------------------------------- malformed input


@pytest.mark.parametrize(
    "order, layers, n_callables, n_samples, match",
    [
        ([], None, 1, 1, r"order is empty"),
        ([1, 0, -1, 0], None, 1, 2, r"chunk id 0 .* 1-based"),
        ([1, -1, -2], None, 1, 1, r"backward of chunk 2 \(-2\) but no forward"),
        ([1, 2, -1], None, 2, 2, r"3 entries, not a multiple of 2 \* num_chunks = 4"),
        ([1, -1, 1, -1, 3, -3], None, 3, 6, r"never mentions chunk\(s\) \[2\].*cover 1\.\.3"),
        ([1, 1, 1, -1], None, 1, 2, r"chunk 1 forward 3 time\(s\) and backward 1.*Balance"),
        (
            [1, 1, 1, 2, -1, -1, -1, -2], None, 2, 4,
            r"chunk 1 forward 3 .* 2 microbatch.*exactly 2 forwards",
        ),
        ([-1, 1], None, 1, 1, r"order\[0\] = -1 runs a backward of chunk 1 before .*forward"),
        ([1, -1, -1, 1], None, 1, 2, r"order\[2\] = -1 .*more backwards than forwards"),
        (INTERLEAVED, None, 4, 11, r"11 sample_args but the order needs 12 = 3 microbatch"),
        (INTERLEAVED, [2, 2, 2], 6, 18, r"3 entries but order has 2 chunk"),
        (INTERLEAVED, [1, 2], 4, 12, r"sums to 3 layers but 4 callables"),
        (INTERLEAVED, 3, 4, 12, r"sums to 6 layers but 4 callables"),
        (INTERLEAVED, None, 3, 9, r"3 callables cannot be split evenly over 2 chunk"),
        (INTERLEAVED, [-1, 5], 4, 12, r"negative count"),
    ],
)
def test_malformed_schedules_raise(order, layers, n_callables, n_samples, match) -> None:
    with pytest.raises(ValueError, match=match):
        plan_schedule(n_callables, n_samples, order=order, num_layers_per_chunk=layers)


def test_no_order_mismatches_raise() -> None:
    with pytest.raises(ValueError, match=r"3 callables but 2 sample_args.*order="):
        plan_schedule(3, 2)
    with pytest.raises(ValueError, match=r"without an order.*one chunk"):
        plan_schedule(3, 3, num_layers_per_chunk=[1, 2])
    with pytest.raises(ValueError, match=r"num_callables is 0"):
        plan_schedule(0, 0)


@pytest.mark.parametrize("order", [[True, -1], ["1", "-1"]])
def test_non_int_order_entries_raise_type_error(order) -> None:
    with pytest.raises(TypeError, match=r"order must hold ints"):
        plan_schedule(1, 1, order=order)


def test_floats_equal_to_ints_are_ints_as_in_te() -> None:
    assert plan_schedule(1, 1, order=[1.0, -1.0]).steps == plan_schedule(1, 1, order=[1, -1]).steps


# -------------------------------------------------------- weight-gradient passes (-c-0.5)


def test_wgrad_entries_take_the_oldest_backward_of_their_chunk() -> None:
    order = [1, 2, 1, -2, -2.5, 2, -1, -2, -1, -1.5, -1.5, -2.5]
    steps = plan_schedule(2, 4, order=order, num_layers_per_chunk=[1, 1]).steps
    assert [(s.kind, s.flat_index) for s in steps] == [
        (FORWARD, 0), (FORWARD, 2), (FORWARD, 1), (BACKWARD, 2), (WGRAD, 2), (FORWARD, 3),
        (BACKWARD, 0), (BACKWARD, 3), (BACKWARD, 1), (WGRAD, 0), (WGRAD, 1), (WGRAD, 3),
    ]


def test_without_an_order_the_wgrad_passes_come_after_every_backward() -> None:
    steps = plan_schedule(3, 3).steps
    placed = with_wgrad_passes_last(steps, {0, 2})
    assert [(s.kind, s.flat_index) for s in placed] == [
        (FORWARD, 0), (FORWARD, 1), (FORWARD, 2), (BACKWARD, 2), (BACKWARD, 1), (BACKWARD, 0),
        (WGRAD, 2), (WGRAD, 0),
    ]


def test_reuse_frees_a_split_graph_after_its_wgrad_pass() -> None:
    steps = [Step(FORWARD, 0), Step(BACKWARD, 0), Step(FORWARD, 1), Step(WGRAD, 0), Step(FORWARD, 2)]
    assert plan_buffer_reuse(steps, ["s"] * 3) == {0: None, 1: None, 2: 0}
    with pytest.raises(ValueError, match=r"weight-gradient pass of graph 0 before its backward"):
        plan_buffer_reuse([Step(FORWARD, 0), Step(WGRAD, 0)], ["s"])


# ------------------------------------------------------------------------ buffer reuse


def test_reuse_1f1b_one_layer() -> None:
    s = plan_schedule(1, 4, order=ONE_F_ONE_B)
    donors = plan_buffer_reuse(s.steps, ["sig"] * 4)
    assert donors == {0: None, 1: None, 2: 0, 3: 1}
    assert resolve_buffer_owners(donors) == {0: 0, 1: 1, 2: 0, 3: 1}


def test_reuse_1f1b_two_layers_takes_buffers_in_release_order() -> None:
    s = plan_schedule(2, 8, order=ONE_F_ONE_B)
    donors = plan_buffer_reuse(s.steps, ["sig"] * 8)
    # Steps: F0 F1 F2 F3 B1 B0 F4 F5 B3 B2 F6 F7 B5 B4 B7 B6
    assert donors == {0: None, 1: None, 2: None, 3: None, 4: 1, 5: 0, 6: 3, 7: 2}
    assert_reuse_safe(s.steps, donors)


def test_reuse_interleaved_and_chained_owners() -> None:
    s = plan_schedule(4, 12, order=INTERLEAVED)
    donors = plan_buffer_reuse(s.steps, {i: "sig" for i in range(12)})
    assert {k: v for k, v in donors.items() if v is not None} == {4: 7, 5: 6, 10: 1, 11: 0}
    chained = plan_buffer_reuse(seq("F0 B0 F1 B1 F2 B2"), ["s"] * 3)
    assert chained == {0: None, 1: 0, 2: 1}
    assert resolve_buffer_owners(chained) == {0: 0, 1: 0, 2: 0}


def test_reuse_only_between_equal_signatures() -> None:
    s = plan_schedule(2, 8, order=ONE_F_ONE_B)
    # Layer 0 and layer 1 have different static shapes.
    sigs = [((4, 8), "bf16") if g.layer == 0 else ((4, 16), "bf16") for g in s.graphs]
    donors = plan_buffer_reuse(s.steps, sigs)
    assert donors == {0: None, 1: None, 2: None, 3: None, 4: 0, 5: 1, 6: 2, 7: 3}
    for flat, donor in donors.items():
        assert donor is None or sigs[donor] == sigs[flat]
    assert all(d is None for d in plan_buffer_reuse(s.steps, list(range(8))).values())


def test_no_order_schedule_never_reuses() -> None:
    s = plan_schedule(5, 5)
    assert set(plan_buffer_reuse(s.steps, ["s"] * 5).values()) == {None}


@pytest.mark.parametrize("seed", range(30))
def test_reuse_never_precedes_donor_backward(seed: int) -> None:
    rnd = random.Random(1000 + seed)
    layers = [rnd.randint(1, 3) for _ in range(rnd.randint(1, 3))]
    order = random_order(rnd, len(layers), rnd.randint(1, 6))
    s = plan_schedule(sum(layers), sum(layers) * len(order) // (2 * len(layers)), order, layers)
    sigs = [rnd.choice("ab") for _ in range(s.num_graphs)]
    donors = plan_buffer_reuse(s.steps, sigs)
    assert set(donors) == set(range(s.num_graphs))
    assert_reuse_safe(s.steps, donors)
    for flat, donor in donors.items():
        assert donor is None or sigs[donor] == sigs[flat]


def test_reuse_rejects_bad_steps_and_missing_signatures() -> None:
    with pytest.raises(ValueError, match=r"no signature for graph 2"):
        plan_buffer_reuse(seq("F0 F1 F2"), ["s", "s"])
    with pytest.raises(ValueError, match=r"backward of graph 1 without a pending forward"):
        plan_buffer_reuse(seq("F0 B1"), ["s", "s"])
    with pytest.raises(ValueError, match=r"backward of graph 0 without a pending forward"):
        plan_buffer_reuse(seq("F0 B0 B0"), ["s"])
    with pytest.raises(ValueError, match=r"forward of graph 0 twice"):
        plan_buffer_reuse(seq("F0 F0"), ["s"])


def test_resolve_owners_rejects_loops() -> None:
    with pytest.raises(ValueError, match=r"loops"):
        resolve_buffer_owners({0: 1, 1: 0})


# ----------------------------------------------------------------------------- helpers


def random_order(rnd: random.Random, num_chunks: int, num_microbatches: int) -> List[int]:
    """A random causal order: each chunk's backward only while it has a pending forward."""
    fwd_left = [num_microbatches] * num_chunks
    pending = [0] * num_chunks
    order: List[int] = []
    while any(fwd_left) or any(pending):
        moves = [c + 1 for c in range(num_chunks) if fwd_left[c]]
        moves += [-(c + 1) for c in range(num_chunks) if pending[c]]
        move = rnd.choice(moves)
        chunk = abs(move) - 1
        if move > 0:
            fwd_left[chunk] -= 1
            pending[chunk] += 1
        else:
            pending[chunk] -= 1
        order.append(move)
    return order


def assert_reuse_safe(steps: Sequence[Step], donors: Dict[int, Optional[int]]) -> None:
    """A donor's backward precedes the taker's forward; graphs sharing buffers never overlap."""
    fwd_at = {s.flat_index: i for i, s in enumerate(steps) if s.kind == FORWARD}
    bwd_at = {s.flat_index: i for i, s in enumerate(steps) if s.kind == BACKWARD}
    for flat, donor in donors.items():
        if donor is not None:
            assert bwd_at[donor] < fwd_at[flat], (flat, donor)
    by_owner: Dict[int, List[Tuple[int, int]]] = {}
    for flat, owner in resolve_buffer_owners(donors).items():
        by_owner.setdefault(owner, []).append((fwd_at[flat], bwd_at[flat]))
    for lives in by_owner.values():
        lives.sort()
        for (_, end), (start, _) in zip(lives, lives[1:]):
            assert end < start, lives


def test_graph_slot_and_step_are_frozen_values() -> None:
    assert GraphSlot(0, 0, 0, 0, 0) == GraphSlot(0, 0, 0, 0, 0)
    with pytest.raises(AttributeError):
        Step(FORWARD, 0).flat_index = 1  # type: ignore[misc]
