"""Megatron-style GPT training on a character-level corpus, with per-layer CUDA graphs.

Trains the GPT of ``examples/gpt.py`` (``[seq, batch, hidden]`` blocks, attention dropout
under the tracker's ``'model-parallel-rng'`` stream, hidden dropout from the default
generator) on the repository's own text: its Markdown files, plus the docstrings of its
Python modules when there is little Markdown. Nothing is downloaded.

On a GPU the transformer layers are graphed with ``te_graph.make_graphed_callables``
(forward and backward each one CUDA graph per layer, full activation recompute inside the
graphs, exact dropout random numbers); the embedding, the output layer, the loss and the
optimizer stay eager. Without CUDA it trains eagerly on the CPU.

    python examples/train_gpt.py                      # defaults for the device at hand
    python examples/train_gpt.py --no-graphs          # eager baseline
    python examples/train_gpt.py --compare            # eager then graphed, same seed
    python examples/train_gpt.py --dropout 0 --compare  # ... and bitwise-equal losses

At the end it prints the median step time, tokens/s and peak memory, and writes
``loss_curve.png`` and ``summary.json`` to ``--out``.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import hashlib
import json
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

# Strict deterministic algorithms (--deterministic, the default on CUDA) need cuBLAS's
# workspace config to be set before the process's first cuBLAS call: torch reads it once.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
DETERMINISTIC_CUBLAS_CONFIGS = (":4096:8", ":16:8")

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as `python examples/train_gpt.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import rng  # noqa: E402
import te_graph  # noqa: E402
from examples.gpt import GPT  # noqa: E402

# Sizes per device: (layers, hidden, heads, seq, micro_batch, steps, lr). The CPU default
# finishes in well under two minutes on two cores; the GPU default is small enough to be
# bound by kernel launches, which is where per-layer graphs pay.
DEFAULTS = {
    "cpu": dict(layers=2, hidden=128, heads=4, seq=64, micro_batch=16, steps=200, lr=2e-3),
    "cuda": dict(layers=12, hidden=256, heads=4, seq=128, micro_batch=16, steps=300, lr=1e-3),
}
MIN_MARKDOWN_CHARS = 50_000  # below this, Python docstrings are added to the corpus
SKIPPED_DIRS = {".git", "runs", "build", "dist", "node_modules", "__pycache__", ".gl", ".whl"}


# -- data ----------------------------------------------------------------------------------
def _repo_files(root: Path, pattern: str) -> list[Path]:
    files = []
    for path in sorted(root.rglob(pattern)):
        relative = path.relative_to(root).parts
        if any(p in SKIPPED_DIRS or p.startswith(".") for p in relative[:-1]):
            continue
        if path.is_file():
            files.append(path)
    return files


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return []
    nodes = [tree] + [
        n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    return [d for d in (ast.get_docstring(n) for n in nodes) if d]


def load_corpus(root: Path | str = REPO_ROOT, min_markdown_chars: int = MIN_MARKDOWN_CHARS) -> str:
    """The repository's own text: every ``*.md`` file, plus the docstrings of its Python
    files when the Markdown is shorter than ``min_markdown_chars``. Deterministic order."""
    root = Path(root)
    parts = []
    for path in _repo_files(root, "*.md"):
        try:
            parts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    if sum(map(len, parts)) < min_markdown_chars:
        for path in _repo_files(root, "*.py"):
            parts.extend(_docstrings(path))
    text = "\n\n".join(p.strip() for p in parts if p.strip())
    if not text:
        raise RuntimeError(f"train_gpt: found no Markdown or docstrings under {root} to train on.")
    return text + "\n"


class CharCorpus:
    """A character-level corpus: the vocabulary is the sorted set of its characters."""

    def __init__(self, text: str):
        self.text = text
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.data = self.encode(text)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, tokens: torch.Tensor | Sequence[int]) -> str:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        return "".join(self.chars[t] for t in tokens)

    def batches(self, seq: int, batch: int, seed: int, device: torch.device | str = "cpu"):
        """Endless ``(tokens [b, s], targets [b, s])``: random windows, targets shifted by one.

        The windows come from a CPU generator seeded with ``seed``, so two runs with the
        same seed see the same batches whatever else draws random numbers.
        """
        if len(self.data) < seq + 2:
            raise ValueError(
                f"train_gpt: the corpus has {len(self.data)} characters, too few for --seq {seq}; "
                "pass a smaller --seq."
            )
        generator = torch.Generator(device="cpu").manual_seed(seed)
        offsets = torch.arange(seq + 1)
        while True:
            starts = torch.randint(0, len(self.data) - seq - 1, (batch, 1), generator=generator)
            windows = self.data[starts + offsets]  # [b, s + 1]
            yield (
                windows[:, :-1].to(device, non_blocking=True),
                windows[:, 1:].to(device, non_blocking=True),
            )


# -- options -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a small Megatron-style GPT on the repository's own text, with "
        "per-layer CUDA graphs (te_graph) on a GPU.",
    )

    def auto(name: str) -> str:
        return f"default: {DEFAULTS['cpu'][name]:g} on CPU, {DEFAULTS['cuda'][name]:g} on CUDA"

    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="graph the transformer layers (default: on with CUDA; needs a GPU)")
    p.add_argument("--recompute", choices=("none", "full"), default=None,
                   help="activation recompute of each layer (default: full on CUDA, none on CPU)")
    p.add_argument("--layers", type=int, default=None, help=auto("layers"))
    p.add_argument("--hidden", type=int, default=None, help=auto("hidden"))
    p.add_argument("--heads", type=int, default=None, help=auto("heads"))
    p.add_argument("--seq", type=int, default=None, help=auto("seq"))
    p.add_argument("--micro-batch", type=int, default=None, help=auto("micro_batch"))
    p.add_argument("--steps", type=int, default=None, help=auto("steps"))
    p.add_argument("--lr", type=float, default=None, help=auto("lr"))
    p.add_argument("--warmup", type=int, default=None,
                   help="linear learning-rate warmup steps, then cosine decay to lr/10 (default: steps/10)")
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout (default: 0.1)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default: 0.01)")
    p.add_argument("--clip-grad", type=float, default=1.0, help="max grad norm, 0 for none (default: 1.0)")
    p.add_argument("--seed", type=int, default=1234, help="seeds weights, dropout and batches (default: 1234)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's own; 1 is faster on a busy machine)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="parameter dtype (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.use_deterministic_algorithms during training on CUDA (flash "
                   "attention's backward otherwise adds in a varying order at longer --seq; default: on)")
    p.add_argument("--eager-replay", action="store_true",
                   help="with --graphs, run te_graph's wrapper without graphs (debugging; CPU too)")
    p.add_argument("--compare", action="store_true",
                   help="run eager and graphed back to back with the same seed; print the speedup "
                   "and whether the losses matched bitwise")
    p.add_argument("--out", default="runs/train_gpt", help="directory for loss_curve.png and summary.json (default: runs/train_gpt)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="tqdm progress bar (default: on)")
    return p


@dataclass
class Config:
    device: torch.device
    dtype: torch.dtype
    graphs: bool
    eager_replay: bool
    recompute: str
    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    steps: int
    lr: float
    warmup: int
    dropout: float
    weight_decay: float
    clip_grad: float
    seed: int
    deterministic: bool
    progress: bool

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["device"] = str(self.device)
        d["dtype"] = str(self.dtype).replace("torch.", "")
        return d


def resolve(args: argparse.Namespace) -> tuple[Config, list[str]]:
    """Fill per-device defaults; returns the config and notes to print."""
    notes = []
    cuda = torch.cuda.is_available()
    device = torch.device(args.device) if args.device else torch.device("cuda" if cuda else "cpu")
    if device.type == "cuda" and not cuda:
        raise SystemExit("train_gpt: --device cuda was asked for, but CUDA is not available.")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kind = "cuda" if device.type == "cuda" else "cpu"
    defaults = DEFAULTS[kind]
    values = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    graphs = args.graphs if args.graphs is not None else kind == "cuda"
    eager_replay = args.eager_replay
    if kind != "cuda" and not (graphs and eager_replay):
        if not cuda:
            notes.append("CUDA not available: training eagerly on CPU (graphs need a GPU).")
        elif graphs:
            notes.append(f"--device {device}: training eagerly (graphs need a CUDA device).")
        graphs = False
    recompute = args.recompute or ("full" if kind == "cuda" else "none")
    if args.dtype == "auto":
        dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    else:
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    for name in ("layers", "hidden", "heads", "seq", "micro_batch", "steps"):
        if values[name] < 1:
            raise SystemExit(f"train_gpt: --{name.replace('_', '-')} must be at least 1.")
    if values["hidden"] % values["heads"]:
        raise SystemExit(f"train_gpt: --hidden {values['hidden']} is not divisible by --heads {values['heads']}.")
    if args.warmup is not None and args.warmup < 0:
        raise SystemExit("train_gpt: --warmup must be at least 0.")
    if not 0.0 <= args.dropout < 1.0:
        raise SystemExit("train_gpt: --dropout must be in [0, 1).")
    deterministic = args.deterministic and kind == "cuda"
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if deterministic and workspace not in DETERMINISTIC_CUBLAS_CONFIGS:
        notes.append(
            f"CUBLAS_WORKSPACE_CONFIG={workspace!r} is not one of {DETERMINISTIC_CUBLAS_CONFIGS}: "
            "training without deterministic algorithms (runs may differ in the last bits)."
        )
        deterministic = False
    config = Config(
        device=device, dtype=dtype, graphs=graphs, eager_replay=eager_replay,
        recompute=recompute, dropout=args.dropout,
        warmup=args.warmup if args.warmup is not None else values["steps"] // 10, weight_decay=args.weight_decay,
        clip_grad=args.clip_grad, seed=args.seed, deterministic=deterministic,
        progress=args.progress, **values,
    )
    return config, notes


# -- training ------------------------------------------------------------------------------
@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """Strict torch.use_deterministic_algorithms inside, the previous settings restored after.

    Strict (not warn-only) mode is what makes flash attention's backward deterministic.
    cuBLAS then needs CUBLAS_WORKSPACE_CONFIG set (this module sets it at import).
    """
    if not enabled:
        yield
        return
    import torch.utils.deterministic as det

    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    previous_fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = False  # no NaN-fill kernels for every torch.empty
    try:
        yield
    finally:
        det.fill_uninitialized_memory = previous_fill
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def build_model(config: Config, vocab: int) -> GPT:
    """Seeded the Megatron way; the same seed gives the same weights, graphed or not."""
    torch.manual_seed(config.seed)
    rng.model_parallel_cuda_manual_seed(config.seed)
    model = GPT(
        vocab, config.seq, config.hidden, config.heads, config.layers,
        dropout=config.dropout, recompute=config.recompute == "full",
        device=config.device, dtype=config.dtype,
    )
    model.train()
    return model


def graph_layers(model: GPT, config: Config) -> None:
    """Replace each layer's forward by its graphed version (modules keep their identity)."""
    generator = torch.Generator(device=config.device).manual_seed(config.seed)
    shape = (config.seq, config.micro_batch, config.hidden)
    sample_args = tuple(
        (torch.randn(shape, device=config.device, dtype=config.dtype, generator=generator).requires_grad_(),)
        for _ in model.layers
    )
    te_graph.make_graphed_callables(tuple(model.layers), sample_args, eager_replay=config.eager_replay)


