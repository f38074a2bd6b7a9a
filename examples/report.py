"""What train_gpt measures and writes: per-step losses and times behind a progress bar, the
run's summary (speed, memory, a hash of the final weights, the software, its version and
commit, and the devices), and the loss-curve PNG and summary JSON. Rank 0 prints and
writes; every rank measures."""
from __future__ import annotations

import datetime
import gc
import hashlib
import importlib.metadata
import json
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from examples.runtime import Parallelism

REPO_ROOT = Path(__file__).resolve().parent.parent


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather(value: Any, parallel: Parallelism) -> list:
    """``value`` from every rank, in rank order (just ``[value]`` in a single process)."""
    if not parallel.distributed:
        return [value]
    values = [None] * parallel.world
    dist.all_gather_object(values, value)
    return values


class RunLog:
    """Losses and wall times of the steps of one run, shown by a tqdm bar on rank 0 when
    the output is a terminal (or ``--progress``). A step's time runs from ``start()`` to
    the end of ``done()``, which waits for the device: one step's whole work."""

    def __init__(self, steps: int, label: str, device: torch.device, parallel: Parallelism, progress: bool | None):
        from tqdm import tqdm

        self.device = device
        self.parallel = parallel
        self.losses: list[float] = []
        self.lengths: list[int] = []
        self.step_s: list[float] = []
        show = parallel.is_main and (progress if progress is not None else sys.stdout.isatty())
        self.bar = tqdm(total=steps, desc=label, disable=not show, file=sys.stdout, dynamic_ncols=True, leave=True)
        self._start = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def done(self, loss: torch.Tensor, length: int) -> None:
        """Record the step's loss (the mean over data-parallel replicas) and its time."""
        loss = loss.detach()
        if self.parallel.dp > 1:
            loss = loss.clone()
            dist.all_reduce(loss, group=self.parallel.dp_group)
            loss /= self.parallel.dp
        value = loss.item()
        sync(self.device)
        self.step_s.append(time.perf_counter() - self._start)
        self.losses.append(value)
        self.lengths.append(length)
        self.bar.update()
        self.bar.set_postfix(loss=f"{value:.4f}", step_ms=f"{1e3 * self.step_s[-1]:.2f}")

    def close(self) -> None:
        self.bar.close()


# -- memory ------------------------------------------------------------------------------------
def start_memory(device: torch.device) -> int:
    """Collect garbage, clear the CUDA cache and its peak counters; the memory in use now."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return peak_memory(device)[0]


def peak_memory(device: torch.device) -> tuple[int, str]:
    """The peak so far, and what was measured."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    # ru_maxrss is KiB on Linux, bytes on macOS; it is the whole process's peak so far.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss if sys.platform == "darwin" else rss * 1024), "process max RSS (CPU; whole process)"


# -- the summary -------------------------------------------------------------------------------
def params_sha256(model: torch.nn.Module, parallel: Parallelism) -> list[str]:
    """Per rank, the SHA-256 of its parameters (names and bytes): two runs compare bitwise,
    and data-parallel replicas must agree."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return gather(digest.hexdigest(), parallel)


def _combined(hashes: list[str]) -> str:
    return hashes[0] if len(hashes) == 1 else hashlib.sha256("".join(hashes).encode()).hexdigest()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def environment(device: torch.device, parallel: Parallelism) -> dict:
    """Software versions, the te-graph version and commit, and every rank's device, for the JSON."""
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        **provenance(),
        "devices": gather(device_name(device), parallel),
    }


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second (``2026-11-24T15:49:03Z``)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def provenance(root: Path = REPO_ROOT) -> dict:
    """Which te-graph ran, so a summary can be traced to its code: ``te_graph`` (the
    version), ``git_commit`` and ``git_dirty`` (tracked files changed since it); each None
    where it cannot be known (no setup.py nor installed package; git or ``.git`` absent)."""
    return {"te_graph": te_graph_version(root), **git_state(root)}


