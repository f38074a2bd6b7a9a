"""checkpointing.checkpoint(): recompute reproduces the forward's random numbers bit for bit.

Every equality here is bitwise (``torch.equal``): outputs, input and weight grads, the
dropout masks drawn in the forward and in the recompute, and the state of every stream
(default generator, tracker streams) after backward, against the same program run
without checkpoint from the same seed.
"""
from __future__ import annotations

import contextlib
import functools
import re

import pytest
import torch
import torch.nn.functional as F

import rng
from checkpointing import checkpoint
from rng import MODEL_PARALLEL_RNG, CudaRNGStatesTracker

SEED = 1234
REENTRANT = pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])


# -- trackers of other libraries, duck-typed -----------------------------------------------
class MegatronStyleTracker:
    """Megatron-core's CudaRNGStatesTracker in its classic (non-graph-safe) mode, on the
    CPU generator: byte states, get_states() hands out the stored tensors, set_states()
    takes the dict as is, fork() copies states in and out of the default generator."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return {name: state for name, state in self.states_.items()}

    def set_states(self, states):
        self.states_ = states

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise Exception(f"seed {seed} or name {name} already exists")
        self.seeds_.add(seed)
        original = torch.default_generator.get_state()
        torch.default_generator.manual_seed(seed)
        self.states_[name] = torch.default_generator.get_state()
        torch.default_generator.set_state(original)

    @contextlib.contextmanager
    def fork(self, name=MODEL_PARALLEL_RNG):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        original = torch.default_generator.get_state()
        torch.default_generator.set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.default_generator.get_state()
            torch.default_generator.set_state(original)


class MegatronGraphSafeTracker(MegatronStyleTracker):
    """Megatron-core's tracker with use_cudagraphable_rng=True: generator objects as states,
    get_states() returns live references, fork() swaps with graphsafe_set_state."""

    @staticmethod
    def _cuda_default():
        return torch.cuda.default_generators[torch.cuda.current_device()]

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise Exception(f"seed {seed} or name {name} already exists")
        self.seeds_.add(seed)
        state = self._cuda_default().clone_state()
        state.manual_seed(seed)
        self.states_[name] = state

    @contextlib.contextmanager
    def fork(self, name=MODEL_PARALLEL_RNG):
        generator = self._cuda_default()
        original = generator.graphsafe_get_state()
        generator.graphsafe_set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = generator.graphsafe_get_state()
            generator.graphsafe_set_state(original)


# -- the checkpointed region -----------------------------------------------------------------
def region(x, scale, *, w, mask, tracker, p=0.5, log=None):
    """Dropout from the default generator, then from a tracker stream; a non-tensor
    positional arg, tensor and non-tensor kwargs; a tuple output with None in it."""
    h = F.dropout(x @ w, p=0.3, training=True)
    with tracker.fork():
        m = F.dropout(torch.tanh(h), p=p, training=True)
    out = m * scale + mask
    if log is not None:
        log.append((h == 0, m == 0))
    return out, None, h


def inputs(device):
    """Fixed inputs drawn from a private generator (the streams under test stay untouched)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(42)
    x = torch.randn(16, 32, generator=g)
    w = torch.randn(32, 32, generator=g) / 6
    mask, g1, g2 = (torch.randn(16, 32, generator=g) for _ in range(3))
    return [t.to(device) for t in (x, w, mask, g1, g2)]


def stream_states(tracker, device):
    """Every stream's state, as comparable byte tensors."""
    states = {"cpu": torch.default_generator.get_state()}
    if device == "cuda":
        states["cuda"] = rng.default_generator("cuda").get_state()
    tracker_states = tracker.get_states()
    for name, state in tracker_states.items():
        states[name] = rng.to_byte_state(state)
    return states


def assert_states_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"stream {name!r} differs"


def assert_checkpoint_matches(run, states_at=3):
    """``run(ckpt)`` returns tensors then stream states at ``states_at``: the checkpointed
    run's first three tensors and its streams must equal the plain run's bitwise. Returns
    both runs' results for further checks."""
    ref, got = run(False), run(True)
    for a, b in zip(ref[:3], got[:3]):
        assert torch.equal(a, b)
    assert_states_equal(ref[states_at], got[states_at])
    return ref, got


