"""Every use of a torch private or a version-dependent path in ``te_graph``, in one place.

Each entry says which torch versions it is for and which upstream issue or pull request
would let it go, so it can be removed when the minimum torch moves. Nothing else in
``te_graph`` reaches into torch privates but ``capture/conditional/runtime.py``, whose
allocator routing of conditional-node bodies into the graph's pool (torch 2.4-2.13,
pytorch/pytorch#168912) sits beside the driver calls it pairs with. (``rng`` keeps its own one version switch,
``rng.generator_registration_required``, for torch 2.14's lazy generator registration,
pytorch/pytorch#176753; ``checkpointing`` uses ``torch.autograd._is_checkpoint_valid`` and
``torch._assert_async``, documented where they are called.)
"""
from __future__ import annotations

import contextlib
import operator
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.utils.dlpack
from torch.nn.modules import module as _nn_module
from torch.utils._python_dispatch import TorchDispatchMode

import rng

from .device_ops import draws_random, is_view, unannotated_writes, written_tensors  # noqa: F401
from .engine import (  # noqa: F401  (the autograd engine's privates, in a module of their own)
    accumulate_grad_node,
    after_this_backward,
    engine_asks_for,
    engine_captures,
    engine_will_execute,
    graph_task_id,
    in_backward,
    is_accumulate_grad,
    saved_tensor_hooks,
    saved_tensor_hooks_off,
)

__all__ = [
    "direct_apply",
    "functorch_active",
    "backward_node_class",
    "ddp_forward_active",
    "register_generators",
    "end_generator_capture",
    "weak_alias",
    "owning_alias",
    "tensor_hooks",
    "post_accumulate_hooks",
    "HAS_POST_ACCUMULATE_HOOKS",
    "module_hook_dicts",
    "MODULE_INTERNALS",
    "parameter_slots",
    "buffer_slots",
    "zero_",
    "version_of",
    "bump_version",
    "is_saved_version_error",
    "is_inplace_refusal",
    "view_update_refused",
    "is_fake",
    "numerics_settings",
    "NUMERICS_SETTINGS",
    "sdpa_settings",
    "SDPA_BACKENDS",
    "saved_tensor_hooks",
    "saved_tensor_hooks_off",
    "TorchDispatchMode",
    "draws_random",
    "is_view",
    "written_tensors",
    "unannotated_writes",
    "global_module_hook_dicts",
    "accumulate_grad_node",
    "is_accumulate_grad",
    "engine_will_execute",
    "engine_asks_for",
    "engine_captures",
    "after_this_backward",
    "graph_task_id",
    "in_backward",
    "CAN_POISON",
    "poison_storage",
    "poison_tensor",
    "use_count",
]


# -- autograd.Function.apply without the functorch wrapper ----------------------------------
# torch 2.4-2.13: Function.apply is a Python wrapper that unwraps dead functorch wrappers of
# every argument on every call (microseconds per graphed layer; pytorch/pytorch#189573, being
# moved into C++ by #179332 and #190694). With no functorch transform active, the C
# implementation underneath is what runs anyway, so it is called directly. Where the class
# layout differs (the private `_SingleLevelFunction` is gone), the public apply is used.
def direct_apply(function: type) -> Callable[..., Any]:
    """``function``'s C-level apply, to call when ``functorch_active()`` is False (the
    public ``apply`` where torch's class layout differs)."""
    single_level = getattr(torch.autograd.function, "_SingleLevelFunction", None)
    if single_level is None or not issubclass(function, single_level):
        return function.apply
    return super(single_level, function).apply


functorch_active: Callable[[], bool] = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def backward_node_class(function: type) -> type:
    """The autograd node class of a custom Function's calls (``Function._backward_cls``,
    private but unchanged since torch 1.x; torch has no public way to tell a node's
    Function). te_graph uses it to recognise a graphed call in a tensor's ``grad_fn``."""
    return function._backward_cls


# -- DDP ------------------------------------------------------------------------------------
try:  # torch built without distributed has no DDP
    from torch.nn.parallel import DistributedDataParallel as _DDP
except ImportError:  # pragma: no cover
    _DDP = None


