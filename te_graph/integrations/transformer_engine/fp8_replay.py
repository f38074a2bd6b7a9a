"""Transformer Engine's FP8 bookkeeping around each replay, outside the graphs (TE 2.20
``graph.py``, ``quantization.py``): the checks a call must pass, the registration of the
modules' FP8 meta in TE's global amax buffer, the weight-cache flag of an autocast's first
FP8 call, the recompute copies of the forward's scales, and the backward amax reduction
after the first call's backward (``fp8_reduction``)."""
from __future__ import annotations

from typing import Any, Sequence

from ...extension import NO_REPLAY_STEPS, ReplaySteps
from ...resources import RESOURCES
from .fp8 import FP8Options
from .fp8_reduction import BackwardAmaxReduction
from .modules import keeps_weight_cache

__all__ = ["FP8Checks", "FP8Replay", "backward_amax_reduction", "fp8_replay"]


class _NotFP8(ReplaySteps):
    """A graph of TE modules captured without FP8: refuses a call inside an FP8 autocast,
    where eager TE would run FP8 kernels and the graph would not."""

    def __init__(self):
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: PLC0415

        self.fp8_enabled = FP8GlobalStateManager.is_fp8_enabled  # read at every call

    def before_forward(self, name: str, is_first_microbatch: Any) -> bool:
        if self.fp8_enabled():
            raise RuntimeError(
                f"{name}: called inside an FP8 te.autocast, but it was graphed without FP8 "
                "(its graphs run the kernels they captured, not FP8 ones). Graph it with "
                "enabled=True and the recipe, or call it outside the FP8 autocast."
            )
        return False


class FP8Checks(ReplaySteps):
    """A call of an FP8 graph (or of its eager-replay mirror) is refused where eager TE and
    the graph would part: outside ``te.autocast``, under another recipe, or without
    ``is_first_microbatch`` when the weight cache is on."""

    def __init__(self, options: FP8Options):
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: PLC0415

        self.state = FP8GlobalStateManager
        self.recipe = options.recipe
        self.caching = options.cache_quantized_params

    def before_forward(self, name: str, is_first_microbatch: Any) -> bool:
        self._check(name, is_first_microbatch)
        return False

    def _check(self, name: str, is_first_microbatch: Any) -> Any:
        state = self.state
        if not state.is_fp8_enabled():
            raise RuntimeError(
                f"{name}: graphed with FP8 but called outside te.autocast(enabled=True, "
                "recipe=...); its graphs run FP8 kernels whose scales the autocast keeps up "
                "to date. Call it inside the autocast, as the eager layer would be."
            )
        recipe = state.get_fp8_recipe()
        if recipe is not self.recipe and recipe != self.recipe:
            raise RuntimeError(
                f"{name}: called under te.autocast with recipe {recipe!r}, but its graphs were "
                f"captured with {self.recipe!r}; a graph replays the captured recipe's kernels. "
                "Graph it again with this recipe, or call it under the captured one."
            )
        if self.caching and not isinstance(is_first_microbatch, bool):
            raise ValueError(
                f"{name}: graphed with cache_quantized_params=True, so each call needs the "
                "is_first_microbatch=True/False keyword (it decides whether the weights are "
                "quantized again, as in eager Transformer Engine)."
            )
        return recipe


