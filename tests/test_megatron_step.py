"""megatron-core's own training step as one whole-step graph
(``te_graph.integrations.megatron.make_graphed_train_step``).

examples/megatron_gpt.py trains GPTModel (Transformer Engine layer spec, bf16) through
megatron-core's schedule (``get_forward_backward_func`` over 4 microbatches) and its DDP
(``main_grad``, gradient-accumulation fusion): eagerly, with the whole step graphed
(``--graphs te_graph_step``: every microbatch, DDP's accumulation and reduction, plain SGD
inside the graph, or Megatron's optimizer eagerly after it) and with that graph's eager
replay, in one fresh process per setup; every step's losses, ``main_grad`` buffers and
weights after the optimizer step are compared bitwise (tests/test_megatron_path.py's
helpers). FP8 is refused by name (not yet run through this path on a GPU). Dropout is on in every setup, which Megatron's own ``full_iteration`` graphs do not
allow with recompute. Refusals: Megatron settings that wait for the GPU on the host, named
before anything changes, and a host read in the loss function, refused at capture with
everything put back. Needs a GPU, megatron-core 0.19 and Transformer Engine 2.20.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests import harness
from tests.test_megatron_path import SETUPS as PATH_SETUPS
from tests.test_megatron_path import ROOT, _run, _trace, pytestmark, rows  # noqa: F401 - pytestmark: its marks
from tests.multi_gpu_helpers import fresh_process_env

WHOLE = ("te_graph_step", "te_graph_step_replay")

# The per-layer path's setups this path shares, then its own.
SETUPS = {name: PATH_SETUPS[name] for name in (
    "bf16-dropout", "bf16-dropout-fusion", "full-recompute-dropout", "selective-recompute-dropout", "rope-dropout")}
SETUPS.update({
    # Megatron's optimizer (fp32 main weights, gradient clipping) steps eagerly after each replay.
    "megatron-optimizer": ["--dropout", "0.1", "--fusion", "1", "--optimizer", "megatron"],
    # DDP reduces each bucket from its grad hooks as the last microbatch's gradients are ready.
    "overlap-grad-reduce-megatron-optimizer": ["--dropout", "0.1", "--fusion", "1", "--overlap-grad-reduce", "1",
                                               "--optimizer", "megatron"],
    # The distributed optimizer on one GPU: the graph reduce-scatters the buffer, the eager
    # optimizer steps its shard and gathers the parameters.
    "distributed-optimizer": ["--dropout", "0.1", "--fusion", "1", "--dist-opt", "1"],
    # The graph freed and made again before step 3.
    "regraph-dropout": ["--dropout", "0.1", "--fusion", "1", "--regraph-at", "3"],
    # te_graph's verifier runs every graphed step again eagerly and compares, bitwise.
    "verify-full-recompute": ["--dropout", "0.1", "--fusion", "1", "--recompute", "full", "--step-verify", "1"],
})


@pytest.mark.parametrize("setup", rows(SETUPS))
def test_megatron_step_graphed_whole_trains_as_eager(tmp_path, setup):
    records = _run(tmp_path, list(setup.args), graphs="eager," + ",".join(WHOLE))[0]
    eager = records["eager"]
    for mode in WHOLE:
        assert records[mode]["graphed_with"] == "te_graph.integrations.megatron.step", records[mode]["graphed_with"]
        assert len(records[mode]["losses"]) == len(eager["losses"]) == 4
        harness.assert_same(_trace(records[mode]), _trace(eager), f"{setup.id}, {mode}")


# In a fresh process: GPTModel with DDP (examples/megatron_gpt.py's _build), then
# make_graphed_train_step with a setting that waits on the host (refused by name before
# anything changes: the weights, the main_grads and DDP's gradient accumulators are as
# before), and with a loss function that reads the loss on the host (refused at capture,
# naming the line, with the weights and main_grads put back).
_REFUSED = """
import json, sys
import torch
from examples import megatron_gpt
from te_graph.integrations import megatron as integration

