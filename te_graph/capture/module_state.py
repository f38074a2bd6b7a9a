"""State the callables keep or update, across warmup and capture: module state and inputs.

Warmup runs each forward several times on the user's modules, and capture once more. What
a forward changes besides its outputs would keep warmup's changes, and what a graph cannot
replay must be refused before the user trains on it:

* **buffers and tensor attributes** a forward updates in place (running statistics, a step
  counter, an MoE router's expert bias, a plain ``self.stat`` tensor) are saved before
  warmup and copied back afterwards; the captured graph then updates them in place at
  every replay, as eager calls do. A forward that *reassigns* one (``self.count =
  self.count + 1``) cannot be replayed (the graph writes where the module no longer
  looks): refused.
* **Python attributes** a forward changes at every call (``self.calls += 1``) are seen by
  comparing them after each pass; a graph replays GPU work only, so they are refused. One
  set once (lazy initialisation) is kept, as the first eager call would keep it. So are
  containers that grow at every call (``self.history.append(x)``).
* **parameters** a forward updates in place (``nn.Embedding(max_norm=...)`` renormalises
  rows): the graph replays the update, which matches eager where applying it again changes
  nothing (a renormalisation); that is checked between two warmup passes, and any other
  in-place update of a parameter is refused (te_graph does not copy parameters, so it
  cannot take warmup's updates back).
* **references** a forward keeps to its input or to an output it made (``self.last = x``, a
  cache keyed by tensor identity) would hold te_graph's static buffers at replay: refused.
  So is one it takes to a parameter (a lazy tie made at the first call), which warmup would
  have pointed at a stand-in.

Modules an integration keeps per-call state for (Transformer Engine's FP8 meta, workspaces),
which
their integration saves and restores; their Python attributes are not compared here.

Inputs a callable updates in place are watched by :class:`InputUpdates`.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from .. import compat
from ..compat import MODULE_INTERNALS
from ..memory import shares_memory

__all__ = ["ModuleState", "SCALAR_TYPES", "attribute_tensors"]

SCALAR_TYPES = (bool, int, float, str, type(None))
class _Attr:
    """One attribute of one submodule of a graphed callable."""

    __slots__ = ("owner", "module", "key", "where")

    def __init__(self, owner: str, module: torch.nn.Module, key: str, prefix: str):
        self.owner = owner  # "callable 0 (Net)"
        self.module = module
        self.key = key
        self.where = f"{prefix}.{key}" if prefix else key  # its qualified name

    def get(self) -> Any:
        return self.module.__dict__.get(self.key)


class ModuleState:
    """The state of the graphed modules that warmup and capture may change: saved before
    warmup, compared after every pass, put back afterwards."""

    def __init__(self, modules: Mapping[str, torch.nn.Module], skip_attributes: Callable[[torch.nn.Module], bool]):
        self._buffers: list[tuple[_Attr, torch.Tensor]] = []  # registered buffers
        self._params: list[tuple[str, str, torch.Tensor]] = []  # (owner, name, parameter)
        self._watched: list[tuple[str, str, torch.nn.Module]] = []  # (owner, prefix, module) whose __dict__ is compared
        seen: set[int] = set()
        for owner, module in modules.items():
            for prefix, sub in module.named_modules():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                for name, buffer in compat.buffer_slots(sub).items():
                    if buffer is not None:
                        self._buffers.append((_Attr(owner, sub, name, prefix), buffer))
                for name, p in compat.parameter_slots(sub).items():
                    if p is not None:
                        self._params.append((owner, f"{prefix}.{name}" if prefix else name, p))
                if not skip_attributes(sub):
                    self._watched.append((owner, prefix, sub))
        self._saved_buffers = [b.detach().clone() for _, b in self._buffers]
        # Each watched module's attributes as they were (a shallow copy), and a copy of the
        # value of each plain tensor among them (a forward may update it in place).
        self._saved_dicts = [dict(sub.__dict__) for *_, sub in self._watched]
        # The contents of the containers among them (a failed forward may have filled one).
        self._saved_containers = [
            (value, copy.copy(value))
            for saved in self._saved_dicts for key, value in saved.items()
            if key not in MODULE_INTERNALS and type(value) in (list, dict, set)
        ]
        self._tensors = [
            (attr, value, value.detach().clone())
            for (owner, prefix, sub), saved in zip(self._watched, self._saved_dicts)
            for key, value in saved.items()
            if type(value) is torch.Tensor and key not in MODULE_INTERNALS
            for attr in (_Attr(owner, sub, key, prefix),)
        ]
        # Per watched module, its tensor attributes before warmup, which a first call may write
        # or replace: the keys of its direct ones, and the tensors it holds in containers.
        self._attribute_keys: dict[int, list[str]] = {id(sub): [] for *_, sub in self._watched}
        for attr, _, _ in self._tensors:
            self._attribute_keys[id(attr.module)].append(attr.key)
        self._contained_of = {id(sub): attribute_tensors(sub, contained_only=True) for *_, sub in self._watched}
        # The plain tensors one container deep, with their values (a running statistic in a list).
        self._contained = [(t, t.detach().clone()) for held in self._contained_of.values() for t in held]
        self._maxnorm = [(m.weight, m.weight.detach().clone()) for m in _renorming(modules.values())]
        self._versions = [compat.version_of(p) for *_, p in self._params]
        self._last = self._observe()  # what the previous pass left
        self._passes = 0
        self._sums = [self._state_sums()]  # per pass: what each module's own tensors hold (``_check_first_call``)
        # The watched modules' own parameters, on the host: a forward that writes them (a first
        # call's initialisation, through .data) is refused, and a refusal leaves them as they were.
        self._param_copies = [(p, p.detach().to("cpu", copy=True)) for _, _, sub in self._watched
                              for p in sub._parameters.values() if isinstance(p, torch.Tensor)]

    # -- after each pass ---------------------------------------------------------------------
    def after_pass(self, executed: bool) -> None:
        """Compare what this pass left with what the last one left (a forward that changes
        something at every call cannot be replayed). ``executed``: the pass ran its kernels
        (a warmup pass; a capture only records them)."""
        self.check_not_reassigned()
        now = self._observe()
        if self._passes > 0:
            for key, (attr, value) in now.items():
                before = self._last.get(key)
                if before is not None and _changed(before[1], value):
                    raise ValueError(_change_message(attr, before[1], value))
        if executed:
            self._check_parameters()
            if self._passes < 2:
                self._sums.append(self._state_sums())
            if self._passes == 1:
                self._check_first_call(now)
        self._last = now
        self._passes += 1

    def _observe(self) -> dict:
        """Every watched attribute: a scalar's value, a tensor's identity, a container's
        type, length and item identities."""
        seen = {}
        for owner, prefix, sub in self._watched:
            for key, value in list(sub.__dict__.items()):
                if key in MODULE_INTERNALS:
                    continue
                if isinstance(value, SCALAR_TYPES):
                    seen[(id(sub), key)] = (_Attr(owner, sub, key, prefix), ("value", value))
                elif isinstance(value, torch.Tensor):
                    seen[(id(sub), key)] = (_Attr(owner, sub, key, prefix), ("tensor", id(value)))
                elif isinstance(value, (list, tuple, dict, set)):
                    seen[(id(sub), key)] = (_Attr(owner, sub, key, prefix), ("container", _shape_of(value)))
        return seen

    def _state_sums(self) -> dict:
        """Per watched module, the sums of its own parameters, buffers and tensor attributes
        from before warmup (a change detector of their values, whichever way they were
        written: ``.data`` bypasses version counters; a tensor attribute a first call makes,
        a lazy cache, is no write)."""
        counts, parts = [], []
        with torch.no_grad():
            for _, _, sub in self._watched:
                held = [sub.__dict__.get(k) for k in self._attribute_keys[id(sub)]] + self._contained_of[id(sub)]
                own = [t for t in [*sub._parameters.values(), *sub._buffers.values(), *held]
                       if isinstance(t, torch.Tensor) and t.numel() and t.dtype.is_floating_point]
                counts.append((id(sub), len(own)))
                parts += [t.detach().float().sum() for t in own]
            # One wait for all of them (on the first one's device).
            values = torch.stack([p.to(parts[0].device) for p in parts]).tolist() if parts else []
        sums, start = {}, 0
        for key, count in counts:
            if count:
                sums[key] = values[start:start + count]
            start += count
        return sums

    def _check_first_call(self, now: dict) -> None:
        """After the second pass: a module whose first forward set a Python attribute for good
        and wrote its own parameters, buffers or tensor attributes, which its second left alone, initialises
        itself from its first call's data (an ActNorm's data-dependent init). Warmup made
        that call on the sample (and its buffers are put back after warmup), where eager code
        makes it on the first real batch: refused."""
        before, first, second = self._sums
        for owner, prefix, sub in self._watched:
            key = id(sub)
            if key not in first or _same_sums(before.get(key, []), first[key]) or \
                    not _same_sums(first[key], second[key]):
                continue
            saved = next(d for (*_, m), d in zip(self._watched, self._saved_dicts) if m is sub)
            set_once = [k for k, (attr, value) in now.items() if k[0] == key
                        and (k[1] not in saved or (value[0] == "value" and not _same_value(saved[k[1]], value[1])))]
            if set_once:
                where = f"{prefix}.{set_once[0][1]}" if prefix else set_once[0][1]
                raise ValueError(
                    f"make_graphed_callables: the forward of {owner} initialises {prefix or 'the module'!r} from its "
                    f"first call (it wrote its parameters, buffers or tensors and set {where!r}, and its next call did "
                    "neither); warmup made that first call on the sample inputs, where eager code makes it on your "
                    "first batch. Run one eager step (or initialise the module) before graphing it."
                )

    def _check_parameters(self) -> None:
        """Parameters the forward updated in place: only nn.Embedding's (and EmbeddingBag's)
        max_norm renormalisation, whose weights were copied before warmup, is replayed."""
        renormed = {id(w) for w, _ in self._maxnorm}
        for (owner, name, p), version in zip(self._params, self._versions):
            if compat.version_of(p) != version and id(p) not in renormed:
                raise ValueError(
                    f"make_graphed_callables: the forward of {owner} updates its parameter {name!r} "
                    "in place; a graph would repeat that update at every replay, and warmup has "
                    "already made it (te_graph copies parameters only for nn.Embedding's max_norm, "
                    "so it could not take this one back: check the parameter). Move the update out "
                    "of the forward (before the graphed call, or into the optimizer step)."
                )

    def check_not_reassigned(self) -> None:
        """Raise if a forward replaced a buffer instead of updating it in place."""
        for attr, buffer in self._buffers:
            if compat.buffer_slots(attr.module).get(attr.key) is not buffer:
                raise ValueError(
                    f"make_graphed_callables: the forward of {attr.owner} reassigns its buffer "
                    f"{attr.where!r} (like `self.{attr.key} = self.{attr.key} + 1`); a graph cannot "
                    "replay that: it would write the new value where the module no longer looks. "
                    f"Update the buffer in place instead (`self.{attr.key}.add_(1)`, `.copy_(...)`)."
                )

    # -- what a forward keeps -----------------------------------------------------------------
    def check_references(self, owner: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                         stand_ins: Sequence[torch.Tensor] = ()) -> None:
        """After a forward of ``owner``: no attribute of its modules holds one of its static
        inputs, an output it made (a tensor the module did not hold before warmup), or a
        stand-in of one of its parameters (``stand_ins``: what the modules hold in their
        parameters' place while warmup and capture run)."""
        before = {id(t) for _, t, _ in self._tensors} | {id(b) for _, b in self._buffers}
        standing_in = {id(s) for s in stand_ins}
        for attr, tensor in self._held_tensors(owner):
            if id(tensor) in standing_in:
                raise ValueError(
                    f"make_graphed_callables: the forward of {attr.owner} keeps a reference to one of its "
                    f"parameters in {attr.where!r}, taken while it was graphed (a reference cached at the first "
                    "call?); warmup and capture run on stand-ins in the parameters' place, so that attribute "
                    "would keep a stand-in, and the graphs would train it instead of the parameter. Read the "
                    "parameter from its module at every call (self.linear.weight)."
                )
            if isinstance(tensor, torch.nn.Parameter):
                continue
            if any(shares_memory(tensor, t) for t in inputs):
                raise ValueError(
                    f"make_graphed_callables: the forward of {attr.owner} keeps a reference to its "
                    f"input in {attr.where!r}; at every replay that would be te_graph's static "
                    "input buffer, not the tensor you pass (and an identity check on it would "
                    "always hold). Keep no reference to the input across calls."
                )
            if id(tensor) not in before and any(shares_memory(tensor, o) for o in outputs):
                raise ValueError(
                    f"make_graphed_callables: the forward of {attr.owner} keeps an output it made "
                    f"in {attr.where!r} (a cache of results?); at replay that attribute would hold "
                    "warmup's tensor, and a cached result would be returned without computing it. "
                    "Keep results out of the module, or cache outside the graphed forward."
                )

    def _held_tensors(self, owner: str) -> Iterable[tuple[_Attr, torch.Tensor]]:
        """The tensors (parameters too) the watched modules of ``owner`` hold in plain
        attributes, directly or one container deep."""
        for where, prefix, sub in self._watched:
            if where != owner:
                continue
            for key, value in list(sub.__dict__.items()):
                if key in MODULE_INTERNALS:
                    continue
                for item in _contents(value) or (value,):
                    if isinstance(item, torch.Tensor):
                        yield _Attr(owner, sub, key, prefix), item

    # -- afterwards ---------------------------------------------------------------------------
    def restore(self, succeeded: bool) -> None:
        """Put every buffer, tensor attribute (value too where one container deep) and
        renormalised embedding back (object and value); after a failure, every attribute of the watched modules too, and the contents
        of their lists, dicts and sets (after a success they keep what warmup set once: lazy
        initialisation)."""
        with torch.no_grad():
            for (attr, buffer), saved in zip(self._buffers, self._saved_buffers):
                compat.buffer_slots(attr.module)[attr.key] = buffer
                buffer.copy_(saved)
            for attr, tensor, saved in self._tensors:
                attr.module.__dict__[attr.key] = tensor
                tensor.copy_(saved)
            for tensor, saved in self._contained:
                tensor.copy_(saved)
            for weight, saved in self._maxnorm:
                weight.copy_(saved)
        if not succeeded:
            with torch.no_grad():
                for p, value in self._param_copies:
                    p.copy_(value)
            for (*_, sub), saved in zip(self._watched, self._saved_dicts):
                for key in [k for k in sub.__dict__ if k not in saved]:
                    del sub.__dict__[key]
                sub.__dict__.update(saved)
            for container, contents in self._saved_containers:
                container.clear()
                if isinstance(container, list):
                    container.extend(contents)
                else:
                    container.update(contents)

    def runtime_attributes(self) -> frozenset:
        """``(id(module), key)`` of the Python attributes the forward set (they differ from
        their value before warmup): the module's own per-call state, which a later eager
        call of the module may set again, so the per-call check leaves them alone."""
        changed = set()
        for (*_, sub), saved in zip(self._watched, self._saved_dicts):
            for key, value in sub.__dict__.items():
                if key not in saved or not _same_value(saved[key], value):
                    changed.add((id(sub), key))
        return frozenset(changed)


def _renorming(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """The embeddings whose forward renormalises rows of the weight in place (max_norm)."""
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    found: dict[int, torch.nn.Module] = {}
    for module in modules:
        for m in module.modules():
            if isinstance(m, kinds) and m.max_norm is not None:
                found[id(m)] = m
    return list(found.values())


def _changed(before: tuple, after: tuple) -> bool:
    if before[0] != after[0]:
        return True
    if before[0] == "value":
        return not _same_value(before[1], after[1])
    return before[1] != after[1]


def attribute_tensors(module: torch.nn.Module, contained_only: bool = False) -> list[torch.Tensor]:
    """The plain tensors (no parameters) ``module`` holds in its attributes, directly or one
    container deep (``contained_only``: those in a container alone), each once."""
    found = {}
    for key, value in list(module.__dict__.items()):
        if key not in MODULE_INTERNALS:
            for t in _contents(value) or (() if contained_only else (value,)):
                if type(t) is torch.Tensor:
                    found[id(t)] = t
    return list(found.values())


def _contents(value: Any) -> Iterable:
    """What a list, tuple, set or dict holds (nothing for anything else)."""
    return value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple, set)) else ()


