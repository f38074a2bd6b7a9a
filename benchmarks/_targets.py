"""The performance targets as pure logic: benchmark rows in, PASS/FAIL lines out.

No CUDA and no torch here, so CPU tests pin every verdict down with hand-made rows. A row
is the dict a benchmark records for one variant: ``ms`` (median ms per step, or device
time for the profiled rows), ``steady_reserved_mib`` (footprint over steady steps),
``build_peak_reserved_mib`` (footprint during build and capture), ``capture_s``, and
``error`` where the variant failed. The lines inform; nothing asserts on them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional, Sequence

# Row names, shared by every benchmark script, its table and its PNG.
EAGER = "eager"
EAGER_RECOMPUTE = "eager+recompute"
TORCH_GRAPHED = "torch graphed"
TE_GRAPH = "te_graph"
TE_GRAPH_RECOMPUTE = "te_graph+recompute"
KERNEL_FLOOR = "kernel floor"
FORWARD_KERNELS = "forward kernels"
EAGER_BUCKETS = "eager 3 buckets"
TE_GRAPH_BUCKETS = "te_graph 3 buckets"
WHOLE_STEP_GRAPH = "whole-step graph"
TE_GRAPH_STEP = "te_graph step"  # the product's whole-step graph (te_graph.make_graphed_step)
TE_GRAPH_VERIFY_SAMPLED = "te_graph verify 1/100"  # the runtime verifier on every 100th call
TE_GRAPH_VERIFY_ALL = "te_graph verify all"  # the runtime verifier on every call
TE_GRAPHED = "TE graphed"  # Transformer Engine's make_graphed_callables, where TE is present

PASS, FAIL, NOT_AVAILABLE, INFO = "PASS", "FAIL", "n/a", "info"

Rows = Mapping[str, Mapping[str, object]]  # variant name -> row


@dataclass(frozen=True)
class Targets:
    """One config's limits (None: that target does not apply to the config)."""

    floor_ratio: Optional[float] = None  # te_graph ms <= floor_ratio x kernel floor
    torch_speedup: Optional[float] = None  # torch graphed ms >= torch_speedup x te_graph ms
    footprint_ratio: float = 1.0  # steady footprint te_graph <= ratio x eager (same recompute)
    recompute_overhead: float = 1.1  # te_graph+recompute <= x (te_graph + one forward's kernels)
    capture_peak_ratio: float = 1.1  # peak during capture <= x eager's steady footprint
    capture_time_vs_torch: bool = True  # te_graph capture seconds <= torch's
    recompute_peer: str = EAGER_RECOMPUTE  # the eager row with the same recompute setting


# The step targets: "tiny <= 1.2x floor and >= 2x faster than torch; small <= 1.08x; medium <=
# 1.03x; footprint <= 1.0x eager for small and medium, <= 1.15x for tiny".
STEP_TARGETS = {
    "tiny": Targets(floor_ratio=1.2, torch_speedup=2.0, footprint_ratio=1.15),
    "small": Targets(floor_ratio=1.08),
    "medium": Targets(floor_ratio=1.03),
}


class TargetLine(NamedTuple):
    config: str
    key: str  # stable id of the target (tests and JSON readers use it)
    target: str  # the target in words
    detail: str  # the numbers behind the verdict
    verdict: str  # PASS, FAIL, n/a or info


def _value(rows: Rows, variant: str, field: str) -> tuple[Optional[float], str]:
    """(number, '') or (None, why it is missing)."""
    row = rows.get(variant)
    if row is None:
        return None, f"{variant} not run"
    if row.get("error"):
        return None, f"{variant} failed"
    value = row.get(field)
    if not isinstance(value, (int, float)) or value <= 0:
        return None, f"{variant} has no {field}"
    return float(value), ""


def _compare(config: str, key: str, target: str, rows: Rows, lhs: tuple[str, str],
             rhs: tuple[str, str], limit: float, unit: str, extra: float = 0.0,
             extra_source: Optional[tuple[str, str]] = None) -> TargetLine:
    """``lhs <= limit x (rhs + extra_source)``, with the numbers spelled out."""
    left, why_left = _value(rows, *lhs)
    right, why_right = _value(rows, *rhs)
    if extra_source is not None:
        extra, why_extra = _value(rows, *extra_source)
    else:
        why_extra = ""
    missing = [w for w in (why_left, why_right, why_extra) if w]
    if missing:
        return TargetLine(config, key, target, "missing: " + "; ".join(missing), NOT_AVAILABLE)
    bound = right + (extra or 0.0)
    ratio = left / bound
    base = f"{right:.3g}" if extra_source is None else f"({right:.3g} + {extra:.3g})"
    detail = f"{left:.3g} vs {base} {unit} = {ratio:.3f}x (limit {limit:g}x)"
    return TargetLine(config, key, target, detail, PASS if left <= limit * bound else FAIL)


