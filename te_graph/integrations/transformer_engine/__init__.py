"""Transformer Engine under te_graph's graphs, with TE's meaning (TE 2.20 ``graph.py``):
its modules (``modules``), FP8 across warmup and capture (``fp8``) and around each replay
(``fp8_replay``, ``fp8_reduction``), and its delayed weight gradients. Registered with the
engine's seam (``te_graph.extension``) on import; TE itself is imported only when used."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Sequence

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

    @contextlib.contextmanager
    def kept(self, modules_: Sequence[Any]) -> Iterator[None]:
        """TE's FP8 meta of ``modules_`` (scales, amax histories) put back on exit. Read and
        written through each module's own accessors: TE's ``save_fp8_tensors`` also resets
        the recipe state of its fusible operations, after which their saved meta no longer
        loads (megatron-core's models, even in bf16)."""
        if not modules_ or modules.te_loaded() is None:
            yield
            return
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule  # noqa: PLC0415
        from transformer_engine.pytorch.ops.op import BasicOperation  # noqa: PLC0415

        saved = []
        for top in modules_:
            for m in top.modules():
                if isinstance(m, TransformerEngineBaseModule):
                    state = m.get_fp8_meta_tensors()
                    if state is not None:
                        saved.append((m.reset_fp8_meta_tensors, state))
                elif isinstance(m, BasicOperation):
                    state = m._save_fp8_metas()
                    if state is not None:
                        saved.append((m._load_fp8_metas, state))
        try:
            yield
        finally:
            for load, state in saved:
                load(state)


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
