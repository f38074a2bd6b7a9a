"""``switched``: one of several differentiable programs, chosen by the GPU, forward and backward.

Under a CUDA graph capture, ``switched(index, programs, inputs)`` captures program ``k`` into
body ``k`` of a SWITCH node, and its backward into body ``k`` of a second SWITCH node in the
backward's capture, on the same index tensor: at each replay the GPU runs program ``index``
and then its backward, and no host waits. Outside a capture the host reads ``index`` (a sync)
and runs that program through the same autograd node (its own leaves, the same aliases, the
same gradients handed back), without the SWITCH nodes: the eager mirror, bitwise the same.

What it takes: programs that return tensors of the same shapes and dtypes (one output buffer
serves every body), inputs as tensors, and the module whose parameters the programs train
(``module``): inside the node its parameters are aliases made for it (the same memory and
Python attributes, Megatron's ``main_grad`` included), whose gradients the node hands to the
real ones; every one gets a gradient, zeros where the program that ran left it unused. Under
a capture this keeps autograd's accumulation of the real parameters on the capturing stream:
the bodies run on a stream of their own, and autograd would otherwise join the two captures
by an event (torch 2.11 then crashes in the driver). A program training anything else is
refused (its gradient would be lost), and so is, eagerly too, what a body may not hold.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional, Sequence, Union

import torch

from checkpointing.recompute_state import cuda_stream_capturing

from ..parameters import StandIns
from . import checks
from .guards import ConditionalCaptureError
from .nodes import switch
from .runtime import capture_pool, prepare, retains_graph, runtime

__all__ = ["switched"]

Outputs = Union[torch.Tensor, tuple]
_INDEX_DTYPES = (torch.int64, torch.int32, torch.uint8)  # what a SWITCH node reads


def switched(index: torch.Tensor, programs: Sequence[Callable[..., Outputs]], inputs: Sequence[torch.Tensor], *,
             module: Optional[torch.nn.Module] = None, recompute: bool = False, pool: Any = None) -> Outputs:
    """``programs[index](*inputs)``, differentiable in ``inputs`` and in the trainable parameters
    of ``module``, each of which gets a gradient (zeros where the program left it unused).
    Under a capture each program is captured into a body of a SWITCH node (forward) and its
    backward into a body of another (backward), chosen at each replay from ``index`` on the
    GPU; where ``index`` is out of range no body runs: the outputs keep their last values and
    the gradients are undefined, so keep it in range. Outside a capture ``index`` is read on
    the host, which refuses one out of range, and the device is prepared for conditional
    nodes (``prepare``) where it is not yet. ``pool``: the capture's memory pool (default: the
    pool of the te_graph capture under way, else, where torch has it, of torch's current
    capture). The node takes one backward, or more inside te_graph's
    ``retain_graph_in_backward``. ``recompute``: the forward keeps no activations, only its
    inputs, and the backward runs the program again first: the pool then holds one body's
    temporaries at a time instead of every body's activations (the programs draw no random
    numbers, so the run again is the same)."""
    programs, inputs = tuple(programs), tuple(inputs)
    if not programs:
        raise ValueError("switched: give at least one program")
    if not all(callable(p) for p in programs):
        raise TypeError("switched: programs must be callables")
    bad = [type(t).__name__ for t in inputs if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"switched: inputs must be tensors, got {', '.join(bad)}; close over the rest")
    if not isinstance(recompute, bool):
        raise TypeError(f"switched: recompute must be a bool, not {type(recompute).__name__}")
    if module is not None and not isinstance(module, torch.nn.Module):
        raise TypeError(f"switched: module must be a torch.nn.Module, not {type(module).__name__}")
    if not isinstance(index, torch.Tensor) or index.numel() != 1 or index.dtype not in _INDEX_DTYPES:
        raise TypeError("switched: index must be a tensor of one int64, int32 or uint8 element")
    chosen = None
    if cuda_stream_capturing():
        pool = pool if pool is not None else capture_pool()
        if pool is None:
            raise ConditionalCaptureError(
                "switched: pass pool=, the memory pool of the capture under way (torch.cuda.graph(g, pool=pool))")
    else:
        chosen = int(index)
        if not 0 <= chosen < len(programs):
            raise IndexError(f"switched: index {chosen} is out of range for {len(programs)} programs "
                             "(under a capture no program would run)")
        if index.device.type == "cuda" and not runtime(index.device.index).ready():
            with contextlib.suppress(ImportError):  # without cuda-bindings a capture names the extra
                prepare(index.device.index)  # here, outside any capture, for the capture to come
    state = _State(index, programs, pool, len(inputs), module, chosen, recompute)
    outputs = _Switched.apply(state, *inputs, *state.params)
    return outputs if state.tupled else outputs[0]


class _State:
    """What the forward leaves for the backward: per program run or captured, its leaves and
    outputs (``bodies``); ``chosen``: the program the host chose (None: under a capture)."""

    def __init__(self, index: torch.Tensor, programs: tuple, pool: Any, inputs: int,
                 module: Optional[torch.nn.Module], chosen: Optional[int], recompute: bool):
        self.index, self.programs, self.pool, self.inputs = index, programs, pool, inputs
        self.module = module  # whose parameters the programs train, and whose buffers a refusal or recompute keeps
        # The aliases of its trainable parameters (each once), installed in its slots while a
        # program runs: the same memory and attribute dict.
        self.stand_ins = StandIns([module] if module is not None else [], share_attributes=True)
        self.params = tuple(self.stand_ins.real.values())
        self.aliases = tuple(self.stand_ins.of.values())
        self.own = {id(a) for a in self.aliases}  # leaves a program may train, with its own inputs'
        self.chosen = chosen
        self.recompute = recompute
        self.grad = torch.is_grad_enabled()  # the call's: its programs run so
        self.buffers_before: list = []
        self.packed: Optional[list] = None  # while a forward body is captured: what its program saved
        self.used: set = set()  # ids of the leaves and aliases the programs' graphs reached
        self.param_versions: tuple = ()  # with recompute: (alias, version) of the aliases read
        self.bodies: Optional[dict] = None
        self.tupled: Optional[bool] = None


class _Switched(torch.autograd.Function):
    """The node. Each program runs on leaves of its own (detached inputs) and on the aliases,
    with grad enabled, so that its autograd graph is whole and separate; under a capture its
    outputs are copied into buffers every body shares. The backward asks that graph for the
    gradients of the leaves and the aliases (under a capture in body ``k`` of the second
    node, into buffers every body shares). With ``recompute`` the forward keeps nothing but
    its inputs and the module's buffers as they were; the backward runs the program again on
    those first. Once differentiable: a backward that would build a graph is refused."""

    @staticmethod
    def forward(ctx: Any, state: _State, *tensors: torch.Tensor) -> tuple:
        inputs = tensors[:state.inputs]
        ctx.state = state
        # The module's buffers as the programs find them: a refusal outside a capture puts them
        # back, the run again of recompute starts from them.
        kept = checks.buffers(state.module) if state.recompute or state.chosen is not None else []
        if state.recompute:
            ctx.save_for_backward(*inputs)
            state.buffers_before = kept
        versions = checks.versions(inputs)
        with state.stand_ins.installed():
            if state.chosen is not None:
                drawn = checks.generator_states(inputs) if state.recompute else []
                with checks.put_back_if_refused(kept, drawn):
                    leaves, produced = _run(state, state.chosen, inputs)
                    checks.check_unwritten(state, state.chosen, inputs, versions)
                    checks.check_no_draw(state.chosen, drawn)
                outputs = tuple(_handed_out(o, leaves + state.aliases) for o in produced)
                state.bodies = None if state.recompute else {state.chosen: (leaves, produced)}
            else:
                captured, outputs, unwritten = {}, None, []
                node = switch(state.index, len(state.programs), pool=state.pool)
                with node:
                    for k, body in enumerate(node):
                        with body:
                            state.packed = None if state.recompute else []  # (recompute: never read)
                            leaves, produced = _run(state, k, inputs)
                            unwritten += [r for r in state.packed or () if r[0]._version == r[1]]
                            state.packed = None
                            checks.check_unwritten(state, k, inputs, versions)
                            if outputs is None:  # in the pool, like any of the body's allocations
                                outputs = tuple(torch.empty_like(o, requires_grad=False) for o in produced)
                            checks.check_like(k, produced, outputs)
                            for buffer, output in zip(outputs, produced):
                                buffer.copy_(output.detach())
                            if not state.recompute:
                                captured[k] = (leaves, produced)
                            del leaves, produced  # with recompute, the next body reuses their memory
                state.bodies = None if state.recompute else captured
                # The bodies were captured one after the other, but one runs per replay: a write
                # of a later body to what an earlier one saved is none at its backward.
                for record in unwritten:
                    record[1] = record[0]._version
        checks.note_param_versions(state)
        # One rule whichever program runs: an output of a floating dtype takes a gradient.
        ctx.mark_non_differentiable(*(o for o in outputs if not (o.is_floating_point() or o.is_complex())))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple:
        if torch.is_grad_enabled():  # autograd's engine runs a backward so under create_graph=True alone
            raise RuntimeError("switched: a backward with create_graph=True (a gradient of a gradient) is not "
                               "supported: the node hands out gradients without a graph of their own")
        state, aliases = ctx.state, ctx.state.aliases
        if state.recompute:
            return (None, *_recomputed_backward(ctx, grads))
        bodies = state.bodies
        if bodies is None:
            raise RuntimeError("switched: its backward ran a second time; it keeps its programs' graphs for "
                               "another only inside te_graph's retain_graph_in_backward (or with recompute=True)")
        retain = retains_graph()
        if not retain:
            state.bodies = None  # each program's graph goes with this backward
        wanted = ctx.needs_input_grad[1:]

        def body_grads(k: int) -> list:
            leaves, outputs = bodies[k]
            return _grads(leaves + aliases, outputs, grads, wanted, retain)

        if state.chosen is not None:
            return (None, *body_grads(state.chosen))
        return (None, *_backward_node(state, tuple(bodies[0][0]) + aliases, wanted, body_grads))


def _recomputed_backward(ctx: Any, grads: tuple) -> list:
    """The backward with ``recompute``: program ``k`` run again on the inputs the forward kept,
    from the module's buffers as the forward found them (put back as this backward found them
    after), then asked for its gradients (under a capture, in body ``k``)."""
    state, inputs = ctx.state, ctx.saved_tensors
    wanted = ctx.needs_input_grad[1:]
    checks.check_params_unwritten(state)

    def run_again(k: int) -> list:
        leaves, outputs = _run(state, k, inputs, grad=True)
        checks.note_param_versions(state)  # the run again may write them (an embedding's max_norm)
        return _grads(leaves + state.aliases, outputs, grads, wanted, False)

    with state.stand_ins.installed(), checks.buffers_as(state.buffers_before):
        if state.chosen is not None:
            return run_again(state.chosen)
        return _backward_node(state, tuple(inputs) + state.aliases, wanted, run_again)


def _backward_node(state: _State, sources: tuple, wanted: tuple, body_grads: Callable[[int], list]) -> list:
    """Under a capture: the backward's SWITCH node, whose body ``k`` writes ``body_grads(k)``
    (the gradients of ``sources``, where wanted) into buffers every body shares."""
    shared = [torch.empty_like(t) if w else None for t, w in zip(sources, wanted)]
    with switch(state.index, len(state.programs), pool=capture_pool() or state.pool) as node:
        for k, body in enumerate(node):
            with body:
                for buffer, grad in zip(shared, body_grads(k)):
                    if buffer is not None:
                        buffer.copy_(grad)
    return shared


def _handed_out(output: torch.Tensor, sources: tuple) -> torch.Tensor:
    """An output as the node hands it out: a copy where it shares memory with an input or a
    parameter (autograd would not see an in-place change of it as one of theirs), else itself."""
    output = output.detach()
    storage = output.untyped_storage().data_ptr()
    if any(s.untyped_storage().data_ptr() == storage for s in sources):
        return output.clone()
    return output


def _run(state: _State, k: int, inputs: tuple, grad: Optional[bool] = None) -> tuple:
    """Program ``k`` on leaves of its own, in the grad mode of the call (``grad``: the run
    again of ``recompute``, with grad; the forward of ``recompute`` runs as the call does, for
    the same kernels): (its leaves, its outputs). Its saved tensors are its own: the hooks of a
    non-reentrant checkpoint around the node would run the whole region again inside the
    node's backward (under a capture, a node inside a body)."""
    grad = state.grad if grad is None else grad
    with torch.enable_grad() if grad else torch.no_grad(), \
            torch.autograd.graph.saved_tensors_hooks(functools.partial(checks.pack, state), checks.unpack):
        leaves = tuple(t.detach().requires_grad_(t.requires_grad and grad) for t in inputs)
        try:
            result = state.programs[k](*leaves)
        except RuntimeError as error:
            if "leaf Variable that requires grad is being used in an in-place operation" not in str(error):
                raise
            raise ConditionalCaptureError(
                f"switched: program {k} writes in place a tensor requiring grad that is a leaf of its graph: "
                "inside the node each input requiring grad is one. Write it out of place (t = t * 2, not "
                "t.mul_(2))") from error
    tupled = isinstance(result, tuple)
    if state.tupled is not None and tupled != state.tupled:
        raise ConditionalCaptureError(f"switched: program {k} returns {'a tuple' if tupled else 'a tensor'}, an "
                                      "earlier one the other; every program must return the same")
    state.tupled = tupled
    outputs = result if tupled else (result,)
    if any(not isinstance(o, torch.Tensor) for o in outputs):
        raise TypeError(f"switched: program {k} must return tensors")
    if grad:
        state.used |= checks.check_graph(k, outputs, state.own | {id(t) for t in leaves}, state.stand_ins)
    return leaves, outputs


def _grads(sources: tuple, outputs: tuple, grads: tuple, wanted: tuple, retain: bool) -> list:
    """The gradients of ``sources`` where wanted (zeros where the program left one unused),
    None elsewhere."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
    asked = [s for s, w in zip(sources, wanted) if w and s.requires_grad]
    found = iter(torch.autograd.grad([o for o, _ in pairs], asked, [g for _, g in pairs], allow_unused=True,
                                     retain_graph=retain) if pairs and asked else [None] * len(asked))
    result = []
    for source, w in zip(sources, wanted):
        grad = next(found) if w and source.requires_grad else None
        result.append(None if not w else torch.zeros_like(source) if grad is None else grad)
    return result
