"""Held outputs stay valid memory (``tests/held_outputs.py``): after reset, other graphs in
the same and another pool, collection of the graphed modules and a refilled allocator
cache, the kept tensors equal eager's bit for bit; outputs a later replay overwrote raise
the documented error, never other values. GPU rows run in a process of their own."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.harness import EAGER_REPLAY, GRAPHED
from tests.held_outputs import held_outputs, reused_outputs
from tests.multi_gpu_helpers import fresh_process_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Transformer Engine and te_graph's integration of it.
HAVE_TE = all(importlib.util.find_spec(m) is not None for m in ("transformer_engine", "te_graph.integrations.transformer_engine"))


def _in_own_process(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.held_outputs", *argv], cwd=ROOT, env=fresh_process_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the run failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_held(found: dict, overwritten: str) -> None:
    """Kept tensors equal eager's; earlier outputs are ``overwritten`` ("raised" where torch
    can poison, "equal" where the outputs are tensors of their own)."""
    assert set(found["kept"]) == {"equal"}, found["kept"]
    assert found["collected"] == "equal"
    assert found["earlier"] == [overwritten] * len(found["earlier"]), found["earlier"]


GPU_ROWS = [pytest.param("torch", "graphs", id="torch-graphs"),
            pytest.param("torch", "eager-replay", id="torch-eager-replay"),
            pytest.param("te", "graphs", id="te-graphs",
                         marks=pytest.mark.skipif(not HAVE_TE, reason="needs Transformer Engine")),
            pytest.param("te", "eager-replay", id="te-eager-replay",
                         marks=pytest.mark.skipif(not HAVE_TE, reason="needs Transformer Engine"))]


@pytest.mark.gpu
@pytest.mark.parametrize("layers, mode", GPU_ROWS)
def test_held_outputs_stay_valid_after_reset_other_graphs_and_empty_cache(layers, mode):
    _assert_held(_in_own_process(layers, mode), "raised")


def test_held_outputs_stay_valid_in_eager_replay_cpu():
    _assert_held(held_outputs("torch", "cpu", EAGER_REPLAY), "equal")


# One chunk, 1F1B over four microbatches: microbatches 0 and 1 hand their buffers on to 2 and 3,
# whose own outputs stay theirs (no later forward takes them).
REUSED_BY_LATER = ["raised", "raised", "equal", "equal"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", GRAPHED["cuda"])
def test_outputs_in_reused_buffers_raise_once_their_backward_ran_and_after_reset(mode):
    found = _in_own_process("reuse", mode)
    assert found == {"after_backward": REUSED_BY_LATER, "after_reset": REUSED_BY_LATER}, found


def test_outputs_in_reused_buffers_keep_their_values_in_eager_replay_cpu():
    """On the CPU nothing can be poisoned: eager replay's outputs are tensors of their own."""
    assert reused_outputs("cpu", EAGER_REPLAY) == {"after_backward": ["equal"] * 4, "after_reset": ["equal"] * 4}
