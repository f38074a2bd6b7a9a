"""What a forward touches outside its modules and its random streams, watched while the
first warmup pass runs it: warmup must leave every stream and tensor the user owns as it
was, and a graph replays device work only, so what it would bake in on the host is refused.

* **Host random streams** (Python's ``random``, NumPy's global generator, and torch's CPU
  generator for a forward on a GPU): put back after warmup and capture; a forward that
  draws from one (fairseq-style LayerDrop) is refused, since its graph would repeat the
  draw of capture at every call.
* **Reseeding**: a forward that calls ``torch.manual_seed`` (or ``torch.cuda.manual_seed``,
  ``torch.random.fork_rng``), or leaves a live device stream with another seed or an
  offset behind where it started, is refused: a graph reads the streams' host state at
  each replay and cannot replay a reset.
* **Random draws from streams te_graph does not know**: a ``generator=`` that is neither
  the default generator nor a stream of the RNG tracker, or the default
  generator swapped to another tracker's stream (a tracker instance other than
  ``get_rng_state_tracker``): refused, naming the fix.
* **Tensors outside the modules that the forward updates in place** (a process-global
  loss tracker): their values from before warmup are put back afterwards, so warmup adds
  nothing to them; the graphs update them in place at each replay, as eager calls do.
"""
from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.utils._pytree as pytree

import rng

from .. import compat
from ..memory import address_range, storage_of
from ..records import StateAccess

__all__ = ["HostState"]

# The seeding functions a forward may not call (looked up on their modules at call time).
_SEEDING = (("torch", "manual_seed"), ("torch.random", "manual_seed"), ("torch.cuda", "manual_seed"),
            ("torch.cuda", "manual_seed_all"), ("torch", "seed"), ("torch.cuda", "seed"), ("torch.cuda", "seed_all"),
            ("torch.random", "fork_rng"))
_OWN = ("rng", "checkpointing", "te_graph")  # modules whose calls are te_graph's own


