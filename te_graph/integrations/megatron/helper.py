"""megatron-core's own CUDA-graph path with te_graph as the graph maker, and what the
engine asks of megatron-core's layers through the seam (``Megatron`` in this package).

Megatron-LM users turn per-layer graphs on with ``--cuda-graph-impl transformer_engine``;
megatron-core's ``TECudaGraphHelper`` (``megatron/core/transformer/cuda_graphs.py``) then
calls ``make_graphed_callables`` (Transformer Engine's, through a module-level name) with
one entry per (layer, microbatch), and replays ``layer.cuda_graphs[mb](...)``.
:func:`enable` makes that name te_graph's, and Megatron's checkpoint te_graph's
(``checkpointing.checkpoint``, whose recompute draws the forward's exact dropout masks,
also inside graphs); :func:`disable` puts both back. Nothing of Megatron is edited.

What ``make_graphed_callables`` itself does for this path (no adapter needed):

* the RNG tracker is found without being told (``rng.process_tracker``);
* a layer is captured the way Megatron routes it while its capture flag is set
  (:func:`capture_entry`: ``GraphableMegatronModule._te_cuda_graph_capture``);
* Megatron's replay keywords, mostly ``None``, are accepted where the layer's ``forward``
  defaults them to ``None`` (``te_graph.layout.InputLayout``);
* ``main_grad`` and gradient-accumulation fusion (Transformer Engine modules built with
  ``fuse_wgrad_accumulation=True``) are replayed as TE's Python does them (``te_graph.grads``,
  ``te_graph.capture.parameters.StandIns.scratch_main_grads``);
* the forward pre-hooks Megatron's DDP puts on submodules, which the helper runs by hand
  before each replay (``cuda_graph_set_manual_hooks``), pass the per-call check
  (:func:`hooks_run_by_hand`).

Megatron refuses full recompute with per-layer graphs because its own checkpoint restores
RNG states by reference, so its recompute draws other dropout masks. With :func:`enable`,
recompute is exact; Megatron's config check still runs when its ``TransformerConfig`` is
made, so set ``recompute_granularity="full"`` (with ``recompute_method`` and
``recompute_num_layers``) on the config after constructing it (docs/migration.md).
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional

import torch

from checkpointing import checkpoint as exact

from ...api import make_graphed_callables

__all__ = ["enable", "disable", "enabled", "routes_capture", "capture_entry", "manual_hooks", "hooks_run_by_hand",
           "modules_run_by_hand", "scope_names", "submodules_run_eagerly", "checkpoint", "te_checkpoint"]

_CUDA_GRAPHS = "megatron.core.transformer.cuda_graphs"
# (module, attribute) pairs enable() replaces, with what it puts there.
_PATCHES: dict[tuple[str, str], Any] = {}


def _loaded(name: str) -> Optional[Any]:
    return sys.modules.get(name)


def capturing() -> bool:
    """Whether megatron-core's capture flag is set (its helper sets it around capture)."""
    graphs = _loaded(_CUDA_GRAPHS)
    return graphs is not None and bool(graphs.is_graph_capturing())


def routes_capture(module: torch.nn.Module) -> bool:
    """Whether a megatron-core layer's ``__call__`` routes to its captured part now (its
    helper's capture flag is set): its graphs are then replayed from that ``__call__``,
    without ``nn.Module.__call__`` (:func:`capture_entry`)."""
    return hasattr(module, "_te_cuda_graph_capture") and capturing()


def capture_entry(module: torch.nn.Module) -> Optional[Callable]:
    """What a megatron-core layer's ``__call__`` runs while Megatron's capture flag is set
    (``GraphableMegatronModule._te_cuda_graph_capture``: the layer's captured part, returning
    ``(hidden_states,)`` or, for a partial scope, the tensors the rest of the layer resumes
    from), or None where that does not apply. Calling that function rather than ``__call__``
    keeps eager replay from routing a call back to the replay.

    The function returned sets Megatron's capture flag while it runs, where it is not set
    already: the code a graph holds ran under that flag (MoE layers return early after the
    router or the dispatch preprocessing when ``cuda_graph_modules`` says so; DDP's pre-hooks
    step aside), so eager replay, which runs the function at every call, must run it
    under the flag too to take the same path."""
    if not routes_capture(module):
        return None
    route = module._te_cuda_graph_capture

    @functools.wraps(route)
    def as_captured(*args: Any, **kwargs: Any) -> Any:
        if capturing():
            return route(*args, **kwargs)
        graphs = _loaded(_CUDA_GRAPHS)
        graphs._set_capture_start()
        try:
            return route(*args, **kwargs)
        finally:
            graphs._set_capture_end()

    return as_captured


