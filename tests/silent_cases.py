"""The cases of tests/test_silent.py: small setups a user can reach, each run eagerly and graphed.

A case is a ``Case``: how to build its modules, how to graph them, what the user changes
and when, how one microbatch runs. The harness (tests/test_silent.py) hands each function a
``State`` ``st``: ``st.layers`` (the modules as built), ``st.calls`` (what the user calls:
the modules in the eager run, the graphed callables otherwise), ``st.model`` (everything
whose parameters, grads and buffers are observed), ``st.graphing`` (False in the eager
run), ``st.randn``/``st.sample`` (data and sample tensors from private generators),
``st.log`` (an extra observable), ``st.backward``, ``st.zero_grad``, ``st.step``.
Everything a case does happens identically in the eager run, except graphing.

Classes: changed (model or call changed after graphing), grads (gradients eager would not
produce), side-effects (forwards with side effects), shared-samples, nested (nested
tensors in the call), outputs (outputs read after the next replay), rounding, other.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

import te_graph
from checkpointing import checkpoint
from tests import harness
from tests.graph_helpers import NoGrad, ddp_pre_hook

H, SEQ, B, VOCAB = 16, 8, 2, 32


# -- layers ---------------------------------------------------------------------------------------
class Net(nn.Module):
    """The plain layer: [s, b, h] in, [s, b, h] out (two linears, tanh, dropout)."""

    def __init__(self, p=0.1, unused=False, gate=False):
        super().__init__()
        self.lin1, self.lin2, self.drop = nn.Linear(H, H), nn.Linear(H, H), nn.Dropout(p)
        if unused:
            self.unused = nn.Linear(H, H)  # never used by forward
        if gate:
            self.gate, self.use_gate = nn.Linear(H, H), False  # used only when use_gate

    def body(self, x):
        h = torch.tanh(self.lin1(x))
        if getattr(self, "use_gate", False):
            h = h * torch.sigmoid(self.gate(x))
        return self.lin2(self.drop(h))

    def forward(self, x):
        return self.body(x)


class ReentrantNet(Net):
    """Net inside torch's reentrant checkpoint, whose autograd node has no edge to the
    parameters: fed an input that requires no grad, eager autograd gives its output none,
    and the layer trains nothing (torch warns)."""

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=True, preserve_rng_state=False)


class _ScaleKeepingVariable(torch.autograd.Function):
    """x * w, keeping x on its context under the name ``variable`` (a custom Function's node
    carries its context's attributes: not a gradient accumulator for all that)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.variable = x
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g * w, (g * ctx.variable).sum(dim=(0, 1))


class _TwoOfOneNode(torch.autograd.Function):
    """One node, two outputs: ``2y`` and ``|y|``. Like eigh's backward for its eigenvectors,
    the backward skips the second output's term when it got no gradient; zeros pushed
    through it give NaN where ``y`` is 0 (0 * y / |y|). (eigh itself waits for the GPU from
    the host, which no graph can capture.)"""

    @staticmethod
    def forward(ctx, y):
        ctx.set_materialize_grads(False)
        magnitude = y.abs()
        ctx.save_for_backward(y, magnitude)
        return y * 2, magnitude

    @staticmethod
    def backward(ctx, g_double, g_magnitude):
        y, magnitude = ctx.saved_tensors
        grad = g_double * 2
        return grad if g_magnitude is None else grad + g_magnitude * y / magnitude


class VariableNet(nn.Module):
    """A scale behind a custom Function whose context has a ``variable`` (the input): the
    output needs grad through the weight whatever the input, which the graph walk must see."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, H))

    def forward(self, x):
        return _ScaleKeepingVariable.apply(x, self.scale)


class KwNet(Net):
    """Net taking the keyword inputs of a Megatron layer: masks, biases, rotary (cos, sin),
    dicts and tuples mixing constants and tensors, a residual."""

    def forward(self, x, mask=None, bias=None, scale=1.0, rope=None, extra=None, cfg=None, skip=None):
        if mask is not None:
            x = x * mask
        if bias is not None:
            x = x + bias
        if rope is not None:
            x = x * rope[0] + x.roll(1, -1) * rope[1]
        if extra is not None:
            x = x * extra["scale"] + extra["shift"]
        if cfg is not None:
            x = x * cfg[0] + cfg[1]
        y = self.body(x) * scale
        return y if skip is None else y + skip


class Returns(Net):
    """Returns two tensors: ``what`` picks the second (aliasing, NaN-prone, ...)."""

    def __init__(self, what):
        super().__init__()
        self.what = what
        if what == "sqrt":
            self.aux = nn.Linear(H, H)

    def forward(self, x):
        if self.what == "source":  # the output is computed from the second (MoE router probabilities)
            h = torch.tanh(self.lin1(x))
            return self.lin2(self.drop(h)), h
        if self.what == "one-node":  # both outputs of one node: the first used, the second not
            return _TwoOfOneNode.apply(torch.relu(self.body(x)))
        if self.what == "behind-function":  # computed from the second through a Function giving it no grad
            d = self.lin1(x) - self.lin1(x).detach()
            second = torch.sqrt(d * d)  # zeros pushed back here would be NaN (sqrt at 0)
            return NoGrad.apply(second) + self.body(x), second
        y = self.body(x)
        second = {"input": lambda: x, "input-view": lambda: x[..., : H // 2], "same": lambda: y, "row": lambda: y[0],
                  "param-view": lambda: self.lin1.weight.t(), "sqrt": lambda: torch.sqrt(self.aux(x))}
        return y, second[self.what]()


class MaskOutput(Net):
    """Takes a second input (a mask, with zeros) and returns a second tensor computed from it
    alone, through log, from a node the first output's path shares (zeros pushed through its
    backward turn into NaN there: 0 / 0)."""

    def forward(self, x, mask):
        shared = mask * 2
        return self.body(x) * shared, torch.log(shared)


class Effect(Net):
    """A forward with a side effect (``kind``) besides computing Net."""

    def __init__(self, kind, device):
        super().__init__()
        self.kind, self.calls, self.peaks = kind, 0, []
        self.stat = torch.zeros(H, device=device)  # a plain attribute, not a buffer
        self.cache_src, self.cache = None, None
        if kind == "buffer-reassigned":
            self.register_buffer("count", torch.zeros((), dtype=torch.long, device=device))

    def forward(self, x, mask=None):
        if self.kind == "input-hook" and x.requires_grad:
            x.register_hook(lambda g: g * 0.5)
        if self.kind == "identity-cache":  # recompute the mask's transform only for a new mask
            if mask is not self.cache_src:
                self.cache_src, self.cache = mask, mask * 2 - 1
            x = x * self.cache
        if self.kind == "stores-input":
            self.last_input = x
        h = torch.tanh(self.lin1(x))
        if self.kind == "aux-loss":
            self.aux_loss = h.square().mean()
        y = self.lin2(self.drop(h))
        if self.kind == "stat":
            with torch.no_grad():
                self.stat.add_(y.mean(dim=(0, 1)))
        if self.kind == "counter":
            self.calls += 1
        if self.kind == "item":
            self.peaks.append(y.detach().abs().max().item())
        if self.kind == "buffer-reassigned":
            self.count = self.count + 1
        return y


class Emb(nn.Module):
    """Token ids [s, b] (int64) in, [s, b, h] out."""

    def __init__(self, max_norm=None):
        super().__init__()
        self.emb, self.lin = nn.Embedding(VOCAB, H, max_norm=max_norm), nn.Linear(H, H)

    def forward(self, ids):
        return torch.tanh(self.lin(self.emb(ids)))


class Scaled(Net):
    """Net times a plain tensor attribute (not a buffer): the graphs read it by address."""

    def __init__(self, device):
        super().__init__()
        self.scale = torch.full((H,), 0.5, device=device)

    def forward(self, x):
        return self.body(x) * self.scale


class LazyTied(Net):
    """Net whose second linear also reads the first's weight, through a reference kept at
    the first call (a lazy tie)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.tied = None

    def forward(self, x):
        if self.tied is None:
            self.tied = [self.lin1.weight]
        return self.body(x) @ self.tied[0].t()