class HostState:
    """The host streams and outside tensors of one ``make_graphed_callables`` call."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self._python = random.getstate()
        numpy = sys.modules.get("numpy")
        self._numpy = numpy.random.get_state() if numpy is not None else None
        self._cpu = torch.get_rng_state() if device_type != "cpu" else None
        self._outside: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its value before warmup)
        self._outside_ids: set[int] = set()
        self._generators: list[tuple[torch.Generator, torch.Tensor]] = []  # (a generator of the forward's own, its state)
        self._state_access: dict[str, Optional[StateAccess]] = {}  # per forward (``state_access``)

    @contextlib.contextmanager
    def watching(self, name: str, tracker: Any, known: Sequence[torch.Tensor],
                 state: Sequence[torch.Tensor] = (), inputs: Sequence[torch.Tensor] = ()) -> Iterator[None]:
        """Around a first-pass forward of ``name``: refuse what it does that a graph cannot
        replay; note the outside tensors it updates (``known``: the inputs, parameters and
        module tensors, which are not outside) and when it reads and writes ``state`` (its
        modules' buffers and tensor attributes) and its ``inputs`` (``state_access``)."""
        before = self._host_streams()
        streams = self._device_streams(tracker)
        seeding: list[str] = []
        order = _AccessOrder(state, inputs) if state else None  # (without state, no input can alias it)
        effects = _Effects(self, known, streams, order)
        with _seeding_noted(seeding), compat.compiled_code_run_eagerly(), effects:
            yield
        self._state_access[name] = order.record() if order is not None else None
        if seeding:
            raise ValueError(_RESEEDS.format(name=name, what=f"calls {seeding[0]}"))
        for key, (seed, offset) in self._stream_positions(streams).items():
            then = streams[key][1]
            if seed != then[0] or offset < then[1]:
                raise ValueError(_RESEEDS.format(name=name, what=f"leaves the random stream {key!r} reseeded or rewound"))
        after = self._host_streams()
        for what, was, now in zip(("Python's random module", "NumPy's global random generator",
                                   "torch's CPU generator"), before, after):
            if not _same_state(was, now):
                raise ValueError(
                    f"make_graphed_callables: the forward of {name} draws from {what}; a graph replays device "
                    "work only, so every replay would repeat the draw made at capture (a random layer drop, a "
                    "random shape). Draw on the device from the default generator or a tracker stream, or make "
                    "the decision outside the graphed callable."
                )
        if effects.refusal is not None:
            raise ValueError(effects.refusal.format(name=name))

    def _host_streams(self) -> tuple:
        numpy = sys.modules.get("numpy")
        return (random.getstate(), numpy.random.get_state() if numpy is not None else None,
                torch.get_rng_state() if self.device_type != "cpu" else None)

    def _device_streams(self, tracker: Any) -> dict:
        if self.device_type != "cuda":
            return {}
        device = torch.device("cuda", torch.cuda.current_device())
        live = rng.live_stream_generators(tracker, device)
        return {key: (g, (g.initial_seed(), g.get_offset())) for key, g in live.items()}

    @staticmethod
    def _stream_positions(streams: dict) -> dict:
        return {key: (g.initial_seed(), g.get_offset()) for key, (g, _) in streams.items()}

    def state_access(self, name: str) -> Optional[StateAccess]:
        """When the forward of ``name`` read and wrote its modules' state and its inputs in
        its first pass (None: it wrote neither)."""
        return self._state_access.get(name)

    def note_outside(self, t: torch.Tensor) -> None:
        """``t`` (outside the modules) is about to be updated in place: keep its value."""
        if id(t) not in self._outside_ids:
            self._outside_ids.add(id(t))
            self._outside.append((t, t.detach().clone()))

    def note_generator(self, generator: torch.Generator) -> None:
        """The forward is about to draw from ``generator``, a stream of its own: keep its state."""
        if not any(generator is g for g, _ in self._generators):
            self._generators.append((generator, generator.get_state()))

    def restore(self) -> None:
        """Put the host streams, the forward's own generators and the outside tensors back as
        they were before warmup."""
        for generator, state in self._generators:
            generator.set_state(state)
        random.setstate(self._python)
        numpy = sys.modules.get("numpy")
        if self._numpy is not None and numpy is not None:
            numpy.random.set_state(self._numpy)
        if self._cpu is not None:
            torch.set_rng_state(self._cpu)
        with torch.no_grad():
            for t, value in self._outside:
                if t.shape == value.shape:  # (an out= argument the op resized stays as the op left it)
                    t.copy_(value)


_RESEEDS = (
    "make_graphed_callables: the forward of {name} {what}; a graph reads each random stream's "
    "host state at every replay and advances it, so it cannot replay a reseed or a rewind "
    "(eager code would draw the same numbers at every call, the graph others). Seed outside the "
    "graphed callable, or draw from a stream of the RNG tracker (get_rng_state_tracker=)."
)


def _same_state(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and len(a) > 1 and hasattr(a[1], "shape"):  # NumPy's (name, keys, pos, ...)
        return a[0] == b[0] and (a[1] == b[1]).all() and a[2:] == b[2:]
    return a == b


@contextlib.contextmanager
def _seeding_noted(calls: list) -> Iterator[None]:
    """Inside: a call of a seeding function from outside te_graph's own packages is noted."""
    patched = []
    for module_name, attribute in _SEEDING:
        module = sys.modules.get(module_name)
        original = getattr(module, attribute, None) if module is not None else None
        if original is None:
            continue

        def noted(*args: Any, __original: Any = original, __name: str = f"{module_name}.{attribute}", **kwargs: Any):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith(_OWN):
                calls.append(__name)
            return __original(*args, **kwargs)

        setattr(module, attribute, noted)
        patched.append((module, attribute, original))
    try:
        yield
    finally:
        for module, attribute, original in reversed(patched):
            setattr(module, attribute, original)


class _Effects(compat.TorchDispatchMode):
    """The device ops of one forward: random draws from unknown streams (refused), in-place
    updates of tensors outside the modules (their values kept for ``restore``), and, to
    ``order``, every op's reads and writes."""

    def __init__(self, owner: HostState, known: Sequence[torch.Tensor], streams: dict,
                 order: Optional[_AccessOrder] = None):
        super().__init__()
        self.owner = owner
        self.order = order
        self.device_type = owner.device_type
        self.storages = {_storage(t) for t in known if isinstance(t, torch.Tensor)}
        self.generators = [g for g, _ in streams.values()]
        self.seeds = {seed for _, (seed, _) in streams.values()}
        self.refusal: Optional[str] = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if compat.draws_random(func) and self.refusal is None:
            self._check_draw(kwargs.get("generator"))
        written = compat.written_tensors(func, args, kwargs)
        for value in written:
            if value.device.type == self.device_type and _storage(value) not in self.storages:
                self.owner.note_outside(value)
        if self.order is not None:
            self.order.note_op(func, args, kwargs, written)
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.storages.add(_storage(t))
        return out

    def _check_draw(self, generator: Optional[torch.Generator]) -> None:
        if generator is not None:
            # On the CPU (eager replay) torch's default CPU generator is the live stream.
            own = generator is torch.default_generator and self.device_type == "cpu"
            if not own and not any(generator is g for g in self.generators):
                self.owner.note_generator(generator)
                self.refusal = (
                    "make_graphed_callables: the forward of {name} draws from a torch.Generator of its own "
                    "(generator=...), neither the default generator nor a stream of the RNG tracker; a graph "
                    "draws only from streams te_graph keeps in step with eager code. Add it to the tracker "
                    "(tracker.add(name, seed) and tracker.fork(name)) and pass that tracker as "
                    "get_rng_state_tracker=."
                )
            return
        if self.device_type != "cuda":
            return
        default = torch.cuda.default_generators[torch.cuda.current_device()]
        if default.initial_seed() not in self.seeds:
            if hasattr(default, "graphsafe_get_state"):
                # The stream a tracker of its own swapped in (graph-safe: a handle on that
                # very state), kept so that the refusal leaves it where it was.
                self.owner.note_generator(default.graphsafe_get_state())
            self.refusal = (
                "make_graphed_callables: the forward of {name} draws from a random stream that is neither the "
                "default generator nor a stream of the RNG tracker given (or found) for this call: a tracker of "
                "its own forks it (Transformer Engine's examples build one). Pass that tracker: "
                "make_graphed_callables(..., get_rng_state_tracker=lambda: tracker)."
            )


def _storage(t: torch.Tensor) -> tuple:
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a subclass without storage
        return (t.device, id(t))


class _AccessOrder:
    """The device ops of one forward, numbered (``_Effects`` hands each one over): when each
    view of the modules' state is first written and last read, and each input last read and
    first written."""

    def __init__(self, state: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]):
        self.state = {storage_of(t) for t in state} - {None}
        self.inputs = {storage_of(t): i for i, t in enumerate(inputs) if storage_of(t) is not None}
        self.op = 0
        self.writes: dict[tuple, int] = {}  # (first address, past the last, storage) -> first write
        self.reads: dict[tuple, int] = {}  # -> last read
        self.last_read = [-1] * len(inputs)
        self.first_write = [-1] * len(inputs)

    def note_op(self, func: Any, args: tuple, kwargs: dict, written: list) -> None:
        if not compat.is_view(func):  # (a view reads no element)
            ids = {id(v) for v in written}
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    self._note(t, id(t) in ids)
        self.op += 1

    def _note(self, t: torch.Tensor, write: bool) -> None:
        storage = storage_of(t)
        index = self.inputs.get(storage)
        if index is not None:
            self.last_read[index] = self.op
            if write and self.first_write[index] < 0:
                self.first_write[index] = self.op
        if storage in self.state:
            span = (*address_range(t), storage)
            self.reads[span] = self.op
            if write:
                self.writes.setdefault(span, self.op)

    def record(self) -> Optional[StateAccess]:
        if not self.writes and max(self.first_write, default=-1) < 0:
            return None  # it writes neither: no input can see a write through another
        return StateAccess(frozenset(self.state), tuple((a, b, op, s) for (a, b, s), op in self.writes.items()),
                           tuple((a, b, op, s) for (a, b, s), op in self.reads.items()), tuple(self.last_read),
                           tuple(self.first_write))
