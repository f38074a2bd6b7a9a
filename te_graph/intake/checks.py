"""Checks on what the user hands to make_graphed_callables, run before anything is changed.

Each error says what is wrong and what to do; docs/troubleshooting.md lists them all.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from .. import compat
from ..extension import SEAM
from ..guards.hooks import global_hooks_run_at_capture_only, hooks_outside_graphs
from ..layout import InputLayout, describe
from ..resources import graphed_callable_of

EAGER_REPLAY_HINT = (
    "To debug on a machine without graphs, pass eager_replay=True (or set "
    "TE_GRAPH_EAGER_REPLAY=1): it runs the same static-buffer wrapper eagerly."
)


def check_environment(eager_replay: bool) -> None:
    """CUDA graphs need CUDA; autocast's weight cache would be captured stale."""
    if not eager_replay and not torch.cuda.is_available():
        raise RuntimeError(
            "make_graphed_callables: CUDA is not available, and capturing CUDA graphs needs a "
            "CUDA device. " + EAGER_REPLAY_HINT
        )
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "make_graphed_callables: called under torch.inference_mode(), whose tensors autograd cannot record "
            "and graphs cannot keep between calls. Graph outside it (for forward-only graphs, under "
            "torch.no_grad()), and call the graphed callable there."
        )
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        raise RuntimeError(
            "make_graphed_callables: autocast is enabled with its cache, which would bake "
            "stale casts of the weights into the graph. Use "
            "torch.autocast(..., cache_enabled=False)."
        )


def check_callables(modules: Any) -> tuple[Callable, ...]:
    """The callables as a tuple: a callable, or a tuple/list of distinct, ungraphed ones."""
    if isinstance(modules, torch.nn.ModuleList):
        raise TypeError(
            "make_graphed_callables: modules is an nn.ModuleList, which has no forward to graph; "
            "pass tuple(module_list) to graph each of its modules."
        )
    if inspect.isgenerator(modules) or isinstance(modules, (map, filter)):
        raise TypeError(
            "make_graphed_callables: modules is a generator; pass a tuple (tuple(...)), since "
            "the modules are indexed and the result has the same form."
        )
    callables = tuple(modules) if isinstance(modules, (tuple, list)) else (modules,)
    if not callables:
        raise ValueError("make_graphed_callables: no callables given; pass at least one.")
    seen: dict[int, int] = {}
    for index, c in enumerate(callables):
        if not callable(c):
            raise TypeError(
                f"make_graphed_callables: callable {index} is a {type(c).__name__}, which cannot "
                "be called; pass modules or functions."
            )
        if isinstance(c, type):
            raise TypeError(
                f"make_graphed_callables: callable {index} is the class {c.__name__}, not an instance "
                f"of it; pass the module you train ({c.__name__}(...)), not its class."
            )
        if id(c) in seen:
            raise ValueError(
                f"make_graphed_callables: callable {index} is the same object as callable "
                f"{seen[id(c)]}; graph each module once (for several microbatches of one "
                "layer, pass order=... and one sample set per microbatch)."
            )
        seen[id(c)] = index
        graphed = graphed_callable_of(c)
        if graphed is None and isinstance(c, torch.nn.Module):
            graphed = next(filter(None, map(graphed_callable_of, c.modules())), None)
        if graphed is not None:
            raise ValueError(
                f"make_graphed_callables: callable {index} ({type(c).__name__}) is already graphed, "
                f"or holds a module that is ({graphed!r}); graphs cannot nest. Graph the "
                "original modules once, or free the old graphs first: te_graph.reset(module) "
                "gives a module its eager forward back."
            )
    return callables


def check_modules(callables: Sequence[Callable]) -> None:
    """No hooks (they would run once, at capture), no buffer requiring grad, one mode."""
    modes = {}
    for index, c in enumerate(callables):
        if not isinstance(c, torch.nn.Module):
            continue
        modes.setdefault(c.training, index)
        # A megatron-core layer its helper graphs (routed) runs some submodules only after the replay.
        routed = SEAM.routes_capture(c)
        outside = hooks_outside_graphs(c, routed)
        global_hooks = [kind for kind, table in compat.global_module_hook_dicts() if table]
        if global_hooks and global_hooks_run_at_capture_only(c, routed):
            raise ValueError(
                f"make_graphed_callables: global module hooks are registered ({', '.join(global_hooks)}: "
                f"torch.nn.modules.module.register_module_*); they run for the submodules of callable {index} "
                "only while its graphs are captured, never at replay. Remove them before graphing, or pass "
                "hooks as capture_time_hooks=... to run them while the graphs are prepared."
            )
        for name, module in c.named_modules():
            where = f"submodule {name!r} of callable {index}" if name else f"callable {index}"
            SEAM.check_module(where, module)  # what an integration refuses of its modules
            if isinstance(module, torch.nn.RNNBase):
                raise ValueError(
                    f"make_graphed_callables: {where} is a torch.nn.{type(module).__name__}, which te_graph does not "
                    "graph: torch's recurrent modules re-point their weights (_flat_weights, and flatten_parameters on "
                    "the GPU) whenever their parameters change, as they do while graphs are made. Graph the layers "
                    "around it and run it eagerly."
                )
            if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
                raise ValueError(
                    f"make_graphed_callables: {where} ({type(module).__name__}) is a lazy module whose parameters "
                    "are not made yet; its first call makes them from that call's input, which would be warmup's "
                    "sample. Call the model once eagerly (or on a sample batch) before graphing it."
                )
            hooks = compat.module_hook_dicts(module)
            if hooks and name not in outside:
                after = ("megatron-core's helper replays the layer's graphs without nn.Module.__call__, so not even "
                         "hooks on the layer itself run at replay" if routed else
                         "hooks registered on the module after graphing run around the graphed forward")
                raise ValueError(
                    f"make_graphed_callables: {where} has hooks registered ({', '.join(hooks)}); "
                    f"hooks would run only during capture, never at replay. Remove them before "
                    f"graphing ({after}), or pass them as capture_time_hooks=... to run them "
                    "while the graphs are prepared."
                )
        for name, p in c.named_parameters():
            if (p.requires_grad and type(p).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
                    and not SEAM.is_quantized_parameter(p)):
                raise ValueError(
                    f"make_graphed_callables: parameter {name!r} of callable {index} is a "
                    f"{type(p).__name__}, a tensor subclass with its own dispatch (a DTensor, "
                    "...); te_graph graphs plain parameters and Transformer Engine's quantized "
                    "weights (quantized_model_init), not other tensor subclasses. Give the "
                    "module plain parameters."
                )
        for name, buffer in c.named_buffers():
            if buffer.requires_grad:
                raise ValueError(
                    f"make_graphed_callables: buffer {name!r} of callable {index} requires grad; "
                    "only parameters may be trainable in a graphed module. Make it a Parameter "
                    "or call .requires_grad_(False) on it."
                )
    if len(modes) > 1:
        raise ValueError(
            f"make_graphed_callables: callables are in mixed training modes (callable "
            f"{modes[True]} is in train mode, callable {modes[False]} in eval mode); a graph is "
            "used only in the mode it was captured in. Call .train() or .eval() on all of them."
        )