class TanhOut(Net):
    """Net ending in tanh, whose backward reads its output."""

    def forward(self, x):
        return torch.tanh(self.body(x))


class Recompute(Net):
    """Net with its body under checkpointing.checkpoint (recompute inside the graph)."""

    def forward(self, x):
        return checkpoint(self.body, x)


class ListIn(Net):
    """Takes a list [x, gate] as its one positional argument."""

    def forward(self, xs):
        return self.body(xs[0]) * torch.sigmoid(xs[1])


class Residual(Net):
    """Uses its input twice (x + body(x))."""

    def forward(self, x):
        return x + self.body(x)


class Conv(nn.Module):
    """[b, 4, 8, 8] images in and out: two 3x3 convolutions."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.c2(torch.tanh(self.c1(x)))


# -- the vocabulary of a case -----------------------------------------------------------------------
def chain(st, x):
    """One microbatch's forward: the layers in sequence."""
    for f in st.calls:
        x = f(x)
    return x


def make_input(shape=(SEQ, B, H), view=None, grad=True):
    """An input factory: (what the first layer gets, the leaf whose .grad is observed).
    ``shape`` and ``grad`` may be functions of ``st``; ``view`` turns the leaf into the input."""
    def make(st):
        leaf = st.randn(*(shape(st) if callable(shape) else shape), grad=grad(st) if callable(grad) else grad)
        return (leaf if view is None else view(leaf)), leaf
    return make


def default_samples(st):
    return [(st.sample(SEQ, B, H),) for _ in st.layers]


def default_graph(st):
    return st.make_graphed(st.layers, st.case.samples(st), sample_kwargs=st.case.sample_kwargs(st))


def microbatches(st):
    """The default microbatch loop: forward, weighted loss of every output, backward."""
    for st.mb in range(st.case.micro):
        x, leaf = st.case.input(st)
        y = st.case.forward(st, x)
        st.case.backward(st, st.loss(y), leaf)
        st.log("output", y)
        st.log("input grad", leaf.grad)


def each_step(st):
    """The steps: the case's change, zero_grad, (the caller's body), the optimizer step."""
    for st.step_i in range(st.case.steps):
        if st.case.change is not None:
            st.case.change(st, st.step_i)
        st.zero_grad()
        yield st.step_i
        st.step()


def default_train(st):
    for _ in each_step(st):
        microbatches(st)