def hooks_run_by_hand(layer: torch.nn.Module) -> frozenset:
    """The code of the forward pre-hooks megatron-core's DDP puts on ``layer``'s submodules
    (``overlap_param_gather``), as its helper's ``cuda_graph_manual_hooks`` holds them, or
    nothing where the helper runs none by hand. Such hooks may come and go after graphing;
    the per-call check (``te_graph.guards.frozen``) accepts them

    * on a submodule the helper runs them for before each replay (:func:`modules_run_by_hand`:
      megatron-core's ``setup_manual_hooks`` lists the submodules with parameters of their
      own under the graph's scopes);
    * on a submodule without parameters of its own, where they do nothing (they wait for
      those parameters' all-gather);

    and where hooks run eagerly anyway (:func:`submodules_run_eagerly`). On any other
    submodule with parameters they would be skipped, and are refused. Hooks are told apart
    by their code: DDP makes one closure per submodule from one factory. Megatron-LM turns
    them off and on around evaluation and checkpoints."""
    return frozenset(getattr(hook, "__code__", None) for hook, _ in manual_hooks(layer) or ()) - {None}


def modules_run_by_hand(layer: torch.nn.Module) -> frozenset:
    """The ids of the modules whose DDP forward pre-hooks the helper runs by hand before each
    replay of ``layer`` (the arguments of its ``cuda_graph_manual_hooks``)."""
    return frozenset(id(m) for _, args in manual_hooks(layer) or () for m in args if isinstance(m, torch.nn.Module))


def manual_hooks(layer: torch.nn.Module) -> Optional[list]:
    """The list object of ``(hook, args)`` megatron-core's helper runs by hand before each
    replay of ``layer`` (``cuda_graph_manual_hooks``), or None. The helper assigns a new list
    when it sets them up or deletes the graphs, so the object and its length tell a cheap
    per-call check whether :func:`hooks_run_by_hand` may have changed."""
    return getattr(layer, "cuda_graph_manual_hooks", None)


def scope_names(config: Any) -> set:
    """The names of a config's ``cuda_graph_modules`` (megatron-core's ``CudaGraphModule``
    members or their names as strings): ``{"attn", "moe_router", ...}``."""
    return {str(scope).rsplit(".", 1)[-1] for scope in getattr(config, "cuda_graph_modules", None) or ()}


def submodules_run_eagerly(layer: torch.nn.Module) -> frozenset:
    """The qualified names of the submodules of a megatron-core ``TransformerLayer`` graphed
    through its helper's scopes (``cuda_graph_modules``) that its graphs never run: they run
    eagerly before or after the replay, so hooks on them run as in eager. As megatron-core
    0.19's ``_te_cuda_graph_capture`` and ``_te_cuda_graph_replay`` split the layer: without
    the ``attn`` scope the attention side (layernorm, attention, their bias-dropout-adds);
    with an MoE layer's ``moe_router`` scope its routed experts (the router, with
    ``moe_preprocess`` the dispatch preprocessing, and non-overlapped shared experts are in
    the graph); with no MLP scope
    the MLP side. Empty where the whole layer is graphed or the layer is not megatron-core's.
    Only what is named here is exempt, and only its hooks (a change of its mode or
    parameters is still refused): a module that also runs eagerly but is not named (the
    MLP's bias-dropout-add module built as a module) is refused rather than risked."""
    scopes = scope_names(getattr(layer, "config", None))
    if not scopes or not hasattr(layer, "_te_cuda_graph_capture") or not hasattr(layer, "mlp"):
        return frozenset()
    moe = bool(getattr(layer, "is_moe_layer", False))
    roots = []
    if "attn" not in scopes:
        roots += ["input_layernorm", "self_attention", "self_attn_bda", "pre_cross_attn_layernorm", "cross_attention",
                  "cross_attn_bda"]
    if moe and "moe_router" in scopes and "moe" not in scopes:
        # The routed experts and the latent up-projection after them (postprocess); without the
        # moe_preprocess scope the preprocessing too: the latent down-projection, and shared
        # experts overlapped with the dispatch (their communication starts there).
        roots += ["mlp.experts", "mlp.fc2_latent_proj"]
        if "moe_preprocess" not in scopes:
            roots.append("mlp.fc1_latent_proj")
            if getattr(layer.config, "moe_shared_expert_overlap", False):
                roots.append("mlp.shared_experts")
    elif not (("mlp" in scopes and not moe) or (moe and ({"moe", "moe_router"} & scopes))):
        roots += ["pre_mlp_layernorm", "mlp", "mlp_bda"]
    return frozenset(name for name, _ in layer.named_modules()
                     if any(name == root or name.startswith(root + ".") for root in roots))


