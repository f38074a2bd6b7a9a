"""CPU tests for the benchmarks' pure logic: target verdicts, per-input medians, the table,
the incremental JSON and the PNG, all from hand-made rows (no GPU, nothing timed)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

import _targets as T
from _measure import medians_by_label, progress_line
from _report import JsonReport, table_lines, write_png


def row(ms=None, mib=None, peak=None, capture=None, error=None) -> dict:
    r = {"ms": ms, "steady_reserved_mib": mib, "build_peak_reserved_mib": peak, "capture_s": capture}
    if error:
        r["error"] = error
    return {k: v for k, v in r.items() if v is not None}


def tiny_rows(**changes) -> dict:
    """Rows of a tiny config that meet every target; ``changes`` replace whole rows."""
    rows = {
        T.EAGER: row(ms=35.0, mib=200.0, peak=20.0),
        T.EAGER_RECOMPUTE: row(ms=45.0, mib=150.0, peak=20.0),
        T.KERNEL_FLOOR: row(ms=3.5),
        T.FORWARD_KERNELS: row(ms=1.0),
        T.TE_GRAPH: row(ms=4.0, mib=220.0, peak=215.0, capture=0.2),
        T.TE_GRAPH_RECOMPUTE: row(ms=5.0, mib=160.0, peak=160.0, capture=0.3),
        T.TORCH_GRAPHED: row(ms=8.0, mib=260.0, peak=300.0, capture=0.25),
    }
    rows.update(changes)
    return rows


def verdicts(results, targets=None) -> dict:
    return {(line.config, line.key): line.verdict
            for line in T.evaluate_targets(results, targets or T.STEP_TARGETS)}


def test_every_target_passes_when_met():
    assert verdicts({"tiny": tiny_rows()}) == {
        ("tiny", "floor"): "PASS",  # 4.0 <= 1.2 * 3.5 = 4.2
        ("tiny", "torch_speedup"): "PASS",  # 8.0 >= 2 * 4.0
        ("tiny", "recompute_overhead"): "PASS",  # 5.0 <= 1.1 * (4.0 + 1.0)
        ("tiny", "footprint"): "PASS",  # 220 <= 1.15 * 200
        ("tiny", "footprint_recompute"): "PASS",  # 160 <= 1.15 * 150
        ("tiny", "capture_peak"): "PASS",  # 215 <= 1.1 * 200
        ("tiny", "capture_peak_recompute"): "PASS",  # 160 <= 1.1 * 150
        ("tiny", "capture_time"): "PASS",  # 0.2 <= 0.25
    }


def test_every_target_fails_when_missed():
    rows = tiny_rows(**{
        T.TE_GRAPH: row(ms=4.3, mib=231.0, peak=221.0, capture=0.3),
        T.TE_GRAPH_RECOMPUTE: row(ms=5.9, mib=173.0, peak=166.0, capture=0.4),
        T.TORCH_GRAPHED: row(ms=8.5, capture=0.25),
    })
    assert verdicts({"tiny": rows}) == {
        ("tiny", "floor"): "FAIL",  # 4.3 > 4.2
        ("tiny", "torch_speedup"): "FAIL",  # 8.5 < 8.6
        ("tiny", "recompute_overhead"): "FAIL",  # 5.9 > 1.1 * 5.3 = 5.83
        ("tiny", "footprint"): "FAIL",  # 231 > 230
        ("tiny", "footprint_recompute"): "FAIL",  # 173 > 172.5
        ("tiny", "capture_peak"): "FAIL",  # 221 > 220
        ("tiny", "capture_peak_recompute"): "FAIL",  # 166 > 165
        ("tiny", "capture_time"): "FAIL",  # 0.3 > 0.25
    }


def test_limits_per_config_and_equality_passes():
    small = tiny_rows(**{T.TE_GRAPH: row(ms=1.08 * 3.5, mib=200.0, peak=215.0, capture=0.2)})
    medium = tiny_rows(**{T.TE_GRAPH: row(ms=1.04 * 3.5, mib=201.0, peak=215.0, capture=0.2)})
    got = verdicts({"small": small, "medium": medium})
    assert got["small", "floor"] == "PASS"  # exactly 1.08x
    assert got["small", "footprint"] == "PASS"  # exactly 1.0x eager
    assert got["small", "footprint_recompute"] == "FAIL"  # 160 > 1.0 * 150 (tiny allowed 1.15)
    assert got["medium", "floor"] == "FAIL"  # 1.04x > 1.03x
    assert got["medium", "footprint"] == "FAIL"  # 201 > 200
    assert ("small", "torch_speedup") not in got and ("medium", "torch_speedup") not in got


def test_missing_or_failed_rows_give_n_a_with_the_reason():
    rows = tiny_rows(**{T.TORCH_GRAPHED: row(error="RuntimeError: boom")})
    del rows[T.FORWARD_KERNELS]
    lines = {line.key: line for line in T.evaluate_targets({"tiny": rows}, T.STEP_TARGETS)}
    assert lines["torch_speedup"].verdict == "n/a"
    assert "torch graphed failed" in lines["torch_speedup"].detail
    assert lines["capture_time"].verdict == "n/a"
    assert lines["recompute_overhead"].verdict == "n/a"
    assert "forward kernels not run" in lines["recompute_overhead"].detail
    assert lines["floor"].verdict == "PASS"
    te_no_mib = tiny_rows(**{T.TE_GRAPH: row(ms=4.0)})
    assert verdicts({"tiny": te_no_mib})["tiny", "footprint"] == "n/a"


def test_configs_without_targets_are_skipped_and_peers_are_configurable():
    assert T.evaluate_targets({"other": tiny_rows()}, T.STEP_TARGETS) == []
    peer = "megatron full recompute"
    rows = tiny_rows()
    rows[peer] = rows.pop(T.EAGER_RECOMPUTE)
    targets = {"megatron": T.Targets(floor_ratio=1.08, recompute_peer=peer)}
    got = verdicts({"megatron": rows}, targets)
    assert got["megatron", "footprint_recompute"] == "FAIL"  # 160 > 1.0 * 150
    assert got["megatron", "capture_peak_recompute"] == "PASS"  # 160 <= 1.1 * 150
    assert got["megatron", "floor"] == "FAIL"  # 4.0 > 1.08 * 3.5


def test_bucket_rows_get_info_lines():
    rows = tiny_rows(**{T.TE_GRAPH_BUCKETS: row(ms=3.0, mib=330.0), T.EAGER_BUCKETS: row(ms=30.0, mib=200.0)})
    lines = [line for line in T.evaluate_targets({"tiny": rows}, T.STEP_TARGETS) if line.verdict == "info"]
    assert [line.key for line in lines] == ["buckets_vs_te_graph", "buckets_vs_eager 3 buckets"]
    assert "(1.50x)" in lines[0].detail and "(0.10x)" in lines[1].detail
    formatted = T.format_lines(lines)
    assert formatted[0].split()[:2] == ["info", "tiny"]


def test_whole_step_graph_row_gets_info_lines():
    rows = tiny_rows(**{T.WHOLE_STEP_GRAPH: row(ms=3.2, mib=180.0)})
    lines = [line for line in T.evaluate_targets({"tiny": rows}, T.STEP_TARGETS) if line.verdict == "info"]
    assert [line.key for line in lines] == ["te_graph_vs_whole_step", "torch graphed_vs_whole_step"]
    assert lines[0].detail == "4 vs 3.2 ms = 1.250x"
    assert lines[1].detail == "8 vs 3.2 ms = 2.500x"


def test_medians_by_label_groups_steps_by_input():
    times = [1.0, 10.0, 100.0, 3.0, 30.0, 300.0, 2.0]
    labels = ["s128", "s64", "s32"]
    assert medians_by_label(times, labels) == {"s128": 2.0, "s64": 20.0, "s32": 200.0}


def test_table_and_progress_lines():
    rows = tiny_rows(**{T.TORCH_GRAPHED: row(error="RuntimeError: outputs must be tensors\nmore")})
    rows[T.TE_GRAPH]["steady_allocated_mib"] = 100.0
    rows[T.TE_GRAPH]["ms_by_input"] = {"s128": 4.5, "s64": 3.5}
    lines = table_lines(rows)
    te = next(line for line in lines if line.startswith("te_graph "))
    assert "4.000" in te and "1.14" in te and "220" in te and "1.10" in te and "0.20" in te
    assert any("median ms per input (s128: 4.500, s64: 3.500)" in line for line in lines)
    assert any(line.startswith("torch graphed") and "ERROR: RuntimeError: outputs must be tensors more" in line
               for line in lines)
    assert progress_line("tiny", "torch graphed", rows[T.TORCH_GRAPHED]) == (
        "[tiny] torch graphed: ERROR RuntimeError: outputs must be tensors")
    done = progress_line("tiny", "te_graph", rows[T.TE_GRAPH])
    assert done.startswith("[tiny] te_graph: 4.000 ms, steady 220 MiB reserved (100 allocated)")
    assert done.endswith("capture 0.200 s")


def test_json_report_is_rewritten_after_every_row(tmp_path):
    path = tmp_path / "out.json"
    report = JsonReport(str(path), {"torch": "x", "device": "fake"})
    report.add_config("tiny", {"layers": 24})
    report.add_row("tiny", "eager", row(ms=35.0, mib=200.0))
    on_disk = json.loads(path.read_text())
    assert on_disk["configs"]["tiny"]["variants"]["eager"]["ms"] == 35.0
    report.set_targets(T.evaluate_targets({"tiny": tiny_rows()}, T.STEP_TARGETS))
    on_disk = json.loads(path.read_text())
    assert {t["verdict"] for t in on_disk["targets"]} == {"PASS"}
    assert not (tmp_path / "out.json.tmp").exists()
    assert JsonReport(None, {}).write() is None  # no path: nothing written


def test_png_from_fake_results(tmp_path):
    pytest.importorskip("matplotlib")
    results = {"tiny": tiny_rows(**{T.TORCH_GRAPHED: row(error="boom")}), "small": tiny_rows()}
    path = write_png(str(tmp_path / "table.png"), results, "fake")
    assert path is not None
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_peer_targets_compare_each_pair_on_speed_footprint_and_capture_peak():
    rows = {"te-small": {
        "te_graph bf16": row(ms=5.0, mib=1000.0, peak=1100.0),
        "TE graphed bf16": row(ms=6.0, mib=990.0, peak=1500.0),
        "te_graph fp8-delayed": row(error="boom"),
    }}
    lines = T.peer_targets(rows, [("te_graph bf16", "TE graphed bf16"), ("te_graph fp8-delayed", "TE graphed fp8-delayed")])
    verdicts = {line.key: line.verdict for line in lines}
    assert verdicts == {
        "te_graph bf16_vs_TE graphed bf16_faster": T.PASS,
        "te_graph bf16_vs_TE graphed bf16_footprint": T.FAIL,
        "te_graph bf16_vs_TE graphed bf16_capture_peak": T.PASS,
        "te_graph fp8-delayed_vs_TE graphed fp8-delayed_faster": T.NOT_AVAILABLE,
        "te_graph fp8-delayed_vs_TE graphed fp8-delayed_footprint": T.NOT_AVAILABLE,
        "te_graph fp8-delayed_vs_TE graphed fp8-delayed_capture_peak": T.NOT_AVAILABLE,
    }
    assert [line.detail for line in lines][0] == "5 vs 6 ms = 0.833x (limit 1x)"


def test_fp8_targets_hold_each_fp8_row_against_bf16_and_the_whole_step_graph():
    rows = {"te-tiny": {
        "te_graph bf16": row(ms=5.0, mib=1.0, peak=1.0),
        "te_graph fp8-delayed": row(ms=5.5, mib=1.0, peak=1.0),
        "whole-step graph fp8-delayed": row(ms=4.9, mib=1.0, peak=1.0),
        "te_graph fp8-current": row(ms=6.0, mib=1.0, peak=1.0),
    }}
    names = {p: (f"te_graph {p}", "te_graph bf16", f"whole-step graph {p}") for p in ("fp8-delayed", "fp8-current")}
    lines = {line.key: line for line in T.fp8_targets(rows, names)}
    assert {k: v.verdict for k, v in lines.items()} == {
        "fp8-delayed_vs_bf16": T.PASS, "fp8-delayed_vs_whole_step": T.FAIL,
        "fp8-current_vs_bf16": T.FAIL, "fp8-current_vs_whole_step": T.NOT_AVAILABLE,
    }
    assert lines["fp8-delayed_vs_whole_step"].detail == "5.5 vs 4.9 ms = 1.122x (limit 1.1x)"
    assert lines["fp8-current_vs_bf16"].target == "te_graph fp8-current <= 1.15x te_graph bf16"


def test_the_megatron_example_runs_on_one_rank_or_under_torchrun_with_an_output_per_rank():
    """The command line that the Megatron tests and benchmarks start, and where each rank's
    records land (examples/megatron_gpt.py; the runs themselves need GPUs)."""
    from examples import megatron_gpt

    assert megatron_gpt.command(["--graphs", "eager"]) == [sys.executable, "-m", "examples.megatron_gpt",
                                                           "--graphs", "eager"]
    assert megatron_gpt.command(["--expert-parallel", "2"], ranks=2) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "examples.megatron_gpt", "--expert-parallel", "2"]
    assert megatron_gpt.rank_path("/tmp/run.pt", 0, 1) == "/tmp/run.pt"
    assert [megatron_gpt.rank_path("/tmp/run.pt", r, 2) for r in range(2)] == ["/tmp/run.rank0.pt", "/tmp/run.rank1.pt"]


def test_the_megatron_example_makes_its_graphs_after_warmup_and_again_only_where_asked():
    """The steps before which a run of examples/megatron_gpt.py makes its graphs: after the
    eager warmup, and again at --regraph-at only where it is set (0, the default, is never:
    a check of ``step == regraph_at`` alone deleted the graphs before step 0)."""
    from examples.megatron_gpt import RunConfig, graph_event

    def events(**fields) -> dict:
        cfg = RunConfig(**fields)
        return {step: e for step in range(cfg.steps) if (e := graph_event(cfg, step))}

    assert events(graphs="te_graph") == {1: "make"}
    assert events(graphs="te_graph_replay", warmup_steps=2, steps=6) == {2: "make"}
    assert events(graphs="te", regraph_at=3) == {1: "make", 3: "remake"}
    assert events(graphs="eager", regraph_at=3) == {}


def test_the_host_timeline_clocks_te_graphs_functions_and_puts_them_back():
    import profile_te_host

    import te_graph.grads as grads
    import te_graph.replay.function as replay

    originals = (grads.ParamGrads.__dict__["prepare_in_graph"], replay._Replay.__dict__["backward"])
    params = [torch.nn.Parameter(torch.ones(2))]
    buffers = [torch.zeros(2)]
    totals: dict = {}
    with profile_te_host._timed(totals):
        assert isinstance(replay._Replay.__dict__["backward"], staticmethod)
        grads.ParamGrads(params, buffers).prepare_in_graph()
    assert params[0].grad is buffers[0]  # the clocked function ran
    assert list(totals) == ["  parameter-gradient bookkeeping"] and totals["  parameter-gradient bookkeeping"] > 0
    assert (grads.ParamGrads.__dict__["prepare_in_graph"], replay._Replay.__dict__["backward"]) == originals


def test_moe_rounds_alternate_their_order_and_the_summary_takes_ratios_within_a_round():
    import bench_moe

    assert bench_moe.rounds(["a", "b", "c"], 3) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                                                   (2, "a"), (2, "b"), (2, "c")]
    buckets, reference = "te_graph buckets", "te_graph drop-pad"
    # A machine slower in round 1 for both rows; in round 2 the reference failed.
    results = [{"row": buckets, "round": 0, "ms": 40.0}, {"row": reference, "round": 0, "ms": 32.0},
               {"row": reference, "round": 1, "ms": 40.0}, {"row": buckets, "round": 1, "ms": 50.0},
               {"row": buckets, "round": 2, "ms": 36.0}, {"row": reference, "round": 2, "error": "boom"},
               {"row": "eager", "round": 0, "error": "boom"}]
    assert bench_moe.summary_lines(results, reference) == [
        f"over 3 rounds: row, median ms (min-max), median ratio to {reference!r} within a round",
        f"  {buckets:31}    40.00 (36.00-50.00)  1.25x over 2 rounds",
        f"  {reference:31}    36.00 (32.00-40.00)  1.00x over 2 rounds",
        f"  {'eager':31} failed in every round",
    ]