def nets(n=2, make=Net, then=None, **kw):
    """A build: ``n`` layers ``make(**kw)``, then ``then(layers)`` (freezing, tying ...)."""
    def build(device):
        layers = [make(**kw).to(device) for _ in range(n)]
        if then is not None:
            then(layers)
        return layers
    return build


@dataclass
class Case(harness.Row):
    id: str
    cls: str
    doc: str  # what the user is doing
    build: Callable[[str], Any] = nets()  # device -> the layers, or a dict of State attributes
    samples: Callable = default_samples  # st -> one tuple of sample args per layer
    sample_kwargs: Callable = lambda st: None  # st -> one dict per layer, or None
    graph: Callable = default_graph  # st -> the graphed callables
    change: Optional[Callable] = None  # (st, step) at the start of every step, after graphing
    input: Callable = make_input()
    forward: Callable = chain  # (st, x) -> output tensor(s); the loss is taken of every one
    backward: Callable = lambda st, loss, leaf: st.backward(loss)
    train: Callable = default_train
    observe: Optional[Callable] = None  # st -> {name: value} observed after every step
    opt: str = "sgd"  # or "adamw" (weight decay 0.1)
    steps: int = 3
    micro: int = 2
    # A difference the guarantee states (a phrase of its condition in docs/capture-and-replay.md):
    # the harness then expects rounding differences, and says so.
    documented: str = ""
    # The eager program a documented case equals bitwise (None: it differs by rounding).
    same_as: Optional["Case"] = None
    # Where eager code itself refuses the case: a phrase of its error. The graphed run must
    # then refuse it too, at the same point, with what it observed before equal.
    eager_refuses: str = ""


def at(step, fn):
    """A change made at the start of one step (step 1: after the graphs replayed)."""
    return lambda st, s: fn(st) if s == step else None


def with_kw(**kw):
    """A forward calling every layer with keyword arguments {k: v(st)}."""
    def forward(st, x):
        for f in st.calls:
            x = f(x, **{k: v(st) for k, v in kw.items()})
        return x
    return forward


def kw_samples(**kw):
    return lambda st: [{k: v(st) for k, v in kw.items()} for _ in st.layers]


def set_attr(name, value):
    return lambda st: setattr(st, name, value)


def mask(st):
    return (st.randn(SEQ, B, 1) > 0).float()


# -- 1. The model or the call changed after graphing ---------------------------------------------------
W0 = lambda st: st.layers[0].lin1.weight  # noqa: E731


def scaled_load(st, **kw):
    st.model.load_state_dict({k: v * 0.5 for k, v in st.model.state_dict().items()}, **kw)
    st.reset_opt()


def param_to_buffer(st):
    lin = st.layers[0].lin2
    bias = lin.bias
    del lin.bias
    lin.register_buffer("bias", bias.detach().clone())
    st.reset_opt()


def new_linear(st):
    torch.manual_seed(5)
    st.layers[0].lin2 = nn.Linear(H, H).to(st.device)
    st.reset_opt()


def to_double(st):
    st.model.double()
    st.dtype = torch.float64


def under_autocast(st, x):
    with st.autocast():
        return chain(st, x)


def graph_under_autocast(st):
    with st.autocast(cache_enabled=False):
        return default_graph(st)


def ddp_hooks_then_swap(st, step):
    """Step 1: DDP's forward pre-hook on a submodule that Megatron's helper runs by hand
    (``cuda_graph_manual_hooks``): accepted. Step 2: that hook swapped for one of the user's,
    which keeps every hook table's size."""
    layer = st.layers[0]
    if step == 1:
        layer.cuda_graph_manual_hooks = [(ddp_pre_hook(), (layer.lin1,))]
        st.kept.append(layer.lin1.register_forward_pre_hook(ddp_pre_hook()))
    if step == 2:
        st.kept.pop().remove()
        layer.lin1.register_forward_pre_hook(lambda m, a: (a[0] * 0.5,))


def eval_call(context):
    def observe(st):
        with context():
            return {"eval output": chain(st, st.randn(SEQ, B, H))}
    return observe


