"""rng/: the named-stream tracker, Megatron seed derivation, and snapshots that are content.

CPU tests use the byte-tensor tracker on the CPU default generator; the ``gpu`` tests run
the same properties on CUDA with graph-safe (generator-object) states, and show that a
live reference from ``graphsafe_get_state()`` does not rewind a stream while our
snapshots do.
"""
from __future__ import annotations

import re

import pytest
import torch

import rng
from rng import DATA_PARALLEL_RNG, EXPERT_PARALLEL_RNG, MODEL_PARALLEL_RNG, CudaRNGStatesTracker

N = 257  # odd on purpose: no draw lines up with a Philox block of four


def expected_draws(seed: int, n: int = N, device: str = "cpu", skip: int = 0) -> torch.Tensor:
    """``n`` uniforms from a fresh generator seeded with ``seed``, after ``skip`` draws."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    if skip:
        torch.rand(skip, generator=generator, device=device)
    return torch.rand(n, generator=generator, device=device)


def cpu_tracker() -> CudaRNGStatesTracker:
    return CudaRNGStatesTracker(device="cpu")


# -- add ---------------------------------------------------------------------------------
def test_add_duplicate_seed_names_the_seed_and_both_streams():
    tracker = cpu_tracker()
    tracker.add("attention", 5)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "CudaRNGStatesTracker.add: seed 5 is already used by stream 'attention'; "
            "give 'mlp' a different seed."
        ),
    ):
        tracker.add("mlp", 5)
    assert tracker.names() == ("attention",)


def test_add_duplicate_name_raises_and_reserves_nothing():
    tracker = cpu_tracker()
    tracker.add("attention", 5)
    with pytest.raises(
        ValueError,
        match=re.escape("stream 'attention' already exists; call reset() first or pick another name."),
    ):
        tracker.add("attention", 6)
    # The failed add must not have claimed seed 6, nor replaced the stream.
    tracker.add("mlp", 6)
    assert tracker.names() == ("attention", "mlp")
    with tracker.fork("attention"):
        got = torch.rand(N)
    assert torch.equal(got, expected_draws(5))


# -- fork --------------------------------------------------------------------------------
def test_fork_draws_the_named_stream_and_leaves_the_default_alone():
    tracker = cpu_tracker()
    tracker.add("a", 11)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(N)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(first, expected_draws(11))
    # The default stream (seeded 0 by the conftest) did not move.
    assert torch.equal(torch.rand(N), expected_draws(0))
    # A second fork continues the stream instead of repeating its first window.
    with tracker.fork("a"):
        second = torch.rand(N)
    assert torch.equal(second, expected_draws(11, skip=N))


def test_fork_default_name_is_model_parallel_rng():
    tracker = cpu_tracker()
    tracker.add(MODEL_PARALLEL_RNG, 77)
    with tracker.fork():
        got = torch.rand(N)
    assert torch.equal(got, expected_draws(77))


def test_nested_forks_each_continue_their_own_stream():
    tracker = cpu_tracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    with tracker.fork("a"):
        a1 = torch.rand(N)
        with tracker.fork("b"):
            b1 = torch.rand(N)
        a2 = torch.rand(N)
        with tracker.fork("b"):
            b2 = torch.rand(N)
    assert torch.equal(a1, expected_draws(1))
    assert torch.equal(a2, expected_draws(1, skip=N))
    assert torch.equal(b1, expected_draws(2))
    assert torch.equal(b2, expected_draws(2, skip=N))
    assert torch.equal(torch.rand(N), expected_draws(0))


def test_fork_restores_the_default_generator_when_the_block_raises():
    tracker = cpu_tracker()
    tracker.add("a", 1)
    before = torch.get_rng_state()
    with pytest.raises(ZeroDivisionError):
        with tracker.fork("a"):
            torch.rand(N)
            1 / 0
    assert torch.equal(torch.get_rng_state(), before)
    with tracker.fork("a"):  # the stream kept what the failed block drew
        got = torch.rand(N)
    assert torch.equal(got, expected_draws(1, skip=N))


def test_fork_unknown_name_raises_keyerror_listing_known_streams():
    tracker = cpu_tracker()
    with pytest.raises(KeyError, match=re.escape("no stream named 'x' (known: none)")):
        with tracker.fork("x"):
            pass
    tracker.add("a", 1)
    tracker.add("b", 2)
    with pytest.raises(
        KeyError,
        match=re.escape(
            "CudaRNGStatesTracker.fork: no stream named 'nope' (known: 'a', 'b'); add it with "
            "tracker.add(name, seed) or model_parallel_cuda_manual_seed()."
        ),
    ):
        with tracker.fork("nope"):
            pass


# -- get_states / set_states / reset -----------------------------------------------------
def test_get_states_are_copies_and_set_states_rewinds():
    tracker = cpu_tracker()
    tracker.add("a", 3)
    tracker.add("b", 4)
    with tracker.fork("a"):
        torch.rand(N)
    saved = tracker.get_states()
    frozen = {name: state.clone() for name, state in saved.items()}
    with tracker.fork("a"):
        first_a = torch.rand(N)
    with tracker.fork("b"):
        first_b = torch.rand(N)
    # Later draws did not move the snapshot ...
    for name in frozen:
        assert torch.equal(saved[name], frozen[name])
    # ... and restoring it replays the same numbers.
    tracker.set_states(saved)
    with tracker.fork("a"):
        again_a = torch.rand(N)
    with tracker.fork("b"):
        again_b = torch.rand(N)
    assert torch.equal(again_a, first_a)
    assert torch.equal(again_b, first_b)
    assert torch.equal(first_a, expected_draws(3, skip=N))
    # Mutating what set_states was given does not reach the tracker (it copied).
    saved["a"].zero_()
    tracker.set_states({"a": frozen["a"]})
    with tracker.fork("a"):
        assert torch.equal(torch.rand(N), first_a)


def test_set_states_into_a_fresh_tracker_adds_the_streams():
    source = cpu_tracker()
    source.add("a", 3)
    with source.fork("a"):
        torch.rand(N)
    target = cpu_tracker()
    target.set_states(source.get_states())
    assert target.names() == ("a",)
    with target.fork("a"):
        got = torch.rand(N)
    assert torch.equal(got, expected_draws(3, skip=N))


def test_reset_and_is_initialized():
    tracker = cpu_tracker()
    assert not tracker.is_initialized()
    tracker.add("a", 3)
    assert tracker.is_initialized()
    tracker.reset()
    assert not tracker.is_initialized()
    assert tracker.names() == ()
    assert tracker.get_states() == {}
    with pytest.raises(KeyError, match=re.escape("(known: none)")):
        with tracker.fork("a"):
            pass
    # Seeds and names are free again after reset.
    tracker.add("a", 3)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(N), expected_draws(3))


@pytest.mark.skipif(rng.graph_safe_rng_available(), reason="graph-safe states are available here")
def test_graph_safe_tracker_without_cuda_is_refused():
    with pytest.raises(ValueError, match=re.escape("pass graph_safe=False for byte-tensor states")):
        CudaRNGStatesTracker(device="cpu", graph_safe=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the global tracker is on CUDA here")
def test_global_tracker_uses_byte_states_on_cpu():
    tracker = rng.get_cuda_rng_tracker()
    assert tracker is rng.get_cuda_rng_tracker()
    assert tracker.device == torch.device("cpu")
    assert not tracker.graph_safe
    rng.model_parallel_cuda_manual_seed(1)
    states = tracker.get_states()
    assert set(states) == {MODEL_PARALLEL_RNG, EXPERT_PARALLEL_RNG, DATA_PARALLEL_RNG}
    assert all(isinstance(s, torch.Tensor) and not rng.is_graph_safe_rng_state(s) for s in states.values())


# -- Megatron seed derivation --------------------------------------------------------------
@pytest.mark.parametrize("seed,tp,ep,etp", [(1234, None, None, None), (1234, 3, 2, 1), (7, 1, 0, 5)])
def test_model_parallel_cuda_manual_seed_derivation(seed, tp, ep, etp):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng.model_parallel_cuda_manual_seed(seed, tp_rank=tp, ep_rank=ep, etp_rank=etp)
    tracker = rng.get_cuda_rng_tracker()
    tp, ep, etp = tp or 0, ep or 0, etp or 0
    assert tracker.names() == (MODEL_PARALLEL_RNG, EXPERT_PARALLEL_RNG, DATA_PARALLEL_RNG)
    with tracker.fork(MODEL_PARALLEL_RNG):
        model_parallel = torch.rand(N, device=device)
    with tracker.fork(EXPERT_PARALLEL_RNG):
        expert_parallel = torch.rand(N, device=device)
    with tracker.fork(DATA_PARALLEL_RNG):
        data_parallel = torch.rand(N, device=device)
    default = torch.rand(N, device=device)
    assert torch.equal(data_parallel, expected_draws(seed, device=device))
    assert torch.equal(default, expected_draws(seed, device=device))
    assert torch.equal(model_parallel, expected_draws(seed + 2718 + tp, device=device))
    assert torch.equal(expert_parallel, expected_draws(seed + 1024 + 100 * ep + etp, device=device))


def test_seeding_keeps_tensor_parallel_meaning():
    """Default stream identical on every TP rank; 'model-parallel-rng' differs per rank."""
    draws = []
    for tp_rank in (0, 1):
        tracker = cpu_tracker()
        rng.model_parallel_cuda_manual_seed(99, tp_rank=tp_rank, tracker=tracker)
        with tracker.fork():
            model_parallel = torch.rand(N)
        draws.append((torch.rand(N), model_parallel))
    (default0, mp0), (default1, mp1) = draws
    assert torch.equal(default0, default1)
    assert not torch.equal(mp0, mp1)


def test_reseeding_replaces_every_stream():
    tracker = cpu_tracker()
    tracker.add("extra", 5)
    rng.model_parallel_cuda_manual_seed(1, tracker=tracker)
    rng.model_parallel_cuda_manual_seed(2, tracker=tracker)  # no duplicate-seed error
    assert tracker.names() == (MODEL_PARALLEL_RNG, EXPERT_PARALLEL_RNG, DATA_PARALLEL_RNG)
    with tracker.fork():
        assert torch.equal(torch.rand(N), expected_draws(2 + 2718))


def test_seed_collision_between_derived_streams_is_reported():
    # 2718 + tp == 1024 + 100 * ep + etp for tp=0, ep=16, etp=94.
    with pytest.raises(ValueError, match=re.escape(f"seed {10 + 2718} is already used by stream "
                                                   f"'{MODEL_PARALLEL_RNG}'")):
        rng.model_parallel_cuda_manual_seed(10, tp_rank=0, ep_rank=16, etp_rank=94, tracker=cpu_tracker())


# -- snapshots are content ----------------------------------------------------------------
def test_snapshot_restore_replays_the_same_numbers_cpu():
    snapshot = rng.get_rng_state("cpu")
    frozen = snapshot.clone()
    first = torch.rand(N)
    assert torch.equal(snapshot, frozen), "a snapshot moved with the live stream"
    rng.set_rng_state(snapshot, "cpu")
    assert torch.equal(torch.rand(N), first)


def test_snapshot_and_restore_of_a_private_generator_keep_its_identity():
    generator = torch.Generator()
    generator.manual_seed(21)
    snapshot = rng.snapshot_generator(generator)
    assert not rng.is_graph_safe_rng_state(snapshot)
    first = torch.rand(N, generator=generator)
    rng.restore_generator(generator, snapshot)
    assert torch.equal(torch.rand(N, generator=generator), first)
    # Generator-form state restores into a byte generator too.
    as_generator = rng.to_generator_state(snapshot, device="cpu")
    assert rng.is_graph_safe_rng_state(as_generator)
    rng.restore_generator(generator, as_generator)
    assert torch.equal(torch.rand(N, generator=generator), first)


def test_state_conversions_copy():
    state = torch.get_rng_state()
    as_bytes = rng.to_byte_state(state)
    assert torch.equal(as_bytes, state) and as_bytes.data_ptr() != state.data_ptr()
    generator = rng.to_generator_state(state, device="cpu")
    assert torch.equal(torch.rand(N, generator=generator), expected_draws(0))
    # The generator form is independent of the source: drawing from it moved nothing else.
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(rng.to_byte_state(generator), generator.get_state())


def test_default_generator_and_unsupported_device():
    assert rng.default_generator("cpu") is torch.default_generator
    with pytest.raises(ValueError, match=re.escape("rng: unsupported device meta; use 'cpu' or 'cuda'.")):
        rng.default_generator("meta")


def test_generator_registration_override(monkeypatch):
    has_method = hasattr(torch.cuda.CUDAGraph, "register_generator_state")
    monkeypatch.setenv("TE_GRAPH_LAZY_GENERATOR_REGISTRATION", "1")
    assert rng.generator_registration_required() is False
    monkeypatch.setenv("TE_GRAPH_LAZY_GENERATOR_REGISTRATION", "0")
    # The override cannot ask for a registration method this torch does not have.
    assert rng.generator_registration_required() is has_method


def test_tracker_snapshot_helpers_on_our_tracker():
    tracker = cpu_tracker()
    tracker.add("a", 8)
    snapshot = rng.snapshot_tracker_states(tracker)
    with tracker.fork("a"):
        first = torch.rand(N)
    rng.restore_tracker_states(tracker, snapshot)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(N), first)


# -- Megatron's call forms -----------------------------------------------------------------
def test_manual_seed_refuses_megatrons_flag_in_the_rank_position():
    tracker = cpu_tracker()
    with pytest.raises(TypeError, match=re.escape(
            "model_parallel_cuda_manual_seed: tp_rank must be an int rank, got True. Megatron's "
            "own function takes flags (te_rng_tracker, inference_rng_tracker, ...) in these "
            "positions; pass ranks by keyword")):
        rng.model_parallel_cuda_manual_seed(5, True, tracker=tracker)
    assert not tracker.is_initialized(), "nothing was seeded"


class GeneratorDictTracker:
    """Megatron-core's graph-safe tracker shape: generator objects in a dict that
    get_states() copies and set_states() replaces."""

    def __init__(self):
        self.states_ = {}

    def add(self, name, seed):
        self.states_[name] = torch.Generator().manual_seed(seed)

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = states

    def reset(self):
        self.states_ = {}


def test_reseeding_a_duck_tracker_keeps_its_generator_objects():
    tracker = GeneratorDictTracker()
    rng.model_parallel_cuda_manual_seed(1, tracker=tracker)  # first seeding adds the streams
    objects = dict(tracker.states_)
    rng.model_parallel_cuda_manual_seed(2, tp_rank=1, tracker=tracker)
    assert all(tracker.states_[k] is g for k, g in objects.items()), "reseeded in place"
    assert tracker.states_[MODEL_PARALLEL_RNG].initial_seed() == 2 + 2718 + 1
    assert tracker.states_[EXPERT_PARALLEL_RNG].initial_seed() == 2 + 1024
    assert tracker.states_[DATA_PARALLEL_RNG].initial_seed() == 2


# -- GPU: graph-safe states ------------------------------------------------------------------
@pytest.mark.gpu
def test_live_reference_does_not_rewind_but_our_snapshot_does():
    """What TE and Megatron save (graphsafe_get_state) versus what rng saves (a copy)."""
    generator = rng.default_generator("cuda")
    reference = generator.graphsafe_get_state()
    first = torch.rand(N, device="cuda")
    generator.graphsafe_set_state(reference)
    again = torch.rand(N, device="cuda")
    assert not torch.equal(again, first), "restoring a live reference rewound the stream"
    assert torch.equal(again, expected_draws(0, device="cuda", skip=N))

    snapshot = rng.get_rng_state("cuda")
    assert rng.is_graph_safe_rng_state(snapshot)
    first = torch.rand(N, device="cuda")
    shared = generator.graphsafe_get_state()  # shares the live state object
    rng.set_rng_state(snapshot, "cuda")
    # The restore copied content into the live state object (graph registrations hold it),
    # rather than swapping in another one.
    assert rng.default_generator("cuda") is generator
    assert shared.get_offset() == snapshot.get_offset()
    assert shared.initial_seed() == snapshot.initial_seed()
    assert torch.equal(torch.rand(N, device="cuda"), first)


@pytest.mark.gpu
def test_graph_safe_tracker_states_on_cuda():
    tracker = rng.get_cuda_rng_tracker()
    assert tracker.graph_safe and tracker.device.type == "cuda"
    rng.model_parallel_cuda_manual_seed(5)
    live = tracker._live_generators()[MODEL_PARALLEL_RNG]
    saved = tracker.get_states()
    assert all(rng.is_graph_safe_rng_state(s) for s in saved.values())
    assert saved[MODEL_PARALLEL_RNG] is not live
    offset = saved[MODEL_PARALLEL_RNG].get_offset()
    default_before = rng.default_generator("cuda").get_offset()
    with tracker.fork():
        first = torch.rand(N, device="cuda")
    assert rng.default_generator("cuda").get_offset() == default_before
    assert saved[MODEL_PARALLEL_RNG].get_offset() == offset, "a snapshot moved with the stream"
    assert live.get_offset() > offset
    shared = live.graphsafe_get_state()  # shares the live state object
    tracker.set_states(saved)
    assert tracker._live_generators()[MODEL_PARALLEL_RNG] is live, "set_states replaced the generator"
    assert shared.get_offset() == offset, "set_states swapped the state object instead of copying"
    with tracker.fork():
        assert torch.equal(torch.rand(N, device="cuda"), first)
    assert torch.equal(first, expected_draws(5 + 2718, device="cuda"))


@pytest.mark.gpu
def test_nested_forks_on_cuda():
    tracker = rng.get_cuda_rng_tracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    with tracker.fork("a"):
        a1 = torch.rand(N, device="cuda")
        with tracker.fork("b"):
            b1 = torch.rand(N, device="cuda")
        a2 = torch.rand(N, device="cuda")
    # (On CUDA, two draws of N are not one draw of 2N: compare call by call.)
    assert torch.equal(a1, expected_draws(1, device="cuda"))
    assert torch.equal(a2, expected_draws(1, device="cuda", skip=N))
    assert torch.equal(b1, expected_draws(2, device="cuda"))
    assert torch.equal(torch.rand(N, device="cuda"), expected_draws(0, device="cuda"))


@pytest.mark.gpu
def test_restore_generator_into_cuda_generator_keeps_identity():
    generator = torch.Generator(device="cuda")
    generator.manual_seed(3)
    snapshot = rng.snapshot_generator(generator)
    assert rng.is_graph_safe_rng_state(snapshot) and snapshot is not generator
    first = torch.rand(N, device="cuda", generator=generator)
    rng.restore_generator(generator, snapshot)
    assert torch.equal(torch.rand(N, device="cuda", generator=generator), first)
    rng.restore_generator(generator, rng.to_byte_state(snapshot))
    assert torch.equal(torch.rand(N, device="cuda", generator=generator), first)


@pytest.mark.gpu
def test_reseeding_keeps_each_streams_generator_object():
    """CUDA graphs register generator objects: reseeding must reseed them in place so a
    graph captured before the reseed keeps drawing from the stream the tracker forks."""
    tracker = CudaRNGStatesTracker(device="cuda" if torch.cuda.is_available() else "cpu")
    if not tracker.graph_safe:
        pytest.skip("generator objects are kept in graph-safe mode only")
    rng.model_parallel_cuda_manual_seed(1, tracker=tracker)
    before = tracker._live_generators()
    rng.model_parallel_cuda_manual_seed(2, tracker=tracker)
    after = tracker._live_generators()
    assert all(after[name] is before[name] for name in before)
    with tracker.fork():
        assert torch.equal(torch.rand(N, device="cuda"), expected_draws(2 + 2718, device="cuda"))
