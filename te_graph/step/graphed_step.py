"""``make_graphed_step``: a whole training step (every microbatch's forward, loss and
backward, the gradients accumulated, optionally the optimizer's step) captured as one CUDA
graph and replayed each step, bitwise equal to the eager step, dropout and recompute
included.

The step function runs eagerly ``num_warmup_iters`` times on a side stream (lazy
initialisation, the random streams each checkpointed region draws from and where), then
every value the step changed is put back (``state.StepState``: parameters, gradients,
buffers, optimizer state, random streams; host streams and tensors outside the modules,
``capture.host_state``), and the step is captured once. Its random draws come from the live
streams, so each replay draws what the eager step would; each checkpointed region's
recompute draws from a private generator set, before each replay, where the region's draws
begin inside the step (``capture.recompute_rng``), and torch's own checkpoint is routed
through the same (``checkpointing.torch_routing``). The gradients the captured backward
makes stay the parameters' ``.grad`` after each replay. What a step froze (its modules'
attributes it read, the optimizer's hyperparameters, the process's settings) is checked at
each call; ``verify=`` compares chosen replays with the eager step, bitwise; and
``eager_replay=True`` runs the same wrapper without a graph. A checkpointed region under
FP8 that keeps scaling state (delayed scaling) is refused in warmup (``_Regions``).
"""
from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

import rng
from checkpointing.capture_hook import capture_hook_set
from checkpointing.checks import tracker_from
from checkpointing.torch_routing import torch_checkpoint_routed

from ..capture.graphs import capturing
from ..capture.host_state import HostState
from ..capture.recompute_rng import ForwardDraws, RecomputeRNG
from ..guards.frozen import FrozenModule
from ..guards.outside import OutsideReads
from ..guards.reads import ForwardReads, reads_recorded
from ..guards.settings import Settings
from ..extension import SEAM
from ..intake.checks import check_environment
from ..intake.options import eager_replay_default
from ..layout import InputLayout, OutputLayout, describe_value
from ..replay.copy_in import Slot, copy_in
from ..replay.outputs import GraphOutputs
from ..resources import RESOURCES
from ..verify.compare import differences, report
from ..verify.options import Schedule, verify_options
from .optimizer import (changed_hyperparameters, check_no_state_made, check_optimizer, optimizer_groups,
                        optimizer_state, with_state)
from .state import StepState

__all__ = ["make_graphed_step", "GraphedStep"]

_NAME = "the graphed step"


_FP8_RECOMPUTE = (
    "make_graphed_step: the step recomputes a checkpointed region (checkpointing.checkpoint or "
    "torch.utils.checkpoint) under FP8 that keeps scaling state from step to step ({what}); such a step graphed "
    "whole is not proven equal to eager (the loss of its first replay differs from eager's). Graph its layers "
    "with make_graphed_callables instead (exact with FP8 and recompute), or graph the step without recompute, "
    "or in bf16."
)


class _Regions:
    """``checkpointing.capture_hook``'s hook while the step warms up: regions run eagerly,
    observed by the last pass's draw record. A region entered while the precision keeps
    scaling state from step to step (FP8 delayed scaling) is refused before it runs: the
    whole-step graph of such a recompute is not proven equal to eager, and warmup's
    ``finally`` puts back what the step did before it."""

    def __init__(self, draws: Optional[ForwardDraws]):
        self.draws = draws

    def forward_region(self):
        what = SEAM.precision.scaling_state_in_use()
        if what is not None:
            raise ValueError(_FP8_RECOMPUTE.format(what=what))
        return self.draws.forward_region() if self.draws is not None else contextlib.nullcontext()


class _Owner:
    """What ``GraphOutputs`` reads of its owner: the memory that is the model's own."""

    def __init__(self, modules: Sequence[torch.nn.Module]):
        self.func = torch.nn.ModuleList(modules)