cfg = megatron_gpt.RunConfig(layers=2, hidden=256, heads=4, seq=128, dropout=0.1)
megatron_gpt.setup_process(cfg)
integration.enable()
model, config, _ = megatron_gpt._build(cfg)
sample = megatron_gpt._batches(cfg)
batches = [next(sample) for _ in range(cfg.microbatches)]
params = [p for p in model[0].parameters() if p.requires_grad]

def state():
    return [p.detach().clone() for p in params] + [p.main_grad.clone() for p in params]

def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))

def graph(forward_step):
    return integration.make_graphed_train_step(forward_step, model, batches, num_microbatches=cfg.microbatches,
                                               seq_length=cfg.seq, micro_batch_size=cfg.micro_batch)

def attempt(what, forward_step=megatron_gpt._forward_step):
    before, count = state(), len(model[0].grad_accs)
    for acc in model[0].grad_accs:  # marked, not held: the graph's path makes them again where it may
        acc.metadata[what] = True
    del acc
    try:
        graph(forward_step)
    except Exception as error:
        after = state()
        kept = len(model[0].grad_accs) == count and all(acc.metadata.get(what) for acc in model[0].grad_accs)
        print(json.dumps({"what": what, "error": type(error).__name__, "message": str(error),
                          "unchanged": same(before, after), "accumulators_kept": kept}), flush=True)
    else:
        print(json.dumps({"what": what, "error": None}), flush=True)

model[0].ddp_config.check_for_nan_in_grad = True
attempt("check_for_nan_in_grad")
model[0].ddp_config.check_for_nan_in_grad = False
config.timers = object()
attempt("timers")
config.timers = None
config.fp8 = "hybrid"
attempt("fp8")
config.fp8 = None

def reads_loss(data, model_):
    output, loss_func = megatron_gpt._forward_step(data, model_)

    def on_host(out):
        loss, reduced = loss_func(out)
        if loss.item() > 1e9:
            raise RuntimeError("diverged")
        return loss, reduced
    return output, on_host

attempt("item", reads_loss)
"""


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    """What the script found, by what it tried (a file, so that refusals can name its lines)."""
    script = tmp_path_factory.mktemp("refusals") / "refusals.py"
    script.write_text(_REFUSED)
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=fresh_process_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {f["what"]: f for f in found}


def test_a_host_syncing_megatron_setting_is_refused_by_name_before_anything_changes(refusals):
    nan = refusals["check_for_nan_in_grad"]
    assert nan["error"] == "ValueError", nan
    assert re.match(r"make_graphed_train_step: the step cannot be one graph: "
                    r"DistributedDataParallelConfig\(check_for_nan_in_grad=True\) reads each gradient bucket's norm on "
                    r"the host before the reduction; set check_for_nan_in_grad=False", nan["message"]), nan["message"]
    timers = refusals["timers"]
    assert timers["error"] == "ValueError", timers
    assert "config.timers is set: Megatron's timers synchronize the device" in timers["message"], timers["message"]
    assert "set config.timers = None" in timers["message"]
    fp8 = refusals["fp8"]
    assert fp8["error"] == "ValueError", fp8
    assert "config.fp8='hybrid': FP8 through megatron-core's whole step (Transformer Engine's scaling state" \
        in fp8["message"], fp8["message"]
    for found in (nan, timers, fp8):
        assert found["unchanged"] and found["accumulators_kept"], found


def test_a_host_read_in_the_loss_function_is_refused_at_capture_with_everything_put_back(refusals):
    item = refusals["item"]
    assert item["error"] == "HostSyncError", item
    assert re.search(r"make_graphed_callables: the graphed step waits for the GPU from the host while it is captured: "
                     r".* at \S*refusals\.py:\d+ \(`if loss\.item\(\) > 1e9:`\)", item["message"]), item["message"]
    assert item["unchanged"], item
