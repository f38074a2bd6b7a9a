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

Besides FP8: the TE modules a forward runs are found in the first warmup pass, and the
operation fusers of ``te.ops.Sequential`` built during warmup (which keep the parameters
they saw, the stand-ins) are dropped after capture, so that an eager call later rebuilds
them around the real parameters.

te_graph never imports TE at module import: only when FP8 is asked for, or when a
graphed module holds TE modules (already imported by the user, then).
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from .resources import RESOURCES

__all__ = [
    "FP8_ARGUMENTS", "FP8Options", "fp8_options", "te_modules_in", "FP8Capture", "fp8_replay",
    "NO_FP8", "accepts_is_first_microbatch", "is_te_module", "is_quantized_tensor", "forget_stand_in_caches", "visited_te_modules", "FP8Checks", "FP8Replay",
    "keeps_weight_cache",
]

_DEPRECATED = {
    "fp8_enabled": "enabled",
    "fp8_calibrating": "calibrating",
    "fp8_recipe": "recipe",
    "fp8_group": "amax_reduction_group",
    "fp8_weight_caching": "cache_quantized_params",
}
FP8_ARGUMENTS = tuple(_DEPRECATED.values()) + tuple(_DEPRECATED)


def _te() -> Any:
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


def _te_loaded() -> Optional[Any]:
    """``transformer_engine.pytorch`` if the process has imported it, else None (never
    imports it: a model without TE modules must not pay for or depend on TE)."""
    return sys.modules.get("transformer_engine.pytorch")


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
    _te()
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


def te_modules_in(module: Any) -> bool:
    """Whether ``module`` holds Transformer Engine modules (False without TE imported)."""
    te = _te_loaded()
    if te is None or not isinstance(module, torch.nn.Module):
        return False
    kinds = _te_kinds(te)
    return any(isinstance(m, kinds) for m in module.modules())


def is_te_module(module: Any) -> bool:
    """Whether ``module`` is one of Transformer Engine's modules (False without TE imported)."""
    te = _te_loaded()
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
    te = _te_loaded()
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


def accepts_is_first_microbatch(call: Callable) -> bool:
    """Whether a forward takes TE's ``is_first_microbatch`` keyword (TE modules do)."""
    try:
        return "is_first_microbatch" in inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False


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
        te = _te()
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
        back where a forward's backward did not run (``warmup._probed_backward``): a push
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
        te = _te()
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


@contextlib.contextmanager
def visited_te_modules(func: Any) -> Iterator[list]:
    """Inside: collects the TE modules a forward of ``func`` runs (``func`` itself when it
    is one: te_graph calls its forward directly), as TE records them."""
    te = _te_loaded()
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


# -- replay -------------------------------------------------------------------------------------
class _NoFP8:
    """A graph without TE modules: nothing to do around its replays."""

    @staticmethod
    def before_forward(name: str, is_first_microbatch: Any) -> bool:
        return False

    @staticmethod
    def before_replay() -> None:
        pass

    @staticmethod
    def after_forward() -> None:
        pass

    @staticmethod
    def after_backward(first: bool) -> None:
        pass


NO_FP8 = _NoFP8()


class _NotFP8(_NoFP8):
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


class FP8Checks(_NoFP8):
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


def keeps_weight_cache(modules: Sequence[Any]) -> bool:
    """Whether TE may reuse these modules' FP8 weights after a step's first microbatch: not
    where one is megatron-core's TE wrapper built with ``disable_parameter_transpose_cache``,
    which passes ``is_first_microbatch=None`` to TE, so that TE quantizes at every call."""
    return not any(getattr(m, "disable_parameter_transpose_cache", False) for m in modules)


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
            RESOURCES.backward_amax_reduction().run(self.state)


def fp8_replay(enabled: bool, options: FP8Options, modules: Sequence[Any], has_te: bool, graphs: bool) -> Any:
    """What a runner does around each call: for an FP8 graph ``FP8Replay`` (its eager-replay
    mirror only checks: the real modules do TE's bookkeeping themselves), the FP8-autocast
    guard of a TE graph without FP8, or ``NO_FP8``."""
    if enabled and options.on:
        return FP8Replay(modules, options) if graphs else FP8Checks(options)
    return _NotFP8() if has_te else NO_FP8