def _change_message(attr: _Attr, before: tuple, after: tuple) -> str:
    if before[0] == after[0] == "tensor":
        return (
            f"make_graphed_callables: the forward of {attr.owner} assigns a new tensor to its "
            f"attribute {attr.where!r} at every call; at replay it would keep the tensor of the "
            "capture (and autograd could not go back through it). Return the tensor as an output, "
            "or update one tensor in place (`.copy_(...)`)."
        )
    if before[0] == after[0] == "container":
        return (
            f"make_graphed_callables: the forward of {attr.owner} changes its attribute "
            f"{attr.where!r} ({type(attr.get()).__name__}) at every call (its length or items "
            "change between warmup passes); a graph replays GPU work only, so at replay it would "
            "stay as warmup left it. Change it outside the graphed forward, or return what you "
            "collect as an output."
        )
    shown = lambda state: repr(state[1]) if state[0] == "value" else f"a {state[0]}"  # noqa: E731
    return (
        f"make_graphed_callables: the forward of {attr.owner} changes its attribute {attr.where!r} "
        f"at every call ({shown(before)}, then {shown(after)}); a graph replays GPU work only, so at "
        "replay it would keep its value. Keep such state in a tensor buffer updated in place "
        "(register_buffer and `.add_(1)`), or change it outside the graphed forward."
    )


def _same_sums(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))  # NaN equals NaN


def _same_value(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, SCALAR_TYPES) and a == b)


def _shape_of(container: Any) -> Any:
    """What is compared of a container between passes: its type, length and the identity
    of its items (a cache keyed by call grows; one filled once does not change)."""
    if isinstance(container, dict):
        return (dict, len(container), tuple(map(id, container.keys())), tuple(map(id, container.values())))
    return (type(container), len(container), tuple(map(id, container)))
