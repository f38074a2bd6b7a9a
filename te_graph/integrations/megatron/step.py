"""megatron-core's own training step as one whole-step graph: its schedule
(``forward_backward_func``) over every microbatch, DDP's gradient accumulation into the
contiguous ``main_grad`` buffer (its grad hooks, and Transformer Engine writing weight
gradients there itself under gradient-accumulation fusion), DDP's gradient reduction
(``finalize_model_grads``) and, where given, an update that reads no value on the host,
captured once by ``te_graph.make_graphed_step`` and replayed each step, bitwise equal to the
eager step with dropout and recompute. Nothing of Megatron is edited.

What the graph holds and what stays eager:

* **Inside**: ``zero_grad_buffer()`` (a memset per buffer, and DDP's per-step bookkeeping
  reset before each warmup pass and the capture), every microbatch's forward, loss and
  backward, DDP's accumulation into ``main_grad``, its reduction of the buffer
  (``finish_grad_sync``: all-reduce, or reduce-scatter for the distributed optimizer, NCCL
  captured in the graph), and ``update=`` (an in-place step on ``main_grad``, or a
  capturable torch optimizer's ``step``).
* **Eager**: the data (each call takes ``num_microbatches`` batches from the iterator on the
  host and copies them into the graph's static batches, which ``forward_step_func`` then
  pulls with ``next``), and Megatron's optimizer (``get_megatron_optimizer``): its step
  reads the gradient norm on the host (``clip_grads``: ``total_norm.item()``), keeps its
  step count there and, distributed, gathers the updated parameters; call its ``step()``
  after each call, as Megatron-LM does.

Megatron settings that wait for the GPU on the host, or that would run code a replay skips,
are refused by name before anything changes (:func:`refusals`); so is FP8, not yet run
through this path on a GPU (its scaling state across warmup, its amax reduction inside the
graph), where the per-layer graphs have been.

torch before 2.12 runs each parameter's ``AccumulateGrad`` on the stream it was made on;
DDP keeps those nodes from its construction (usually the default stream), and a capture on
a side stream then makes the legacy default stream wait on the capture
(``cudaErrorStreamCaptureImplicit``; pytorch#180090 added
``set_override_stale_capture_stream`` for it). So DDP's accumulators are made again, with
DDP's own hooks, on te_graph's capture stream before warmup (megatron-core 0.19's
``grad_accs`` and ``_make_backward_post_hook``).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ...intake.options import eager_replay_default
from ...layout import describe_value
from ...resources import RESOURCES
from ...step.graphed_step import GraphedStep, make_graphed_step
from . import helper

__all__ = ["make_graphed_train_step", "GraphedTrainStep", "refusals"]

_NAME = "make_graphed_train_step"


class _StaticBatches:
    """The iterator ``forward_step_func`` pulls from: the graph's static batches, one per
    microbatch, each pulled once."""

    def __init__(self, batches: Sequence[Any]):
        self.batches, self.pulled = batches, 0

    def __iter__(self) -> "_StaticBatches":
        return self

    def __next__(self) -> Any:
        if self.pulled == len(self.batches):
            raise RuntimeError(f"{_NAME}: forward_step_func pulled more batches from the data iterator than the "
                               f"{len(self.batches)} microbatches of the step; it must pull one per call.")
        self.pulled += 1
        return self.batches[self.pulled - 1]


class GraphedTrainStep:
    """megatron-core's step as one graph. ``step(data_iterator)`` takes ``num_microbatches``
    batches from the iterator (or a sequence of that many), copies them into the static
    batches and replays; it returns what ``forward_backward_func`` returns (each
    microbatch's reduced losses, as tensors of the graph: read them after the call, clone
    what you keep past the next one)."""

    def __init__(self, step: GraphedStep, num_microbatches: int):
        self.step, self.num_microbatches = step, num_microbatches

    def __call__(self, data_iterator: Any) -> Any:
        return self.step(_take(data_iterator, self.num_microbatches))

    @property
    def eager_replay(self) -> bool:
        return self.step.eager_replay

    def reset(self) -> None:
        """Free the graph."""
        self.step.reset()


def _take(data: Any, n: int) -> tuple:
    if isinstance(data, (list, tuple)):
        if len(data) != n:
            raise ValueError(f"{_NAME}: got {len(data)} batches; the step runs {n} microbatches.")
        return tuple(data)
    if not hasattr(data, "__next__"):
        raise TypeError(f"{_NAME}: pass a data iterator (or a list of {n} batches), got {describe_value(data)}.")
    batches = []
    for _ in range(n):
        try:
            batches.append(next(data))
        except StopIteration:
            raise ValueError(f"{_NAME}: the data iterator ran out after {len(batches)} of the step's {n} "
                             "microbatches.") from None
    return tuple(batches)


def refusals(model: Sequence[torch.nn.Module], update: Optional[Callable] = None) -> list[str]:
    """What keeps ``model``'s step from one graph, each with the setting to change (empty
    where nothing does). Host waits: Megatron's timers (``config.timers``: they synchronize
    the device, with a barrier under ``barrier_with_L1_time``), DDP's gradient checks
    (``check_for_nan_in_grad``, ``check_for_large_grads``: a bucket's norm read on the host
    through the rerun state machine), Megatron's optimizer as ``update``. Not yet put back
    after warmup: FP8 (``config.fp8``). Code a replay would skip: DDP's forward pre-hooks
    (``overlap_param_gather``), Megatron's own graphs
    (``cuda_graph_impl="local"``) and the helper's per-layer graphs."""
    from megatron.core.utils import get_model_config  # noqa: PLC0415

    found = []
    config = get_model_config(model[0])
    if getattr(config, "timers", None) is not None:
        found.append("config.timers is set: Megatron's timers synchronize the device (and barrier with "
                     "barrier_with_L1_time) around the forward, backward and gradient reduction; set "
                     "config.timers = None for the graphed step and time the call from outside")
    if getattr(config, "fp8", None):
        found.append(f"config.fp8={config.fp8!r}: FP8 through megatron-core's whole step (Transformer Engine's "
                     "scaling state across warmup, its amax reduction inside the graph) has not been proven equal "
                     "to eager yet; for FP8, graph per layer (te_graph.integrations.megatron.enable() with "
                     "TECudaGraphHelper)")
    if getattr(config, "cuda_graph_impl", "none") == "local":
        found.append("config.cuda_graph_impl='local': megatron-core would capture its own graphs inside the "
                     "step's; set cuda_graph_impl='none'")
    for chunk in model:
        ddp = getattr(chunk, "ddp_config", None)
        for flag in ("check_for_nan_in_grad", "check_for_large_grads"):
            if ddp is not None and getattr(ddp, flag, False):
                found.append(f"DistributedDataParallelConfig({flag}=True) reads each gradient bucket's norm on the "
                             f"host before the reduction; set {flag}=False and check the returned losses (or the "
                             "gradient norm of Megatron's eager optimizer step) after each call")
        if ddp is not None and getattr(ddp, "overlap_param_gather", False):
            found.append("DistributedDataParallelConfig(overlap_param_gather=True): DDP's forward pre-hooks wait "
                         "for parameter all-gathers the eager optimizer step starts, which a replay cannot wait "
                         "for; set overlap_param_gather=False (the distributed optimizer then gathers the "
                         "parameters within its step)")
        graphed = [name for name, m in chunk.named_modules() if getattr(m, "cuda_graphs", None)]
        if graphed:
            found.append(f"{graphed[0]} has per-layer graphs (TECudaGraphHelper.create_cudagraphs); delete them "
                         "(helper.delete_cuda_graphs()) before graphing the whole step")
    owner = getattr(update, "__self__", None)
    if owner is not None and any(c.__name__ == "MegatronOptimizer" for c in type(owner).__mro__):
        found.append("update is Megatron's optimizer step, which reads the gradient norm on the host "
                     "(clip_grads: total_norm.item()) and counts its steps there; leave update=None and call "
                     "optimizer.step() after each call of the graphed step")
    return list(dict.fromkeys(found))


