"""Test setup: the ``gpu`` and ``multi_gpu`` markers, per-worker GPU pinning under xdist, RNG reset."""
from __future__ import annotations

import os

import pytest
import torch

import rng


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "multi_gpu: spawns NCCL ranks on 2 CUDA devices (skipped with fewer)")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # xdist runs one worker per core; torch's own threads would oversubscribe them.
        torch.set_num_threads(1)
    if torch.cuda.is_available():
        # Under pytest-xdist, worker gwN takes cuda:(N % device count), so `-n <gpus>`
        # spreads the suite over the GPUs.
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
        index = int(worker[2:]) if worker[2:].isdigit() else 0
        torch.cuda.set_device(index % torch.cuda.device_count())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    skip_multi_gpu = pytest.mark.skip(reason=f"needs 2 CUDA devices (NCCL ranks); this machine has {gpus}")
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multi_gpu)


@pytest.fixture(autouse=True)
def fresh_rng():
    """Every test starts from seed 0 and an empty global tracker."""
    torch.manual_seed(0)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(0)
    tracker = rng.get_cuda_rng_tracker()
    tracker.reset()
    yield
    tracker.reset()
