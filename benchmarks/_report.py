"""Shared by the benchmark scripts: failing rows, the printed table, the JSON and the PNG.

A failing variant becomes a row, not a crash. The JSON is rewritten after every row, so a
run killed half-way still leaves its finished rows on disk.
"""
from __future__ import annotations

import contextlib
import json
import os
import traceback
from typing import Any, Mapping, Optional, Sequence

import torch

from _targets import EAGER, KERNEL_FLOOR, TargetLine, Targets, evaluate_targets, format_lines

Rows = Mapping[str, Mapping[str, Any]]


def record_failure(result: dict, error: BaseException, show_traceback: bool) -> None:
    """Put ``error`` in the variant's row (and its traceback on stderr if asked); leave the
    device synchronised so the next variant starts clean."""
    result["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
    if show_traceback:
        traceback.print_exc()
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- table

_COLUMNS = (  # header, width, row field
    ("median ms", 10, "ms"),
    ("x floor", 8, None),
    ("steady MiB", 11, "steady_reserved_mib"),
    ("x eager", 8, None),
    ("alloc MiB", 10, "steady_allocated_mib"),
    ("build peak", 11, "build_peak_reserved_mib"),
    ("capture s", 10, "capture_s"),
)


def _cell(value: Optional[float], width: int, spec: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def table_lines(rows: Rows) -> list[str]:
    """The table of one config: ms, ratio to the kernel floor, steady footprint (reserved)
    and its ratio to eager's, allocated, peak reserved during build + capture, capture s."""
    floor = _number(rows.get(KERNEL_FLOOR, {}), "ms")
    eager = _number(rows.get(EAGER, {}), "steady_reserved_mib")
    header = f"{'variant':<22}" + "".join(f" {h:>{w}}" for h, w, _ in _COLUMNS)
    lines = [header, "-" * len(header)]
    for name, row in rows.items():
        if row.get("error"):
            lines.append(f"{name:<22} ERROR: {' '.join(str(row['error']).split())[:200]}")
            continue
        ms = _number(row, "ms")
        mib = _number(row, "steady_reserved_mib")
        values = {
            "ms": ms,
            "x floor": ms / floor if ms and floor else None,
            "x eager": mib / eager if mib and eager else None,
        }
        cells = []
        for head, width, field in _COLUMNS:
            value = values.get(head) if field is None else _number(row, field)
            spec = ".2f" if field is None or field == "capture_s" else (".3f" if field == "ms" else ".0f")
            cells.append(" " + _cell(value, width, spec))
        lines.append(f"{name:<22}" + "".join(cells))
        if row.get("ms_by_input"):
            per = ", ".join(f"{label}: {ms_:.3f}" for label, ms_ in row["ms_by_input"].items())
            lines.append(f"{'':<22}   median ms per input ({per})")
    lines.append("steady MiB = max_memory_reserved over the timed steps (footprint); alloc = "
                 "max_memory_allocated there; build peak = max reserved during build + capture.")
    return lines


def _number(row: Mapping[str, Any], field: str) -> Optional[float]:
    value = row.get(field)
    return float(value) if isinstance(value, (int, float)) else None


# --------------------------------------------------------------------------- JSON


class JsonReport:
    """Everything a run measured, rewritten to ``path`` (atomically) after every change."""

    def __init__(self, path: Optional[str], header: Mapping[str, Any]):
        self.path = path
        self.payload: dict = dict(header)
        self.payload.setdefault("configs", {})
        self.payload.setdefault("targets", [])

    def add_config(self, name: str, shape: Mapping[str, Any]) -> None:
        self.payload["configs"][name] = {**shape, "variants": {}}
        self.write()

    def add_row(self, config: str, variant: str, row: Mapping[str, Any]) -> None:
        self.payload["configs"][config]["variants"][variant] = dict(row)
        self.write()

    def set_targets(self, lines: Sequence[TargetLine]) -> None:
        self.payload["targets"] = [line._asdict() for line in lines]
        self.write()

    def results(self, order: Sequence[str] = ()) -> dict[str, dict[str, dict]]:
        """config -> variant -> row, as the target check and the PNG read them; the
        variants named in ``order`` first, in that order."""
        ranked = {name: i for i, name in enumerate(order)}
        return {
            c: dict(sorted(v["variants"].items(), key=lambda item: ranked.get(item[0], len(ranked))))
            for c, v in self.payload["configs"].items()
        }

    def write(self) -> None:
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.payload, f, indent=1, default=str)
        os.replace(tmp, self.path)


# --------------------------------------------------------------------------- the end of a run


def finish(report: JsonReport, order: Sequence[str], targets: Mapping[str, Targets],
           png: Optional[str], title: str) -> list[TargetLine]:
    """Print each config's table and the target lines, store the lines, plot the PNG."""
    results = report.results(order)
    for config, rows in results.items():
        print(f"\n{config}:")
        print("\n".join(table_lines(rows)), flush=True)
    lines = evaluate_targets(results, targets)
    report.set_targets(lines)
    print("\nStep targets (informational; they assert nothing):")
    print("\n".join(format_lines(lines)), flush=True)
    if png and write_png(png, results, title):
        print(f"table plotted to {png}")
    if report.path:
        print(f"raw numbers written to {report.path}")
    return lines


# --------------------------------------------------------------------------- PNG


def write_png(path: str, results: Mapping[str, Rows], title: str) -> Optional[str]:
    """Per config, bars of ms per variant and of steady footprint (MiB) per variant.
    Returns the path written, or None (with a printed note) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"NOTE: matplotlib is not installed; no PNG written to {path}.", flush=True)
        return None
    configs = [c for c, rows in results.items() if rows]
    if not configs:
        print(f"NOTE: no rows to plot; no PNG written to {path}.", flush=True)
        return None
    widest = max(len(rows) for rows in results.values())
    fig, axes = plt.subplots(len(configs), 2, figsize=(max(10.0, 1.1 * widest * 2), 3.6 * len(configs)),
                             squeeze=False)
    for (ax_ms, ax_mib), config in zip(axes, configs):
        rows = results[config]
        _bars(ax_ms, rows, "ms", f"{config}: median ms per step", "ms")
        floor = _number(rows.get(KERNEL_FLOOR, {}), "ms")
        if floor:
            ax_ms.axhline(floor, color="#555555", linestyle="--", linewidth=0.8)
        _bars(ax_mib, rows, "steady_reserved_mib", f"{config}: steady footprint (reserved)", "MiB")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax: Any, rows: Rows, field: str, title: str, unit: str) -> None:
    names = list(rows)
    values = [_number(rows[n], field) or 0.0 for n in names]
    colors = ["#999999" if n == KERNEL_FLOOR or n.endswith("kernels") else
              "#4c72b0" if n.startswith("te_graph") else "#dd8452" for n in names]
    bars = ax.bar(range(len(names)), values, color=colors)
    top = max(values) if any(values) else 1.0
    for bar, name, value in zip(bars, names, values):
        if rows[name].get("error"):
            label = "error"
        elif _number(rows[name], field) is None:
            label = "-"
        else:
            label = f"{value:.3g}" if unit == "ms" else f"{value:.0f}"
        ax.text(bar.get_x() + bar.get_width() / 2, value + 0.01 * top, label,
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, top * 1.15)


def add_output_args(parser: Any) -> None:
    parser.add_argument("--out", default=None,
                        help="JSON path for everything measured (rewritten after every row)")
    parser.add_argument("--png", default=None, help="PNG path for bars of ms and MiB per variant")
