"""Transformer Engine's layers and FP8 under te_graph's graphs, with TE's meaning (TE 2.20
``graph.py``).

* **Arguments**: TE's ``enabled`` (one bool, or one per callable), ``calibrating``,
  ``recipe``, ``amax_reduction_group``, ``cache_quantized_params``, and the deprecated
  ``fp8_*`` spellings (Megatron still passes those).
* **Capture**: TE's capture flag is set (its modules then leave the backward amax reduction
  out of the graphs), the FP8 meta of every module (amax history, scales) is saved before
  warmup and put back after capture, and each callable runs inside
  ``te.autocast(enabled, calibrating, recipe, amax_reduction_group, _graph=True)``, which
  keeps the modules out of TE's global amax buffers while graphs are made. The TE modules a
  forward runs are recorded in the first warmup pass.
* **Each call** (outside the graphs, so inside the user's ``te.autocast``): the recorded
  modules' FP8 meta joins TE's global amax buffer, the first FP8 call of the autocast sets
  the weight-cache flag from ``is_first_microbatch`` (a device flag the captured weight
  casts read), its backward runs the backward amax reduction after its replay (one graph
  per device, ``fp8_reduction``, where it can be captured), and the
  forward reduction runs at the user's autocast exit, as in eager TE. A call inside an
  activation checkpoint (Megatron's full recompute around the layer graphs) keeps, under
  delayed scaling, TE's copy of the forward's scales, and its recompute replays with them
  in place, as TE's modules do eagerly.

The replay side is ``fp8_replay``; the modules' side ``modules``.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from .modules import te_pytorch

__all__ = ["FP8_ARGUMENTS", "FP8Options", "fp8_options", "FP8Capture"]


_DEPRECATED = {
    "fp8_enabled": "enabled",
    "fp8_calibrating": "calibrating",
    "fp8_recipe": "recipe",
    "fp8_group": "amax_reduction_group",
    "fp8_weight_caching": "cache_quantized_params",
}


FP8_ARGUMENTS = tuple(_DEPRECATED.values()) + tuple(_DEPRECATED)


@dataclass(frozen=True)
class FP8Options:
    """TE's FP8 arguments of one call, normalised (``enabled`` per callable)."""

    enabled: tuple[bool, ...]
    calibrating: bool = False
    recipe: Any = None
    amax_reduction_group: Any = None
    cache_quantized_params: bool = False

    @property
    def on(self) -> bool:
        return any(self.enabled)


def fp8_options(arguments: Mapping[str, Any], callables: Sequence[Callable]) -> FP8Options:
    """Normalise TE's FP8 arguments (checked before anything changes; TE imported only if
    FP8 is on)."""
    given = dict(arguments)
    for old, new in _DEPRECATED.items():
        if old not in given:
            continue
        value = given.pop(old)
        if value is None:
            continue
        if given.get(new) is not None:
            raise ValueError(
                f"make_graphed_callables: both {old}= (deprecated) and {new}= are set; pass "
                f"{new}= only."
            )
        warnings.warn(
            f"make_graphed_callables: {old}= is deprecated (as in Transformer Engine); use {new}=.",
            DeprecationWarning,
            stacklevel=3,
        )
        given[new] = value
    for name in ("calibrating", "cache_quantized_params"):
        if given.get(name) is not None and not isinstance(given[name], bool):
            raise TypeError(f"make_graphed_callables: {name} must be True or False, got {given[name]!r} "
                            f"({type(given[name]).__name__}).")
    enabled = given.get("enabled")
    if enabled is None:
        enabled = False
    if isinstance(enabled, bool):
        enabled = (enabled,) * len(callables)
    elif isinstance(enabled, (tuple, list)) and all(isinstance(e, bool) for e in enabled):
        if len(enabled) != len(callables):
            raise ValueError(
                f"make_graphed_callables: enabled= has {len(enabled)} entries for "
                f"{len(callables)} callables; give one bool, or one per callable."
            )
        enabled = tuple(enabled)
    else:
        raise TypeError(
            f"make_graphed_callables: enabled= must be a bool or a tuple of bools (one per "
            f"callable), got {enabled!r}."
        )
    if not any(enabled):
        return FP8Options(enabled=enabled)  # TE forces the recipe off too
    te_pytorch()
    for index, (c, on) in enumerate(zip(callables, enabled)):
        if on and not isinstance(c, torch.nn.Module):
            raise TypeError(
                f"make_graphed_callables: callable {index} is a {type(c).__name__} with FP8 "
                "enabled; FP8 capture needs modules (Transformer Engine's FP8 state lives in "
                "the modules, and each call registers it). Wrap it in an nn.Module."
            )
    from transformer_engine.pytorch.quantization import check_recipe_support, get_default_fp8_recipe  # noqa: PLC0415

    recipe = given.get("recipe")
    if recipe is None:
        recipe = get_default_fp8_recipe()  # TE's default for this GPU
    check_recipe_support(recipe)  # a recipe this GPU cannot run: TE's error, before any change
    return FP8Options(
        enabled=enabled,
        calibrating=bool(given.get("calibrating") or False),
        recipe=recipe,
        amax_reduction_group=given.get("amax_reduction_group"),
        cache_quantized_params=bool(given.get("cache_quantized_params") or False),
    )