def evaluate_targets(results: Mapping[str, Rows], targets: Mapping[str, Targets]) -> list[TargetLine]:
    """PASS/FAIL/n/a lines for every config of ``results`` that has targets, plus info
    lines comparing the 3-bucket rows where they were run."""
    lines: list[TargetLine] = []
    for config, rows in results.items():
        t = targets.get(config)
        if t is None:
            continue
        ms, mib = "ms", "steady_reserved_mib"
        if t.floor_ratio is not None:
            lines.append(_compare(config, "floor", f"te_graph <= {t.floor_ratio:g}x kernel floor",
                                  rows, (TE_GRAPH, ms), (KERNEL_FLOOR, ms), t.floor_ratio, "ms"))
        if t.torch_speedup is not None:
            lines.append(_torch_speedup(config, rows, t.torch_speedup))
        lines.append(_compare(
            config, "recompute_overhead",
            f"te_graph+recompute <= {t.recompute_overhead:g}x (te_graph + one forward's kernels)",
            rows, (TE_GRAPH_RECOMPUTE, ms), (TE_GRAPH, ms), t.recompute_overhead, "ms",
            extra_source=(FORWARD_KERNELS, ms)))
        for graphed, peer, suffix in ((TE_GRAPH, EAGER, ""),
                                      (TE_GRAPH_RECOMPUTE, t.recompute_peer, "_recompute")):
            lines.append(_compare(config, "footprint" + suffix,
                                  f"steady footprint {graphed} <= {t.footprint_ratio:g}x {peer}",
                                  rows, (graphed, mib), (peer, mib), t.footprint_ratio, "MiB"))
            lines.append(_compare(config, "capture_peak" + suffix,
                                  f"peak footprint during {graphed} capture <= "
                                  f"{t.capture_peak_ratio:g}x {peer}'s steady footprint",
                                  rows, (graphed, "build_peak_reserved_mib"), (peer, mib),
                                  t.capture_peak_ratio, "MiB"))
        if t.capture_time_vs_torch:
            lines.append(_compare(config, "capture_time", "te_graph capture time <= torch graphed's",
                                  rows, (TE_GRAPH, "capture_s"), (TORCH_GRAPHED, "capture_s"), 1.0, "s"))
        lines.extend(_bucket_info(config, rows))
        lines.extend(_whole_step_info(config, rows))
    return lines


def _torch_speedup(config: str, rows: Rows, speedup: float) -> TargetLine:
    target = f"te_graph >= {speedup:g}x faster than torch graphed"
    te, why_te = _value(rows, TE_GRAPH, "ms")
    peer, why_peer = _value(rows, TORCH_GRAPHED, "ms")
    if te is None or peer is None:
        return TargetLine(config, "torch_speedup", target,
                          "missing: " + "; ".join(w for w in (why_te, why_peer) if w), NOT_AVAILABLE)
    detail = f"torch {peer:.3g} ms / te_graph {te:.3g} ms = {peer / te:.2f}x (need {speedup:g}x)"
    return TargetLine(config, "torch_speedup", target, detail, PASS if peer >= speedup * te else FAIL)


def _bucket_info(config: str, rows: Rows) -> list[TargetLine]:
    """The buckets' question, no limit set: what do 3 buckets cost against one, and eager?"""
    lines = []
    for other in (TE_GRAPH, EAGER_BUCKETS):
        if TE_GRAPH_BUCKETS not in rows or other not in rows:
            continue
        parts = []
        for field, unit in (("ms", "ms"), ("steady_reserved_mib", "MiB")):
            mine, why_mine = _value(rows, TE_GRAPH_BUCKETS, field)
            theirs, why_theirs = _value(rows, other, field)
            if mine is None or theirs is None:
                parts.append(f"{unit}: missing ({why_mine or why_theirs})")
            else:
                parts.append(f"{mine:.3g} vs {theirs:.3g} {unit} ({mine / theirs:.2f}x)")
        lines.append(TargetLine(config, f"buckets_vs_{other}", f"te_graph 3 buckets against {other}",
                                "; ".join(parts), INFO))
    return lines


