"""The hooks of a graphed module: which run outside its graphs (and are neither refused at
graphing nor watched after), and how the per-call check tells a hook table unchanged."""
from __future__ import annotations

import itertools
import operator

import torch

from ..extension import SEAM

__all__ = ["HOOK_KINDS", "hooks_outside_graphs", "global_hooks_run_at_capture_only", "SUBMODULE_HOOKS",
           "ROUTED_SUBMODULE_HOOKS", "ROUTED_HOOKS", "same_objects", "leaving_out"]


def hooks_outside_graphs(module: torch.nn.Module, routed: bool) -> frozenset:
    """The submodules (qualified names) of a graphed module whose own hooks run outside its
    graphs, never inside them, so that they are neither refused at graphing nor watched after:

    * those its class declares in ``_hooks_run_around``: ``integrations.megatron.moe_experts`` graphs
      a program around an experts module that megatron-core calls through
      ``nn.Module.__call__``, which replays the graphs (its submodules' hooks are watched);
    * of a megatron-core layer graphed through its helper's scopes (``routed``), those the
      graphs never run, which run eagerly after the replay
      (``Extension.submodules_run_eagerly``)."""
    declared = frozenset(getattr(module, "_hooks_run_around", ()))
    return declared | SEAM.submodules_run_eagerly(module) if routed else declared


def global_hooks_run_at_capture_only(module: torch.nn.Module, routed: bool) -> bool:
    """Whether hooks for every module (``torch.nn.modules.module.register_module_*``) would
    run for a graphed module only while its graphs are captured: for its submodules, and for
    a megatron-core layer (``routed``) not even around its replays. Around a module without
    submodules, called through ``nn.Module.__call__``, they run as in eager: refused at
    graphing (``checks.check_modules``) and watched after only where this holds."""
    return routed or next(itertools.islice(module.modules(), 1, None), None) is not None


SUBMODULE_HOOKS = ("hooks on a submodule run only while a graph is captured, never at replay (hooks on the "
                    "graphed module itself run around the graphed forward)")


ROUTED_SUBMODULE_HOOKS = ("hooks on a submodule the layer's graphs run are run only while the graphs are captured, "
                           "never at replay")


STEP_HOOKS = ("a step's graph replays the module hooks that ran while it was captured, and only those: graph the "
              "step again after adding or removing one")


ROUTED_HOOKS = ("megatron-core's __call__ replays this layer's graphs without nn.Module.__call__, so hooks on the "
                 "layer itself never run at replay, while an eager run would run them; remove the hook (a hook "
                 "that must run belongs outside the graphed layer, on the module that calls it)")


def same_objects(a: tuple, b: tuple) -> bool:
    """The same objects, in order (identity: a hook's ``__eq__`` is its own business)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def leaving_out(hooks: tuple, codes: frozenset) -> tuple:
    return tuple(h for h in hooks if getattr(h, "__code__", None) not in codes)


HOOK_KINDS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