def check_devices(
    callables: Sequence[Callable], layouts: Sequence[InputLayout], eager_replay: bool
) -> None:
    """Graph capture works on CUDA tensors of one device only."""
    if eager_replay:
        return
    current = torch.cuda.current_device()
    for index, (c, layout) in enumerate(zip(callables, layouts)):
        tensors = list(layout.samples)
        if isinstance(c, torch.nn.Module):
            tensors += list(c.parameters()) + list(c.buffers())
        for t in tensors:
            if t.device.type != "cuda":
                raise ValueError(
                    f"make_graphed_callables: {layout.name} has a tensor on {t.device} "
                    f"({describe(t)}); CUDA graphs capture CUDA tensors only. Move the module "
                    "and its inputs to CUDA. " + EAGER_REPLAY_HINT
                )
            if t.device.index != current:
                raise ValueError(
                    f"make_graphed_callables: {layout.name} has a tensor on {t.device}, but the "
                    f"current device is cuda:{current}; a graph captures work of one device. "
                    "Call torch.cuda.set_device() to the module's device before graphing."
                )


def check_not_over_nested(callable_: Callable, sample_args: Any) -> None:
    """A single callable's ``sample_args`` is the tuple of its arguments; one holding a
    tuple of tensors (as for a tuple of callables) whose tensors the forward could take as
    its arguments is refused before warmup calls the forward with a tuple."""
    if not (isinstance(sample_args, (tuple, list)) and len(sample_args) == 1
            and isinstance(sample_args[0], (tuple, list)) and sample_args[0]
            and all(isinstance(t, torch.Tensor) for t in sample_args[0])):
        return
    forward = callable_.forward if isinstance(callable_, torch.nn.Module) else callable_
    try:
        signature = inspect.signature(forward)
        signature.bind(*sample_args[0])
    except (TypeError, ValueError):
        return  # the forward cannot take them one by one: one tuple argument it is
    n = len(sample_args[0])
    raise TypeError(
        f"make_graphed_callables: one callable was given, and its sample_args is a tuple holding a "
        f"tuple of {n} tensor(s), which the forward would get as one tuple argument. For a single "
        f"callable, sample_args is the tuple of its arguments: pass (x,), not ((x,),). If the "
        "forward does take one tuple, pass the callable in a tuple: make_graphed_callables((m,), "
        "(((a, b),),))."
    )


def check_sample_kwargs(sample_args: Sequence[Any], sample_kwargs: Sequence[Any]) -> None:
    """One dict of sample kwargs per tuple of sample args (the planner checks the args)."""
    if len(sample_kwargs) != len(sample_args):
        raise ValueError(
            f"make_graphed_callables: got {len(sample_args)} sample_args but "
            f"{len(sample_kwargs)} sample_kwargs; give one dict of sample kwargs per tuple "
            "of sample args."
        )


def check_tensors(callables: Sequence[Callable], sets: Sequence[tuple]) -> None:
    """The samples and parameters are dense tensors with data, in graphs and eager replay
    alike: a graph copies each input into a dense static buffer and reads dense parameters,
    and warmup runs the forward on the samples."""
    samples = [t for args, kwargs in sets for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    params = [p for c in callables if isinstance(c, torch.nn.Module) for p in c.parameters()]
    for t in samples + params:
        what = "sample" if any(t is s for s in samples) else "parameter"
        if t.layout != torch.strided:
            raise ValueError(
                f"make_graphed_callables: a {what} is a {t.layout} tensor ({describe(t)}); a graph copies each "
                "input into a dense static buffer and reads dense parameters. Pass dense tensors (x.to_dense()), "
                "or keep the sparse part outside the graphed callable."
            )
        if t.device.type == "meta":
            raise ValueError(
                f"make_graphed_callables: a {what} is on the meta device ({describe(t)}), which holds no data to "
                "run warmup on. Materialise the module and the samples first (to_empty() and an initialisation, "
                "or real sample tensors)."
            )