def run(device, tracker, ckpt, use_reentrant=True, seed_streams=None):
    """One forward+backward of ``region``; returns outputs, grads, masks and stream states."""
    (seed_streams or (lambda: rng.model_parallel_cuda_manual_seed(SEED, tracker=tracker)))()
    x0, w0, mask, g1, g2 = inputs(device)
    x = x0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    log = []
    kwargs = dict(w=w, mask=mask, tracker=tracker, p=0.5, log=log)
    if ckpt:
        out, none, h = checkpoint(region, x, 2.0, use_reentrant=use_reentrant,
                                  get_rng_state_tracker=lambda: tracker, **kwargs)
    else:
        out, none, h = region(x, 2.0, **kwargs)
    assert none is None
    after_forward = stream_states(tracker, device)
    # Other work draws from every stream between this forward and its backward; the
    # recompute must neither repeat those numbers nor consume any of its own.
    between = [torch.rand(7, device=device)]
    with tracker.fork():
        between.append(torch.rand(7, device=device))
    ((out * g1).sum() + (h * g2).sum()).backward()
    return dict(
        out=out.detach(), h=h.detach(), gx=x.grad, gw=w.grad, log=log, between=between,
        after_forward=after_forward, after_backward=stream_states(tracker, device),
    )


def assert_same_run(ref, got):
    assert torch.equal(got["out"], ref["out"])
    assert torch.equal(got["h"], ref["h"])
    assert torch.equal(got["gx"], ref["gx"])
    assert torch.equal(got["gw"], ref["gw"])
    assert_states_equal(got["after_forward"], ref["after_forward"])
    for a, b in zip(got["between"], ref["between"]):
        assert torch.equal(a, b)
    assert_states_equal(got["after_backward"], ref["after_backward"])
    # The forward drew the same masks as the plain run, and the recompute drew them again.
    assert len(ref["log"]) == 1 and len(got["log"]) == 2
    (h_ref, m_ref), = ref["log"]
    for h_mask, m_mask in got["log"]:
        assert torch.equal(h_mask, h_ref)
        assert torch.equal(m_mask, m_ref)
    # Sanity: dropout really dropped, so equal masks are evidence.
    assert 0 < int(h_ref.sum()) < h_ref.numel()
    assert 0 < int(m_ref.sum()) < m_ref.numel()


# -- CPU: our tracker ----------------------------------------------------------------------------
@REENTRANT
def test_checkpoint_matches_plain_run_bitwise(use_reentrant):
    tracker = CudaRNGStatesTracker(device="cpu")
    ref = run("cpu", tracker, ckpt=False)
    got = run("cpu", tracker, ckpt=True, use_reentrant=use_reentrant)
    assert_same_run(ref, got)


@REENTRANT
def test_checkpoint_with_default_tracker_argument(use_reentrant):
    """get_rng_state_tracker=None means rng.get_cuda_rng_tracker()."""
    tracker = rng.get_cuda_rng_tracker()
    rng.model_parallel_cuda_manual_seed(SEED, tracker=tracker)
    x = torch.ones(4096, device=tracker.device, requires_grad=True)

    def fn(t):
        with tracker.fork():
            return F.dropout(t, p=0.5, training=True)

    def stream():
        return rng.to_byte_state(tracker.get_states()[MODEL_PARALLEL_RNG])

    def advance():  # the stream moves on between forward and backward
        with tracker.fork():
            torch.rand(8, device=tracker.device)

    plain = fn(x)
    advance()
    plain.sum().backward()
    ref_grad, ref_state = x.grad.clone(), stream()
    x.grad = None
    rng.model_parallel_cuda_manual_seed(SEED, tracker=tracker)
    out = checkpoint(fn, x, use_reentrant=use_reentrant)
    advance()
    out.sum().backward()
    assert torch.equal(out, plain)
    assert torch.equal(x.grad, ref_grad)
    assert torch.equal(x.grad, plain.detach())  # grad of sum(dropout(ones)) is the output itself
    assert torch.equal(stream(), ref_state)


