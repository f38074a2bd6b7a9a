"""Bad input to make_graphed_callables: the exact error, raised before anything changes."""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import rng
from te_graph import make_graphed_callables

CUDA = torch.cuda.is_available()


class Lin(nn.Module):
    def __init__(self, device="cpu"):
        super().__init__()
        self.lin = nn.Linear(4, 4, device=device)

    def forward(self, x, scale=1.0):
        return self.lin(x) * scale


def _x(device="cpu", requires_grad=True):
    return torch.randn(3, 4, device=device, requires_grad=requires_grad)


def _unchanged(module, forward_before):
    assert module.forward == forward_before
    assert all(p.grad is None for p in module.parameters())


def test_non_tensor_positional_sample_arg():
    m = Lin()
    forward = m.forward
    with pytest.raises(TypeError, match=r"positional sample arg 1 of callable 0 \(Lin\) is a float; positional sample args must be tensors .* Pass constants as sample_kwargs instead"):
        make_graphed_callables(m, (_x(), 2.0), eager_replay=True)
    _unchanged(m, forward)


def test_hooks_on_a_submodule():
    m = Lin()
    m.lin.register_forward_hook(lambda *a: None)
    forward = m.forward
    with pytest.raises(ValueError, match=r"submodule 'lin' of callable 0 has hooks registered \(_forward_hooks\); hooks would run only once, during capture\. Remove them before graphing"):
        make_graphed_callables(m, (_x(),), eager_replay=True)
    _unchanged(m, forward)


def test_buffer_requiring_grad():
    m = Lin()
    m.register_buffer("running", torch.zeros(4, requires_grad=True))
    with pytest.raises(ValueError, match=r"buffer 'running' of callable 0 requires grad; only parameters may be trainable in a graphed module\. Make it a Parameter or call \.requires_grad_\(False\)"):
        make_graphed_callables(m, (_x(),), eager_replay=True)


def test_mixed_training_modes():
    a, b = Lin(), Lin().eval()
    with pytest.raises(ValueError, match=r"callables are in mixed training modes \(callable 0 is in train mode, callable 1 in eval mode\).*Call \.train\(\) or \.eval\(\) on all of them"):
        make_graphed_callables((a, b), ((_x(),), (_x(),)), eager_replay=True)


def test_sample_count_mismatch():
    with pytest.raises(ValueError, match=r"Got 2 callables but 1 sample_args; without an order each callable takes exactly one sample args tuple"):
        make_graphed_callables((Lin(), Lin()), ((_x(),),), eager_replay=True)
    with pytest.raises(ValueError, match=r"got 1 sample_args but 2 sample_kwargs; give one dict of sample kwargs per tuple of sample args"):
        make_graphed_callables((Lin(),), ((_x(),),), sample_kwargs=({}, {}), eager_replay=True)


def test_zero_warmup_iterations():
    with pytest.raises(ValueError, match=r"num_warmup_iters=0; at least 1 warmup pass is needed"):
        make_graphed_callables(Lin(), (_x(),), num_warmup_iters=0, eager_replay=True)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda: torch.randn(5, 4, requires_grad=True), r"positional input 0 has shape \(5, 4\), dtype torch.float32, device cpu, but the graph was captured with shape \(3, 4\)"),
        (lambda: torch.randn(3, 4, dtype=torch.float64, requires_grad=True), r"positional input 0 has shape \(3, 4\), dtype torch.float64, device cpu, but the graph was captured with shape \(3, 4\), dtype torch.float32"),
    ],
    ids=["shape", "dtype"],
)
def test_replay_input_mismatch(bad, message):
    graphed = make_graphed_callables(Lin(), (_x(),), eager_replay=True)
    with pytest.raises(ValueError, match=message + r".*A graph replays fixed shapes"):
        graphed(bad())


def test_replay_input_requiring_grad_that_the_sample_did_not():
    graphed = make_graphed_callables(Lin(), (_x(requires_grad=False),), eager_replay=True)
    graphed(_x(requires_grad=False))
    with pytest.raises(ValueError, match=r"positional input 0 requires grad, but its sample did not, so the graph computes no gradient for it\. Capture with a sample that requires grad"):
        graphed(_x())


def test_replay_constant_kwarg_must_match():
    graphed = make_graphed_callables(Lin(), (_x(),), sample_kwargs={"scale": 2.0}, eager_replay=True)
    graphed(_x(), scale=2.0)
    with pytest.raises(ValueError, match=r"keyword argument 'scale' is 3.0 but was 2.0 at capture; non-tensor keyword arguments are baked into the graph"):
        graphed(_x(), scale=3.0)
    with pytest.raises(ValueError, match=r"called with keyword arguments \[\], but the graph was captured with \['scale'\]"):
        graphed(_x())