def checkpoint(function: Callable, distribute_saved_activations: bool, *args: Any) -> Any:
    """megatron-core's ``tensor_parallel.checkpoint`` (its argument order) as te_graph's
    checkpoint: exact dropout masks in the recompute, inside graphs too, with Megatron's RNG
    tracker and tensor-parallel group."""
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # noqa: PLC0415

    group = parallel_state.get_tensor_model_parallel_group() if distribute_saved_activations else None
    return exact(function, *args, distribute_saved_activations=distribute_saved_activations,
                 get_rng_state_tracker=get_cuda_rng_tracker, tp_group=group)


def te_checkpoint(forward_func: Callable, distribute_saved_activations: bool, get_rng_state_tracker: Callable,
                  tp_group: Any, *args: Any, **kwargs: Any) -> Any:
    """megatron-core's ``te_checkpoint`` (used under FP8) as te_graph's checkpoint."""

    return exact(forward_func, *args, distribute_saved_activations=distribute_saved_activations,
                 get_rng_state_tracker=get_rng_state_tracker, tp_group=tp_group, **kwargs)


def enable(recompute: bool = True) -> None:
    """Make megatron-core's helper graph with te_graph, and (``recompute``) Megatron's
    checkpoints recompute exactly. Call after importing megatron-core, before
    ``TECudaGraphHelper.create_cudagraphs()``; :func:`disable` undoes it."""
    if not isinstance(recompute, bool):
        raise TypeError(f"te_graph.integrations.megatron.enable(): recompute must be True or False, got "
                        f"{recompute!r} ({type(recompute).__name__}).")
    try:
        import megatron.core.tensor_parallel  # noqa: F401, PLC0415
        import megatron.core.transformer.cuda_graphs  # noqa: F401, PLC0415
    except ImportError as error:
        raise RuntimeError(f"te_graph.integrations.megatron.enable(): megatron-core does not import ({error}); "
                           "install it (pip install megatron-core) in the environment that trains.") from error
    _patch(_CUDA_GRAPHS, "make_graphed_callables", make_graphed_callables)
    if recompute:
        _patch("megatron.core.tensor_parallel", "checkpoint", checkpoint)
        _patch("megatron.core.tensor_parallel.random", "checkpoint", checkpoint)
        for name in ("megatron.core.recompute", "megatron.core.extensions.transformer_engine"):
            if _loaded(name) is not None and hasattr(_loaded(name), "te_checkpoint"):
                _patch(name, "te_checkpoint", te_checkpoint)


def disable() -> None:
    """Put back everything :func:`enable` replaced."""
    for (name, attribute), original in list(_PATCHES.items()):
        module = _loaded(name)
        if module is not None:
            setattr(module, attribute, original)
        del _PATCHES[(name, attribute)]


def enabled() -> bool:
    graphs = _loaded(_CUDA_GRAPHS)
    return graphs is not None and getattr(graphs, "make_graphed_callables", None) is make_graphed_callables


def _patch(name: str, attribute: str, value: Any) -> None:
    module = sys.modules[name]
    key = (name, attribute)
    if key not in _PATCHES:
        _PATCHES[key] = getattr(module, attribute, None)
    setattr(module, attribute, value)
