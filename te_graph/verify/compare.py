"""Comparing a graphed call with its eager shadow, and the report of a difference: which
tensor, where, by how much, and what the graph froze that most likely explains it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["Difference", "differences", "report"]

_ULPS = 8  # the rounding class: within this many units in the last place of the larger value


@dataclass(frozen=True)
class Difference:
    """One tensor that differs: what it is, where it first differs, by how much."""

    what: str  # "output 0", "gradient of input 1", "gradient of parameter 'lin.weight'"
    index: tuple  # the first differing element
    graphed: float
    eager: float
    max_abs: float
    count: int
    total: int
    rounding: bool  # every difference within the rounding class


def _compare(what: str, graphed: Optional[torch.Tensor], eager: Optional[torch.Tensor]) -> Optional[Difference]:
    if graphed is None and eager is None:
        return None
    if graphed is None or eager is None:
        present = "the graph's" if graphed is not None else "eager code's"
        return Difference(f"{what} (only {present} exists)", (), float("nan"), float("nan"), float("inf"), 1, 1, False)
    if graphed.shape != eager.shape or graphed.dtype != eager.dtype:
        return Difference(f"{what} ({tuple(graphed.shape)} {graphed.dtype} vs {tuple(eager.shape)} {eager.dtype})",
                          (), float("nan"), float("nan"), float("inf"), 1, 1, False)
    if torch.equal(graphed, eager) or (graphed.numel() == 0):
        return None
    a, b = graphed.detach().double(), eager.detach().double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    differs = (a != b) & ~both_nan
    if not bool(differs.any()):
        return None
    first = tuple(int(i) for i in differs.nonzero()[0].tolist())
    gap = (a - b).abs().nan_to_num(nan=float("inf"))
    eps = torch.finfo(graphed.dtype).eps if graphed.dtype.is_floating_point else 0.0
    scale = torch.maximum(a.abs(), b.abs())
    rounding = bool(eps > 0 and (gap[differs] <= _ULPS * eps * scale[differs]).all())
    return Difference(what, first, float(a[first]), float(b[first]), float(gap[differs].max()),
                      int(differs.sum()), graphed.numel(), rounding)


def differences(named: Sequence[tuple[str, Optional[torch.Tensor], Optional[torch.Tensor]]]) -> list[Difference]:
    """The tensors of ``named`` (what, graphed, eager) that differ."""
    return [d for d in (_compare(*item) for item in named) if d is not None]


def _cause(found: Sequence[Difference], stage: str) -> str:
    """The most likely cause among what the graph froze, from where the differences are."""
    if all(d.rounding for d in found):
        return ("every difference is within rounding: the graph and eager code ran kernels that round "
                "differently (an incoming gradient the graph copied into a contiguous buffer, a reduction "
                "order chosen per shape)")
    if stage == "output" and any(d.count < d.total for d in found):
        return ("some elements differ and others are equal: most likely random numbers (a stream the graph "
                "does not keep in step with eager code) or a value the forward read on the host at capture "
                "(a Python branch on data, an attribute changed since)")
    if stage == "output":
        return ("the whole output differs: most likely state the graph froze at capture (a tensor read by "
                "address that was replaced, an attribute, a global setting) or an input it did not copy")
    return ("the outputs were equal but gradients differ: most likely the backward graph's parameter or "
            "input gradients (accumulation, a hook, a recompute drawing other random numbers)")


def report(name: str, found: Sequence[Difference], stage: str) -> str:
    """The report of a verified call of ``name`` whose ``stage`` ("output" or "gradient")
    differed from eager code."""
    lines = [f"{name}: te_graph's verifier ran this call again eagerly and its {stage}s differ from the graph's:"]
    for d in found:
        where = f" at {list(d.index)}" if d.index else ""
        lines.append(f"  {d.what}: {d.count} of {d.total} elements differ{where} (graph {d.graphed!r}, eager "
                     f"{d.eager!r}), max |difference| {d.max_abs:.3g}"
                     + (" (within rounding)" if d.rounding else ""))
    lines.append(f"Likely cause: {_cause(found, stage)}. Run the callable with eager_replay=True to tell the "
                 "graph from the model, and see docs/troubleshooting.md (the runtime verifier).")
    return "\n".join(lines)
