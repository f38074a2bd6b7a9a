"""What a graph froze, checked at every call.

A captured graph bakes in more than its input shapes: the addresses of the parameters it
reads (and of the ``main_grad`` buffers fused weight-gradient kernels write) and which of
them get a gradient, the submodules it ran and their training flags and
hyperparameters (a dropout's ``p``), that no hook ran inside it, the autocast state and the
numerics settings its kernels were chosen under (TF32, deterministic algorithms). A model
changed after graphing would replay the old program without a word, so each call first
compares a small fingerprint of all that with the one taken when graphing ended. Eager
replay checks the same, so it stays the graphs' mirror.

The hot path is a few C-level passes over tuples taken once (identities, data pointers,
``requires_grad`` flags, hook-dict sizes with torch's hook-handle counter, a handful of
global settings); only a mismatch pays for finding what changed. A change that leaves the
program as it was (a value assigned again, equal to the old one; the forward pre-hooks
Megatron's DDP registers on submodules of a layer whose ``cuda_graph_manual_hooks`` run
them before each replay, see ``Extension.hooks_run_by_hand``) is taken into
the fingerprint and the call goes on; anything else raises before the call changes
anything, saying what changed and to graph again.

Plain tensor attributes are compared by identity (a new tensor over the same memory is
taken in: the graphs read them by address).

What no fingerprint here sees (``guards.outside`` watches config objects, module globals and
class attributes the forward reads): integer attributes the forward was not seen to read
(a framework's per-call counters live there), tuples and subclasses of the watched types
(NumPy scalars) on modules whose reads are not recorded, attributes created after
graphing, the Python attributes of modules an integration checks itself
(Transformer Engine's: its FP8 steps check their per-call state), values closed over by a function, and
tensors' contents.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from .. import compat
from ..compat import MODULE_INTERNALS
from ..extension import SEAM
from ..layout import describe_value
from .hooks import (
    HOOK_KINDS, ROUTED_HOOKS, ROUTED_SUBMODULE_HOOKS, STEP_HOOKS, SUBMODULE_HOOKS, global_hooks_run_at_capture_only,
    hooks_outside_graphs, leaving_out, same_objects,
)
from .reads import ForwardReads, kept, plain_value, watched_names
from .slots import GONE, ScriptAttributes, Slot, equal_is_identity, qualified, same_memory

__all__ = ["FrozenModule", "REGRAPH"]

# Attribute values of modules whose reads are not recorded, compared by identity at every
# call (a new object equal to the old one is taken in on the slow path). Integers are left
# out there: frameworks keep per-call counters on layers (Megatron's ``current_microbatch``);
# an int a recorded forward read is watched.
_WATCHED = (bool, float, str, type(None))
_getitem = operator.getitem
_requires_grad = operator.attrgetter("requires_grad")
_data_ptr = torch.Tensor.data_ptr


REGRAPH = (
    "A graph replays what it captured, so this call would not follow the change. Graph it "
    "again after changing the model: te_graph.reset(...) frees the graphs and gives a module "
    "its eager forward back; then call make_graphed_callables again."
)


class FrozenModule:
    """The fingerprint of one graphed module: what its graphs read of it."""

    def __init__(self, module: torch.nn.Module, runtime: frozenset, skip_attributes: Any, routed: bool = False,
                 reads: Optional[ForwardReads] = None, step: bool = False):
        """``routed``: the module's class replays the graphs from its own ``__call__``, before
        ``nn.Module.__call__`` would run the module's hooks (megatron-core's layers), so hooks
        on the module itself never run at replay either. ``reads``: what its forwards read
        (``reads``): the attributes compared are those; without it, every attribute of a
        watched type. ``step``: a module a whole-step graph trains, whose own hooks ran inside
        the capture too."""
        self.module = module
        reads = reads if reads is not None else ForwardReads()
        recorded: list[torch.nn.Module] = []  # modules whose reads are known
        slots: list[Slot] = []  # values compared by equality (after identity): flags, floats, strings
        values: list[Any] = []
        object_slots: list[Slot] = []  # compared by identity: parameters, buffers, submodules, main_grad
        objects: list[Any] = []
        hook_tables: list[dict] = []
        hook_names: list[str] = []
        hook_kinds: list[str] = []
        hook_reasons: list[str] = []
        hook_owners: list[Optional[torch.nn.Module]] = []  # the module of each table (None: global)
        params: list[tuple[str, torch.Tensor]] = []
        main_grads: list[tuple[str, torch.Tensor]] = []
        tensor_slots: list[Slot] = []  # plain tensor attributes: the graphs read them by address
        tensor_values: list[torch.Tensor] = []
        buffers: list[tuple[str, torch.Tensor]] = []  # read by address: `.data = ...` moves one
        outside = hooks_outside_graphs(module, routed)
        structure: list[dict] = []  # each module's parameter, buffer and submodule tables: one added is a change
        seen: set[int] = set()
        for prefix, sub in module.named_modules():
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            where = f"submodule {prefix!r}" if prefix else "the module"
            script = isinstance(sub, torch.jit.ScriptModule)  # C++ tables: wrappers handing out new objects
            for table, kind in ((compat.parameter_slots(sub), "parameter"), (compat.buffer_slots(sub), "buffer"),
                                (sub._modules, "submodule")) if not script else ():
                structure.append(table)
                for key, value in table.items():
                    object_slots.append(Slot(table, key, f"{kind} {qualified(prefix, key)!r}"))
                    objects.append(value)
            attributes = sub.__dict__
            slots.append(Slot(ScriptAttributes(sub) if script else attributes, "training", where))
            values.append(sub.training)
            read = id(sub) in reads.recorded
            if read:
                recorded.append(sub)
                names = watched_names(reads, sub, runtime)
            elif not skip_attributes(sub) and not script:
                names = [k for k, v in attributes.items() if (type(v) in _WATCHED or type(v) is torch.Tensor)
                         and k not in MODULE_INTERNALS and k != "training" and (id(sub), k) not in runtime]
            else:
                names = []
            for key in names:
                value = attributes[key]
                if type(value) is torch.Tensor:
                    tensor_slots.append(Slot(attributes, key, f"attribute {key!r} of {where}"))
                    tensor_values.append(value)
                elif read or type(value) is not int:
                    # An int the forward was seen to read may steer it (a mode, a count); one it
                    # was not seen to read may be a framework's per-call counter read elsewhere
                    # (megatron-core's current_microbatch, read by its own replay routing).
                    slots.append(Slot(attributes, key, f"attribute {key!r} of {where}"))
                    values.append(kept(value) if plain_value(value) else value)  # a dict of options: its contents
            buffers.extend((qualified(prefix, k), b) for k, b in compat.buffer_slots(sub).items()
                           if type(b) is torch.Tensor)
            # The graphed module's own hooks run around the graphed forward, unless its class
            # routes the call to the graphs before nn.Module.__call__ runs them.
            if (prefix or routed or step) and prefix not in outside:
                for kind in HOOK_KINDS:
                    hook_tables.append(getattr(sub, kind))
                    hook_names.append(f"{kind[1:].replace('_', ' ')} on {where}")
                    hook_kinds.append(kind)
                    hook_reasons.append(STEP_HOOKS if step else ROUTED_HOOKS if not prefix else
                                        ROUTED_SUBMODULE_HOOKS if routed else SUBMODULE_HOOKS)
                    hook_owners.append(sub)
            fused = SEAM.writes_main_grad(sub)
            for name, p in compat.parameter_slots(sub).items():
                if p is not None:
                    params.append((qualified(prefix, name), p))
                    if fused and isinstance(p.__dict__.get("main_grad"), torch.Tensor):
                        # Transformer Engine's fused weight-gradient GEMM writes main_grad by
                        # address: the same object (a slot) at the same address (megatron-core
                        # DDP's offload and reload of its grad buffers keep the object).
                        object_slots.append(Slot(p.__dict__, "main_grad",
                                                  f"main_grad of parameter {qualified(prefix, name)!r}"))
                        objects.append(p.__dict__["main_grad"])
                        main_grads.append((qualified(prefix, name), p.__dict__["main_grad"]))
        for kind, table in compat.global_module_hook_dicts() if global_hooks_run_at_capture_only(module, routed or step) else ():
            hook_tables.append(table)
            hook_names.append(f"global module {kind} (torch.nn.modules.module.register_module_{kind[:-1]})")
            hook_kinds.append(kind)
            hook_reasons.append(STEP_HOOKS if step else ROUTED_SUBMODULE_HOOKS if routed else SUBMODULE_HOOKS)
            hook_owners.append(None)
        self._structure = tuple(structure)
        self._slots = tuple(slots)
        self._tables = tuple(s.table for s in slots)
        self._keys = tuple(s.key for s in slots)
        self._values = tuple(values)
        # Compared by identity only (a one-element tensor's == would compare its value); a
        # plain tensor attribute replaced by a new tensor over the same memory is taken in on
        # the slow path.
        self._object_slots = tuple(object_slots) + tuple(tensor_slots)
        self._object_tables = tuple(s.table for s in self._object_slots)
        self._object_keys = tuple(s.key for s in self._object_slots)
        self._objects = tuple(objects) + tuple(tensor_values)
        self._first_tensor = len(objects)  # from here on, plain tensor attributes (read by address)
        self._hook_tables = tuple(hook_tables)
        self._hook_names = tuple(hook_names)
        self._hook_kinds = tuple(hook_kinds)
        self._hook_reasons = tuple(hook_reasons)
        self._hook_owners = tuple(hook_owners)
        self._hook_sizes = tuple(map(len, hook_tables))
        self._hook_keys = tuple(map(tuple, hook_tables))  # handle ids: a new hook has a new one
        self._handles_made = compat.hook_handles_made()
        self._hooks_at_capture = tuple(tuple(table.values()) for table in hook_tables)
        # The hooks megatron-core's helper runs by hand, as the hook tables were last accepted
        # with: a helper that stops running them makes those hooks a change again. Its list
        # object and length stand for it on the hot path (the helper assigns a new list).
        self._manual = SEAM.manual_hooks(module)
        self._manual_len = len(self._manual or ())
        self._no_hooks = not any(self._hook_sizes)  # the usual case: one integer compare per call
        self._params = tuple(p for _, p in params)
        self._param_names = tuple(name for name, _ in params)
        self._grads = tuple(map(_requires_grad, self._params))
        # Only plain tensors have a data pointer of their own (TE's quantized weights are
        # wrapper subclasses: their identity and requires_grad are compared).
        addressed = [(f"parameter {n!r}", p) for n, p in params if type(p) in (torch.Tensor, torch.nn.Parameter)]
        addressed += [(f"buffer {n!r}", b) for n, b in buffers]
        self._addressed = tuple(p for _, p in addressed)
        self._addressed_names = tuple(n for n, _ in addressed)
        self._pointers = tuple(map(_data_ptr, self._addressed))
        self._main_grads = tuple(g for _, g in main_grads)
        self._main_grad_names = tuple(n for n, _ in main_grads)
        self._main_grad_pointers = tuple(map(_data_ptr, self._main_grads))
        # The modules whose reads are known: their class and how many instance attributes they
        # hold (a new one may shadow what the forward reads from the class: a patched forward).
        self._recorded = tuple(recorded)
        self._classes = tuple(map(type, recorded))
        self._dicts = tuple(m.__dict__ for m in recorded)
        self._lengths = tuple(map(len, self._dicts))
        self._class_reads = tuple(frozenset(reads.class_names.get(id(m), ())) for m in recorded)
        self._names = {id(m): name for name, m in module.named_modules()}
        self._expect()

    def _expect(self) -> None:
        """What the hot path's one tuple must equal: the watched values and the objects whose
        == cannot call a changed one equal (modules, None, tensors of several elements, whose
        == raises), the data pointers of parameters, buffers and main_grads, the
        requires_grad flags, the lengths of the recorded modules' ``__dict__`` and their
        classes; and the other objects, compared by identity alone."""
        slots = self._slots + self._object_slots
        values = self._values + self._objects
        safe: list[int] = []
        rest: list[int] = []
        for i, value in enumerate(values):
            (safe if i < len(self._slots) or equal_is_identity(value) else rest).append(i)
        self._safe_tables = tuple(slots[i].table for i in safe)
        self._safe_keys = tuple(slots[i].key for i in safe)
        self._ident_tables = tuple(slots[i].table for i in rest)
        self._ident_keys = tuple(slots[i].key for i in rest)
        self._ident_objects = tuple(values[i] for i in rest)
        self._expected = (tuple(values[i] for i in safe) + self._pointers + self._main_grad_pointers + self._grads
                          + self._lengths + self._classes + tuple(map(len, self._structure)))

    def matches(self) -> bool:
        """The hot path: True when nothing the graphs read of the module changed."""
        try:
            # One tuple built in C-level passes and compared once (identity first, then ==);
            # a mismatch is sorted out on the slow path.
            return (
                (*map(_getitem, self._safe_tables, self._safe_keys), *map(_data_ptr, self._addressed),
                 *map(_data_ptr, self._main_grads), *map(_requires_grad, self._params), *map(len, self._dicts),
                 *map(type, self._recorded), *map(len, self._structure)) == self._expected
                and (not self._ident_objects or all(map(operator.is_, map(_getitem, self._ident_tables,
                                                                            self._ident_keys), self._ident_objects)))
                and (self._still_no_hooks() if self._no_hooks else self._same_hooks())
            )
        except (KeyError, RuntimeError):  # an attribute was deleted; a value that became a tensor
            return False

    def _still_no_hooks(self) -> bool:
        """Whether the hook tables, empty at the last check, still are: one integer compare
        while no hook was registered anywhere (``compat.hook_handles_made``), else a pass
        over the tables (about a hundred dicts for one Transformer Engine layer, which a
        step's other work has pushed out of the CPU caches)."""
        made = compat.hook_handles_made()
        if made == self._handles_made and made >= 0:
            return True
        if any(self._hook_tables):
            return False
        self._handles_made = made  # hooks registered elsewhere (a tensor's, another module's)
        return True

    def _same_hooks(self) -> bool:
        """Whether every hook table holds the hooks it held at the last check: one integer
        compare while no hook was registered anywhere (``compat.hook_handles_made``; where
        torch lacks the counter, -1), else the tables' keys (a hook removed and another added
        keeps a table's size, never its keys)."""
        manual = SEAM.manual_hooks(self.module)
        if manual is not self._manual or len(manual or ()) != self._manual_len:
            return False
        made = compat.hook_handles_made()
        if made == self._handles_made and made >= 0:
            return tuple(map(len, self._hook_tables)) == self._hook_sizes
        if tuple(map(tuple, self._hook_tables)) != self._hook_keys:
            return False
        self._handles_made = made  # hooks registered elsewhere (a tensor's, another module's)
        return True

    def changes(self) -> list[str]:
        """What changed, taking in the changes that leave the program as it was."""
        found: list[str] = []
        values = list(self._values) + list(self._objects)
        scalars = len(self._slots)  # then the objects compared by identity
        by_address = scalars + self._first_tensor  # from here on, plain tensor attributes (read by address)
        for i, slot in enumerate(self._slots + self._object_slots):
            now = slot.table.get(slot.key, GONE)
            then = values[i]
            if now is then:
                continue
            if now is GONE:
                found.append(f"{slot.what} was deleted")
            elif isinstance(then, torch.nn.Module) or isinstance(now, torch.nn.Module):
                found.append(f"{slot.what} was replaced by another module")
            elif i >= by_address and type(now) is torch.Tensor and same_memory(now, then):
                values[i] = now  # another tensor over the same memory: the graphs read it alike
            elif i >= by_address:
                found.append(f"{slot.what} was replaced by another object ({describe_value(now)}); the graphs "
                             "read the tensor of the capture by its address. Update that tensor in place "
                             "(.copy_(...)), or pass the new one as an input")
            elif i >= scalars or isinstance(now, torch.Tensor):
                found.append(f"{slot.what} was replaced by another object (a new nn.Parameter or tensor, "
                             "load_state_dict(assign=True), or None)")
            elif type(now) is type(then) and now == then:
                values[i] = kept(now) if plain_value(now) else now  # the same value assigned again
            elif slot.key == "training" and isinstance(now, bool):
                found.append(f"{slot.what} is in {'train' if now else 'eval'} mode, but was in "
                             f"{'train' if then else 'eval'} mode at capture")
            elif type(then) is int and type(now) is int:
                found.append(f"{slot.what} is {now!r}, but was {then!r} at capture (an int the forward reads; "
                             "one that changes at every call, such as a step counter, keep in a tensor updated "
                             "in place, or read it outside the graphed forward)")
            else:
                found.append(f"{slot.what} is {now!r}, but was {then!r} at capture")
        for name, p, then in zip(self._addressed_names, self._addressed, self._pointers):
            if p.data_ptr() != then:
                found.append(f"{name} now lies at another address ({name[0]}.data = ..., or the module was moved "
                             "or cast)")
        found += self._class_changes()
        known = {id(t): len({s.key for s in self._object_slots if s.table is t}) for t in self._structure}
        for table in self._structure:
            if len(table) != known[id(table)]:
                added = [k for k in table if not any(s.table is table and s.key == k for s in self._object_slots)]
                found.append(f"the module tree gained or lost a parameter, buffer or submodule "
                             f"({', '.join(map(repr, added)) or 'one removed'}), which the graphs do not hold")
        for name, g, then in zip(self._main_grad_names, self._main_grads, self._main_grad_pointers):
            if g.data_ptr() != then:
                found.append(f"main_grad of parameter {name!r} now lies at another address (megatron-core DDP's "
                             "offload and reload of its grad buffers, or a reallocation), which the fused weight-"
                             "gradient kernels write by address")
        for name, p, then in zip(self._param_names, self._params, self._grads):
            if p.requires_grad != then:
                found.append(f"parameter {name!r} {'now requires' if p.requires_grad else 'no longer requires'} grad")
        made = compat.hook_handles_made()
        sizes = tuple(map(len, self._hook_tables))
        megatron_hooks = SEAM.hooks_run_by_hand(self.module)
        by_hand = SEAM.modules_run_by_hand(self.module)
        for name, kind, reason, owner, table, captured in zip(self._hook_names, self._hook_kinds, self._hook_reasons,
                                                              self._hook_owners, self._hook_tables,
                                                              self._hooks_at_capture):
            now = tuple(table.values())
            if same_objects(now, captured):
                continue
            # Forward pre-hooks of megatron-core's DDP where they are run by hand before each
            # replay (megatron-core's TECudaGraphHelper) or do nothing (no parameters of its own).
            if (kind == "_forward_pre_hooks" and owner is not None
                    and (id(owner) in by_hand or next(owner.parameters(recurse=False), None) is None)
                    and same_objects(leaving_out(now, megatron_hooks), leaving_out(captured, megatron_hooks))):
                continue
            counts = f"{len(captured)} -> {len(now)}" + (", other hooks" if len(now) == len(captured) else "")
            found.append(f"{name} changed ({counts}); {reason}")
        if not found:
            self._values = tuple(values[:scalars])
            self._objects = tuple(values[scalars:])
            self._hook_sizes = sizes
            self._hook_keys = tuple(map(tuple, self._hook_tables))
            self._handles_made = made
            self._manual = SEAM.manual_hooks(self.module)
            self._manual_len = len(self._manual or ())
            self._no_hooks = not any(sizes)
            self._lengths = tuple(map(len, self._dicts))
            self._expect()
        return found

    def _class_changes(self) -> list[str]:
        """A module's class swapped, or an instance attribute shadowing a name the forward
        read from the class (``forward`` patched on the instance, a method replaced)."""
        found = []
        for module, cls, names in zip(self._recorded, self._classes, self._class_reads):
            where = self._names.get(id(module)) or "the module"
            if type(module) is not cls:
                found.append(f"the class of {where!r} is now {type(module).__name__}, not {cls.__name__}")
            shadowed = sorted(names & module.__dict__.keys())
            if shadowed:
                found.append(f"{where!r} has an instance attribute {shadowed[0]!r} now, which hides what its forward "
                             f"read from its class at capture (a forward or method patched on the instance)")
        return found