def test_torch_checkpoint_gets_the_tracker_stream_wrong():
    """Negative control: torch.utils.checkpoint restores the default generator but not the
    tracker's stream, so its recompute draws another mask. The equalities above can fail."""
    tracker = CudaRNGStatesTracker(device="cpu")
    ref = run("cpu", tracker, ckpt=False)
    rng.model_parallel_cuda_manual_seed(SEED, tracker=tracker)
    x0, w0, mask, g1, g2 = inputs("cpu")
    x = x0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    log = []
    bound = functools.partial(region, w=w, mask=mask, tracker=tracker, log=log)
    out, _, h = torch.utils.checkpoint.checkpoint(bound, x, 2.0, use_reentrant=True)
    ((out * g1).sum() + (h * g2).sum()).backward()
    assert torch.equal(out, ref["out"])  # the forward itself is the same
    assert torch.equal(log[0][0], ref["log"][0][0])  # default stream: torch restores it
    assert torch.equal(log[1][0], ref["log"][0][0])
    assert torch.equal(log[0][1], ref["log"][0][1])
    assert not torch.equal(log[1][1], ref["log"][0][1]), "recompute redrew the forward's mask"
    assert not torch.equal(x.grad, ref["gx"])
    # ... and the recompute consumed a second window of the tracker stream.
    after = stream_states(tracker, "cpu")
    assert not torch.equal(after[MODEL_PARALLEL_RNG], ref["after_backward"][MODEL_PARALLEL_RNG])


@REENTRANT
def test_two_checkpointed_layers_draw_different_masks(use_reentrant):
    tracker = CudaRNGStatesTracker(device="cpu")

    def two_layers(ckpt):
        rng.model_parallel_cuda_manual_seed(SEED, tracker=tracker)
        x0, w0, mask, g1, _ = inputs("cpu")
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        logs = [[], []]
        h = x
        for log in logs:
            kwargs = dict(w=w, mask=mask, tracker=tracker, log=log)
            if ckpt:
                h, _, _ = checkpoint(region, h, 0.5, use_reentrant=use_reentrant,
                                     get_rng_state_tracker=lambda: tracker, **kwargs)
            else:
                h, _, _ = region(h, 0.5, **kwargs)
        (h * g1).sum().backward()
        return h.detach(), x.grad, w.grad, logs, stream_states(tracker, "cpu")

    ref, got = assert_checkpoint_matches(two_layers, states_at=4)
    for ref_log, got_log in zip(ref[3], got[3]):
        for masks in got_log:  # forward and recompute
            assert torch.equal(masks[0], ref_log[0][0]) and torch.equal(masks[1], ref_log[0][1])
    # Layers draw different windows of each stream.
    assert not torch.equal(ref[3][0][0][0], ref[3][1][0][0])
    assert not torch.equal(ref[3][0][0][1], ref[3][1][0][1])


@REENTRANT
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_checkpoint_called_inside_a_fork(use_reentrant, device):
    """The region draws from a tracker stream that was forked *around* the checkpoint; the
    backward runs after the fork has closed."""
    tracker = CudaRNGStatesTracker(device="cpu") if device == "cpu" else rng.get_cuda_rng_tracker()

    def fn(t, w):
        return F.dropout(torch.tanh(t @ w), p=0.5, training=True)

    def once(ckpt):
        rng.model_parallel_cuda_manual_seed(SEED, tracker=tracker)
        x0, w0, _, g1, _ = inputs(device)
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        with tracker.fork():
            if ckpt:
                out = checkpoint(fn, x, w, use_reentrant=use_reentrant,
                                 get_rng_state_tracker=lambda: tracker)
            else:
                out = fn(x, w)
        torch.rand(7, device=device)
        with tracker.fork():
            torch.rand(7, device=device)
        (out * g1).sum().backward()
        return out.detach(), x.grad, w.grad, stream_states(tracker, device)

    assert_checkpoint_matches(once)


@REENTRANT
def test_backward_twice_with_retain_graph(use_reentrant):
    tracker = CudaRNGStatesTracker(device="cpu")

    def twice(ckpt):
        rng.model_parallel_cuda_manual_seed(SEED, tracker=tracker)
        x0, w0, mask, g1, g2 = inputs("cpu")
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        kwargs = dict(w=w, mask=mask, tracker=tracker)
        if ckpt:
            out, _, h = checkpoint(region, x, 2.0, use_reentrant=use_reentrant,
                                   get_rng_state_tracker=lambda: tracker, **kwargs)
        else:
            out, _, h = region(x, 2.0, **kwargs)
        loss = (out * g1).sum() + (h * g2).sum()
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        loss.backward()
        return first, x.grad, w.grad, stream_states(tracker, "cpu")

    assert_checkpoint_matches(twice)


