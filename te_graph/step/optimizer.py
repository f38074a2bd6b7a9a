"""What a whole-step graph holds of its optimizer: the hyperparameters and state it baked in,
checked at each call, and the lazily made state it must not make inside the capture."""
from __future__ import annotations

from typing import Any

from ..layout import describe_value

__all__ = ["optimizer_groups", "changed_hyperparameters", "optimizer_state", "check_optimizer", "with_state",
           "check_no_state_made"]


def optimizer_groups(optimizer: Any) -> tuple:
    """The optimizer's hyperparameters as a capture bakes them in (floats, flags; a tensor
    learning rate by identity)."""
    if optimizer is None:
        return ()
    return tuple(tuple((k, v) for k, v in sorted(group.items()) if k != "params") for group in optimizer.param_groups)


def changed_hyperparameters(optimizer: Any, captured: tuple) -> str:
    """Which entries of the param_groups differ from ``captured`` (``optimizer_groups``), for
    a message: ``'lr' of group 0``; a group added or removed."""
    now = optimizer_groups(optimizer)
    if len(now) != len(captured):
        return f"{len(now)} param_groups, {len(captured)} at capture"
    names = []
    for index, (group, then) in enumerate(zip(now, captured)):
        group, then = dict(group), dict(then)
        names += [f"{key!r} of group {index}" + ("" if key in then else " (new)")
                  for key in group if key not in then or group[key] is not then[key] and group[key] != then[key]]
    return ", ".join(names)


def optimizer_state(optimizer: Any) -> tuple:
    """The optimizer's state as a capture holds it, by identity: the state dict and each
    parameter's entry (``load_state_dict`` makes new ones; in-place updates keep them)."""
    if optimizer is None:
        return ()
    return id(optimizer.state), len(optimizer.state), tuple(map(id, optimizer.state.values()))


def check_optimizer(optimizer: Any) -> None:
    if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "state"):
        raise TypeError(f"make_graphed_step: optimizer must be a torch.optim.Optimizer, got {describe_value(optimizer)}.")


def with_state(optimizer: Any) -> set:
    """Ids of the parameters ``optimizer`` keeps state for."""
    return {id(p) for p, state in optimizer.state.items() if state} if optimizer is not None else set()


def check_no_state_made(optimizer: Any, before: set) -> None:
    """After the first warmup pass: the step made no optimizer state that was not there (an
    optimizer makes it lazily at a parameter's first step; made inside the capture, it would
    be made anew at every replay). An optimizer that keeps none (SGD without momentum), or
    none for a parameter without gradients, passes. State the pass made is dropped."""
    made = [p for p, state in list(optimizer.state.items()) if state and id(p) not in before] if optimizer else []
    if made:
        for p in made:
            del optimizer.state[p]
        raise ValueError(
            "make_graphed_step: the optimizer has no state yet for some parameters; it makes it lazily at its "
            "first step, which inside a graph would happen anew at every replay. Run one eager step before "
            "graphing the step (its result is kept)."
        )