CHANGED = [
    Case("freeze-weight", "changed", "freezes a weight with requires_grad_(False) after graphing",
         change=at(1, lambda st: W0(st).requires_grad_(False))),
    Case("param-data-swap", "changed", "replaces a weight's storage: p.data = new tensor",
         change=at(1, lambda st: setattr(W0(st), "data", W0(st).detach() * 0.5))),
    Case("param-replaced", "changed", "assigns module.weight = nn.Parameter(new) (and a new optimizer)",
         change=at(1, lambda st: (setattr(st.layers[0].lin1, "weight", nn.Parameter(W0(st).detach() * 0.5)),
                                  st.reset_opt()))),
    Case("load-state-assign", "changed", "loads a state dict with assign=True (and a new optimizer)",
         change=at(1, lambda st: scaled_load(st, assign=True))),
    Case("load-state-copy", "changed", "loads a state dict in place (the documented way)",
         change=at(1, scaled_load)),
    Case("submodule-forward-hook", "changed", "adds a forward hook to a submodule after graphing",
         change=at(1, lambda st: st.layers[0].lin1.register_forward_hook(lambda m, i, o: o * 2))),
    Case("submodule-pre-hook", "changed", "adds a forward pre-hook to a submodule after graphing",
         change=at(1, lambda st: st.layers[1].lin2.register_forward_pre_hook(lambda m, a: (a[0] * 0.5,)))),
    Case("graphed-module-hook", "changed", "adds a forward hook on the graphed module (documented to work)",
         change=at(1, lambda st: st.layers[0].register_forward_hook(lambda m, i, o: o * 2))),
    Case("tensor-attribute-replaced", "changed", "replaces a plain tensor attribute the forward reads: m.scale = new",
         build=lambda device: [Scaled(device).to(device) for _ in range(2)],
         change=at(1, lambda st: setattr(st.layers[0], "scale", st.layers[0].scale * 3))),
    Case("submodule-eval", "changed", "puts one submodule (a dropout) in eval mode, the layer stays in train",
         change=at(1, lambda st: st.layers[0].drop.eval())),
    Case("dropout-p-changed", "changed", "changes a dropout probability (module.drop.p = 0.3)",
         change=at(1, lambda st: setattr(st.layers[1].drop, "p", 0.3))),
    Case("autocast-call", "changed", "calls under torch.autocast a graph captured without it",
         forward=under_autocast),
    Case("autocast-call-one-layer", "changed", "calls under torch.autocast a one-layer graph captured without it",
         build=nets(1), forward=under_autocast),
    Case("autocast-capture", "changed", "graphs under torch.autocast(cache_enabled=False), calls without it",
         graph=graph_under_autocast),
    Case("param-to-buffer", "changed", "re-registers a bias as a buffer (stops training it)",
         change=at(1, param_to_buffer)),
    Case("model-to-double", "changed", "moves the model to float64 after graphing (and feeds float64)",
         change=at(1, to_double), forward=lambda st, x: chain(st, x.to(st.dtype))),
    Case("kwarg-starts-needing-grad", "changed", "starts learning a keyword tensor whose sample had no grad",
         build=lambda device: dict(layers=nets(make=KwNet)(device), bias=(torch.randn(H) * 0.1).to(device)),
         sample_kwargs=kw_samples(bias=lambda st: st.sample(H, grad=False)),
         forward=with_kw(bias=lambda st: st.bias), change=at(1, lambda st: st.bias.requires_grad_()),
         observe=lambda st: {"bias grad": st.bias.grad}),
    Case("constant-kwarg-changed", "changed", "passes another constant keyword value than at capture",
         build=nets(make=KwNet), sample_kwargs=kw_samples(scale=lambda st: 1.0),
         forward=with_kw(scale=lambda st: getattr(st, "scale", 1.0)), change=at(1, set_attr("scale", 2.0))),
    Case("whole-model-eval", "changed", "switches the graphed modules to eval (runs eagerly, documented)",
         change=at(1, lambda st: st.model.eval())),
    Case("submodule-replaced", "changed", "replaces a submodule: layer.lin2 = nn.Linear(...)",
         change=at(1, new_linear)),
    Case("no-grad-eval-call", "changed", "evaluates under torch.no_grad() between steps",
         observe=eval_call(torch.no_grad)),
    Case("inference-mode-call", "changed", "evaluates under torch.inference_mode() between steps",
         observe=eval_call(torch.inference_mode)),
    Case("unfreeze-later", "changed", "unfreezes a bias that had requires_grad=False at capture",
         build=nets(then=lambda ls: ls[0].lin1.bias.requires_grad_(False)),
         change=at(1, lambda st: st.layers[0].lin1.bias.requires_grad_())),
    Case("ddp-hook-swapped", "changed", "adds Megatron DDP's pre-hook (run by hand), then swaps it for its own",
         change=ddp_hooks_then_swap),
]


# -- 2. Gradients eager would not produce --------------------------------------------------------------
def first_outputs(st, x):
    """A forward over Returns layers that ignores their second outputs."""
    for f in st.calls:
        x = f(x)[0]
    return x


def every_output(st, x):
    h = st.calls[0](x)
    return h, st.calls[1](h)


def mask_outputs(st, x):
    """A forward over MaskOutput layers, each fed a mask without grad: their second outputs
    (and whether they require grad) are observed, not put in the loss."""
    for f in st.calls:
        x, second = f(x, (st.randn(SEQ, B, H) > -0.5).to(x.dtype))
        st.log("second output", second)
        st.log("second output requires grad", second.requires_grad)
    return x


def output_updated_in_place(st, x):
    """The last output updated in place before the loss is taken of it."""
    y = chain(st, x)
    y.add_(1.0)
    return y


def frozen_first_forward(st, x):
    h = st.calls[0](x.detach())
    st.log("first layer's output requires grad", h.requires_grad)
    return st.calls[1](h)