def autocast_case(device, tracker, use_reentrant):
    """Checkpointed vs plain under bf16 autocast on ``device``, dropout inside a tracker fork
    and outside it: outputs, grads and every stream afterwards must be bitwise equal."""

    def fn(x, w):
        h = F.gelu(x @ w)
        with tracker.fork():
            h = F.dropout(h, p=0.2, training=True)
        return F.dropout(h @ w, p=0.1, training=True)

    def once(ckpt):
        rng.model_parallel_cuda_manual_seed(SEED, tracker=tracker)
        x0, w0, _, g1, _ = inputs(device)
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            out = (checkpoint(fn, x, w, use_reentrant=use_reentrant, get_rng_state_tracker=lambda: tracker)
                   if ckpt else fn(x, w))
        assert out.dtype == torch.bfloat16
        (out.float() * g1).sum().backward()
        return out.detach(), x.grad, w.grad, stream_states(tracker, device)

    assert_checkpoint_matches(once)


@REENTRANT
def test_autocast_recompute_matches_bitwise(use_reentrant):
    autocast_case("cpu", CudaRNGStatesTracker(device="cpu"), use_reentrant)


@REENTRANT
def test_context_fn_wraps_forward_and_recompute(use_reentrant):
    events = []

    @contextlib.contextmanager
    def tag(name):
        events.append(f"enter {name}")
        yield
        events.append(f"exit {name}")

    def fn(t):
        events.append("run")
        return t.sin()  # saves its input, so the non-reentrant path recomputes too

    x = torch.randn(8, requires_grad=True)
    out = checkpoint(fn, x, use_reentrant=use_reentrant,
                     context_fn=lambda: (tag("forward"), tag("recompute")))
    assert events == ["enter forward", "run", "exit forward"]
    out.sum().backward()
    assert events[3:] == ["enter recompute", "run", "exit recompute"]
    assert torch.equal(x.grad, x.detach().cos())


def test_checkpoint_without_grad_just_calls_the_function():
    tracker = CudaRNGStatesTracker(device="cpu")
    rng.model_parallel_cuda_manual_seed(SEED, tracker=tracker)
    x0, w0, mask, _, _ = inputs("cpu")
    ref = region(x0, 2.0, w=w0, mask=mask, tracker=tracker)[0]
    ref_states = stream_states(tracker, "cpu")
    rng.model_parallel_cuda_manual_seed(SEED, tracker=tracker)
    with torch.no_grad():
        out = checkpoint(region, x0, 2.0, w=w0, mask=mask, tracker=tracker,
                         get_rng_state_tracker=lambda: tracker)[0]
    assert torch.equal(out, ref)
    assert_states_equal(stream_states(tracker, "cpu"), ref_states)


def test_non_reentrant_works_under_autograd_grad():
    tracker = CudaRNGStatesTracker(device="cpu")
    ref = run("cpu", tracker, ckpt=False)
    rng.model_parallel_cuda_manual_seed(SEED, tracker=tracker)
    x0, w0, mask, g1, g2 = inputs("cpu")
    x = x0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    out, _, h = checkpoint(region, x, 2.0, use_reentrant=False, w=w, mask=mask, tracker=tracker,
                           get_rng_state_tracker=lambda: tracker)
    torch.rand(7)  # the same draws between forward and backward as run() makes
    with tracker.fork():
        torch.rand(7)
    gx, gw = torch.autograd.grad((out * g1).sum() + (h * g2).sum(), (x, w))
    assert torch.equal(gx, ref["gx"]) and torch.equal(gw, ref["gw"])
    assert_states_equal(stream_states(tracker, "cpu"), ref["after_backward"])


# -- CPU: a Megatron-style duck-typed tracker -----------------------------------------------------
def megatron_seed(tracker):
    def seed():
        tracker.reset()
        torch.default_generator.manual_seed(SEED)
        tracker.add(MODEL_PARALLEL_RNG, SEED + 2718)
    return seed


