"""Probe for a hang at exit: 2 NCCL ranks, a graphed tensor-parallel block with
collectives inside its graphs, then ``dist.destroy_process_group()`` with the graphs
alive, then exit. Not a test (pytest does not collect it); run it on a 2-GPU machine, from
the repository root (``-m`` puts the root on the path; the spawned ranks inherit it):

    python -m tests.multi_gpu_teardown_probe                      # every mode below
    python -m tests.multi_gpu_teardown_probe --modes destroy --timeout 60
    python -m tests.multi_gpu_teardown_probe --cpu                # gloo + eager replay: checks the script only

Each mode runs 2 fresh ranks that log every step (with a timestamp) to
``--log-dir/<mode>.rank<r>.log``; a rank still alive after ``--timeout`` seconds is
reported as hung with its last step, its Python stack (faulthandler, a few seconds
before the deadline) and, where ``py-spy`` or ``gdb`` exists, its native stack; then it
is killed. A table at the end shows each mode's outcome. Modes:

* ``destroy``           the report: graphs alive, destroy_process_group, exit
* ``reset-destroy``     te_graph.reset() of the graphed modules first (what the tests do)
* ``gc-destroy``        drop the graphed modules and gc.collect() first
* ``destroy-os-exit``   like ``destroy``, then os._exit(0): skips interpreter finalisation
* ``no-destroy``        graphs and process group alive at exit
* ``eager``             the same block, never graphed (control)
"""
from __future__ import annotations

import argparse
import atexit
import faulthandler
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_STEP = re.compile(r"\s*\d+\.\d\ds  (.*)")  # a StepLog line: "  12.34s  what happened"
MODES = ("destroy", "reset-destroy", "gc-destroy", "destroy-os-exit", "no-destroy", "eager")
WORLD = 2


class StepLog:
    """Timestamped lines in a file, flushed at once (the process may be killed any time)."""

    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1, encoding="utf-8")
        self.start = time.monotonic()

    def __call__(self, step: str) -> None:
        self.file.write(f"{time.monotonic() - self.start:8.2f}s  {step}\n")
        self.file.flush()
        os.fsync(self.file.fileno())


def rank_main(rank: int, mode: str, store: str, log_path: str, timeout_s: float, cpu: bool = False) -> None:
    step = StepLog(Path(log_path))
    atexit.register(step, "atexit: interpreter finalising (registered first, runs last)")
    faulthandler.dump_traceback_later(max(timeout_s - 8, 5), file=step.file)  # stack, no exit
    step(f"rank {rank}: start, mode {mode}")

    import torch
    import torch.distributed as dist

    import rng
    import te_graph
    from examples.parallel import ParallelGPTBlock
    from examples.runtime import init_process_group

    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    dtype = torch.float32 if cpu else torch.bfloat16
    init_process_group("gloo" if cpu else "nccl", rank, WORLD, f"file://{store}", timeout_s=timeout_s,
                       device=None if cpu else device)
    step(f"process group up ({'gloo' if cpu else 'NCCL, device_id bound'})")
    tracker = rng.CudaRNGStatesTracker(device=device)
    rng.model_parallel_cuda_manual_seed(1234, tp_rank=rank, tracker=tracker)
    blocks = [ParallelGPTBlock(256, 8, 0.1, None, recompute=True, distribute_saved_activations=True,
                               get_rng_tracker=lambda: tracker, device=device, dtype=dtype) for _ in range(2)]
    generator = torch.Generator(device=device).manual_seed(0)  # the same samples on both ranks
    shape = (64, 2, 256)
    if mode != "eager":
        samples = tuple((torch.randn(shape, device=device, dtype=dtype, generator=generator,
                                     requires_grad=True),) for _ in blocks)
        te_graph.make_graphed_callables(tuple(blocks), samples, eager_replay=cpu,
                                        get_rng_state_tracker=lambda: tracker)
        _sync(device)
        step("graphed: all-reduces and all-gathers captured in the graphs")
    for _ in range(3):
        x = torch.randn(shape, device=device, dtype=dtype, generator=generator, requires_grad=True)
        y = x
        for block in blocks:
            y, _ = block(y)
        y.float().square().mean().backward()
    _sync(device)
    step("trained 3 steps (graph replays with NCCL inside)")

    if mode == "reset-destroy":
        te_graph.reset(*blocks)
        _sync(device)
        step("te_graph.reset: graphs freed")
    elif mode == "gc-destroy":
        del blocks, x, y, samples
        gc.collect()
        _sync(device)
        step("graphed modules dropped, gc.collect() done")
    if mode != "no-destroy":
        step("destroy_process_group: calling")
        dist.destroy_process_group()
        step("destroy_process_group: returned")
    if mode == "destroy-os-exit":
        step("os._exit(0)")
        os._exit(0)
    step("leaving the rank function (locals, graphs among them, go next)")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _native_stack(pid: int) -> str:
    """The process's native stacks, where py-spy or gdb is installed."""
    if shutil.which("py-spy"):
        command = ["py-spy", "dump", "--native", "--pid", str(pid)]
    elif shutil.which("gdb"):
        command = ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 12"]
    else:
        return "(no py-spy or gdb on this machine: native stack not taken)"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        return (done.stdout + done.stderr)[-12000:]
    except (OSError, subprocess.SubprocessError) as error:
        return f"({command[0]} failed: {error})"


