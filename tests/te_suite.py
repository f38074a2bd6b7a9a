"""Transformer Engine's own CUDA-graph tests, run against te_graph: a pytest plugin.

    python -m pytest -p tests.te_suite <TransformerEngine>/tests/pytorch/test_cuda_graphs.py

TE's test module imports ``make_graphed_callables`` by name from ``transformer_engine.pytorch``;
this plugin swaps that one name, in every collected module that has it, for
``te_graph.make_graphed_callables``, and changes nothing else: every test runs as TE wrote
it, with its own eager reference and its own bitwise assertions. (TE's test file is not
part of this project; fetch it from the TransformerEngine repository, release 2.20, with
``tests/pytorch/utils.py`` beside it. Without TE installed, collecting it fails at import.)
Results and the deliberate differences are in docs/migration.md.
"""
from __future__ import annotations

import pytest

import te_graph


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    modules = {id(item.module): item.module for item in items if getattr(item, "module", None) is not None}
    for module in modules.values():
        if hasattr(module, "make_graphed_callables"):
            module.make_graphed_callables = te_graph.make_graphed_callables