@REENTRANT
def test_megatron_style_tracker_reproduces_masks_and_keeps_streams(use_reentrant):
    tracker = MegatronStyleTracker()
    ref = run("cpu", tracker, ckpt=False, seed_streams=megatron_seed(tracker))
    got = run("cpu", tracker, ckpt=True, use_reentrant=use_reentrant,
              seed_streams=megatron_seed(tracker))
    assert_same_run(ref, got)
    assert set(tracker.states_) == {MODEL_PARALLEL_RNG}


def test_snapshot_helpers_on_megatron_style_tracker():
    tracker = MegatronStyleTracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    snapshot = rng.snapshot_tracker_states(tracker)
    with tracker.fork("a"):
        first_a = torch.rand(64)
    with tracker.fork("b"):
        first_b = torch.rand(64)
    rng.restore_tracker_states(tracker, {"a": snapshot["a"]})  # only one stream restored
    with tracker.fork("a"):
        assert torch.equal(torch.rand(64), first_a)
    with tracker.fork("b"):  # the other stream kept going
        assert not torch.equal(torch.rand(64), first_b)


# -- errors -------------------------------------------------------------------------------------
def test_reentrant_checkpoint_under_autograd_grad_says_what_to_do():
    x = torch.randn(8, requires_grad=True)
    out = checkpoint(lambda t: t * 2, x)
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "checkpoint(use_reentrant=True) was reached through torch.autograd.grad() (or "
            ".backward(inputs=...)), which it cannot hand gradients back through. Call .backward() / "
            "torch.autograd.backward() without inputs= instead, or use checkpoint(..., use_reentrant=False)."
        ),
    ):
        torch.autograd.grad(out.sum(), x)


def test_reentrant_checkpoint_needs_an_input_that_requires_grad():
    x = torch.randn(8)
    w = torch.randn(8, requires_grad=True)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "checkpoint(use_reentrant=True): no tensor argument requires grad, so no gradient "
            "would reach the parameters used inside the function. Make an input require grad "
            "or use use_reentrant=False."
        ),
    ):
        checkpoint(lambda t: t * w, x)
    # The non-reentrant path handles it: the weight gets its grad.
    checkpoint(lambda t: t * w, x, use_reentrant=False).sum().backward()
    assert torch.equal(w.grad, x)


def test_reentrant_recompute_without_grad_outputs_is_reported():
    x = torch.randn(8, requires_grad=True)
    out = checkpoint(lambda t: t.detach() * 2, x)
    with pytest.raises(RuntimeError, match=re.escape("no output of the checkpointed function requires grad")):
        out.sum().backward()


def test_non_reentrant_recompute_that_saves_differently_is_reported():
    calls = []

    def fn(t):
        calls.append(1)
        return t.sin() if len(calls) == 1 else t * 2  # sin saves its input, * 2 saves nothing

    x = torch.randn(8, requires_grad=True)
    out = checkpoint(fn, x, use_reentrant=False)
    with pytest.raises(
        RuntimeError,
        match=re.escape("checkpoint(use_reentrant=False): the recompute saved 0 tensors but the "
                        "forward saved 1; the checkpointed function must run the same operations"),
    ):
        out.sum().backward()


@REENTRANT
@pytest.mark.parametrize("container", ["list", "dict", "nested"])
def test_container_outputs_get_their_grads(use_reentrant, container):
    """Outputs in a list, a dict or nested structures keep their structure, their
    constants and their gradients, bitwise the plain run's."""
    w = torch.randn(6, requires_grad=True)

    def fn(t):
        a, b = t * w, (t + w).sin()
        if container == "list":
            return [a, b]
        if container == "dict":
            return {"a": a, "b": b, "note": "kept"}
        return (a, {"inner": [b, None]}, 3)

    def loss(out):
        leaves = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        return sum((leaf * (i + 1)).sum() for i, leaf in enumerate(leaves))

    x = torch.randn(6, requires_grad=True)
    plain = fn(x)
    loss(plain).backward()
    want = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    got = checkpoint(fn, x, use_reentrant=use_reentrant)
    assert type(got) is type(plain)
    assert torch.utils._pytree.tree_structure(got) == torch.utils._pytree.tree_structure(plain)
    loss(got).backward()
    assert torch.equal(x.grad, want[0]) and torch.equal(w.grad, want[1])


