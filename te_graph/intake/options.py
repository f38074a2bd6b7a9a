"""The options of one ``make_graphed_callables`` call: normalised, checked, then frozen.

Accepts Transformer Engine's spellings of the same options (``_order``,
``_num_layers_per_chunk``, ``_reuse_graph_input_output_buffers``), so callers written for
TE work unchanged, and the precision arguments of the registered integration (TE's FP8
ones, normalised there), and refuses anything else
it does not know, suggesting the close name.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import rng

from ..extension import SEAM

__all__ = ["GraphOptions", "graph_options", "eager_replay_default"]

_TE_ALIASES = {
    "_order": "order",
    "_num_layers_per_chunk": "num_layers_per_chunk",
    "_reuse_graph_input_output_buffers": "reuse_graph_input_output_buffers",
}
_CALL_FORM_ARGS = ("modules", "callables", "sample_args", "sample_kwargs")
_CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


def eager_replay_default() -> bool:
    """``TE_GRAPH_EAGER_REPLAY`` (``1/true/yes/on`` or ``0/false/no/off``; anything else is a
    ``ValueError``) turns eager replay on for every call that does not say."""
    return bool(rng.env_flag("TE_GRAPH_EAGER_REPLAY"))


@dataclass(frozen=True)
class GraphOptions:
    """Everything a ``make_graphed_callables`` call was asked besides callables and samples
    (see its docstring for each)."""

    num_warmup_iters: int = 3
    allow_unused_input: bool = False
    order: Optional[tuple[float, ...]] = None  # ints; -c-0.5 for a weight-gradient pass
    num_layers_per_chunk: Any = None
    pool: Any = None  # as given; api resolves it to a handle
    retain_graph_in_backward: bool = False
    reuse_graph_input_output_buffers: bool = False
    accumulate_grads_in_graph: Optional[bool] = None
    clone_param_grads_on_return: bool = True
    capture_time_hooks: Optional[Sequence[Optional[Mapping[str, Any]]]] = None
    pre_warmup_hook: Optional[Callable[[], None]] = None
    post_warmup_hook: Optional[Callable[[], None]] = None
    capture_error_mode: str = "thread_local"
    more_shapes: tuple = ()
    unseen_shape: str = "error"
    eager_replay: bool = False
    get_rng_state_tracker: Optional[Callable[[], Any]] = None
    verify: Any = None  # the runtime verifier's schedule as given (``te_graph.verify.options``)
    fp8_arguments: tuple = ()  # the precision (TE's FP8) arguments as given, (name, value) pairs


def graph_options(te_arguments: Mapping[str, Any], **given: Any) -> GraphOptions:
    """``given`` (make_graphed_callables' own keywords) with TE's spellings in
    ``te_arguments`` folded in, checked; nothing has been changed when this raises."""
    options = dict(given)
    fp8: list = []
    for name, value in te_arguments.items():
        if name in _TE_ALIASES:
            target = _TE_ALIASES[name]
            if options[target] not in (None, False) and value not in (None, False):
                raise TypeError(f"make_graphed_callables: got both {target}= and {name}=; pass one of them.")
            if value not in (None, False):
                options[target] = value
        elif name in SEAM.precision.argument_names:
            fp8.append((name, value))
        else:
            raise TypeError(_unexpected_keyword(name))
    if options["eager_replay"] is None:
        options["eager_replay"] = eager_replay_default()
    _check_types(options)
    if options["order"] is not None:
        if not isinstance(options["order"], (list, tuple)):
            raise TypeError(
                f"make_graphed_callables: order must be a list or tuple of ints (TE's _order: +c the forward of "
                f"chunk c, -c its backward, in the order they run), got {options['order']!r} "
                f"({type(options['order']).__name__})."
            )
        options["order"] = tuple(options["order"])
    options["more_shapes"] = tuple(options["more_shapes"])
    result = GraphOptions(**options, fp8_arguments=tuple(fp8))
    _check(result)
    return result


def _unexpected_keyword(name: str) -> str:
    known = [f.name for f in dataclasses.fields(GraphOptions)] + list(_CALL_FORM_ARGS) + list(_TE_ALIASES) + list(SEAM.precision.argument_names)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else "; see help(te_graph.make_graphed_callables) for the accepted ones."
    return f"make_graphed_callables() got an unexpected keyword argument {name!r}{hint}"


# Options that take a bool (None too where it means "the default"), and those that take a
# callable or None: a string such as "false" would read as true.
_BOOLS = {"allow_unused_input": False, "retain_graph_in_backward": False, "reuse_graph_input_output_buffers": False,
          "accumulate_grads_in_graph": True, "clone_param_grads_on_return": False, "eager_replay": False}
_CALLABLES = ("pre_warmup_hook", "post_warmup_hook", "get_rng_state_tracker")


def _check_types(given: Mapping[str, Any]) -> None:
    for name, none_ok in _BOOLS.items():
        value = given.get(name)
        if not isinstance(value, bool) and not (none_ok and value is None):
            raise TypeError(
                f"make_graphed_callables: {name} must be True or False{' (or None: the default)' if none_ok else ''}, "
                f"got {value!r} ({type(value).__name__}); a string such as 'false' would read as true."
            )
    for name in _CALLABLES:
        value = given.get(name)
        if value is not None and not callable(value):
            raise TypeError(f"make_graphed_callables: {name} must be a callable or None, got {value!r} "
                            f"({type(value).__name__}).")
    for name in ("capture_error_mode", "unseen_shape"):
        if not isinstance(given.get(name), str):
            raise TypeError(f"make_graphed_callables: {name} must be a str, got {given.get(name)!r}.")
    more = given.get("more_shapes")
    if isinstance(more, (str, bytes)) or not isinstance(more, (tuple, list)):
        raise TypeError(f"make_graphed_callables: more_shapes must be a list or tuple of sample sets, got "
                        f"{type(more).__name__}.")


def _check(options: GraphOptions) -> None:
    """The option values on their own (the callables and samples are checked in ``checks``)."""
    warmup = options.num_warmup_iters
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise TypeError(
            f"make_graphed_callables: num_warmup_iters must be an int, got {warmup!r} "
            f"({type(warmup).__name__})."
        )
    if warmup < 1:
        raise ValueError(
            f"make_graphed_callables: num_warmup_iters={warmup}; at least 1 warmup pass is "
            "needed (it also learns which random streams each recomputed region uses)."
        )
    if options.capture_error_mode not in _CAPTURE_ERROR_MODES:
        raise ValueError(
            f"make_graphed_callables: capture_error_mode={options.capture_error_mode!r}; use one of "
            f"{', '.join(map(repr, _CAPTURE_ERROR_MODES))}."
        )
    if options.unseen_shape not in ("error", "eager"):
        raise ValueError(f"make_graphed_callables: unseen_shape={options.unseen_shape!r}; use 'error' or 'eager'.")
    if options.reuse_graph_input_output_buffers and options.order is None:
        raise ValueError(
            "make_graphed_callables: reuse_graph_input_output_buffers=True needs order=... "
            "(TE's _order): buffers are reused by forwards that run after an earlier "
            "microbatch's backward, and without a schedule no forward does."
        )