GRADS = [
    Case("unused-param-adamw", "grads", "has a parameter its forward never uses, AdamW with weight decay",
         build=nets(unused=True), opt="adamw"),
    Case("unused-output-nan", "grads", "ignores a second output whose backward would give NaN for a zero grad",
         build=nets(make=Returns, what="sqrt"), forward=first_outputs),
    Case("unused-source-output", "grads", "ignores a second output that the first was computed from",
         build=nets(make=Returns, what="source"), forward=first_outputs),
    Case("unused-second-of-one-node", "grads",
         "uses one output of a node and ignores its second, whose backward would give NaN for a zero grad",
         build=nets(make=Returns, what="one-node"), forward=first_outputs),
    Case("unused-output-behind-function", "grads",
         "ignores a second output the first reaches only through a Function that gives it no gradient",
         build=nets(make=Returns, what="behind-function"), forward=first_outputs),
    Case("autograd-grad-input", "grads", "takes torch.autograd.grad(loss, x) (params' .grad untouched)",
         backward=lambda st, loss, leaf: st.log("dloss/dx", st.autograd_grad(loss, leaf)), opt="adamw"),
    Case("backward-inputs-x", "grads", "calls loss.backward(inputs=[x])",
         backward=lambda st, loss, leaf: st.backward(loss, inputs=[leaf])),
    Case("backward-inputs-param", "grads", "calls loss.backward(inputs=[one weight])",
         backward=lambda st, loss, leaf: st.backward(loss, inputs=[st.layers[1].lin2.weight])),
    Case("autograd-grad-params", "grads", "takes torch.autograd.grad(loss, every parameter) instead of backward",
         backward=lambda st, loss, leaf: st.log("dloss/dparams", st.autograd_grad(loss, list(st.model.parameters())))),
    Case("autograd-grad-input-and-one-weight", "grads", "takes torch.autograd.grad(loss, (x, one weight))",
         backward=lambda st, loss, leaf: st.log("dloss/d(x, w)", st.autograd_grad(loss, [leaf, st.layers[0].lin1.weight]))),
    Case("backward-inputs-params", "grads", "calls loss.backward(inputs=every parameter)",
         backward=lambda st, loss, leaf: st.backward(loss, inputs=list(st.model.parameters()))),
    Case("autograd-grad-params-one-output-left-out", "grads",
         "takes torch.autograd.grad(loss, every parameter) of a loss that ignores a second output",
         build=nets(make=Returns, what="sqrt"), forward=first_outputs,
         backward=lambda st, loss, leaf: st.log("dloss/dparams", st.autograd_grad(
             loss, list(st.model.parameters()), allow_unused=True))),
    Case("backward-inputs-params-one-output-left-out", "grads",
         "calls loss.backward(inputs=every parameter) of a loss that ignores a second output",
         build=nets(make=Returns, what="sqrt"), forward=first_outputs,
         backward=lambda st, loss, leaf: st.backward(loss, inputs=list(st.model.parameters()))),
    Case("gate-enabled-later", "grads", "enables a gated branch (a Python flag false at capture), AdamW",
         build=nets(gate=True), opt="adamw",
         change=at(1, lambda st: [setattr(layer, "use_gate", True) for layer in st.layers])),
    Case("backward-twice", "grads", "calls backward(retain_graph=True) and then backward again",
         backward=lambda st, loss, leaf: (st.backward(loss, retain_graph=True), st.backward(loss))),
    Case("deep-supervision", "grads", "puts a loss on every layer's output", forward=every_output),
    Case("frozen-first-layer", "grads", "freezes the whole first layer and feeds data without grad",
         build=nets(then=lambda ls: ls[0].requires_grad_(False)), forward=frozen_first_forward),
    Case("function-context-variable-input-without-grad", "grads",
         "feeds data without grad to a layer behind a custom Function whose context has a 'variable'",
         build=nets(make=VariableNet), forward=frozen_first_forward),
    Case("reentrant-checkpoint-input-without-grad", "grads",
         "feeds data without grad to a layer inside torch's reentrant checkpoint (eager trains it nothing)",
         build=lambda device: [ReentrantNet(p=0.0).to(device), Net().to(device)], forward=frozen_first_forward),
    Case("reentrant-recompute-input-without-grad", "grads",
         "feeds data without grad to a layer under checkpointing.checkpoint(use_reentrant=True), which eager refuses",
         build=nets(make=Recompute), forward=frozen_first_forward, eager_refuses="no tensor argument requires grad"),
    Case("output-read-by-backward-updated-in-place", "grads",
         "updates in place an output its backward reads (tanh) before the backward, which eager refuses",
         build=nets(make=TanhOut), forward=output_updated_in_place,
         eager_refuses="modified by an inplace operation"),
    Case("output-of-input-without-grad-unused", "grads",
         "feeds a mask without grad (its sample had grad) and leaves out of the loss an output computed from it alone",
         build=nets(make=MaskOutput), samples=lambda st: [(st.sample(SEQ, B, H), st.sample(SEQ, B, H))
                                                          for _ in st.layers], forward=lambda st, x: mask_outputs(st, x)),
]


# -- 3. Forwards with side effects ---------------------------------------------------------------------
def effect(kind, n=2):
    return lambda device: [Effect(kind, device).to(device) for _ in range(n)]


def ids_input(st):
    x = torch.randint(0, VOCAB, (SEQ, B), generator=st.data).to(st.device)
    return x, x


def ids_samples(st):
    return [(torch.randint(0, VOCAB, (SEQ, B), generator=st.sample_gen).to(st.device),)]


def scaled_second(st, x):
    """A forward over Returns layers whose second output views the first: each second output
    is scaled in place (eager autograd carries that into the first's history); the loss is
    taken of the last output and of every second output."""
    seconds = []
    for f in st.calls:
        x, second = f(x)
        second.mul_(2.0)
        seconds.append(second)
    return (x, *seconds)