@pytest.mark.skipif(CUDA, reason="checks the CPU-only machine's error")
def test_cuda_unavailable_points_to_eager_replay():
    with pytest.raises(RuntimeError, match=r"CUDA is not available, and capturing CUDA graphs needs a CUDA device\. To debug on a machine without graphs, pass eager_replay=True \(or set TE_GRAPH_EAGER_REPLAY=1\)"):
        make_graphed_callables(Lin(), (_x(),))


def test_te_spellings_and_arguments():
    with pytest.raises(TypeError, match=r"got both order= and _order=; pass one of them"):
        make_graphed_callables((Lin(),), ((_x(),),), order=[1, -1], _order=[1, -1], eager_replay=True)
    with pytest.raises(NotImplementedError, match=r"FP8 capture is not supported"):
        make_graphed_callables(Lin(), (_x(),), fp8_enabled=True, eager_replay=True)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bogus'"):
        make_graphed_callables(Lin(), (_x(),), bogus=1, eager_replay=True)
    # TE's spelling of the order works the same as ours (one layer, two microbatches).
    m = Lin()
    graphed = make_graphed_callables((m,), ((_x(),), (_x(),)), _order=[1, 1, -1, -1], fp8_enabled=False, eager_replay=True)
    assert len(graphed) == 2


def test_failed_capture_leaves_process_and_model_as_they_were():
    class Fails(Lin):
        calls = 0

        def forward(self, x):
            Fails.calls += 1
            y = torch.nn.functional.dropout(self.lin(x), 0.5)
            if Fails.calls == 2:
                raise RuntimeError("boom in the second warmup pass")
            return y

    rng.model_parallel_cuda_manual_seed(3)
    m = Fails()
    m.lin.weight.grad = torch.ones_like(m.lin.weight)
    forward = m.forward
    sample = (_x(),)
    before = torch.get_rng_state(), rng.get_cuda_rng_tracker().get_states()
    with pytest.raises(RuntimeError, match="boom in the second warmup pass"):
        make_graphed_callables(m, sample, eager_replay=True)
    assert m.forward == forward
    assert torch.equal(m.lin.weight.grad, torch.ones_like(m.lin.weight)), "grads put back"
    assert m.lin.bias.grad is None
    assert gc.isenabled()
    assert torch.equal(torch.get_rng_state(), before[0]), "RNG put back"
    after = rng.get_cuda_rng_tracker().get_states()
    assert all(
        torch.equal(rng.to_byte_state(after[k]), rng.to_byte_state(before[1][k])) for k in after
    )


# -- GPU-only errors --------------------------------------------------------------------
@pytest.mark.gpu
def test_cpu_tensors_to_graph_capture():
    with pytest.raises(ValueError, match=r"callable 0 \(Lin\) has a tensor on cpu .*CUDA graphs capture CUDA tensors only\. Move the module and its inputs to CUDA\. To debug on a machine without graphs, pass eager_replay=True"):
        make_graphed_callables(Lin("cpu"), (_x("cpu"),))


@pytest.mark.gpu
def test_autocast_cache_enabled():
    m = Lin("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match=r"autocast is enabled with its cache.*Use torch\.autocast\(\.\.\., cache_enabled=False\)"):
            make_graphed_callables(m, (_x("cuda"),))
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        graphed = make_graphed_callables(m, (_x("cuda"),))
        y = graphed(_x("cuda"))
    assert y.dtype == torch.bfloat16


@pytest.mark.gpu
def test_replay_input_on_another_device():
    graphed = make_graphed_callables(Lin("cuda"), (_x("cuda"),))
    with pytest.raises(ValueError, match=r"positional input 0 has shape \(3, 4\), dtype torch.float32, device cpu, but the graph was captured with shape \(3, 4\), dtype torch.float32, device cuda:0"):
        graphed(_x("cpu"))


@pytest.mark.gpu
def test_failed_graph_capture_leaves_process_usable():
    """A capture that fails inside the graph (a host sync is illegal while capturing)
    leaves the model, RNG and CUDA usable; graphing a good module afterwards works."""

    class Syncs(Lin):
        def forward(self, x):
            y = self.lin(x)
            if torch.cuda.is_current_stream_capturing():
                y.sum().item()  # illegal during capture
            return y

    rng.model_parallel_cuda_manual_seed(4)
    m = Syncs("cuda")
    forward = m.forward
    sample = (_x("cuda"),)
    before = rng.get_rng_state("cuda").get_offset()
    with pytest.raises(RuntimeError):
        make_graphed_callables(m, sample)
    assert m.forward == forward
    assert all(p.grad is None for p in m.parameters())
    assert rng.get_rng_state("cuda").get_offset() == before
    assert gc.isenabled()
    good = make_graphed_callables(Lin("cuda"), (_x("cuda"),))
    good(_x("cuda")).sum().backward()
    torch.cuda.synchronize()