def learning_rate(config: Config, step: int) -> float:
    """Megatron's schedule: linear warmup, then cosine decay to a tenth of ``--lr``."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    decay = max(config.steps - config.warmup, 1)
    progress = min((step - config.warmup) / decay, 1.0)
    return config.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy; ``logits [s, b, vocab]``, ``targets [b, s]``."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.t().flatten())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _params_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _current_memory(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else _peak_memory(device)[0]


def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    # ru_maxrss is KiB on Linux, bytes on macOS; it is the whole process's peak so far.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss if sys.platform == "darwin" else rss * 1024), "process max RSS (CPU; whole process)"


def train(config: Config, corpus: CharCorpus, label: str = "") -> dict:
    """One training run; returns its summary."""
    from tqdm import tqdm

    device = config.device
    run_start = time.perf_counter()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start_memory = _current_memory(device)
    with deterministic_algorithms(config.deterministic):
        model = build_model(config, corpus.vocab_size)
        capture_s = 0.0
        if config.graphs:
            start = time.perf_counter()
            graph_layers(model, config)
            _sync(device)
            capture_s = time.perf_counter() - start
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay,
            fused=device.type == "cuda" or None,
        )
        batches = corpus.batches(config.seq, config.micro_batch, config.seed, device)
        losses: list[float] = []
        step_s: list[float] = []
        bar = tqdm(range(config.steps), desc=label or ("graphed" if config.graphs else "eager"),
                   disable=not config.progress, dynamic_ncols=True, leave=True)
        for step in bar:
            start = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(config, step)
            tokens, targets = next(batches)
            model.zero_grad(set_to_none=False)
            loss = lm_loss(model(tokens), targets)
            loss.backward()
            if config.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad)
            optimizer.step()
            value = loss.item()
            _sync(device)
            step_s.append(time.perf_counter() - start)
            losses.append(value)
            bar.set_postfix(loss=f"{value:.4f}", step_ms=f"{1e3 * step_s[-1]:.2f}")
        bar.close()
        params_sha256 = _params_sha256(model)
        n_params = sum(p.numel() for p in model.parameters())
    peak, peak_kind = _peak_memory(device)
    # The first steps pay for lazy initialisation (allocator growth, cuBLAS, autotuning).
    skip = min(3, len(step_s) - 1)
    median_s = statistics.median(step_s[skip:])
    del model, optimizer
    gc.collect()  # graphed modules hold their graphs in reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "config": config.to_json(),
        "graphs": config.graphs and not config.eager_replay,
        "eager_replay": config.graphs and config.eager_replay,
        "parameters": n_params,
        "vocab_size": corpus.vocab_size,
        "corpus_chars": len(corpus.text),
        "losses": losses,
        "step_ms": [1e3 * s for s in step_s],
        "median_step_ms": 1e3 * median_s,
        "timed_steps": len(step_s) - skip,
        "tokens_per_s": config.micro_batch * config.seq / median_s,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        # What this run added: in --compare the second run starts with what the first left
        # allocated (cuBLAS workspaces, the allocator's own blocks).
        "peak_memory_above_start_bytes": peak - start_memory,
        "capture_s": capture_s,
        "params_sha256": params_sha256,
        "final_loss": losses[-1],
        "wall_s": time.perf_counter() - run_start,
    }


# -- reporting -----------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def describe_run(name: str, s: dict) -> str:
    line = (
        f"{name}: median step {s['median_step_ms']:.2f} ms, {s['tokens_per_s']:,.0f} tokens/s, "
        f"peak memory {_mib(s['peak_memory_bytes'])} ({s['peak_memory_kind']}; "
        f"{_mib(s['peak_memory_above_start_bytes'])} above the run's start), "
        f"final loss {s['final_loss']:.4f}"
    )
    if s["capture_s"]:
        line += f", graph capture {s['capture_s']:.2f} s"
    return line


def plot_losses(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, s in runs.items():
        losses = s["losses"]
        ax.plot(range(1, len(losses) + 1), losses, label=f"{name} ({s['median_step_ms']:.2f} ms/step)", linewidth=1)
    c = next(iter(runs.values()))["config"]
    ax.set_title(
        f"GPT {c['layers']}x{c['hidden']}, seq {c['seq']}, batch {c['micro_batch']}, "
        f"{c['dtype']}, dropout {c['dropout']}, recompute {c['recompute']} on {c['device']}",
        fontsize=9,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross entropy)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _with_graphs(config: Config, graphs: bool) -> Config:
    values = dict(config.__dict__)
    values["graphs"] = graphs
    return Config(**values)


def main(argv: Sequence[str] | None = None) -> dict:
    """Train; print the summary, write ``loss_curve.png`` and ``summary.json`` to ``--out``.

    Returns the summary (with ``--compare``: both runs under ``'eager'`` and ``'graphed'``,
    plus ``'speedup'`` and ``'losses_match_bitwise'``).
    """
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    config, notes = resolve(args)
    if args.compare and config.device.type != "cuda":
        notes = [
            f"No CUDA device: --compare runs eager against te_graph's eager-replay wrapper on "
            f"{config.device} (the same static-buffer wrapper, without graphs)."
        ]
        config = Config(**{**config.__dict__, "eager_replay": True})
    for note in notes:
        print(note)
    corpus = CharCorpus(load_corpus())
    c = config
    print(
        f"corpus: {len(corpus.text):,} characters, vocabulary {corpus.vocab_size}; model: "
        f"{c.layers} layers, hidden {c.hidden}, {c.heads} heads, seq {c.seq}, micro-batch "
        f"{c.micro_batch}, {str(c.dtype).replace('torch.', '')} on {c.device}; dropout {c.dropout}, "
        f"recompute {c.recompute}, {c.steps} steps"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.compare:
        graphed_name = "eager-replay" if config.eager_replay else "graphed"
        runs = {
            "eager": train(_with_graphs(config, False), corpus, "eager"),
            graphed_name: train(_with_graphs(config, True), corpus, graphed_name),
        }
        eager, graphed = runs["eager"], runs[graphed_name]
        match = eager["losses"] == graphed["losses"]
        weights_match = eager["params_sha256"] == graphed["params_sha256"]
        speedup = eager["median_step_ms"] / graphed["median_step_ms"]
        for name, s in runs.items():
            print(describe_run(name, s))
        print(f"speedup {graphed_name} vs eager: {speedup:.2f}x")
        print(f"losses matched bitwise: {match} (final weights {'equal' if weights_match else 'differ'})")
        if not match and config.dropout > 0 and config.recompute == "full" and not config.eager_replay:
            print(
                "  (expected with dropout > 0 and recompute: inside graphs each recomputed layer "
                "draws its dropout masks from its own derived stream; use --dropout 0 to compare bitwise)"
            )
        summary = {
            "eager": eager,
            graphed_name: graphed,
            "graphed_name": graphed_name,
            "speedup": speedup,
            "losses_match_bitwise": match,
            "weights_match_bitwise": weights_match,
        }
    else:
        summary = train(config, corpus)
        name = "graphed" if summary["graphs"] else ("eager-replay" if summary["eager_replay"] else "eager")
        runs = {name: summary}
        print(describe_run(next(iter(runs)), summary))
    plot_losses(runs, out / "loss_curve.png")
    with open(out / "summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {out / 'loss_curve.png'} and {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    main()