def two_outputs(combine):
    """A forward over Returns layers: ``combine(y, second)`` feeds the next layer, and the
    loss is taken of the last output and of every second output."""
    def forward(st, x):
        seconds = []
        for f in st.calls:
            y, second = f(x)
            seconds.append(second)
            x = combine(y, second)
        return (x, *seconds)
    return forward


SIDE_EFFECTS = [
    Case("embedding-max-norm", "side-effects", "uses nn.Embedding(max_norm=1.0), which renormalises rows in place",
         build=lambda device: [Emb(max_norm=1.0).to(device)], samples=ids_samples, input=ids_input),
    Case("plain-tensor-stat", "side-effects", "updates a plain tensor attribute (not a buffer) in place",
         build=effect("stat"), observe=lambda st: {"stat": st.layers[0].stat}),
    Case("python-counter", "side-effects", "counts calls in a Python int attribute (self.calls += 1)",
         build=effect("counter"), observe=lambda st: {"calls": st.layers[0].calls}),
    Case("input-tensor-hook", "side-effects", "registers a hook on its input tensor in forward (scales its grad)",
         build=effect("input-hook")),
    Case("identity-cache", "side-effects", "caches a mask's transform by tensor identity (mask is self.src)",
         build=effect("identity-cache"), sample_kwargs=kw_samples(mask=lambda st: st.sample(SEQ, B, 1, grad=False)),
         forward=with_kw(mask=mask)),
    Case("stores-input", "side-effects", "keeps self.last_input = x and reads it after the step",
         build=effect("stores-input"), observe=lambda st: {"last input": st.layers[0].last_input,
                                                   "requires grad": st.layers[0].last_input.requires_grad}),
    Case("aux-loss-attribute", "side-effects", "stores an auxiliary loss on the module and adds it to the loss",
         build=effect("aux-loss"), forward=lambda st, x: (chain(st, x), 0.1 * sum(m.aux_loss for m in st.layers))),
    Case("returns-input", "side-effects", "returns its input as a second output (a residual), summed by the caller",
         build=nets(make=Returns, what="input"), forward=two_outputs(lambda y, r: y + r)),
    Case("returns-input-view", "side-effects", "returns a view of its input as a second output",
         build=nets(make=Returns, what="input-view"), forward=two_outputs(lambda y, v: y)),
    Case("output-view-updated-in-place", "side-effects",
         "returns a row of its output as a second output, and scales that row in place",
         build=nets(make=Returns, what="row"), forward=scaled_second),
    Case("lazy-parameter-reference", "side-effects",
         "keeps a reference to its own weight at its first call and computes with it after",
         build=nets(make=LazyTied)),
    Case("same-output-twice", "side-effects", "returns the same tensor twice",
         build=nets(make=Returns, what="same"), forward=two_outputs(lambda y, y2: y + 0.5 * y2)),
    Case("output-aliases-param", "side-effects", "returns a view of its weight (for a regulariser)",
         build=nets(make=Returns, what="param-view"), forward=two_outputs(lambda y, w: y)),
    Case("buffer-reassigned", "side-effects", "reassigns a registered buffer in forward (documented refusal)",
         build=effect("buffer-reassigned")),
    Case("item-in-forward", "side-effects", "logs each call's peak with .item() into a Python list in forward",
         build=effect("item"), observe=lambda st: {"peaks": tuple(st.layers[0].peaks)}),
]


# -- 4. Samples that share memory across callables --------------------------------------------------------
def shared_sample(st):
    x = st.sample(SEQ, B, H)
    return [(x,)] * len(st.layers)


def views(starts, length):
    def samples(st):
        big = st.sample(max(starts) + length, B, H, grad=False)
        return [(big[s:s + length].requires_grad_(),) for s in starts]
    return samples


def arg_samples(st):
    st.shared = [st.sample(SEQ, B, H) for _ in st.layers]
    return [(s,) for s in st.shared]


def input_is_sample(st):
    with torch.no_grad():
        st.buf.copy_(st.randn(SEQ, B, H))
    st.buf.grad = None
    return st.buf, st.buf


def graph_each_alone(with_mask: bool):
    """Each layer graphed by a make_graphed_callables call of its own, all with one sample
    tensor (and one mask in sample_kwargs)."""
    def graph(st):
        x = st.sample(SEQ, B, H)
        kwargs = {"mask": st.sample(SEQ, B, 1, grad=False)} if with_mask else {}
        return [call for layer in st.layers
                for call in st.make_graphed([layer], [(x,)], sample_kwargs=[kwargs] if with_mask else None)]
    return graph