def test_megatrons_argument_order_is_refused():
    x = torch.randn(8, requires_grad=True)
    with pytest.raises(TypeError, match=re.escape(
            "checkpoint(<lambda>, False, ...): the first argument after the function is a bool, "
            "which looks like Megatron's argument order checkpoint(function, "
            "distribute_saved_activations, *args). Here the options are keywords: "
            "checkpoint(function, *args, distribute_saved_activations=...)")):
        checkpoint(lambda flag, t: t * 2, False, x)


def test_distribute_saved_activations_errors_without_a_group():
    x = torch.randn(8, requires_grad=True)
    with pytest.raises(ValueError, match=re.escape(
            "checkpoint(distribute_saved_activations=True) needs use_reentrant=True.")):
        checkpoint(lambda t: t * 2, x, use_reentrant=False, distribute_saved_activations=True)
    if not torch.distributed.is_initialized():
        with pytest.raises(ValueError, match=re.escape(
                "needs torch.distributed to be initialized and a tensor-parallel group (tp_group=...)")):
            checkpoint(lambda t: t * 2, x, distribute_saved_activations=True)


def test_fork_of_unknown_stream_inside_checkpoint_raises_keyerror():
    tracker = rng.get_cuda_rng_tracker()
    x = torch.randn(8, requires_grad=True)

    def fn(t):
        with tracker.fork("missing"):
            return t * 2

    with pytest.raises(KeyError, match=re.escape("no stream named 'missing' (known: none)")):
        checkpoint(fn, x)


# -- bad arguments are refused before anything runs ---------------------------------------------
class FakeTracker:
    """Has fork() only: not a tracker checkpoint() can snapshot."""

    def fork(self, name=MODEL_PARALLEL_RNG):
        return contextlib.nullcontext()


BAD_CALLS = {
    "function-not-callable": (dict(function=5), (
        "checkpoint: the first argument must be the function to recompute, got 5 (int), which "
        "cannot be called; pass it first: checkpoint(function, *args, ...).")),
    "use-reentrant-str": (dict(use_reentrant="no"), (
        "checkpoint: use_reentrant must be True or False, got 'no' (str); pass a bool (Python "
        "reads 'no' as True).")),
    "use-reentrant-none": (dict(use_reentrant=None), (
        "checkpoint: use_reentrant must be True or False, got None (NoneType); pass a bool "
        "(Python reads None as False).")),
    "distribute-str": (dict(distribute_saved_activations="false"), (
        "checkpoint: distribute_saved_activations must be True or False, got 'false' (str); pass "
        "a bool (Python reads 'false' as True).")),
    "tracker-getter-int": (dict(get_rng_state_tracker=42), (
        "checkpoint: get_rng_state_tracker must be a function that returns the tracker, got 42 "
        "(int); pass the function, not its result: get_rng_state_tracker=rng.get_cuda_rng_tracker, "
        "or lambda: tracker.")),
    "tracker-not-getter": (dict(get_rng_state_tracker=CudaRNGStatesTracker("cpu")), (
        "checkpoint: get_rng_state_tracker must be a function that returns the tracker, got a "
        "CudaRNGStatesTracker; pass the function, not its result")),
    "getter-returns-int": (dict(get_rng_state_tracker=lambda: 42), (
        "checkpoint: get_rng_state_tracker() returned 42 (int), which has no get_states, "
        "set_states, fork; it must return an RNG tracker with get_states(), set_states() and "
        "fork() (ours: rng.get_cuda_rng_tracker(); Megatron's, apex's and Transformer Engine's "
        "work too).")),
    "getter-returns-none": (dict(get_rng_state_tracker=lambda: None), (
        "checkpoint: get_rng_state_tracker() returned None (NoneType), which has no get_states, "
        "set_states, fork;")),
    "getter-returns-fork-only": (dict(get_rng_state_tracker=FakeTracker), (
        "checkpoint: get_rng_state_tracker() returned a FakeTracker, which has no get_states, "
        "set_states;")),
    "context-fn-one-context": (dict(context_fn=contextlib.nullcontext), (
        "checkpoint: context_fn() returned a nullcontext; it must return a pair of context "
        "managers (forward_context, recompute_context), the first entered around the forward and "
        "the second around the recompute, e.g. lambda: (contextlib.nullcontext(), my_context()).")),
    "context-fn-three": (dict(context_fn=lambda: (contextlib.nullcontext(),) * 3), (
        "checkpoint: context_fn() returned a tuple of 3; it must return a pair of context managers")),
    "context-fn-not-contexts": (dict(context_fn=lambda: (1, 2)), (
        "checkpoint: context_fn() returned a tuple of 2; it must return a pair of context managers")),
    "context-fn-not-callable": (dict(context_fn=contextlib.nullcontext()), (
        "checkpoint: context_fn must be a function returning two context managers, got a "
        "nullcontext; e.g. context_fn=lambda: (forward_context, recompute_context).")),
}