class FP8Replay(FP8Checks):
    """Around each replay of an FP8 graph: TE's bookkeeping outside the graphs."""

    def __init__(self, modules: Sequence[Any], options: FP8Options):
        super().__init__(options)
        # With weight caching the captured casts read TE's "skip the weight update" flag,
        # which the first call of each autocast sets from is_first_microbatch, as eager TE
        # does; where the modules keep no cache, eager TE quantizes at every call, and so
        # do the replays (the flag set False), whatever the keyword says.
        self.reuses_weights = keeps_weight_cache(modules)
        from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention  # noqa: PLC0415
        from transformer_engine.pytorch.ops.op import BasicOperation  # noqa: PLC0415

        self.metas: list[dict] = []  # FP8 meta dicts to register at each call
        self.attention_metas: list[dict] = []  # DotProductAttention's: only with fp8_mha/fp8_dpa
        for m in modules:
            if isinstance(m, BasicOperation):
                self.metas.extend(m._fp8_metas[mode] for mode in ("forward", "backward") if m.num_quantizers(mode))
            elif isinstance(m, DotProductAttention):
                self.attention_metas.append(m.fp8_meta)
            else:
                self.metas.append(m.fp8_meta)
        # Under an activation recompute, TE's modules (not its fusible operations) keep a copy
        # of their forward scales and amax history when the checkpointed forward runs, put it
        # in place for the recompute and the live one back after (TE 2.20 base.py,
        # prepare_forward and end_forward): the recompute quantizes as the forward did and
        # leaves the history alone. That is Python a replay does not run; before_replay and
        # after_forward do it around the replay (for a checkpoint around the graphed call,
        # Megatron's full recompute: a checkpoint inside the graphed module was captured with it).
        self.recompute_metas = [m.fp8_meta for m in modules if not isinstance(m, BasicOperation)
                                and "scaling_fwd" in getattr(m, "fp8_meta", {})]
        # Only delayed scaling (built in, or asked for by a custom recipe) keeps amaxes in TE's
        # global buffers; under another recipe TE's registration returns at once, each call.
        recipe = options.recipe
        if not (getattr(recipe, "delayed", lambda: True)() or getattr(recipe, "custom", lambda: False)()):
            self.metas, self.attention_metas, self.recompute_metas = [], [], []
        from transformer_engine.pytorch import distributed  # noqa: PLC0415

        self.recompute_region = distributed.is_fp8_activation_recompute_enabled  # read at every call
        self.recompute_phase = distributed.in_fp8_activation_recompute_phase

    def before_forward(self, name: str, is_first_microbatch: Any) -> bool:
        """Checks and registration before a forward replay; whether this call is the first
        FP8 call of its autocast (its backward then runs the backward reduction)."""
        recipe = self._check(name, is_first_microbatch)
        state = self.state
        group = state.get_fp8_group()
        fp8_attention = getattr(recipe, "fp8_mha", False) or getattr(recipe, "fp8_dpa", False)
        registered = state.get_buffer_info()
        for meta in self.metas + self.attention_metas if fp8_attention else self.metas:
            meta["fp8_group"] = group
            meta["recipe"] = recipe
            if registered not in meta:  # TE's own test, without its call: once per module
                state.add_fp8_tensors_to_global_buffer(meta)
        first = state.is_first_fp8_module()
        if first and self.caching:
            state.set_skip_fp8_weight_update_tensor(self.reuses_weights and not is_first_microbatch)
        return first

    def before_replay(self) -> None:
        """Right before the forward replay, after every check of the call (nothing may
        refuse it between this and after_forward): in TE's recompute region, a copy of the
        forward's scales for the recompute; in its recompute phase, those scales in place."""
        if self.recompute_metas and self.recompute_phase():
            for meta in self.recompute_metas:  # the forward's scales in place (after_forward undoes it)
                self.state.get_old_fp8_meta_tensors_for_recompute(meta)
        elif self.recompute_metas and self.recompute_region():
            for meta in self.recompute_metas:  # a copy of the scales for the recompute (two copy kernels each)
                self.state.copy_forward_fp8_meta_tensors_for_recompute(meta)

    def after_forward(self) -> None:
        """After a forward replay in TE's recompute phase: the live scales and amax history
        back in place (the replay's amaxes went to the forward's copy, as in eager TE)."""
        if self.recompute_metas and self.recompute_phase():
            for meta in self.recompute_metas:
                self.state.restore_fp8_meta_tensors(meta)

    def after_backward(self, first: bool) -> None:
        """After the backward replay of an autocast's first FP8 call: the backward amax
        reduction (eager TE runs it at the end of the first FP8 module's backward), replayed
        as a graph where it can be (``fp8_reduction``)."""
        if first:
            backward_amax_reduction().run(self.state)


def backward_amax_reduction() -> BackwardAmaxReduction:
    """The current device's backward amax reduction graph (one per device, owned by
    ``RESOURCES``, reset at teardown)."""
    return RESOURCES.per_device("transformer_engine.backward_amax_reduction",
                                lambda: BackwardAmaxReduction(RESOURCES.capture_stream()))


def fp8_replay(enabled: bool, options: FP8Options, modules: Sequence[Any], framework_modules: bool, graphs: bool) -> Any:
    """What a runner does around each call: for an FP8 graph ``FP8Replay`` (its eager-replay
    mirror only checks: the real modules do TE's bookkeeping themselves), the FP8-autocast
    guard of a TE graph without FP8, or nothing (``NO_REPLAY_STEPS``)."""
    if enabled and options.on:
        return FP8Replay(modules, options) if graphs else FP8Checks(options)
    return _NotFP8() if framework_modules else NO_REPLAY_STEPS

