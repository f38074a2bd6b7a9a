"""Transformer Engine's modules as te_graph meets them: which modules are TE's (found
without importing TE, from the classes a loaded TE defines), its quantized weights, the
operation fusers to drop after capture, the weight-cache opt-out, and the protocol of
modules that delay their weight gradients to ``backward_dw()`` (TE 2.20 ``module/base.py``,
``module/_common.py``).

te_graph never imports TE at module import: only when FP8 is asked for, or when a graphed
module holds TE modules (already imported by the user, then).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Optional, Sequence

import torch

__all__ = ["te_pytorch", "te_loaded", "te_modules_in", "is_te_module", "forget_stand_in_caches", "is_quantized_tensor",
           "visited_te_modules", "keeps_weight_cache", "queued_wgrad", "run_backward_dw", "run_wgrad_hooks",
           "wgrad_hooks_held", "check_module"]


def te_pytorch() -> Any:
    """``transformer_engine.pytorch``, imported on first need, with a clear error."""
    try:
        import transformer_engine.pytorch as te  # noqa: PLC0415 - lazy on purpose
    except ImportError as error:
        raise RuntimeError(
            "make_graphed_callables: FP8 capture needs Transformer Engine "
            f"(transformer_engine.pytorch), which does not import here ({error}). Install "
            "Transformer Engine 2.20, or leave the FP8 arguments off."
        ) from error
    return te


def te_loaded() -> Optional[Any]:
    """``transformer_engine.pytorch`` if the process has imported it, else None (never
    imports it: a model without TE modules must not pay for or depend on TE)."""
    return sys.modules.get("transformer_engine.pytorch")


def te_modules_in(module: Any) -> bool:
    """Whether ``module`` holds Transformer Engine modules (False without TE imported)."""
    te = te_loaded()
    if te is None or not isinstance(module, torch.nn.Module):
        return False
    kinds = _te_kinds(te)
    return any(isinstance(m, kinds) for m in module.modules())


def is_te_module(module: Any) -> bool:
    """Whether ``module`` is one of Transformer Engine's modules (False without TE imported)."""
    te = te_loaded()
    return te is not None and isinstance(module, _te_kinds(te))


def _te_kinds(te: Any) -> tuple[type, type, type]:
    """TE's module base, its fusible-operation base and ``te.ops.Sequential``."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule  # noqa: PLC0415
    from transformer_engine.pytorch.ops.op import BasicOperation  # noqa: PLC0415

    return (TransformerEngineBaseModule, BasicOperation, te.ops.Sequential)


def forget_stand_in_caches(modules: Sequence[Any]) -> None:
    """Drop the operation fusers ``te.ops.Sequential`` built while the modules held
    parameter stand-ins (a fuser keeps the parameters it was built with; an eager call
    rebuilds it, around the real parameters)."""
    te = te_loaded()
    if te is None:
        return
    for module in modules:
        for m in module.modules() if isinstance(module, torch.nn.Module) else ():
            if isinstance(m, te.ops.Sequential):
                m._module_groups = None


def is_quantized_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is one of Transformer Engine's quantized tensors (FP8 primary weights
    from ``te.quantized_model_init``), by its class's lineage: never imports TE."""
    return any(
        cls.__name__ == "QuantizedTensor" and cls.__module__.startswith("transformer_engine.")
        for cls in type(t).__mro__
    )


@contextlib.contextmanager
def visited_te_modules(func: Any) -> Iterator[list]:
    """Inside: collects the TE modules a forward of ``func`` runs (``func`` itself when it
    is one: te_graph calls its forward directly), as TE records them."""
    te = te_loaded()
    found: list = []
    if te is None:
        yield found
        return
    base, operation, sequential = _te_kinds(te)

    def record(module: torch.nn.Module, *_: Any) -> None:
        if isinstance(module, (base, operation)):
            found.append(module)
        elif isinstance(module, sequential):
            for group in module._module_groups or ():
                found.extend(getattr(group, "_basic_ops", ()))

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        yield found
    finally:
        handle.remove()
        if isinstance(func, torch.nn.Module):
            record(func)
        unique = list({id(m): m for m in found}.values())
        found[:] = unique


def keeps_weight_cache(modules: Sequence[Any]) -> bool:
    """Whether TE may reuse these modules' FP8 weights after a step's first microbatch: not
    where one is megatron-core's TE wrapper built with ``disable_parameter_transpose_cache``,
    which passes ``is_first_microbatch=None`` to TE, so that TE quantizes at every call."""
    return not any(getattr(m, "disable_parameter_transpose_cache", False) for m in modules)


def queued_wgrad(module: Any) -> Any:
    """The deque of work ``module``'s backward queued for ``backward_dw()`` (TE 2.20
    ``module/_common.py``: ``WeightGradStore.context``, a ``queue.Queue``), or None."""
    return getattr(getattr(getattr(module, "wgrad_store", None), "context", None), "queue", None)


def run_backward_dw(module: Any) -> None:
    """The module's own ``backward_dw()`` (its class's: on a module graphed without an order,
    the attribute of that name is the graphed one, as in TE)."""
    type(module).backward_dw(module)


def run_wgrad_hooks(module: Any) -> None:
    """What ``backward_dw()`` ends with: the module's wgrad accumulation-and-reduce hooks."""
    for hook in getattr(module, "wgrad_accumulation_and_reduce_hooks", ()):
        hook()


@contextlib.contextmanager
def wgrad_hooks_held(modules: Sequence[Any]) -> Iterator[None]:
    """Inside: the modules' wgrad accumulation-and-reduce hooks are held back, so warmup and
    capture run (and capture) none of them; they come back on exit."""
    saved = [(m, m.wgrad_accumulation_and_reduce_hooks) for m in modules
             if isinstance(getattr(m, "wgrad_accumulation_and_reduce_hooks", None), list)]
    try:
        for m, _ in saved:
            m.wgrad_accumulation_and_reduce_hooks = []
        yield
    finally:
        for m, hooks in saved:
            m.wgrad_accumulation_and_reduce_hooks = hooks


def check_module(where: str, module: torch.nn.Module) -> None:
    """TE modules built with ``fuse_wgrad_accumulation=True`` need ``main_grad`` on their
    weights, and cannot also delay their weight gradients (their pass would flag
    ``main_grad`` outside the backward, which te_graph does not replay)."""
    fused = getattr(module, "fuse_wgrad_accumulation", False) is True and hasattr(module, "need_backward_dw")
    if not fused:
        return
    weights = {w: getattr(module, w, None) for w in getattr(module, "weight_names", ())}
    missing = [w for w, p in weights.items() if p is not None and p.requires_grad and not hasattr(p, "main_grad")]
    if missing:
        raise ValueError(
            f"make_graphed_callables: {where} ({type(module).__name__}) is built with "
            f"fuse_wgrad_accumulation=True, but its weight {missing[0]!r} has no main_grad: "
            "its backward accumulates the weight gradient into that buffer (Megatron's DDP "
            "attaches it). Wrap the model in the DDP that attaches main_grad before graphing, "
            "or build the module with fuse_wgrad_accumulation=False."
        )
    if module.need_backward_dw():
        raise NotImplementedError(
            f"make_graphed_callables: {where} ({type(module).__name__}) is built with both "
            "fuse_wgrad_accumulation=True and delay_wgrad_compute=True: its weight-gradient "
            "pass would accumulate into main_grad and flag it (grad_added_to_main_grad) "
            "outside the backward, which te_graph does not replay yet. Build it with one of "
            "the two."
        )