def ddp_forward_active() -> bool:
    """True inside the forward of a ``DistributedDataParallel`` module.

    Reads DDP's private class attribute ``_active_ddp_module`` (torch >= 1.13, added for
    TorchDynamo's DDP optimizer, pytorch/torchdynamo#628); absent, DDP is not detected and
    the gradients of a graphed layer under DDP would skip its reducer hooks, so the
    attribute's presence is checked by tests/test_multi_gpu.py's DDP rows.
    """
    return _DDP is not None and getattr(_DDP, "_active_ddp_module", None) is not None


# -- generators and capture -----------------------------------------------------------------
def register_generators(graph: Any, generators: Sequence[torch.Generator]) -> None:
    """Register the generators a capture draws from (torch 2.4-2.13 need it; torch 2.14
    registers lazily and warns on the call, pytorch/pytorch#176753)."""
    if generators and rng.generator_registration_required():
        for generator in generators:
            graph.register_generator_state(generator)


def end_generator_capture(generators: Sequence[torch.Generator]) -> None:
    """Take generators out of capture mode after a failed capture.

    When ``capture_end`` fails (or is never reached), torch (checked on 2.11) skips the
    capture epilogue of every generator the graph registered, and every later random draw
    on them fails (pytorch/pytorch#171263; #171265 moves the cleanup into
    ``CUDAGraph::reset``). An empty capture registering the same generators runs it.
    """
    graph = torch.cuda.CUDAGraph()
    register_generators(graph, generators)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
        graph.capture_begin(capture_error_mode="thread_local")
        graph.capture_end()


# -- memory ---------------------------------------------------------------------------------
def weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``t``'s memory without keeping it allocated (the allocator may hand
    the memory to later allocations; the alias sees whatever is written there). Only for
    te_graph's own buffers, never handed out: see ``owning_alias``.

    Uses ``torch._C._construct_storage_from_data_pointer``, private, as torch's own CUDA
    graph trees do (torch/_inductor/cudagraph_trees.py) for the same purpose; torch has no
    public non-owning storage.
    """
    storage = torch._C._construct_storage_from_data_pointer(
        t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes()
    )
    return _on_storage(t, storage)


def owning_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``t``'s memory through a storage of its own that keeps ``t``'s
    storage allocated while any tensor on it lives: poisoning it (``poison_storage``) leaves
    ``t`` readable, and it stays valid memory after ``t``'s owner (a graph) is freed.

    The storage comes from a DLPack round trip (public API): the capsule holds a reference
    to ``t``'s storage and the imported storage releases it when it dies. The storage is
    exported as bytes, so every dtype (float8 included) takes the same path.
    """
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return t.detach()
    as_bytes = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    imported = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(as_bytes))
    return _on_storage(t, imported.untyped_storage())


def _on_storage(t: torch.Tensor, storage: Any) -> torch.Tensor:
    """``t``'s dtype, layout and ``requires_grad`` on ``storage``."""
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    alias.set_(storage, t.storage_offset(), t.shape, t.stride())
    return alias.requires_grad_(t.requires_grad)


def zero_(tensors: Sequence[torch.Tensor]) -> None:
    """Zero several tensors in one launch (``torch._foreach_zero_``, as torch.optim does)."""
    if tensors:
        torch._foreach_zero_(list(tensors))


# In-place updates are tracked by each tensor's version counter (``Tensor._version``,
# private, unchanged since torch 1.x; autograd's saved-tensor checks read it). A graph replay
# updates memory without bumping it, so te_graph bumps it where eager code would have
# (``torch.autograd.graph.increment_version``, public since torch 2.1).
version_of = operator.attrgetter("_version")
bump_version: Callable[[torch.Tensor], None] = torch.autograd.graph.increment_version


def is_saved_version_error(error: BaseException) -> bool:
    """Whether ``error`` is autograd's refusal to use a saved tensor whose version counter
    moved after it was saved (its message since torch 1.x: "one of the variables needed for
    gradient computation has been modified by an inplace operation")."""
    return isinstance(error, RuntimeError) and "modified by an inplace operation" in str(error)


# A view's creation meta (``torch._C._autograd._get_creation_meta``, private, torch >= 1.10;
# torch/_subclasses/meta_utils.py reads it): anything but DEFAULT (a view a custom Function
# returned, one output of a multi-output view op, a view made under no_grad) is a view whose
# in-place update eager autograd refuses. Where torch lacks it, no view counts as such.
_creation_meta = getattr(torch._C._autograd, "_get_creation_meta", None)
_CREATION_DEFAULT = getattr(getattr(torch._C._autograd, "CreationMeta", None), "DEFAULT", None)