def run_mode(mode: str, log_dir: Path, timeout_s: float, cpu: bool = False) -> dict:
    import multiprocessing as mp

    context = mp.get_context("spawn")
    store = tempfile.mktemp(prefix=f"teardown-{mode}-", dir=log_dir)
    logs = [log_dir / f"{mode}.rank{r}.log" for r in range(WORLD)]
    for path in logs:
        path.unlink(missing_ok=True)
    processes = [context.Process(target=rank_main, args=(r, mode, store, str(logs[r]), timeout_s, cpu)) for r in range(WORLD)]
    start = time.monotonic()
    for p in processes:
        p.start()
    deadline = start + timeout_s
    outcome = {}
    for r, p in enumerate(processes):
        p.join(max(deadline - time.monotonic(), 0.1))
    for r, p in enumerate(processes):
        text = logs[r].read_text(encoding="utf-8") if logs[r].exists() else ""
        steps = [m.group(1) for m in map(_STEP.match, text.splitlines()) if m]
        last = steps[-1] if steps else "(nothing logged)"
        if p.is_alive():
            print(f"\n=== {mode}, rank {r}: HUNG after '{last}'; log with Python stack:\n{text}")
            print(f"=== {mode}, rank {r}: native stack:\n{_native_stack(p.pid)}")
            p.kill()
            p.join(10)
            outcome[r] = ("hung", last)
        else:
            outcome[r] = (f"exit {p.exitcode}", last)
            if p.exitcode != 0:
                print(f"\n=== {mode}, rank {r}: exit code {p.exitcode}; log:\n{text}")
    return {"mode": mode, "seconds": time.monotonic() - start, "ranks": outcome}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per mode before a rank counts as hung")
    parser.add_argument("--log-dir", default=None, help="where the step logs go (default: a new temporary folder)")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU with eager replay: checks this script, not the hang")
    args = parser.parse_args()
    import torch

    if not args.cpu and torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} CUDA devices; this machine has {torch.cuda.device_count()}.")
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; use {', '.join(MODES)}")
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="teardown-probe-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    where = "CPU (gloo, eager replay)" if args.cpu else (
        f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
        f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}")
    print(f"torch {torch.__version__}, {where}; logs in {log_dir}")
    results = [run_mode(mode, log_dir, args.timeout, args.cpu) for mode in modes]
    print(f"\n{'mode':<17} {'seconds':>7}  rank 0 / rank 1: outcome, last step")
    for result in results:
        ranks = "; ".join(f"{outcome} after '{last}'" for outcome, last in result["ranks"].values())
        print(f"{result['mode']:<17} {result['seconds']:7.1f}  {ranks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
