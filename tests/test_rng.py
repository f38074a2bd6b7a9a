"""rng/: the named-stream tracker, Megatron seed derivation, and snapshots that are content.

CPU tests use the byte-tensor tracker on the CPU default generator; the ``gpu`` tests run
the same properties on CUDA with graph-safe (generator-object) states, and show that a
live reference from ``graphsafe_get_state()`` does not rewind a stream while our
snapshots do.
"""
from __future__ import annotations

import contextlib
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
    tracker = cpu_tracker()
    with pytest.raises(ValueError, match=re.escape(
            "'model-parallel-rng' (seed + 2718 + tp_rank, tp_rank=0) and 'expert-parallel-rng' "
            "(seed + 1024 + 100 * ep_rank + etp_rank, ep_rank=16, etp_rank=94) would both get "
            f"seed {10 + 2718} and draw the same numbers; nothing was seeded.")):
        rng.model_parallel_cuda_manual_seed(10, tp_rank=0, ep_rank=16, etp_rank=94, tracker=tracker)
    assert not tracker.is_initialized()


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


# -- bad input is refused before anything changes ------------------------------------------
def streams_of(tracker) -> dict[str, torch.Tensor]:
    """Content of every stream of any tracker, as byte tensors."""
    return {name: rng.to_byte_state(state) for name, state in tracker.get_states().items()}


def assert_same_streams(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), f"stream {name!r} changed"