# Without grad checkpoint() just calls the function, so it never calls get_rng_state_tracker
# or context_fn: what they return is checked with grad only.
CALLS_WITH_RESULTS = {"getter-returns-int", "getter-returns-none", "getter-returns-fork-only",
                      "context-fn-one-context", "context-fn-three", "context-fn-not-contexts"}


@pytest.mark.parametrize("case,grad", [(c, True) for c in BAD_CALLS] + [
    (c, False) for c in BAD_CALLS if c not in CALLS_WITH_RESULTS])
def test_bad_arguments_are_refused_before_anything_runs(case, grad):
    options, message = BAD_CALLS[case]
    options = dict(options)
    tracker = rng.get_cuda_rng_tracker()
    rng.model_parallel_cuda_manual_seed(SEED)
    with tracker.fork():
        torch.rand(8)
    calls = []

    def region(t):
        calls.append(1)
        return F.dropout(t, 0.5)

    function = options.pop("function", region)
    x = torch.ones(16, requires_grad=True)
    default, streams = torch.get_rng_state(), tracker.get_states()
    with torch.set_grad_enabled(grad), pytest.raises(TypeError, match=re.escape(message)):
        checkpoint(function, x, **options)
    assert not calls, "the function ran"
    assert torch.equal(torch.get_rng_state(), default)
    after = tracker.get_states()
    assert after.keys() == streams.keys() and all(torch.equal(after[n], streams[n]) for n in streams)
    assert x.grad is None


# -- GPU: the same properties with graph-safe tracker states ------------------------------------
@pytest.mark.gpu
@REENTRANT
def test_checkpoint_matches_plain_run_bitwise_cuda(use_reentrant):
    tracker = rng.get_cuda_rng_tracker()
    assert tracker.graph_safe
    shared = {}

    def seed():
        rng.model_parallel_cuda_manual_seed(SEED, tracker=tracker)
        shared.update(live_state_references(tracker))

    ref = run("cuda", tracker, ckpt=False, seed_streams=seed)
    got = run("cuda", tracker, ckpt=True, use_reentrant=use_reentrant, seed_streams=seed)
    assert_same_run(ref, got)
    # The restores copied into the live state objects (what a CUDA graph registration
    # holds) instead of swapping others in: references taken at seeding still follow.
    torch.rand(7, device="cuda")
    with tracker.fork():
        torch.rand(7, device="cuda")
    now = live_state_references(tracker)
    assert shared.keys() == now.keys()
    for name in now:
        assert shared[name].get_offset() == now[name].get_offset(), name


def live_state_references(tracker):
    """A reference sharing the state object of each live CUDA stream."""
    generators = {**tracker.live_generators(), "<default>": rng.default_generator("cuda")}
    return {name: g.graphsafe_get_state() for name, g in generators.items()}


@pytest.mark.gpu
@REENTRANT
def test_autocast_recompute_matches_bitwise_cuda(use_reentrant):
    autocast_case("cuda", rng.get_cuda_rng_tracker(), use_reentrant)


@pytest.mark.gpu
@REENTRANT
def test_graph_safe_duck_tracker_reproduces_masks_and_keeps_streams(use_reentrant):
    tracker = MegatronGraphSafeTracker()

    def seed():
        tracker.reset()
        torch.cuda.manual_seed(SEED)
        torch.default_generator.manual_seed(SEED)
        tracker.add(MODEL_PARALLEL_RNG, SEED + 2718)

    ref = run("cuda", tracker, ckpt=False, seed_streams=seed)
    got = run("cuda", tracker, ckpt=True, use_reentrant=use_reentrant, seed_streams=seed)
    assert_same_run(ref, got)


