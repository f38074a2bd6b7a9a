"""Shared by the benchmark scripts: a failing variant becomes a row, not a crash."""
from __future__ import annotations

import contextlib
import traceback

import torch


def record_failure(result: dict, error: BaseException, show_traceback: bool) -> None:
    """Put ``error`` in the variant's row (and its traceback on stderr if asked); leave the
    device synchronised so the next variant starts clean."""
    result["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
    if show_traceback:
        traceback.print_exc()
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()