def te_graph_version(root: Path = REPO_ROOT) -> str | None:
    """``setup.py``'s version when ``root`` has one (the checkout whose code runs), else the
    installed distribution's, else None."""
    try:
        match = re.search(r"""\bversion\s*=\s*["']([^"']+)["']""", (root / "setup.py").read_text(encoding="utf-8"))
    except OSError:
        match = None
    if match:
        return match.group(1)
    try:
        return importlib.metadata.version("te-graph")
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state(root: Path = REPO_ROOT) -> dict:
    """``git_commit`` (HEAD) and ``git_dirty`` of the checkout at ``root``; both None when
    ``root`` is no git checkout or git is missing or fails (never an error)."""
    if not (root / ".git").exists():  # not a parent directory's repository
        return {"git_commit": None, "git_dirty": None}
    try:
        commit = _git(root, "rev-parse", "HEAD")
        dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit, "git_dirty": dirty}


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=10)
    return done.stdout.strip()


def summarize(log: RunLog, model: torch.nn.Module, parallel: Parallelism, config: Any, *,
              capture_s: float, memory_at_start: int, started: float, started_utc: str) -> dict:
    """One run's summary (the JSON's run entry); ``config`` is train_gpt's ``Config``;
    ``started`` is ``time.perf_counter()`` at the run's start, ``started_utc`` its UTC time."""
    device = log.device
    peak, peak_kind = peak_memory(device)
    # The first steps pay for lazy initialisation (allocator growth, cuBLAS, autotuning).
    skip = min(3, len(log.step_s) - 1)
    median_s = statistics.median(log.step_s[skip:])
    timed_lengths = log.lengths[skip:]
    tokens_per_step = config.micro_batch * parallel.dp * sum(timed_lengths) / len(timed_lengths)
    hashes = params_sha256(model, parallel)
    return {
        "started_utc": started_utc,
        "config": config.to_json(),
        "graphs": config.graphs and not config.eager_replay,
        "eager_replay": config.graphs and config.eager_replay,
        "parallel": {"world_size": parallel.world, "tensor_parallel": parallel.tp, "data_parallel": parallel.dp},
        "environment": environment(device, parallel),
        "parameters": sum(p.numel() for p in model.parameters()),
        "losses": log.losses,
        "seq_lengths": log.lengths if config.seq_buckets else None,
        "step_ms": [1e3 * s for s in log.step_s],
        "median_step_ms": 1e3 * median_s,
        "timed_steps": len(log.step_s) - skip,
        "tokens_per_s": tokens_per_step / median_s,
        "peak_memory_bytes": peak,
        "peak_memory_bytes_per_rank": gather(peak, parallel),
        "peak_memory_kind": peak_kind,
        # What this run added: in --compare the second run starts with what the first left
        # allocated (cuBLAS workspaces, the allocator's own blocks).
        "peak_memory_above_start_bytes": peak - memory_at_start,
        "capture_s": capture_s,
        "params_sha256": _combined(hashes),  # of every rank's parameters
        "params_sha256_per_rank": hashes,
        "final_loss": log.losses[-1],
        "wall_s": time.perf_counter() - started,
    }


# -- printing and files ------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def describe_run(name: str, s: dict) -> str:
    line = (
        f"{name}: median step {s['median_step_ms']:.2f} ms, {s['tokens_per_s']:,.0f} tokens/s, "
        f"peak memory {_mib(s['peak_memory_bytes'])} ({s['peak_memory_kind']}; "
        f"{_mib(s['peak_memory_above_start_bytes'])} above the run's start"
        f"{'; rank 0 of ' + str(s['parallel']['world_size']) if s['parallel']['world_size'] > 1 else ''}), "
        f"final loss {s['final_loss']:.4f}"
    )
    if s["capture_s"]:
        line += f", graph capture {s['capture_s']:.2f} s"
    return line