SHARED_SAMPLES = [
    Case("one-sample-two-graphing-calls", "shared-samples",
         "passes one tensor as the sample of each layer, graphed by a make_graphed_callables call each",
         graph=graph_each_alone(False)),
    Case("one-mask-two-graphing-calls", "shared-samples",
         "one mask in the sample_kwargs of each layer, graphed by a call each, a mask per layer at call",
         build=nets(make=KwNet), graph=graph_each_alone(True),
         forward=lambda st, x: st.calls[1](st.calls[0](x, mask=mask(st)), mask=mask(st))),
    Case("one-sample-for-all", "shared-samples", "passes one tensor as every layer's sample ((x,),)*n",
         samples=shared_sample),
    Case("one-sample-recompute", "shared-samples", "one shared sample, with checkpoint() inside the layers",
         build=nets(make=Recompute), samples=shared_sample),
    Case("one-mask-sample", "shared-samples", "one mask in every layer's sample_kwargs, a mask per layer at call",
         build=nets(make=KwNet), sample_kwargs=lambda st: [{"mask": st.sample(SEQ, B, 1, grad=False)}] * 2,
         forward=lambda st, x: st.calls[1](st.calls[0](x, mask=mask(st)), mask=mask(st))),
    Case("sample-views-disjoint", "shared-samples", "samples are disjoint views of one buffer",
         samples=views([0, SEQ], SEQ)),
    Case("sample-views-overlap", "shared-samples", "samples are overlapping views of one buffer",
         samples=views([0, SEQ // 2], SEQ)),
    Case("sample-as-arg-and-kwarg", "shared-samples", "uses one sample tensor as the input and as the skip keyword",
         build=nets(make=KwNet), samples=arg_samples, sample_kwargs=lambda st: [{"skip": s} for s in st.shared],
         forward=with_kw(skip=lambda st: st.randn(SEQ, B, H))),
    Case("input-is-sample", "shared-samples", "feeds the sample tensor itself, refilled each microbatch",
         build=lambda device: dict(layers=nets()(device), buf=torch.zeros(SEQ, B, H, device=device, requires_grad=True)),
         samples=lambda st: [(st.buf,), (st.sample(SEQ, B, H),)], input=input_is_sample),
]


# -- 5. Nested tensors in the call ------------------------------------------------------------------------
def list_forward(st, x):
    for f in st.calls:
        x = f([x, st.randn(SEQ, B, H)])
    return x


def learned_scale(device):
    return dict(layers=nets(make=KwNet)(device), scale=torch.ones(H, device=device, requires_grad=True))


NESTED = [
    Case("rope-tuple-kwarg", "nested", "passes rotary embeddings as a keyword tuple (cos, sin)",
         build=nets(make=KwNet), sample_kwargs=kw_samples(rope=lambda st: (st.sample(SEQ, 1, H, grad=False),) * 2),
         forward=with_kw(rope=lambda st: (st.randn(SEQ, 1, H), st.randn(SEQ, 1, H)))),
    Case("dict-kwarg", "nested", "passes a dict of tensors {scale, shift}, new values at each call",
         build=nets(make=KwNet),
         sample_kwargs=kw_samples(extra=lambda st: {"scale": st.sample(H, grad=False), "shift": st.sample(H, grad=False)}),
         forward=with_kw(extra=lambda st: {"scale": st.randn(H), "shift": st.randn(H)})),
    Case("dict-kwarg-learned", "nested", "passes a dict of tensors, one of them learned (requires grad)",
         build=learned_scale,
         sample_kwargs=kw_samples(extra=lambda st: {"scale": st.sample(H), "shift": st.sample(H, grad=False)}),
         forward=with_kw(extra=lambda st: {"scale": st.scale, "shift": st.randn(H)}),
         observe=lambda st: {"scale grad": st.scale.grad}),
    Case("list-positional", "nested", "passes a list [x, gate] as the positional argument",
         build=nets(make=ListIn), forward=list_forward,
         samples=lambda st: [([st.sample(SEQ, B, H), st.sample(SEQ, B, H, grad=False)],) for _ in st.layers]),
    Case("kwarg-none-then-tensor", "nested", "graphs with mask=None, then passes a mask tensor",
         build=nets(make=KwNet), sample_kwargs=kw_samples(mask=lambda st: None), forward=with_kw(mask=mask)),
    Case("kwarg-tensor-then-none", "nested", "graphs with a mask tensor, then passes mask=None",
         build=nets(make=KwNet), sample_kwargs=kw_samples(mask=lambda st: st.sample(SEQ, B, 1, grad=False)),
         forward=with_kw(mask=lambda st: None)),
    Case("tuple-constant-and-tensor", "nested", "passes cfg=(0.5, tensor): a constant and a tensor in a tuple",
         build=nets(make=KwNet), sample_kwargs=kw_samples(cfg=lambda st: (0.5, st.sample(H, grad=False))),
         forward=with_kw(cfg=lambda st: (0.5, st.randn(H)))),
    Case("tuple-constant-changed", "nested", "changes the constant inside cfg=(c, tensor) after graphing",
         build=nets(make=KwNet), sample_kwargs=kw_samples(cfg=lambda st: (0.5, st.sample(H, grad=False))),
         forward=with_kw(cfg=lambda st: (getattr(st, "c", 0.5), st.randn(H))), change=at(1, set_attr("c", 0.7))),
]


# -- 6. Outputs read after the next replay ------------------------------------------------------------------
def two_forwards_one_loss(st):
    for _ in each_step(st):
        xs = [st.randn(SEQ, B, H, grad=True) for _ in range(st.case.micro)]
        ys = [chain(st, x) for x in xs]
        st.backward(sum(st.loss(y) for y in ys))
        st.log("outputs", tuple(ys))
        st.log("input grads", tuple(x.grad for x in xs))


def keep_outputs(st, x):
    y = chain(st, x)
    st.kept.append(y)
    return y


def read_previous(st, x):
    y = chain(st, x)
    if st.kept:
        st.log("previous microbatch's output", st.kept[-1])
    st.kept.append(y)
    return y


def retain_first(st, x):
    h = st.calls[0](x)
    h.retain_grad()
    st.kept.append(h)
    return st.calls[1](h)


def fed_back(st, x):
    y = chain(st, x if not st.kept else st.kept[-1])
    st.kept.append(y.detach())
    return y


OUTPUTS = [
    Case("read-after-next-microbatch", "outputs", "reads microbatch 1's output after microbatch 2's forward",
         forward=read_previous),
    Case("keep-outputs-across-steps", "outputs", "keeps every output (uncloned) for logging, reads them after each step",
         forward=keep_outputs, observe=lambda st: {"kept": tuple(st.kept)}),
    Case("two-forwards-one-loss", "outputs", "runs two microbatches' forwards, then one backward of the summed loss",
         train=two_forwards_one_loss),
    Case("layer-called-twice", "outputs", "calls one graphed layer twice per forward: l1(l0(l0(x)))",
         forward=lambda st, x: st.calls[1](st.calls[0](st.calls[0](x)))),
    Case("retain-grad-output", "outputs", "retain_grad() on a layer output, reads the grad after the next microbatch",
         forward=retain_first, observe=lambda st: {"kept grads": tuple(h.grad for h in st.kept)}),
    Case("output-fed-back", "outputs", "feeds the last output (detached) back as the next microbatch's input",
         forward=fed_back),
]


# -- 7. Rounding ------------------------------------------------------------------------------------------
def tie(layers):
    layers[1].lin1.weight = layers[0].lin1.weight


def used_outside(st, x):
    h = st.calls[0](x)
    return st.calls[1](h) + 0.5 * h


ROUNDING = [
    Case("tied-weight", "rounding", "ties one weight between two graphed layers", build=nets(then=tie)),
    Case("transposed-input", "rounding", "feeds a transposed (non-contiguous) input",
         input=make_input((B, SEQ, H), view=lambda t: t.transpose(0, 1))),
    Case("expanded-input", "rounding", "feeds an expanded (stride-0) input",
         input=make_input((1, B, H), view=lambda t: t.expand(SEQ, B, H))),
    Case("channels-last-input", "rounding", "feeds a channels-last image to graphed convolutions",
         build=nets(make=Conv), samples=lambda st: [(st.sample(B, 4, 8, 8),) for _ in st.layers],
         input=make_input((B, 4, 8, 8), view=lambda t: t.contiguous(memory_format=torch.channels_last)),
         documented="an input in another memory layout than its sample",
         # what the graphs compute: the input copied into its sample's (contiguous) layout
         same_as=Case("channels-last-input-copied", "rounding", "the same, the input copied to a contiguous one",
                      build=nets(make=Conv), samples=lambda st: [(st.sample(B, 4, 8, 8),) for _ in st.layers],
                      input=make_input((B, 4, 8, 8), view=lambda t: t.contiguous(memory_format=torch.channels_last).contiguous()))),
    Case("input-also-used-outside", "rounding", "uses a layer's input inside (residual) and outside the layer",
         build=nets(make=Residual), forward=used_outside,
         documented="an input that the layer uses more than once and that also feeds other operations"),
]


# -- 8. Others --------------------------------------------------------------------------------------------
def regraph(st):
    if st.graphing:
        te_graph.reset(st.graphed[-1])  # the modules get their eager forwards back
        st.calls = st.make_graphed(st.layers, default_samples(st))


def closure(device):
    holder = nn.Linear(H, H).to(device)
    return dict(layers=[lambda x: torch.tanh(x @ holder.weight.t())], model=holder)


def teacher(st):
    if st.step_i == 0:
        st.teacher = copy.deepcopy(st.layers[0]).eval().requires_grad_(False)
    with torch.no_grad():
        return {"teacher output": st.teacher(st.randn(SEQ, B, H))}


def clip_train(st):
    for _ in each_step(st):
        microbatches(st)
        st.log("grad norm", torch.nn.utils.clip_grad_norm_(st.model.parameters(), 0.05))


OTHERS = [
    Case("regraph-after-reset", "other", "te_graph.reset(), then graphs again mid-training",
         change=at(1, regraph)),
    Case("graph-twice", "other", "graphs the same modules again without reset (re-running a notebook cell)",
         change=at(1, lambda st: st.graphing and st.make_graphed(st.layers, default_samples(st)))),
    Case("other-batch-size", "other", "calls with batch size 3 after graphing with 2",
         input=make_input(lambda st: (SEQ, 3 if st.step_i >= 1 else B, H))),
    Case("token-ids", "other", "feeds int64 token ids to an embedding",
         build=lambda device: [Emb().to(device)], samples=ids_samples, input=ids_input),
    Case("function-closure", "other", "graphs a function closing over a parameter",
         build=closure, samples=lambda st: [(st.sample(SEQ, B, H),)]),
    Case("clip-grad-norm", "other", "clips the gradient norm before the optimizer step", train=clip_train),
    Case("deepcopy-teacher", "other", "deep-copies a graphed layer as a frozen eval-mode teacher", observe=teacher),
    Case("input-grad-sometimes", "other", "feeds inputs requiring grad only in even microbatches",
         input=make_input(grad=lambda st: st.mb % 2 == 0)),
]

CASES = CHANGED + GRADS + SIDE_EFFECTS + SHARED_SAMPLES + NESTED + OUTPUTS + ROUNDING + OTHERS