class GraphedStep:
    """A training step captured as one graph (or, in eager replay, run eagerly on the same
    static buffers). Call it like the step function; ``reset()`` frees the graph."""

    def __init__(self, step_fn: Callable, layout: InputLayout, modules: Sequence[torch.nn.Module], optimizer: Any,
                 tracker: Any, eager_replay: bool, verify: Any):
        self.step_fn, self.layout, self.modules, self.optimizer = step_fn, layout, list(modules), optimizer
        self.tracker, self.eager_replay = tracker, eager_replay
        self.static_inputs = tuple(t.detach() for t in layout.samples)
        self.slots = tuple(map(Slot, self.static_inputs))
        self.params = [p for m in self.modules for p in torch.nn.Module.parameters(m)]
        self.graph: Any = None
        self.outputs: Optional[OutputLayout] = None
        self.handout: Optional[GraphOutputs] = None
        self.recompute: Any = None
        self.static_grads: list = []
        self.reads = ForwardReads()
        self._verification = Schedule(verify) if verify is not None else None
        self._groups = optimizer_groups(optimizer)
        self._state = optimizer_state(optimizer)
        self._frozen: list[FrozenModule] = []
        self._settings: Optional[Settings] = None
        self._outside: Optional[OutsideReads] = None

    # -- making it --------------------------------------------------------------------
    def prepare(self, num_warmup_iters: int, pool: Any) -> None:
        """Warm up and capture (eager replay: warm up only); a failure puts everything back.
        The precision's state (FP8 scales, amax histories), which StepState does not hold, is
        put back last, as before warmup: the first replay starts where eager's next step would.
        Last, since the host watcher keeps a tensor's value at its first in-place update through
        torch, which for these may come after kernels of an extension updated them unseen
        (TE 2.20 copies the forward's scales back in place for a recompute)."""
        with SEAM.precision.kept(self.modules):
            self._prepare(num_warmup_iters, pool)

    def _prepare(self, num_warmup_iters: int, pool: Any) -> None:
        state = StepState(self.modules, self.optimizer, self.tracker)
        # A step without tensor arguments (its batch in a closure) runs where its modules are.
        where = self.static_inputs or tuple(p for m in self.modules for p in m.parameters())[:1]
        device_type = where[0].device.type if where else "cuda"
        host = HostState(device_type)
        known = self.static_inputs + tuple(self.params) + tuple(state.buffers) + tuple(
            t for t, _ in state.optimizer_state) + tuple(g for g, _ in state.grads if g is not None) + tuple(
            state.main_grad_tensors())
        gc_enabled, succeeded = gc.isenabled(), False
        stream = None if self.eager_replay else RESOURCES.capture_stream()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        gc.disable()
        try:
            # torch's own checkpoint is routed in eager replay too: the host watcher takes its
            # recompute's fork_rng for a reseed, and the routed recompute restores the same streams.
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), \
                    torch_checkpoint_routed():
                draws = None
                had_state = with_state(self.optimizer)
                for iteration in range(num_warmup_iters):
                    first, last = iteration == 0, iteration == num_warmup_iters - 1
                    draws = ForwardDraws(self._live()) if last and not self.eager_replay else None
                    with reads_recorded(self.modules, self.reads) if first else contextlib.nullcontext(), \
                            host.watching(_NAME, self.tracker, known) if first else contextlib.nullcontext(), \
                            capture_hook_set(_Regions(draws)):
                        outputs = self._run()
                    if first:
                        check_no_state_made(self.optimizer, had_state)
                    if first and outputs is not None:
                        self.outputs = OutputLayout(_NAME, outputs).without_memory()
                    del outputs
                self.reads.check_per_call(_NAME)
                state.restore()
                if not self.eager_replay:
                    self._capture(draws.close(), pool)
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
            succeeded = True
        finally:
            if stream is not None and not succeeded:
                # What the side stream did, before it is put back (the original error goes on).
                with contextlib.suppress(RuntimeError):
                    torch.cuda.current_stream().wait_stream(stream)
            if gc_enabled:
                gc.enable()
            host.restore()
            self.reads.put_back()
            rng.restore_streams(self.tracker, state.streams)
            if not succeeded:
                state.restore()
        self._frozen = [FrozenModule(m, frozenset(), SEAM.keeps_own_state, False, self.reads, step=True)
                        for m in self.modules]
        self._settings = Settings(device_type)
        self._outside = OutsideReads.of(self.reads)

    def _live(self) -> dict:
        return rng.live_stream_generators(self.tracker, torch.device("cuda", torch.cuda.current_device()))

    def _run(self) -> Any:
        args, kwargs = self.layout.unflatten(self.static_inputs)
        return self.step_fn(*args, **kwargs)

    def _capture(self, draws: Any, pool: Any) -> None:
        torch.cuda.empty_cache()  # warmup's cache on the side stream
        device = torch.device("cuda", torch.cuda.current_device())
        self.recompute = RecomputeRNG.create(draws, None, device)
        before = [p.grad for p in self.params]
        graph = torch.cuda.CUDAGraph()
        generators = tuple(g for k, g in self._live().items() if k != rng.DEFAULT_STREAM) + \
            self.recompute.backward_generators
        regions = self.recompute.capture_hook()
        with capturing(_NAME, graph, pool, generators, "thread_local"), capture_hook_set(regions):
            outputs = self._run()
        regions.check_complete()
        self.outputs = OutputLayout(_NAME, outputs) if outputs is not None else None
        # What each replay hands out: owning views of the static outputs, poisoned once a later
        # replay overwrites them while still held (``replay.outputs``).
        self.handout = GraphOutputs(_NAME, self.outputs.tensors, _Owner(self.modules)) if self.outputs else None
        self.static_grads = [p.grad for p in self.params]  # the gradients the captured backward leaves
        for p, grad in zip(self.params, before):
            p.grad = grad  # no step has run yet: as before capture
        self.graph = graph
        self.recompute = self.recompute.for_replay()

    # -- each step ---------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check()
        tensors = self.layout.flatten(args, kwargs)
        with torch.no_grad():  # the copies are no part of the caller's autograd graph
            for slot, t in zip(self.slots, tensors):
                copy_in(slot, t)
        if self._verification is not None and self._verification.due():
            return self._verified()
        return self._step()

    def _step(self) -> Any:
        if self.eager_replay:
            with torch.enable_grad():
                outputs = self._run()
            return outputs
        if self.graph is None:
            raise RuntimeError(f"{_NAME}: it was reset(), which freed its graph. Graph the step again with "
                               "make_graphed_step.")
        record = self.recompute.record()
        self.recompute.restore(record)
        if self.handout is not None:
            self.handout.before_replay()
        self.graph.replay()
        for p, g in zip(self.params, self.static_grads):
            if p.grad is not g:
                p.grad = g
        if self.outputs is None:
            return None
        return self.outputs.build(self.handout.tensors())

    def _check(self) -> None:
        """What the step froze, as at capture: its modules, the optimizer's hyperparameters
        (a learning rate schedule must update a tensor learning rate in place), settings."""
        found = self._settings.changes() if self._settings.read() != self._settings.captured else []
        for frozen in self._frozen:
            if not frozen.matches():
                found += frozen.changes()
        if self._outside is not None and not self._outside.matches():
            found += self._outside.changes()
        if optimizer_groups(self.optimizer) != self._groups:
            found.append(f"the optimizer's hyperparameters changed ({changed_hyperparameters(self.optimizer, self._groups)}); "
                         "a step's graph bakes in the values of capture (for a learning-rate schedule, give the "
                         "optimizer a tensor lr, torch.tensor(lr), update it in place with .fill_(...), and make "
                         "the scheduler before graphing)")
        if optimizer_state(self.optimizer) != self._state:
            found.append("the optimizer's state was replaced (optimizer.load_state_dict, or its state cleared or "
                         "given other entries); the step's graph updates the state tensors of capture, by address")
        if found:
            raise RuntimeError(f"{_NAME}: since graphing, {'; '.join(found)}. Graph the step again after changing "
                               "the model (make_graphed_step).")

    def _verified(self) -> Any:
        """One step through the graph and the same step eagerly from the same state,
        compared bitwise; the graph's result is what stays."""
        before = StepState(self.modules, self.optimizer, self.tracker)
        # The precision's state (FP8 meta), which StepState does not hold: as before the step
        # for the eager shadow, then as the graph's step left it.
        with contextlib.ExitStack() as graph_left:
            with SEAM.precision.kept(self.modules):
                outputs = self._step()
                of = self.outputs.tensors_of if self.outputs is not None else (lambda _: ())
                graphed = [(f"output {i}", t.detach().clone()) for i, t in enumerate(of(outputs))]
                after = StepState(self.modules, self.optimizer, self.tracker)
                graphed += after.named()
                graph_left.enter_context(SEAM.precision.kept(self.modules))
            before.restore()
            with torch.enable_grad():
                eager_outputs = self._run()
            eager = [(f"output {i}", t.detach()) for i, t in enumerate(of(eager_outputs))]
            eager += after.named()  # the same tensors, now holding the eager step's values
            after.restore()
        for p, g in zip(self.params, self.static_grads or [p.grad for p in self.params]):
            p.grad = g
        found = differences([(what, a, b) for (what, a), (_, b) in zip(graphed, eager)])
        if found:
            options = self._verification.options
            text = report(_NAME, found, "result")
            if options.tolerance == "rounding" and all(d.rounding for d in found) or options.on_mismatch == "warn":
                warnings.warn(text, stacklevel=3)
            elif options.on_mismatch == "eager":
                self.eager_replay = True
            else:
                raise RuntimeError(text)
        return outputs

    def reset(self) -> None:
        """Free the graph (its pool memory goes back once nothing holds it)."""
        if self.graph is not None:
            self.graph.reset()
        if self.handout is not None:
            self.handout.reset()
        self.graph = None