def bitwise_equal(a: list[float], b: list[float]) -> bool:
    """Whether two loss lists hold the same bits (NaN equals NaN, 0.0 differs from -0.0)."""
    return len(a) == len(b) and _steps_differing(a, b) == 0


def _steps_differing(a: list[float], b: list[float]) -> int:
    return sum(x.hex() != y.hex() for x, y in zip(a, b))


def loss_comparison(runs: dict[str, dict]) -> dict | None:
    """For the two runs of ``--compare`` (None otherwise): whether their losses are bitwise
    equal, and the per-step difference, second run minus first."""
    if len(runs) != 2:
        return None
    (first, a), (second, b) = runs.items()
    difference = [y - x for x, y in zip(a["losses"], b["losses"])]
    return {
        "names": (first, second),
        "bitwise_equal": bitwise_equal(a["losses"], b["losses"]),
        "difference": difference,
        "steps_differing": _steps_differing(a["losses"], b["losses"]),
    }


def plot_losses(runs: dict[str, dict], path: Path) -> list[str]:
    """Draw the loss curves to ``path``; returns the notes written on the plot.

    With two runs (``--compare``) the second is dashed over the first, and the plot says
    whether they are bitwise equal; when they are not, a second panel shows the difference
    per step (equal curves would hide one another).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comparison = loss_comparison(runs)
    differs = comparison is not None and not comparison["bitwise_equal"]
    fig, axes = plt.subplots(2 if differs else 1, 1, figsize=(7, 6 if differs else 4), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1]} if differs else {})
    ax = axes[0][0]
    for index, (name, s) in enumerate(runs.items()):
        losses = s["losses"]
        ax.plot(range(1, len(losses) + 1), losses, label=f"{name} ({s['median_step_ms']:.2f} ms/step)",
                linewidth=1, linestyle="--" if index else "-")
    notes = []
    if comparison is not None:
        first, second = comparison["names"]
        steps = len(comparison["difference"])
        if comparison["bitwise_equal"]:
            notes.append(f"{first} and {second}: losses bitwise equal at all {steps} steps")
        else:
            largest = max((abs(d) for d in comparison["difference"]), default=0.0)
            notes.append(f"{first} and {second}: losses differ at {comparison['steps_differing']} of "
                         f"{steps} steps (largest |difference| {largest:.3g})")
        ax.text(0.98, 0.95, notes[-1], transform=ax.transAxes, ha="right", va="top", fontsize=8,
                bbox=dict(boxstyle="round", facecolor="white", alpha=0.8))
    if differs:
        bottom = axes[1][0]
        difference = comparison["difference"]
        bottom.plot(range(1, len(difference) + 1), difference, linewidth=1, color="tab:red")
        bottom.axhline(0.0, color="black", linewidth=0.5)
        bottom.set_ylabel(f"{comparison['names'][1]} - {comparison['names'][0]}", fontsize=8)
        bottom.grid(alpha=0.3)
    first = next(iter(runs.values()))
    c, par = first["config"], first["parallel"]
    seq = f"seq {','.join(map(str, c['seq_buckets']))}" if c["seq_buckets"] else f"seq {c['seq']}"
    where = c["device"] if par["world_size"] == 1 else f"{par['world_size']} ranks (TP {par['tensor_parallel']}, DP {par['data_parallel']})"
    ax.set_title(
        f"GPT {c['layers']}x{c['hidden']}, {seq}, batch {c['micro_batch']}, {c['dtype']}, "
        f"dropout {c['dropout']}, recompute {c['recompute']} on {where}",
        fontsize=9,
    )
    axes[-1][0].set_xlabel("step")
    ax.set_ylabel("training loss (cross entropy)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return notes


def write_outputs(runs: dict[str, dict], summary: dict, out: Path) -> None:
    """``loss_curve.png`` and ``summary.json`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    plot_losses(runs, out / "loss_curve.png")
    with open(out / "summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
