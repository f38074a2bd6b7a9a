"""What ``switched`` checks of its programs, and the state it keeps for a refusal or a run again.

* **Saved tensors written since their save.** The node runs its programs under saved-tensor
  hooks of its own (so that hooks around the node, a non-reentrant checkpoint's, stay out of
  them), which turn off autograd's own version check: :func:`pack` and :func:`unpack` make it.
* **What a run again needs unchanged** (``recompute``): the inputs, the parameters the
  programs read, and the default generators.
* **What a program trains** (its own leaves and the aliases alone), and no reentrant
  checkpoint inside it; every program returns the same shapes (one output buffer).
* **The module's buffers**, kept for a refusal outside a capture and for the run again.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch

from ... import compat
from ..parameters import StandIns
from .guards import ConditionalCaptureError

__all__ = ["pack", "unpack", "versions", "note_param_versions", "check_params_unwritten", "generator_states",
           "check_no_draw", "check_unwritten", "check_graph", "buffers", "buffers_as", "put_back_if_refused",
           "check_like"]


def pack(state: Any, tensor: torch.Tensor) -> list:
    """A saved tensor with its version now (under a capture, noted for the forward's retake)."""
    record = [tensor, tensor._version]
    if state.packed is not None:
        state.packed.append(record)
    return record


def unpack(record: list) -> torch.Tensor:
    """A saved tensor as the program saved it. Saved-tensor hooks turn off autograd's own check
    that a saved tensor was not written in place since, so it is made here, with eager's error."""
    tensor, version = record  # (the version, under a capture, as the node left it: see forward)
    if tensor._version != version:
        raise RuntimeError(written_since("a tensor a program of switched saved for its backward", tensor, version))
    return tensor


def versions(tensors: Sequence[torch.Tensor]) -> tuple:
    return tuple(t._version for t in tensors)


def note_param_versions(state: Any) -> None:
    """With recompute: the versions of the aliases the programs read, which the run again reads."""
    if state.recompute:
        state.param_versions = tuple((a, a._version) for a in state.aliases if id(a) in state.used)


def check_params_unwritten(state: Any) -> None:
    """With recompute, at the backward: the parameters the programs read are as the forward (or
    the last run again) left them, else autograd's in-place error."""
    for alias, version in state.param_versions:
        if alias._version != version:
            raise RuntimeError(written_since("a parameter of module, which switched(recompute=True) reads again",
                                             alias, version))


def generator_states(inputs: tuple) -> list:
    """(generator, its state) of the default generators of the CPU and of the inputs' GPU."""
    generators = [torch.default_generator]
    generators += [torch.cuda.default_generators[torch.cuda.current_device() if t.device.index is None
                                                 else t.device.index] for t in inputs[:1] if t.device.type == "cuda"]
    return [(g, g.get_state()) for g in generators]


def check_no_draw(k: int, drawn: list) -> None:
    """With recompute, refuse a program that draws from a default generator: the run again
    would draw other numbers (under a capture its body refuses random numbers)."""
    if any(not torch.equal(g.get_state(), state) for g, state in drawn):
        raise ConditionalCaptureError(
            f"switched(recompute=True): program {k} draws random numbers, so the backward's run again would draw "
            "others (and a body refuses them under a capture). Draw before the node, into a tensor the program "
            "reads, or use recompute=False")


def check_unwritten(state: Any, k: int, inputs: tuple, versions: tuple) -> None:
    """With recompute, refuse a program that writes an input in place: the backward's run again
    would start from the written value."""
    written = [i for i, (t, v) in enumerate(zip(inputs, versions)) if t._version != v]
    if state.recompute and written:
        raise ConditionalCaptureError(
            f"switched(recompute=True): program {k} writes its input {written[0]} in place, so the backward's run "
            "again would start from the written value. Write it out of place, or use recompute=False")


def written_since(what: str, tensor: torch.Tensor, version: int) -> str:
    return (f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"{what} ({tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}) is at version "
            f"{tensor._version}; expected version {version} instead. Write it after the backward, or out of place")


# The backward nodes of reentrant checkpoints (te_graph's, torch's use_reentrant=True and
# Megatron's, Transformer Engine's): their backward refuses torch.autograd.grad, which the
# node's backward is.
_REENTRANT = frozenset({"_ReentrantCheckpointBackward", "CheckpointFunctionBackward", "_CheckpointFunctionBackward"})


def check_graph(k: int, outputs: tuple, own: set, stand_ins: StandIns) -> set:
    """Refuse a program whose outputs' autograd graph reaches a leaf other than its own leaves
    and aliases (a tensor requiring grad it closes over, a parameter of another module, an
    activation made outside): the node asks only for its own, so that gradient would be lost;
    or holds a reentrant checkpoint, whose backward the node's cannot run. The ids of the leaves
    it reaches."""
    seen: set = set()
    reached: set = set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ in _REENTRANT:
            raise ConditionalCaptureError(
                f"switched: program {k} holds a reentrant checkpoint ({type(node).__name__}), whose backward "
                "refuses the torch.autograd.grad the node's backward asks with: use a non-reentrant checkpoint "
                "(use_reentrant=False), or switched(recompute=True), which runs the program again itself")
        variable = node.variable if compat.is_accumulate_grad(node) else None
        if variable is not None and id(variable) in stand_ins.of:
            raise ConditionalCaptureError(
                f"switched: program {k} reads a parameter of module ({tuple(variable.shape)} "
                f"{str(variable.dtype).replace('torch.', '')}) through a reference taken before the call; while "
                "a program runs the node puts aliases of them in module's slots: read it from the module inside "
                "the program")
        if variable is not None:
            reached.add(id(variable))
        if variable is not None and id(variable) not in own:
            raise ConditionalCaptureError(
                f"switched: program {k} trains a tensor it closes over ({tuple(variable.shape)} "
                f"{str(variable.dtype).replace('torch.', '')}), whose gradient the node would lose: pass it as an "
                "input, or its module as module=")
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


def buffers(module: Optional[torch.nn.Module]) -> list:
    """(buffer, a copy of it) of every buffer of ``module``."""
    return [] if module is None else [(b, b.clone()) for b in module.buffers()]


@contextlib.contextmanager
def buffers_as(kept: list) -> Iterator[None]:
    """Inside: the buffers as ``kept`` has them; after: as they were on entry."""
    now = [(b, b.clone()) for b, _ in kept]
    for b, value in kept:
        b.data.copy_(value)  # .data: a node that saved the buffer sees its version unchanged
    try:
        yield
    finally:
        for b, value in now:
            b.data.copy_(value)


@contextlib.contextmanager
def put_back_if_refused(kept: list, generators: list) -> Iterator[None]:
    """Outside a capture: a refusal after the program ran puts the buffers back as ``kept`` has
    them, and the ``generators`` as they were."""
    try:
        yield
    except BaseException:
        for b, value in kept:
            b.data.copy_(value)
        for g, state in generators:
            g.set_state(state)
        raise


def check_like(k: int, outputs: tuple, shared: tuple) -> None:
    """Every program returns tensors of one structure, shapes and dtypes: the bodies share
    their output buffers."""
    if len(outputs) != len(shared):
        raise ConditionalCaptureError(f"switched: program {k} returns {len(outputs)} tensors, program 0 "
                                      f"{len(shared)}; every program must return the same tensors")
    for i, (o, s) in enumerate(zip(outputs, shared)):
        if o.shape != s.shape or o.dtype != s.dtype or o.device != s.device:
            raise ConditionalCaptureError(
                f"switched: output {i} of program {k} is {tuple(o.shape)} {o.dtype} on {o.device}, program 0's "
                f"{tuple(s.shape)} {s.dtype} on {s.device}; every program must return the same shapes and dtypes")
