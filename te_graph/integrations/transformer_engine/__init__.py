"""Transformer Engine under te_graph's graphs, with TE's meaning (TE 2.20 ``graph.py``):
its modules (``modules``), FP8 across warmup and capture (``fp8``) and around each replay
(``fp8_replay``, ``fp8_reduction``), and its delayed weight gradients. Registered with the
engine's seam (``te_graph.extension``) on import; TE itself is imported only when used."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from ...extension import Extension, Precision, register
from . import modules
from .fp8 import FP8_ARGUMENTS, FP8Capture, fp8_options
from .fp8_replay import fp8_replay

__all__ = ["TransformerEngine", "FP8Precision"]


class FP8Precision(Precision):
    """TE's FP8 arguments, the state warmup and capture run in, and the steps around replays."""

    argument_names = FP8_ARGUMENTS

    def options(self, arguments: Mapping[str, Any], callables: Sequence[Callable]) -> Any:
        return fp8_options(arguments, callables)

    def capture(self, options: Any, modules_: Sequence[torch.nn.Module]) -> Any:
        return FP8Capture(options, modules_) if options is not None and options.on else None

    def replay(self, enabled: bool, options: Any, modules_: Sequence[Any], framework_modules: bool,
               graphs: bool) -> Any:
        return fp8_replay(enabled, options, modules_, framework_modules, graphs)

    def scaling_state_in_use(self) -> Optional[str]:
        """What quantizes now with scaling state kept from step to step, named for a message,
        or None: TE's FP8 autocast under delayed scaling (amax history and scales), or a
        custom recipe, which may ask for it (TE 2.20 ``_has_delayed_scaling_state``; the
        recipes ``FP8Replay`` registers in the global amax buffers). TE is read only where the
        process has imported it."""
        if modules.te_loaded() is None:
            return None
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: PLC0415

        if not FP8GlobalStateManager.is_fp8_enabled():
            return None
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        if getattr(recipe, "delayed", lambda: False)() or getattr(recipe, "custom", lambda: False)():
            return f"Transformer Engine's FP8 autocast with the {type(recipe).__name__} recipe"
        return None

    @contextlib.contextmanager
    def kept(self, modules_: Sequence[Any]) -> Iterator[None]:
        """TE's delayed-scaling FP8 state of ``modules_`` (each scaling state's ``scale`` and
        ``amax_history``, of modules and fusible operations) put back on exit. Read from the
        state objects directly: TE's ``save_fp8_tensors`` resets fusible operations' recipe
        state (their saved meta then no longer loads), and its accessors assume delayed
        scaling where a current- or block-scaling state has no ``scale``."""
        if not modules_ or modules.te_loaded() is None:
            yield
            return
        saved = []
        for top in modules_:
            for m in top.modules():
                metas = [getattr(m, "fp8_meta", None)] + list((getattr(m, "_fp8_metas", None) or {}).values())
                for meta in metas:
                    for state in (meta.values() if isinstance(meta, dict) else ()):
                        scale, history = getattr(state, "scale", None), getattr(state, "amax_history", None)
                        if isinstance(scale, torch.Tensor) and isinstance(history, torch.Tensor):
                            saved.append((scale, scale.clone(), history, history.clone()))
        try:
            yield
        finally:
            with torch.no_grad():
                for scale, scale_then, history, history_then in saved:
                    scale.copy_(scale_then)
                    history.copy_(history_then)


class TransformerEngine(Extension):
    """What the engine asks of Transformer Engine's modules."""

    name = "transformer_engine"
    precision = FP8Precision()

    def keeps_own_state(self, module: Any) -> bool:
        return modules.is_te_module(module)

    def holds_modules(self, module: Any) -> bool:
        return modules.te_modules_in(module)

    def is_quantized_parameter(self, t: torch.Tensor) -> bool:
        return modules.is_quantized_tensor(t)

    def writes_main_grad(self, module: torch.nn.Module) -> bool:
        # TE's fused weight-gradient GEMM (fuse_wgrad_accumulation) writes main_grad by address.
        return getattr(module, "fuse_wgrad_accumulation", False) is True

    def check_module(self, where: str, module: torch.nn.Module) -> None:
        modules.check_module(where, module)

    def visited_modules(self, func: Any) -> contextlib.AbstractContextManager:
        return modules.visited_te_modules(func)

    def forget_stand_in_caches(self, modules_: Sequence[Any]) -> None:
        modules.forget_stand_in_caches(modules_)

    def delays_wgrad(self, module: Any) -> bool:
        return callable(getattr(module, "need_backward_dw", None)) and bool(module.need_backward_dw())

    def queued_wgrad(self, module: Any) -> Any:
        return modules.queued_wgrad(module)

    def run_backward_dw(self, module: Any) -> None:
        modules.run_backward_dw(module)

    def wgrad_hooks_held(self, modules_: Sequence[Any]) -> contextlib.AbstractContextManager:
        return modules.wgrad_hooks_held(modules_)

    def run_wgrad_hooks(self, module: Any) -> None:
        modules.run_wgrad_hooks(module)


register(TransformerEngine())