def view_update_refused(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view whose in-place update eager autograd refuses (``_creation_meta``)."""
    return _creation_meta is not None and t._is_view() and _creation_meta(t) != _CREATION_DEFAULT


def is_inplace_refusal(error: BaseException) -> bool:
    """Whether ``error`` is autograd refusing a tensor updated in place: a saved one
    (``is_saved_version_error``), or a view a custom Function returned, whose base changed
    ("... is a view and its base or another view of its base has been modified inplace",
    raised where autograd would rebase the view's custom backward)."""
    return is_saved_version_error(error) or (isinstance(error, RuntimeError) and "has been modified inplace" in str(error))


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.compile`` trace's fake tensor (``FakeTensor``, private,
    torch >= 2.0), which lives in compile caches and stands for no real memory."""
    return isinstance(t, _FAKE_TENSOR)


try:
    from torch._subclasses.fake_tensor import FakeTensor as _FAKE_TENSOR
except ImportError:  # pragma: no cover - a torch without it has no fake tensors to skip
    _FAKE_TENSOR = ()


# -- hooks, parameters and buffers ----------------------------------------------------------
# Tensors keep their hooks in private dicts (``_backward_hooks``, torch 1.x on;
# ``_post_accumulate_grad_hooks``, torch >= 2.1); torch has no public "has hooks" query.
# Read on the hot path, so they are attribute getters (C-level reads).
tensor_hooks = operator.attrgetter("_backward_hooks")
post_accumulate_hooks = operator.attrgetter("_post_accumulate_grad_hooks")
HAS_POST_ACCUMULATE_HOOKS = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


def hook_handles_made() -> int:
    """How many hook handles the process has made: every hook registration (a module's, a
    tensor's, a gradient accumulator's) takes the next id of torch's one counter
    (``torch.utils.hooks.RemovableHandle.next_id``, a class attribute since torch 1.x), so an
    unmoved counter means no hook was registered since. Where the counter is missing, -1."""
    return getattr(torch.utils.hooks.RemovableHandle, "next_id", -1)


# nn.Module's own bookkeeping attributes (hook dicts, flags), read off a fresh module:
# ``training`` is compared separately where it matters.
MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) - {"training"}

_MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def module_hook_dicts(module: torch.nn.Module) -> list[str]:
    """The kinds of hook registered on ``module`` (nn.Module's private hook dicts)."""
    return [kind for kind in _MODULE_HOOK_DICTS if getattr(module, kind, None)]


def parameter_slots(module: torch.nn.Module) -> dict:
    """``module._parameters``: the dict to swap a parameter in without ``__setattr__``
    (which refuses a plain tensor and runs registration hooks)."""
    return module._parameters


def buffer_slots(module: torch.nn.Module) -> dict:
    """``module._buffers``: the dict holding the module's own buffers."""
    return module._buffers


# -- numerics settings a graph's kernels were chosen under ----------------------------------
# Read at every call of a graphed callable (``frozen.Settings``), so through torch's C getters
# (``torch._C._get_*``, private but stable since torch 1.x; the public ``torch.backends``
# properties wrap them at several times the cost). A getter this torch lacks is left out.
_NUMERICS = (
    ("torch.backends.cuda.matmul.allow_tf32", "_get_cublas_allow_tf32"),
    ("torch.backends.cudnn.allow_tf32", "_get_cudnn_allow_tf32"),
    ("torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction", "_get_cublas_allow_fp16_reduced_precision_reduction"),
    ("torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction", "_get_cublas_allow_bf16_reduced_precision_reduction"),
    ("torch.get_float32_matmul_precision()", "_get_float32_matmul_precision"),
    ("torch.are_deterministic_algorithms_enabled()", "_get_deterministic_algorithms"),
    ("torch.backends.cudnn.deterministic", "_get_cudnn_deterministic"),
)
NUMERICS_GETTERS = tuple(getattr(torch._C, getter) for _, getter in _NUMERICS if hasattr(torch._C, getter))
NUMERICS_SETTINGS = tuple(name for name, getter in _NUMERICS if hasattr(torch._C, getter))


# invoke(f) == f(), for a C-level map over getters: operator.call (Python >= 3.11) calls
# directly; methodcaller looks ``__call__`` up first, about twice as slow per getter.
invoke = getattr(operator, "call", None) or operator.methodcaller("__call__")


def compiled_code_run_eagerly() -> Any:
    """A context in which ``torch.compile``'d functions run their Python eagerly and dynamo
    neither compiles nor touches its caches. te_graph's first warmup pass watches the forward
    through a TorchFunctionMode and a TorchDispatchMode; a compiled function dynamo first meets
    under such a mode is run eagerly from then on (torch 2.11: Transformer Engine's fused
    bias-GELU and bias-dropout-add then round and draw as unfused code for the rest of the
    process). ``torch.compiler.set_stance`` (torch >= 2.6); before it, nothing."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


# Whether autocast is on for any device: one call without a device string to parse
# (``torch._C._is_any_autocast_enabled``, private; None where this torch lacks it).
any_autocast_enabled = getattr(torch._C, "_is_any_autocast_enabled", None)


def numerics_settings() -> tuple:
    """The global settings that choose kernels and their rounding, as one tuple (in the
    order of ``NUMERICS_SETTINGS``)."""
    return tuple(map(invoke, NUMERICS_GETTERS))


# The scaled-dot-product-attention backends allowed (``torch.nn.attention.sdpa_kernel`` sets
# them; private C getters as for the numerics flags). A getter this torch lacks is left out.
_SDPA = (("flash", "_get_flash_sdp_enabled"), ("memory-efficient", "_get_mem_efficient_sdp_enabled"),
         ("math", "_get_math_sdp_enabled"), ("cuDNN", "_get_cudnn_sdp_enabled"),
         ("overrideable", "_get_overrideable_sdp_enabled"))
SDPA_GETTERS = tuple(getattr(torch._C, getter) for _, getter in _SDPA if hasattr(torch._C, getter))
SDPA_BACKENDS = tuple(name for name, getter in _SDPA if hasattr(torch._C, getter))


def sdpa_settings() -> tuple:
    """Which SDPA backends are allowed now, in the order of ``SDPA_BACKENDS``."""
    return tuple(map(invoke, SDPA_GETTERS))


def global_module_hook_dicts() -> list[tuple[str, dict]]:
    """nn.Module's global hook dicts (``torch.nn.modules.module._global_forward_hooks`` and
    its siblings, private; ``register_module_forward_hook`` and friends fill them): hooks
    that run for every module, so for the submodules of a graphed one only at capture."""
    kinds = (("forward_hooks", "_global_forward_hooks"), ("forward_pre_hooks", "_global_forward_pre_hooks"),
             ("backward_hooks", "_global_backward_hooks"), ("backward_pre_hooks", "_global_backward_pre_hooks"))
    return [(kind, getattr(_nn_module, name)) for kind, name in kinds if isinstance(getattr(_nn_module, name, None), dict)]


# -- outputs overwritten by a later replay --------------------------------------------------
# CUDA Graph Trees (torch/_inductor/cudagraph_trees.py) make data access raise: on a storage
# with ``torch._C._set_storage_data_ptr_access_error_msg`` (it drops the storage's data
# pointer: on an alias storage that owns nothing, nothing is freed), on one tensor with
# ``torch._C._set_storage_access_error_msg`` (it detaches that tensor from its storage); and
# count a storage's references with ``torch._C._storage_Use_Count``. All private, in CUDA
# builds of torch >= 2.2; CPU builds lack the first two, so there nothing is poisoned.
CAN_POISON = all(hasattr(torch._C, name) for name in (
    "_set_storage_data_ptr_access_error_msg", "_set_storage_access_error_msg", "_storage_Use_Count"))


def poison_storage(storage: Any, message: str) -> None:
    """Make every later data access of every tensor on ``storage`` raise ``message``."""
    torch._C._set_storage_data_ptr_access_error_msg(storage._cdata, message)


def poison_tensor(t: torch.Tensor, message: str) -> None:
    """Make every later data access of ``t`` itself (not of other views) raise ``message``."""
    torch._C._set_storage_access_error_msg(t, message)


def use_count(storage: Any) -> int:
    """How many references hold a storage (tensors viewing it, and Python storage objects)."""
    return torch._C._storage_Use_Count(storage._cdata)