def seeded_tracker() -> CudaRNGStatesTracker:
    tracker = cpu_tracker()
    tracker.add("a", 3)
    tracker.add("b", 4)
    with tracker.fork("a"):
        torch.rand(N)
    return tracker


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(graph_safe="no"), TypeError, "CudaRNGStatesTracker: graph_safe must be True, False or None (pick for the "
                                       "device), got 'no' (str)."),
    (dict(device="meta"), ValueError, "CudaRNGStatesTracker: device must be a CUDA device (or the CPU, for eager "
                                      "replay), got meta."),
    (dict(device="bogus"), ValueError, "CudaRNGStatesTracker: device must be a torch.device or a device string"),
], ids=["graph-safe-str", "device-meta", "device-bogus"])
def test_a_tracker_refuses_bad_construction_arguments(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        rng.CudaRNGStatesTracker(**kwargs)


CPU_STATE_BYTES = torch.Generator().get_state().numel()  # the Mersenne Twister's state
SET_B = "CudaRNGStatesTracker.set_states: the state of stream 'b'"
VALID = torch.Generator().manual_seed(77).get_state()  # a good state, unlike stream 'a''s


def _set(bad):
    """set_states with a good state for 'a' and a new stream around a bad one: none may land."""
    return lambda tracker: tracker.set_states({"a": VALID, "b": bad, "new": VALID})


BAD_TRACKER_CALLS = {
    **{f"add-seed-{type(seed).__name__}": (lambda t, seed=seed: t.add("c", seed), TypeError, (
        f"CudaRNGStatesTracker.add: seed must be an int (not a bool), got {got}; pass an integer "
        "seed, e.g. tracker.add('c', 1234)."))
       for seed, got in [(1.5, "1.5 (float)"), (True, "True (bool)"), ("7", "'7' (str)"), (None, "None (NoneType)")]},
    "add-name-int": (lambda t: t.add(1234, "c"), TypeError, (
        "CudaRNGStatesTracker.add: name must be a str, got 1234 (int); the name comes first: "
        "tracker.add(name, seed).")),
    "add-seed-too-large": (lambda t: t.add("c", 2**64), ValueError, (
        f"CudaRNGStatesTracker.add: seed {2**64} is outside torch's seed range [-2**63, 2**64 - 1]; "
        "pass a seed inside it.")),
    "set-states-list": (lambda t: t.set_states(list(t.get_states().values())), TypeError, (
        "CudaRNGStatesTracker.set_states: expected a dict {stream name: state}, got a list; pass "
        "what get_states() returned.")),
    "set-states-int-name": (lambda t: t.set_states({0: VALID}), TypeError, (
        "CudaRNGStatesTracker.set_states: stream names are str, got 0 (int); key the dict by "
        "stream name, as get_states() does.")),
    "set-states-10-bytes": (_set(torch.zeros(10, dtype=torch.uint8)), ValueError, (
        f"{SET_B} is 10 bytes, but a cpu generator's state is {CPU_STATE_BYTES} bytes; pass a state "
        "taken from a cpu generator (tracker.get_states(), or get_state() of a cpu torch.Generator).")),
    "set-states-float": (_set(torch.zeros(CPU_STATE_BYTES)), ValueError, (
        f"{SET_B} is a torch.float32 tensor of shape ({CPU_STATE_BYTES},) on cpu; a byte state is a "
        "1-D torch.uint8 tensor on the CPU, as Generator.get_state() returns.")),
    "set-states-2d": (_set(VALID.view(2, -1)), ValueError, (
        f"{SET_B} is a torch.uint8 tensor of shape (2, {CPU_STATE_BYTES // 2}) on cpu; a byte state is a 1-D")),
    "set-states-str": (_set("seed 5"), TypeError, (
        f"{SET_B} is a str; pass a byte tensor (Generator.get_state()) or a torch.Generator on cpu, "
        "as tracker.get_states() returns.")),
    "set-states-none": (_set(None), TypeError, f"{SET_B} is a NoneType; pass a byte tensor"),
    "replace-byte-stream": (lambda t: t.replace_generators({"a": torch.Generator()}), KeyError, (
        "CudaRNGStatesTracker.replace_generators: 'a' is not a generator stream of this tracker "
        "(generator streams: none); replace only names that live_generators() returns.")),
}


@pytest.mark.parametrize("case", list(BAD_TRACKER_CALLS))
def test_bad_tracker_input_is_refused_before_anything_changes(case):
    call, error, message = BAD_TRACKER_CALLS[case]
    tracker = seeded_tracker()
    before = streams_of(tracker)
    with pytest.raises(error, match=re.escape(message)):
        call(tracker)
    assert tracker.names() == ("a", "b"), "no stream was added"
    assert_same_streams(before, streams_of(tracker))
    with tracker.fork("b"):  # the streams still work
        assert torch.equal(torch.rand(N), expected_draws(4))
    tracker.add("c", 5)  # a failed add claimed neither the name nor a seed


def test_live_generators_of_a_byte_state_tracker_is_empty():
    tracker = seeded_tracker()
    assert tracker.live_generators() == {}
    assert rng.live_stream_generators(tracker, torch.device("cpu")) == {rng.DEFAULT_STREAM: torch.default_generator}


def test_add_takes_numpy_ints_and_compares_seeds_as_torch_does():
    np = pytest.importorskip("numpy")
    tracker = cpu_tracker()
    tracker.add("np", np.int64(9))
    with tracker.fork("np"):
        assert torch.equal(torch.rand(N), expected_draws(9))
    with pytest.raises(ValueError, match=re.escape("seed 9 is already used by stream 'np'")):
        tracker.add("int", 9)
    # torch takes seeds modulo 2**64: -1 and 2**64 - 1 are one stream.
    tracker.add("minus-one", -1)
    with pytest.raises(ValueError, match=re.escape(
            f"seed {2**64 - 1} is already used by stream 'minus-one'; give 'max' a different seed.")):
        tracker.add("max", 2**64 - 1)


def test_set_states_takes_a_cpu_generator_into_a_byte_tracker():
    tracker = seeded_tracker()
    tracker.set_states({"a": torch.Generator().manual_seed(21)})
    with tracker.fork("a"):
        assert torch.equal(torch.rand(N), expected_draws(21))


def test_live_streams_of_a_duck_typed_tracker_come_from_get_states():
    """Trackers without live_generators()/replace_generators() (Megatron's, TE's) are read
    through get_states() and swapped through set_states(); their objects are kept."""
    tracker = GeneratorDictTracker()
    rng.model_parallel_cuda_manual_seed(3, tracker=tracker)
    objects = dict(tracker.states_)
    live = rng.live_stream_generators(tracker, torch.device("cpu"))
    assert live.pop(rng.DEFAULT_STREAM) is torch.default_generator
    assert all(live[name] is objects[name] for name in objects) and live.keys() == objects.keys()
    private = torch.Generator().manual_seed(5)
    with rng.streams_swapped({MODEL_PARALLEL_RNG: private}, tracker, torch.device("cpu")):
        assert tracker.states_[MODEL_PARALLEL_RNG] is private
        assert tracker.states_[EXPERT_PARALLEL_RNG] is objects[EXPERT_PARALLEL_RNG]
    assert all(tracker.states_[name] is objects[name] for name in objects)


# -- model_parallel_cuda_manual_seed: everything is checked first -----------------------------
SEEDING_TRACKERS = ["global", "ours", "duck-bytes", "duck-generators"]


def seeding_tracker(kind: str):
    """A seeded tracker of ``kind`` whose streams have moved, and the ``tracker=`` to pass."""
    from tests.graph_helpers import DuckTracker

    tracker = {"global": rng.get_cuda_rng_tracker, "ours": cpu_tracker, "duck-bytes": lambda: DuckTracker("cpu"),
               "duck-generators": GeneratorDictTracker}[kind]()
    rng.model_parallel_cuda_manual_seed(99, tp_rank=1, tracker=tracker)
    with tracker.fork() if hasattr(tracker, "fork") else contextlib.nullcontext():
        torch.rand(N)
    torch.rand(N)
    return tracker, (None if kind == "global" else tracker)


def assert_seeding_refused(kind: str, error: type, message: str, *args, **kwargs) -> None:
    tracker, argument = seeding_tracker(kind)
    objects = dict(tracker.get_states())
    before, default = streams_of(tracker), torch.get_rng_state()
    with pytest.raises(error, match=re.escape(message)):
        rng.model_parallel_cuda_manual_seed(*args, tracker=argument, **kwargs)
    assert torch.equal(torch.get_rng_state(), default), "the default generator was reseeded"
    assert_same_streams(before, streams_of(tracker))
    after = tracker.get_states()
    for name, state in objects.items():
        if isinstance(state, torch.Generator):
            assert after[name] is state, f"stream {name!r} got another generator object"


COLLISION_MESSAGE = (
    "model_parallel_cuda_manual_seed: 'model-parallel-rng' (seed + 2718 + tp_rank, tp_rank=6) and "
    "'expert-parallel-rng' (seed + 1024 + 100 * ep_rank + etp_rank, ep_rank=17, etp_rank=0) would "
    "both get seed 3958 and draw the same numbers; nothing was seeded. Megatron's offsets are "
    "fixed, so another seed does not help: the two meet whenever 100 * ep_rank + etp_rank - tp_rank "
    "== 1694, whatever the seed. Change the parallel layout so that no process has such ranks, or "
    "seed the streams yourself: tracker.reset(), then tracker.add(name, seed) with a seed per "
    "stream that differs from the other streams' and across ranks as Megatron's do (model-parallel "
    "per tp_rank, expert-parallel per (ep_rank, etp_rank)), and torch.manual_seed(seed) "
    "(torch.cuda.manual_seed on CUDA) for the default generator."
)


@pytest.mark.parametrize("kind", SEEDING_TRACKERS)
def test_colliding_derived_seeds_are_refused_before_anything_is_seeded(kind):
    assert_seeding_refused(kind, ValueError, COLLISION_MESSAGE, 1234, tp_rank=6, ep_rank=17)


def test_another_base_seed_collides_the_same_way():
    """What the message says: the collision depends on the ranks only."""
    for seed in (0, 1, 4321, -5):
        with pytest.raises(ValueError, match=re.escape("would both get seed")):
            rng.model_parallel_cuda_manual_seed(seed, tp_rank=6, ep_rank=17, tracker=cpu_tracker())
    rng.model_parallel_cuda_manual_seed(1234, tp_rank=5, ep_rank=17, tracker=cpu_tracker())  # other ranks: fine


@pytest.mark.parametrize("kind", SEEDING_TRACKERS)
@pytest.mark.parametrize("name,group", [("tp_rank", "tensor-parallel"), ("ep_rank", "expert-parallel"),
                                        ("etp_rank", "expert-tensor-parallel")])
def test_negative_ranks_are_refused_before_anything_is_seeded(kind, name, group):
    assert_seeding_refused(kind, ValueError, (
        f"model_parallel_cuda_manual_seed: {name} is -1; ranks count from 0. Pass this process's "
        f"rank in its {group} group (torch.distributed.get_rank(group)), or leave it None for 0."),
        1234, **{name: -1})


@pytest.mark.parametrize("kind", SEEDING_TRACKERS)
def test_a_seed_that_is_not_an_int_is_refused_before_anything_is_seeded(kind):
    assert_seeding_refused(kind, TypeError, (
        "model_parallel_cuda_manual_seed: seed must be an int (not a bool), got '1234' (str); pass "
        "an integer seed, e.g. model_parallel_cuda_manual_seed(1234)."), "1234")


def test_derived_seeds_beyond_torchs_range_are_refused():
    seed = 2**64 - 5
    assert_seeding_refused("ours", ValueError, (
        f"model_parallel_cuda_manual_seed: seed {seed} with these ranks gives a stream the seed "
        f"{seed + 2718 + 3}, beyond torch's largest seed 2**64 - 1 (Megatron adds 2721 to it here); "
        f"pass a seed of at most {2**64 - 1 - 2721}."), seed, tp_rank=3)


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
    live = tracker.live_generators()[MODEL_PARALLEL_RNG]
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
    assert tracker.live_generators()[MODEL_PARALLEL_RNG] is live, "set_states replaced the generator"
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
    before = tracker.live_generators()
    rng.model_parallel_cuda_manual_seed(2, tracker=tracker)
    after = tracker.live_generators()
    assert all(after[name] is before[name] for name in before)
    with tracker.fork():
        assert torch.equal(torch.rand(N, device="cuda"), expected_draws(2 + 2718, device="cuda"))


@pytest.mark.gpu
def test_set_states_on_cuda_checks_device_type_and_philox_size():
    tracker = CudaRNGStatesTracker(device="cuda")
    rng.model_parallel_cuda_manual_seed(8, tracker=tracker)
    objects = tracker.live_generators()
    before = streams_of(tracker)
    cuda_bytes = torch.Generator(device="cuda").get_state().numel()  # Philox: seed and offset
    where = "CudaRNGStatesTracker.set_states: the state of stream 'model-parallel-rng'"
    with pytest.raises(ValueError, match=re.escape(
            f"{where} is {CPU_STATE_BYTES} bytes, but a cuda generator's state is {cuda_bytes} bytes")):
        tracker.set_states({MODEL_PARALLEL_RNG: torch.get_rng_state()})
    with pytest.raises(ValueError, match=re.escape(
            f"{where} is a torch.Generator on cpu, but the streams are on cuda; pass a cuda "
            "generator or a state from tracker.get_states().")):
        tracker.set_states({MODEL_PARALLEL_RNG: torch.Generator()})
    assert_same_streams(before, streams_of(tracker))
    assert all(tracker.live_generators()[n] is g for n, g in objects.items())
    # A byte state of the right size is copied into the live object.
    tracker.set_states({MODEL_PARALLEL_RNG: torch.Generator(device="cuda").manual_seed(3).get_state()})
    assert tracker.live_generators()[MODEL_PARALLEL_RNG] is objects[MODEL_PARALLEL_RNG]
    with tracker.fork():
        assert torch.equal(torch.rand(N, device="cuda"), expected_draws(3, device="cuda"))


@pytest.mark.gpu
def test_cpu_tracker_refuses_a_cuda_generator_state():
    tracker = seeded_tracker()
    before = streams_of(tracker)
    with pytest.raises(ValueError, match=re.escape(
            "the state of stream 'a' is a torch.Generator on cuda, but the streams are on cpu")):
        tracker.set_states({"a": torch.Generator(device="cuda")})
    assert_same_streams(before, streams_of(tracker))


@pytest.mark.gpu
def test_replace_generators_swaps_objects_and_returns_the_previous_ones():
    tracker = CudaRNGStatesTracker(device="cuda")
    rng.model_parallel_cuda_manual_seed(8, tracker=tracker)
    objects = tracker.live_generators()
    with pytest.raises(TypeError, match=re.escape(
            "CudaRNGStatesTracker.replace_generators: the replacement for 'model-parallel-rng' is a "
            "torch.Generator on cpu; pass a torch.Generator on cuda.")):
        tracker.replace_generators({MODEL_PARALLEL_RNG: torch.Generator()})
    with pytest.raises(KeyError, match=re.escape("'missing' is not a generator stream of this tracker")):
        tracker.replace_generators({DATA_PARALLEL_RNG: torch.Generator(device="cuda"), "missing": torch.Generator(device="cuda")})
    assert tracker.live_generators() == objects, "a refused replacement changed nothing"
    private = torch.Generator(device="cuda").manual_seed(41)
    previous = tracker.replace_generators({MODEL_PARALLEL_RNG: private})
    assert previous == {MODEL_PARALLEL_RNG: objects[MODEL_PARALLEL_RNG]}
    assert tracker.live_generators()[MODEL_PARALLEL_RNG] is private
    with tracker.fork():
        assert torch.equal(torch.rand(N, device="cuda"), expected_draws(41, device="cuda"))
    tracker.replace_generators(previous)
    assert tracker.live_generators() == objects