# -- capture ------------------------------------------------------------------------------------
class FP8Capture:
    """TE's FP8 state across warmup and capture: the capture flag, the saved FP8 meta and
    the autocast each callable runs in."""

    def __init__(self, options: FP8Options, modules: Sequence[torch.nn.Module]):
        self.options = options
        self.modules = list(modules)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Around warmup and capture; everything is put back on exit, also on failure."""
        from transformer_engine.pytorch import graph as te_graph  # noqa: PLC0415
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: PLC0415

        te_graph.set_capture_start()
        saved = None
        try:
            saved = te_graph.save_fp8_tensors(self.modules, self.options.recipe)
            if self.options.cache_quantized_params:
                FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(False)
            yield
        finally:
            te_graph.restore_fp8_tensors(self.modules, saved)
            te_graph.set_capture_end()

    @contextlib.contextmanager
    def checkpoint_guard(self, name: str) -> Iterator[None]:
        """Around a callable's first warmup forward: with weight caching, refuse a forward
        that runs TE's LayerNormLinear or LayerNormMLP inside an activation checkpoint
        (TE's recompute region: ``te.distributed.checkpoint``, te_graph's checkpoint,
        megatron-core's ``CheckpointWithoutOutput``).

        Measured on an H100 (TE 2.20, te.TransformerLayer and te.LayerNormMLP, delayed and
        current scaling): from the second microbatch on such graphs part from eager TE. The
        checkpointed forward runs without grad and caches a rowwise-only FP8 weight; its
        recompute caches another with the columnwise copy, and the graphs do not replay that
        exchange as eager TE's Python runs it. A checkpoint around the graphed call
        (Megatron's full recompute) is exact, and so is one inside without weight caching."""
        if not self.options.cache_quantized_params:
            yield
            return
        from transformer_engine.pytorch import distributed  # noqa: PLC0415

        seen: list = []
        # The modules that cache a rowwise-only FP8 weight in a checkpointed forward (TE 2.20;
        # megatron-core's wrappers subclass them). TE's Linear and GroupedLinear cache the
        # columnwise copy there too (linear.py, grouped_linear.py: usage inside the recompute
        # region): nothing to exchange, and te.Linear was measured exact (delayed scaling,
        # 2 microbatches x 2 steps). Normalizations and attention cache no FP8 weight.
        te = te_pytorch()
        exchanging = (te.LayerNormLinear, te.LayerNormMLP)

        def record(module: torch.nn.Module, *_: Any) -> None:
            if (isinstance(module, exchanging) and distributed.is_fp8_activation_recompute_enabled()
                    and not distributed.in_fp8_activation_recompute_phase()):
                seen.append(module)

        handle = torch.nn.modules.module.register_module_forward_hook(record)
        try:
            yield
        finally:
            handle.remove()
        if seen:
            raise ValueError(
                f"make_graphed_callables: {name} runs Transformer Engine's {type(seen[0]).__name__} inside an "
                "activation checkpoint (te.distributed.checkpoint or checkpointing.checkpoint) with "
                "cache_quantized_params=True: its recompute caches other FP8 weights than its forward, which "
                "these graphs do not replay as eager TE does. Put the checkpoint around the graphed callable "
                "(as Megatron's full recompute does), or graph it with cache_quantized_params=False."
            )

    @staticmethod
    def recompute_stash() -> list:
        """What TE's recompute stash holds (TE 2.20 ``fp8_tensors_recompute_buffer``: per
        module, the scales each checkpointed forward pushed and its recompute pops), to put
        back where a forward's backward did not run (``te_graph.capture.backward_reads.probed_backward``): a push
        left there would hand every later recompute the scales of the forward before."""
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: PLC0415

        return [list(queue) for queue in FP8GlobalStateManager.quantization_state.fp8_tensors_recompute_buffer]

    @staticmethod
    def restore_recompute_stash(stash: list) -> None:
        """Put back what ``recompute_stash`` read; queues made since (a module's first
        checkpointed forward) are emptied, keeping the positions TE gave the modules."""
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: PLC0415

        for position, queue in enumerate(FP8GlobalStateManager.quantization_state.fp8_tensors_recompute_buffer):
            queue.clear()
            queue.extend(stash[position] if position < len(stash) else ())

    @contextlib.contextmanager
    def autocast(self, enabled: bool) -> Iterator[None]:
        """The context one callable's forward runs in while graphs are made."""
        te = te_pytorch()
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: PLC0415

        with te.autocast(
            enabled=enabled, calibrating=self.options.calibrating, recipe=self.options.recipe,
            amax_reduction_group=self.options.amax_reduction_group, _graph=True,
        ):
            # No module here is the autocast's "first FP8 module": te_graph decides that at
            # each call (FP8Replay) and runs the backward amax reduction itself. TE 2.20's
            # GroupedLinear, unlike its other modules, does not check is_graph_capturing()
            # before that reduction (grouped_linear.py, "reduce_and_update_bwd_fp8_tensors").
            # Not seen to change results on an H100 (tests/test_te_layers.py's GroupedLinear
            # rows, also graphed after an eager step); taking the flag here (the autocast
            # restores it on exit) keeps any module from acting on it.
            FP8GlobalStateManager.is_first_fp8_module()
            yield