@pytest.mark.gpu
def test_graph_safe_duck_tracker_references_do_not_rewind_but_our_snapshots_do():
    """What TE's and Megatron-core's checkpoints do with a graph-safe tracker: save
    get_states() (live references) and set_states() them back. The stream does not rewind."""
    tracker = MegatronGraphSafeTracker()
    tracker.add(MODEL_PARALLEL_RNG, 7)
    references = tracker.get_states()
    with tracker.fork():
        first = torch.rand(257, device="cuda")
    tracker.set_states(references)
    with tracker.fork():
        again = torch.rand(257, device="cuda")
    assert not torch.equal(again, first), "restoring live references rewound the stream"

    snapshot = rng.snapshot_tracker_states(tracker)
    with tracker.fork():
        first = torch.rand(257, device="cuda")
    rng.restore_tracker_states(tracker, snapshot)
    with tracker.fork():
        assert torch.equal(torch.rand(257, device="cuda"), first)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_checkpoint_captured_outside_te_graph_is_refused():
    x = torch.randn(64, device="cuda", requires_grad=True)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with pytest.raises(RuntimeError, match=re.escape(
            "checkpoint() is being captured into a CUDA graph without te_graph's capture hook")):
        with torch.cuda.graph(graph, stream=stream):
            checkpoint(lambda t: t * 2, x)
    torch.cuda.current_stream().wait_stream(stream)
    # The process is still usable afterwards.
    assert torch.equal(checkpoint(lambda t: t * 2, x), x * 2)


@pytest.mark.gpu
def test_warmup_hook_sees_the_streams_and_offsets_of_each_region():
    """The hook te_graph sets in its last warmup pass learns, per checkpointed region, the
    streams it draws from and where inside the forward its draws begin."""
    from checkpointing.capture_hook import capture_hook_set
    from te_graph.capture.recompute_rng import ForwardDraws

    tracker = rng.get_cuda_rng_tracker()
    rng.model_parallel_cuda_manual_seed(SEED, tracker=tracker)
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(64, device="cuda", requires_grad=True)

    def default_only(t):
        return F.dropout(t, p=0.5, training=True)

    def tracked_only(t):
        with tracker.fork():
            return F.dropout(t, p=0.5, training=True)

    draws = ForwardDraws(rng.live_stream_generators(tracker, device))
    with capture_hook_set(draws):
        h = F.dropout(x, p=0.5, training=True)  # before any region: 4 offsets of the default
        h = checkpoint(default_only, h)
        h = checkpoint(tracked_only, h)
        h = checkpoint(lambda t: t * 2, h)
    use = draws.close()
    assert [r.offsets for r in use.regions] == [{rng.DEFAULT_STREAM: 4}, {MODEL_PARALLEL_RNG: 0}, {}]
    assert use.used == (rng.DEFAULT_STREAM, MODEL_PARALLEL_RNG)


@REENTRANT
def test_outputs_and_their_graph_are_freed_without_the_garbage_collector(use_reentrant):
    """Nothing the checkpoint keeps refers back to its outputs: dropping them frees the
    autograd graph at once (a reference cycle through the autograd node would hold every
    step's activations until a collection, or forever)."""
    import gc
    import weakref

    x = torch.randn(64, requires_grad=True)
    enabled = gc.isenabled()
    gc.disable()
    try:
        out = checkpoint(lambda t: [t * 2, {"a": t.sin(), "n": 1}], x, use_reentrant=use_reentrant)
        refs = [weakref.ref(out[0]), weakref.ref(out[1]["a"])]
        del out
        assert all(r() is None for r in refs), "the outputs outlived their last reference"
    finally:
        if enabled:
            gc.enable()


def test_device_side_message_fits_cudas_limit():
    """Inside a capture the sharded-input check is a device-side assertion, whose message
    torch limits to 254 characters (a longer one fails the capture itself)."""
    from checkpointing.distribute import _SHARDED_ON_DEVICE

    assert len(_SHARDED_ON_DEVICE) < 255
    assert _SHARDED_ON_DEVICE.startswith("checkpoint(distribute_saved_activations=True): the first input differs")