def _check_recompute(config: Any) -> None:
    """Recompute in a graph needs te_graph's exact checkpoint in Megatron's place."""
    if getattr(config, "recompute_granularity", None) is None:
        return

    tp = sys.modules.get("megatron.core.tensor_parallel")
    if tp is None or tp.checkpoint is not helper.checkpoint:
        raise ValueError(
            f"{_NAME}: recompute_granularity={config.recompute_granularity!r} recomputes through Megatron's "
            "checkpoint, which restores the random states by reference (other dropout masks inside a graph). Call "
            "te_graph.integrations.megatron.enable() first: Megatron's checkpoint is then te_graph's, exact in "
            "graphs and eagerly.")
    modules = set(getattr(config, "recompute_modules", None) or ())
    if config.recompute_granularity == "selective" and modules - {"core_attn"}:
        raise ValueError(
            f"{_NAME}: recompute_modules={sorted(modules)}: only 'core_attn' recomputes through the checkpoint "
            "te_graph makes exact; the others use Megatron's CheckpointWithoutOutput. Keep "
            "recompute_modules=['core_attn'] or use recompute_granularity='full'.")


def _accumulators_on(stream: torch.cuda.Stream, model: Sequence[torch.nn.Module]) -> None:
    """DDP's ``AccumulateGrad`` nodes made again on ``stream``, with DDP's hooks (module
    docstring). A node an earlier step's autograd graph still holds cannot be made again."""
    for chunk in model:
        accumulators = getattr(chunk, "grad_accs", None)
        if not accumulators or not hasattr(chunk, "_make_backward_post_hook"):
            continue
        params = [acc.variable for acc in accumulators]
        for acc in accumulators:
            acc.metadata["te_graph_made_before"] = True
        hooks = [chunk._make_backward_post_hook(p) for p in params]
        accumulators.clear()
        del acc
        held = []
        with torch.cuda.stream(stream):
            for p, hook in zip(params, hooks):
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                if acc.metadata.get("te_graph_made_before"):
                    held.append(acc)  # still alive: it keeps DDP's hook
                else:
                    acc.register_hook(hook)
                accumulators.append(acc)
        if held:
            raise RuntimeError(
                f"{_NAME}: the autograd graph of an earlier step is still alive (a loss or output kept with its "
                "graph), holding DDP's gradient accumulators; drop it (keep losses detached) and graph the step "
                "again.")


