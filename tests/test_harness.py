"""The harness itself (tests/harness.py): its comparison tells every kind of difference from
equality, and a refusal passes only with the exact class and message and nothing changed;
the other tests' verdicts rest on both."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

import rng
from tests import harness
from tests.harness import EAGER, EAGER_REPLAY, GRAPHS, Trace


def _trace() -> Trace:
    t = Trace()
    t.outputs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, float("nan")])]
    t.param_grads = [[torch.ones(2), None]]
    t.hook_calls = {"tensor": 2}
    return t


def test_difference_names_the_first_difference_of_every_kind():
    want = _trace()
    assert harness.difference(_trace(), want, nan_equal=True) is None
    assert "outputs[1] differs" in harness.difference(_trace(), want)  # NaN is not NaN unless asked
    changed = _trace()
    changed.outputs[0] = torch.tensor([1.0, 2.5])
    assert harness.difference(changed, want) == "outputs[0] differs (max abs diff 0.5)"
    changed = _trace()
    changed.outputs.pop()
    assert harness.difference(changed, want) == "outputs: 1 entries, eager has 2"
    changed = _trace()
    changed.param_grads[0][1] = torch.zeros(2)
    assert harness.difference(changed, want, nan_equal=True) == "param_grads[0][1]: tensor(2,) torch.float32, eager None"
    changed = _trace()
    changed.outputs[0] = changed.outputs[0].double()
    assert "outputs[0]: tensor(2,) torch.float64" in harness.difference(changed, want, nan_equal=True)
    changed = _trace()
    changed.hook_calls = {"tensor": 3}
    assert harness.difference(changed, want, nan_equal=True) == "hook_calls.tensor: 3, eager 2"
    changed.hook_calls = {"post_accumulate": 2}
    assert harness.difference(changed, want, nan_equal=True) == "hook_calls: keys ['post_accumulate'], eager ['tensor']"
    assert harness.difference({"a": [1]}, {"a": [1]}) is None
    assert harness.difference(torch.tensor([0.0]), torch.tensor([1.0]), "x", reference="theirs") == (
        "x differs (max abs diff 1)")


def test_difference_takes_sparse_tensors_by_value_and_meta_tensors_by_the_rest():
    a = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    assert harness.difference(a.to_sparse(), a.to_sparse()) is None
    assert harness.difference((a * 2).to_sparse(), a.to_sparse(), "x") == "x differs (max abs diff 2)"
    assert harness.difference(a.to_sparse(), a, "x") == (
        "x: tensor(2, 2) torch.float32 sparse_coo on cpu, eager tensor(2, 2) torch.float32 on cpu")
    assert harness.difference(torch.empty(2, device="meta"), torch.empty(2, device="meta")) is None
    assert harness.difference(torch.empty(3, device="meta"), torch.empty(2, device="meta"), "x") == (
        "x: tensor(3,) torch.float32 on meta, eager tensor(2,) torch.float32 on meta")


def test_assert_same_fails_with_what_differs():
    harness.assert_same(Trace(outputs=[torch.ones(1)]), Trace(outputs=[torch.ones(1)]))
    with pytest.raises(AssertionError, match=re.escape("graphs: outputs[0] differs (max abs diff 1)")):
        harness.assert_same(Trace(outputs=[torch.ones(1)]), Trace(outputs=[torch.zeros(1)]), "graphs")


def test_trace_records_copies():
    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))]
    y, x = torch.ones(2), torch.ones(2, requires_grad=True)
    x.grad = torch.full((2,), 3.0)
    params[0].grad = torch.ones(2)
    params[1].main_grad = torch.zeros(2)
    trace = Trace()
    trace.microbatch(y, x)
    trace.step(params)
    trace.end(params, [nn.BatchNorm1d(2)])
    y.add_(1)
    x.grad.add_(1)
    params[0].grad.add_(1)
    assert torch.equal(trace.outputs[0], torch.ones(2)) and torch.equal(trace.input_grads[0], torch.full((2,), 3.0))
    assert torch.equal(trace.param_grads[0][0], torch.ones(2)) and trace.param_grads[0][1] is None
    assert len(trace.weights) == 2 and len(trace.buffers) == 3 and len(trace.main_grads) == 1


def test_differential_runs_eager_first_and_each_mode_against_it():
    runs = []

    def run(mode):
        runs.append(mode)
        return Trace(outputs=[torch.ones(1) * (2 if mode == GRAPHS else 1)])

    harness.differential(run, [EAGER_REPLAY])
    with pytest.raises(AssertionError, match=re.escape("row, graphs: outputs[0] differs")):
        harness.differential(run, [EAGER_REPLAY, GRAPHS], "row")
    assert runs == [EAGER, EAGER_REPLAY, EAGER, EAGER_REPLAY, GRAPHS]
    assert harness.eager_replay(EAGER_REPLAY) and not harness.eager_replay(GRAPHS)
    with pytest.raises(ValueError, match="is not graphed"):
        harness.eager_replay(EAGER)


def test_device_modes_are_the_graphed_modes_of_each_device():
    every = [(device, harness.eager_replay(mode)) for device, modes in harness.GRAPHED.items() for mode in modes]
    assert [tuple(p.values) for p in harness.ALL_DEVICE_MODES] == every
    assert [p.id for p in harness.ALL_DEVICE_MODES] == ["eager-replay-cpu", "graphs", "eager-replay-cuda"]
    assert [p.id for p in harness.DEVICE_MODES] == ["eager-replay-cpu", "graphs"]
    assert all(harness.DEVICE_MODES[i] is p for i, p in enumerate(harness.ALL_DEVICE_MODES[:2]))
    assert [[m.name for m in p.marks] for p in harness.ALL_DEVICE_MODES] == [[], ["gpu"], ["gpu"]]


def test_refused_needs_the_class_the_message_and_nothing_changed():
    m = nn.Linear(2, 2)
    m.weight.grad = torch.ones(2, 2)
    m.bias.main_grad = torch.zeros(2)
    rng.model_parallel_cuda_manual_seed(3)
    with harness.refused(ValueError, "no", m):
        raise ValueError("no")
    with pytest.raises(AssertionError, match="raised KeyError, not LookupError"):
        with harness.refused(LookupError, "no", m):
            raise KeyError("no")
    with pytest.raises(AssertionError, match="Regex pattern did not match"):
        with harness.refused(ValueError, "yes", m):
            raise ValueError("no")
    with pytest.raises(KeyError, match="other"):
        with harness.refused(ValueError, "no", m):
            raise KeyError("other")
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        with harness.refused(ValueError, "no", m):
            pass
    changes = {
        "parameter weight differs": lambda: m.weight.data.add_(1),
        "grad of parameter weight differs": lambda: m.weight.grad.mul_(2),
        "grad of parameter weight (the object): None, before the Tensor": lambda: setattr(m.weight, "grad", None),
        "grad of parameter bias: tensor(2,) torch.float32, before None": lambda: setattr(m.bias, "grad", torch.zeros(2)),
        "forward of the module": lambda: setattr(m, "forward", lambda x: x),
        "the CPU generator": lambda: torch.rand(1),
        "the RNG tracker's streams": lambda: rng.model_parallel_cuda_manual_seed(4),
        "main_grad of parameter bias differs": lambda: m.bias.main_grad.add_(1),
    }
    for what, change in changes.items():
        with pytest.raises(AssertionError, match=re.escape(what)):
            with harness.refused(ValueError, "no", m):
                change()
                raise ValueError("no")
    sample = torch.zeros(2)
    with pytest.raises(AssertionError, match="tensor differs"):
        with harness.refused(ValueError, "no", sample):
            sample.add_(1)
            raise ValueError("no")
    with harness.refused(ValueError, "no", random=False):
        torch.rand(1)
        raise ValueError("no")


def test_snapshot_sees_a_parameter_or_buffer_replaced_by_an_equal_one():
    m = nn.BatchNorm1d(2)
    snapshot = harness.Snapshot(m)
    m.weight = nn.Parameter(m.weight.detach().clone())
    m.running_mean = m.running_mean.clone()
    changes = snapshot.changes()
    assert any(c.startswith("parameter weight (the object): the Parameter at") for c in changes), changes
    assert any(c.startswith("buffer running_mean (the object): the Tensor at") for c in changes), changes
    assert len(changes) == 2, "equal values"


@dataclasses.dataclass(frozen=True)
class _Row(harness.Row):
    id: str
    gpu_only: bool = False


def test_rows_run_where_they_can_with_their_ids():
    rows = [_Row("both"), _Row("gpu", gpu_only=True)]
    cpu, cuda = harness.params(rows, "cpu"), harness.params(rows, "cuda")
    assert [p.id for p in cpu] == ["both"] and not cpu[0].marks
    assert [p.id for p in cuda] == ["both", "gpu"] and all(p.marks[0].name == "gpu" for p in cuda)
    assert str(rows[1]) == "gpu"