def make_graphed_step(step_fn: Callable, sample_args: Any, sample_kwargs: Optional[dict] = None, *,
                      modules: Any, optimizer: Any = None, num_warmup_iters: int = 3, pool: Any = None,
                      eager_replay: Optional[bool] = None, get_rng_state_tracker: Optional[Callable[[], Any]] = None,
                      verify: Any = None) -> GraphedStep:
    """Capture ``step_fn(*sample_args, **sample_kwargs)``, a whole training step (forwards,
    losses, backwards, gradient accumulation, optionally ``optimizer.step()`` and
    ``zero_grad()``), as one graph; returns a callable that replays it on new batches.

    Args:
        step_fn: the step; returns its losses (a tensor or a pytree of tensors), which each
            call hands back. It may not read results on the host (``loss.item()``, a NaN check):
            read them from the returned tensors after the call.
        sample_args, sample_kwargs: a batch laid out as every call's (tensors, same shapes).
        modules: the modules the step trains (one or a sequence): their state is kept and
            their attributes read by the step are checked at each call.
        optimizer: the optimizer the step steps, if it does: a capturable one (``Adam(...,
            capturable=True)``) with its state made by at least one eager step.
        num_warmup_iters: eager passes before capture (their effects are put back).
        pool: a memory pool to capture into (``te_graph.graph_pool_handle()``).
        eager_replay: run the same wrapper without a graph (defaults to ``TE_GRAPH_EAGER_REPLAY``).
        get_rng_state_tracker: the tracker whose streams the step forks (default: the process's).
        verify: compare chosen steps with the eager step (``te_graph.Verify``; as for
            ``make_graphed_callables``).

    A step that recomputes a checkpointed region under FP8 that keeps scaling state
    (Transformer Engine's delayed scaling) is refused with a ``ValueError`` in its first
    warmup pass, everything put back: graphed whole it is not proven equal to eager.
    """
    if not callable(step_fn):
        raise TypeError(f"make_graphed_step: step_fn must be callable, got {describe_value(step_fn)}.")
    eager_replay = eager_replay_default() if eager_replay is None else eager_replay
    if not isinstance(eager_replay, bool):
        raise TypeError(f"make_graphed_step: eager_replay must be True or False, got {eager_replay!r}.")
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError(f"make_graphed_step: num_warmup_iters must be an int >= 1, got {num_warmup_iters!r}.")
    modules = [modules] if isinstance(modules, torch.nn.Module) else list(modules) \
        if isinstance(modules, (list, tuple, torch.nn.ModuleList)) else None
    if not modules or not all(isinstance(m, torch.nn.Module) for m in modules):
        raise TypeError("make_graphed_step: modules must be the nn.Module the step trains, or a sequence of them.")
    check_environment(eager_replay)
    if optimizer is not None:
        check_optimizer(optimizer)
    sample_args = tuple(sample_args) if isinstance(sample_args, (tuple, list)) else (sample_args,)
    if sample_kwargs is not None and not (isinstance(sample_kwargs, dict) and all(isinstance(k, str) for k in sample_kwargs)):
        raise TypeError(f"make_graphed_step: sample_kwargs must be a dict of keyword name -> sample, got "
                        f"{describe_value(sample_kwargs)}.")
    layout = InputLayout(_NAME, sample_args, dict(sample_kwargs or {}))
    wants_grad = next((i for i, t in enumerate(layout.samples) if t.requires_grad), None)
    if wants_grad is not None:
        raise ValueError(
            f"make_graphed_step: the sample {layout.label(wants_grad)} requires grad; a step's graph hands no "
            "gradient back to the tensors passed to it (it is a whole program, with no autograd node around "
            "it). Pass it detached (x.detach()), or make it a parameter of the modules the step trains."
        )
    if not eager_replay and any(t.device.type != "cuda" for t in layout.samples):
        raise ValueError("make_graphed_step: the sample batch must be on the CUDA device the step runs on "
                         "(or pass eager_replay=True).")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError("make_graphed_step: get_rng_state_tracker must be a function returning the RNG tracker "
                        f"(as Megatron's get_cuda_rng_tracker), got {describe_value(get_rng_state_tracker)}.")
    tracker = tracker_from(get_rng_state_tracker, "make_graphed_step") if get_rng_state_tracker is not None \
        else rng.process_tracker()
    step = GraphedStep(step_fn, layout, modules, optimizer, tracker, eager_replay,
                       verify_options(verify, "make_graphed_step"))
    step.prepare(num_warmup_iters, pool if pool is not None or eager_replay else torch.cuda.graph_pool_handle())
    return step