def _whole_step_info(config: str, rows: Rows) -> list[TargetLine]:
    """How far per-layer graphs are from one graph of the whole step, which pays no launch
    or Python cost at all, only the kernels and the gaps between dependent kernels that
    the kernel floor leaves out: the least any graphing of the step can take."""
    if WHOLE_STEP_GRAPH not in rows:
        return []
    lines = []
    for graphed in (TE_GRAPH, TORCH_GRAPHED):
        if graphed not in rows:
            continue
        line = _compare(config, f"{graphed}_vs_whole_step", f"{graphed} against one graph of the whole step",
                        rows, (graphed, "ms"), (WHOLE_STEP_GRAPH, "ms"), 1.0, "ms")
        lines.append(line._replace(detail=line.detail.replace(" (limit 1x)", ""), verdict=INFO))
    return lines


def peer_targets(results: Mapping[str, Rows], pairs: Sequence[tuple[str, str]]) -> list[TargetLine]:
    """The peer targets, per config and per (ours, peer) pair of rows: ours faster than
    the peer, with a steady footprint and a capture peak no larger than the peer's."""
    lines = []
    for config, rows in results.items():
        for ours, peer in pairs:
            if ours not in rows and peer not in rows:
                continue
            for key, field, what, unit in (("faster", "ms", "ms per step", "ms"),
                                           ("footprint", "steady_reserved_mib", "steady footprint", "MiB"),
                                           ("capture_peak", "build_peak_reserved_mib", "capture peak", "MiB")):
                lines.append(_compare(config, f"{ours}_vs_{peer}_{key}", f"{ours} {what} <= {peer}'s",
                                      rows, (ours, field), (peer, field), 1.0, unit))
    return lines


def fp8_targets(results: Mapping[str, Rows], rows_of: Mapping[str, tuple[str, str, str]],
                bf16_ratio: float = 1.15, whole_step_ratio: float = 1.1) -> list[TargetLine]:
    """The FP8 targets, per config and per FP8 precision: te_graph's FP8 row within
    ``bf16_ratio`` of its bf16 row and within ``whole_step_ratio`` of the whole-step graph
    at the same precision. ``rows_of`` maps a precision to (te_graph's row, te_graph's bf16
    row, the whole-step row)."""
    lines = []
    for config, rows in results.items():
        for precision, (ours, bf16, whole) in rows_of.items():
            lines.append(_compare(config, f"{precision}_vs_bf16", f"{ours} <= {bf16_ratio:g}x {bf16}",
                                  rows, (ours, "ms"), (bf16, "ms"), bf16_ratio, "ms"))
            lines.append(_compare(config, f"{precision}_vs_whole_step", f"{ours} <= {whole_step_ratio:g}x {whole}",
                                  rows, (ours, "ms"), (whole, "ms"), whole_step_ratio, "ms"))
    return lines


def whole_step_targets(results: Mapping[str, Rows], pairs: Sequence[tuple[str, str]],
                       ratio: float = 1.02) -> list[TargetLine]:
    """The product's whole-step graph against the hand-made one, per config and per
    (product row, hand-made row) pair: within ``ratio`` of its ms per step, and whether the
    product's verified step was bitwise equal to the eager step (its ``bitwise_equal_to_eager``)."""
    lines = []
    for config, rows in results.items():
        for ours, reference in pairs:
            if ours not in rows and reference not in rows:
                continue
            lines.append(_compare(config, f"{ours}_vs_{reference}", f"{ours} <= {ratio:g}x {reference}",
                                  rows, (ours, "ms"), (reference, "ms"), ratio, "ms"))
            equal = rows.get(ours, {}).get("bitwise_equal_to_eager")
            verdict = NOT_AVAILABLE if equal is None else PASS if equal else FAIL
            detail = {None: "not checked", True: "the verified step equals the eager step bitwise",
                      False: str(rows.get(ours, {}).get("mismatch", "differs")).splitlines()[0][:200]}[equal]
            lines.append(TargetLine(config, f"{ours}_bitwise", f"{ours} bitwise equal to eager", detail, verdict))
    return lines


def format_lines(lines: list[TargetLine]) -> list[str]:
    """One printable line per target."""
    return [f"  {line.verdict:<4} {line.config:<8} {line.target}: {line.detail}" for line in lines]
