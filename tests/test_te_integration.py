"""Transformer Engine's integration (``te_graph.integrations.transformer_engine``) on the CPU,
without Transformer Engine: the FP8 arguments it adds to ``make_graphed_callables`` (TE's
spellings, checked before anything changes), and the per-call check of the ``main_grad`` its
fused weight-gradient kernels write by address. Skipped where the integration does not
import; Transformer Engine's own layers are in tests/test_te_layers.py (GPU)."""
from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from te_graph import make_graphed_callables
from tests.graph_helpers import require
from tests import test_frozen as frozen
from tests.test_errors import Lin, _x

require("te_graph.integrations.transformer_engine", "Transformer Engine's integration")


def test_te_spellings_and_arguments():
    # TE's FP8 arguments: checked before anything changes; FP8 itself needs TE.
    with pytest.raises(ValueError, match=re.escape("both fp8_enabled= (deprecated) and enabled= are set; pass enabled= only.")):
        make_graphed_callables(Lin(), (_x(),), fp8_enabled=True, enabled=True, eager_replay=True)
    with pytest.raises(ValueError, match=re.escape("enabled= has 1 entries for 2 callables; give one bool, or one per callable.")):
        make_graphed_callables((Lin(), Lin()), ((_x(),), (_x(),)), enabled=(True,), eager_replay=True)
    with pytest.raises(TypeError, match=re.escape("enabled= must be a bool or a tuple of bools (one per callable), got 'yes'.")):
        make_graphed_callables(Lin(), (_x(),), enabled="yes", eager_replay=True)
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(RuntimeError, match=re.escape("FP8 capture needs Transformer Engine (transformer_engine.pytorch), which does not import here")):
            make_graphed_callables(Lin(), (_x(),), enabled=True, eager_replay=True)
    with pytest.warns(DeprecationWarning, match=re.escape("fp8_enabled= is deprecated (as in Transformer Engine); use enabled=.")):
        make_graphed_callables(Lin(), (_x(),), fp8_enabled=False, eager_replay=True)
    # TE's spelling of the order, with its FP8 argument off (one layer, two microbatches).
    m = Lin()
    graphed = make_graphed_callables((m,), ((_x(),), (_x(),)), _order=[1, 1, -1, -1], enabled=False, eager_replay=True)
    assert len(graphed) == 2


def test_a_fused_main_grad_in_other_memory_is_refused():
    """Transformer Engine's fused weight-gradient kernels (``fuse_wgrad_accumulation``) write
    ``main_grad`` by address; megatron-core DDP's offload and reload of its grad buffers keep
    the tensor object and move its memory."""
    net = frozen.Net()
    net.lin1.fuse_wgrad_accumulation = True
    net.lin1.weight.main_grad = torch.zeros(frozen.H, frozen.H, dtype=torch.float32)
    m = frozen._graphed(net)
    m(frozen._x())  # served while main_grad stays
    m.lin1.weight.main_grad.set_(torch.zeros(frozen.H, frozen.H, dtype=torch.float32))  # the same object, new memory
    frozen._refused(m, "callable 0 (Net): since graphing, main_grad of parameter 'lin1.weight' now lies at another "
                "address (megatron-core DDP's offload and reload of its grad buffers, or a reallocation), which "
                "the fused weight-gradient kernels write by address. " + frozen._REGRAPH)