def make_graphed_train_step(forward_step_func: Callable, model: Any, sample_batches: Iterable[Any], *,
                            num_microbatches: int, seq_length: int, micro_batch_size: int,
                            forward_backward_func: Optional[Callable] = None, zero_grad_buffer: bool = True,
                            update: Optional[Callable[[], Any]] = None, optimizer: Any = None,
                            num_warmup_iters: int = 3, pool: Any = None, eager_replay: Optional[bool] = None,
                            verify: Any = None) -> GraphedTrainStep:
    """Graph megatron-core's step, ``forward_backward_func(forward_step_func, data_iterator,
    model, num_microbatches, seq_length, micro_batch_size, forward_only=False)``, whole.

    Args:
        forward_step_func: as for Megatron's schedule: ``(data_iterator, model) -> (output,
            loss_func)``, pulling one batch per call with ``next(data_iterator)``.
        model: the DDP-wrapped model (one chunk, or a list of one: no pipeline schedules).
        sample_batches: ``num_microbatches`` batches as ``forward_step_func`` pulls them
            (pytrees of CUDA tensors); their shapes are every call's. Copied, not kept.
        num_microbatches, seq_length, micro_batch_size: the schedule's.
        forward_backward_func: the schedule (default ``get_forward_backward_func()``).
        zero_grad_buffer: the graph zeroes DDP's gradient buffers first, as Megatron-LM's
            ``train_step`` does before the schedule (False: gradients add to what is there).
        update: run inside the graph after the gradients are final (an in-place step on
            ``main_grad``, a capturable torch optimizer's ``step``); None: step eagerly after
            each call (Megatron's optimizer must).
        optimizer: the torch optimizer ``update`` steps, whose state the graph then holds.
        num_warmup_iters, pool, eager_replay, verify: as for ``te_graph.make_graphed_step``.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415
    from megatron.core.utils import get_model_config  # noqa: PLC0415

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 1 or not isinstance(chunks[0], torch.nn.Module):
        raise TypeError(f"{_NAME}: model must be the DDP-wrapped model (one chunk); pipeline schedules with model "
                        f"chunks are not graphed whole, got {describe_value(model)}.")
    schedule = forward_backward_func or get_forward_backward_func()
    if getattr(schedule, "__name__", "") != "forward_backward_no_pipelining":
        raise ValueError(f"{_NAME}: {getattr(schedule, '__name__', schedule)} is a pipeline-parallel schedule; the "
                         "whole step is graphed with forward_backward_no_pipelining (pipeline_model_parallel_size=1).")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"{_NAME}: num_microbatches must be an int >= 1, got {num_microbatches!r}.")
    if update is not None and not callable(update):
        raise TypeError(f"{_NAME}: update must be callable (or None), got {describe_value(update)}.")
    found = refusals(chunks, update)
    if found:
        raise ValueError(f"{_NAME}: the step cannot be one graph: " + "; ".join(found) + ".")
    _check_recompute(get_model_config(chunks[0]))
    batches = _take(list(sample_batches) if not hasattr(sample_batches, "__next__") else sample_batches,
                    num_microbatches)
    leaves = [leaf for batch in batches for leaf in torch.utils._pytree.tree_leaves(batch)]
    if not leaves or not all(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in leaves):
        odd = next((t for t in leaves if not (isinstance(t, torch.Tensor) and t.device.type == "cuda")), None)
        raise TypeError(f"{_NAME}: each sample batch must be a pytree of CUDA tensors (a dict, tuple or list of "
                        f"them), found {describe_value(odd)}; make constants part of forward_step_func instead.")
    with torch.no_grad():  # the graph's own batches: no aliasing between microbatches, none of the caller's
        static = tuple(torch.utils._pytree.tree_map(lambda t: t.detach().clone(), batch) for batch in batches)

    def step(batches: tuple) -> Any:
        if zero_grad_buffer:
            chunks[0].zero_grad_buffer()
        data = _StaticBatches(batches)
        out = schedule(forward_step_func=forward_step_func, data_iterator=data, model=chunks,
                       num_microbatches=num_microbatches, seq_length=seq_length,
                       micro_batch_size=micro_batch_size, forward_only=False)
        if data.pulled != num_microbatches:
            raise RuntimeError(f"{_NAME}: forward_step_func pulled {data.pulled} batches over {num_microbatches} "
                               "microbatches; it must pull one per call.")
        if update is not None:
            update()
        return out


    if not (eager_replay_default() if eager_replay is None else eager_replay):
        _accumulators_on(RESOURCES.capture_stream(), chunks)
    graphed = make_graphed_step(step, (static,), modules=chunks, optimizer=optimizer,
                                num_warmup_iters=num_warmup_iters, pool=pool, eager_replay=eager_replay,
                                verify=verify)
    return GraphedTrainStep(graphed, num_microbatches)
