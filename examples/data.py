"""The training data: a character-level corpus made of this repository's own text.

Its Markdown files, plus the docstrings of its Python modules when there is little
Markdown. Nothing is downloaded. Batches are random windows drawn from a seeded CPU
generator, so two runs with the same seed see the same batches whatever else draws
random numbers.
"""
from __future__ import annotations

import ast
import itertools
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
MIN_MARKDOWN_CHARS = 50_000  # below this, Python docstrings are added to the corpus
SKIPPED_DIRS = {".git", "runs", "build", "dist", "node_modules", "__pycache__", ".gl", ".whl"}


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

    def batches(
        self,
        seq: int | Iterable[int],
        batch: int,
        seed: int,
        device: torch.device | str = "cpu",
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless ``(tokens [b, s], targets [b, s])``: random windows, targets shifted by one.

        ``seq`` is one length, or an iterable of lengths, one per batch (``bucket_lengths``).
        """
        lengths = itertools.repeat(seq) if isinstance(seq, int) else iter(seq)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for length in lengths:
            if len(self.data) < length + 2:
                raise ValueError(
                    f"train_gpt: the corpus has {len(self.data)} characters, too few for --seq "
                    f"{length}; pass a smaller --seq."
                )
            starts = torch.randint(0, len(self.data) - length - 1, (batch, 1), generator=generator)
            windows = self.data[starts + torch.arange(length + 1)]  # [b, s + 1]
            yield (
                windows[:, :-1].to(device, non_blocking=True),
                windows[:, 1:].to(device, non_blocking=True),
            )


def bucket_lengths(buckets: Sequence[int], seed: int) -> Iterator[int]:
    """Endless sequence lengths, each step one of ``buckets`` picked uniformly by a CPU
    generator seeded with ``seed``: the same steps get the same lengths in every run."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    while True:
        yield buckets[int(torch.randint(len(buckets), (), generator=generator))]
