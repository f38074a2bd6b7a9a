"""One run of ``examples/megatron_gpt.py`` in a fresh process, as the Megatron benchmarks
take it: TE's graphs are not freed by the helper's ``delete_cuda_graphs()`` and a failed TE
capture can leave its generator in capture mode, so no two rows share a process."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_arguments(args: Any, steps: int, precision: str, dropout: float, fusion: int) -> list[str]:
    """The example's arguments every Megatron benchmark row shares: the step count (after 2
    eager steps the helper graphs), precision, dropout, fusion, and the model's shape from
    ``args`` (``layers``, ``hidden``, ``heads``, ``seq``, ``micro_batch``, ``microbatches``)."""
    return ["--steps", str(steps), "--warmup-steps", "2", "--dropout", str(dropout),
            "--fp8", "" if precision == "bf16" else precision, "--layers", str(args.layers),
            "--hidden", str(args.hidden), "--heads", str(args.heads), "--seq", str(args.seq),
            "--micro-batch", str(args.micro_batch), "--microbatches", str(args.microbatches),
            "--fusion", str(fusion)]


def run_example(graphs: str, arguments: list[str], timeout: int, ranks: int = 1) -> dict:
    """The run's record for ``graphs`` (``examples.megatron_gpt.train``), with ``ms`` (the
    median graphed step; on several ranks the slowest rank's, each rank's in ``ms_per_rank``);
    or ``{"error": ...}`` with the run's last error lines."""
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    from examples.megatron_gpt import command, rank_path, timing  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "record.pt")
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
        done = subprocess.run(command(["--graphs", graphs, *arguments, "--out", out], ranks), cwd=_ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            lines = (done.stdout + done.stderr).strip().splitlines()
            errors = [line for line in lines if "Error" in line] or lines[-3:]
            return {"error": " | ".join(errors[-3:])}
        import torch  # noqa: PLC0415

        records = [torch.load(rank_path(out, rank, ranks))[graphs] for rank in range(ranks)]
        per_rank = [timing(record) for record in records]
        return {**records[0], "ms": max(per_rank), "ms_per_rank": per_rank,
                "footprint_mib": max(record["footprint_mib"] for record in records)}


def save(path: str | None, results: list) -> None:
    """Write the rows so far as JSON (rewritten after each row: a run killed half-way keeps them)."""
    if path:
        import json  # noqa: PLC0415

        with open(path, "w") as f:
            json.dump(results, f, indent=1)
