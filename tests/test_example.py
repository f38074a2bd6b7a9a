"""The GPT training example (examples/train_gpt.py): data path, CPU training runs through
``main()``, and on a GPU bitwise agreement of graphed and eager training."""
from __future__ import annotations

import copy
import datetime
import importlib.metadata
import json
import math
import re
import shutil
import subprocess

import pytest
import torch

from examples import report, train_gpt
from examples.config import DEFAULTS, WARMUP_DIVISOR
from examples.train_gpt import CharCorpus, load_corpus, main
from tests.multi_gpu_helpers import run_train_gpt

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--micro-batch", "4"]
SUMMARY_KEYS = {
    "config", "graphs", "losses", "median_step_ms", "tokens_per_s", "peak_memory_bytes",
    "peak_memory_kind", "peak_memory_above_start_bytes", "capture_s", "params_sha256", "final_loss",
}


def _cpu(tmp_path, *extra):
    return ["--device", "cpu", "--no-progress", "--out", str(tmp_path), *TINY, *extra]


# -- data path -------------------------------------------------------------------------------
def test_corpus_encode_decode_round_trip():
    text = load_corpus()
    corpus = CharCorpus(text)
    assert corpus.decode(corpus.data) == text
    assert corpus.data.dtype == torch.long
    assert corpus.vocab_size == len(set(text))
    assert corpus.chars == sorted(corpus.chars)
    assert 0 <= int(corpus.data.min()) and int(corpus.data.max()) < corpus.vocab_size
    assert corpus.decode(corpus.encode("the graph")) == "the graph"


def test_batches_are_windows_with_targets_shifted_by_one():
    corpus = CharCorpus(load_corpus())
    text = corpus.text
    tokens, targets = next(corpus.batches(seq=24, batch=5, seed=3))
    assert tokens.shape == targets.shape == (5, 24)
    assert tokens.dtype == targets.dtype == torch.long
    assert torch.equal(tokens[:, 1:], targets[:, :-1]), "targets are the tokens shifted by one"
    for row in range(5):
        window = corpus.decode(tokens[row]) + corpus.decode(targets[row, -1:])
        assert window in text, "each row is a contiguous window of the corpus"


def test_batches_follow_the_seed():
    corpus = CharCorpus(load_corpus())
    a, b, c = (corpus.batches(seq=16, batch=3, seed=s) for s in (7, 7, 8))
    for _ in range(3):
        (xa, ya), (xb, yb), (xc, _) = next(a), next(b), next(c)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, xc), "another seed, other windows"


def test_batches_refuse_a_corpus_shorter_than_seq():
    with pytest.raises(ValueError, match="too few for --seq 64; pass a smaller --seq"):
        next(CharCorpus("short text").batches(seq=64, batch=2, seed=0))


def test_corpus_is_markdown_plus_docstrings_when_little_markdown(tmp_path):
    (tmp_path / "README.md").write_text("# Title\nsome markdown\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("a guide\n")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "secret.md").write_text("not this\n")
    (tmp_path / "mod.py").write_text('"""Module docstring."""\n\ndef f():\n    """Function doc."""\n')
    text = load_corpus(tmp_path, min_markdown_chars=10_000)
    assert "some markdown" in text and "a guide" in text
    assert "Module docstring." in text and "Function doc." in text
    assert "not this" not in text, "hidden folders are skipped"
    only_markdown = load_corpus(tmp_path, min_markdown_chars=10)
    assert "some markdown" in only_markdown and "Module docstring." not in only_markdown


def test_empty_corpus_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="found no Markdown or docstrings"):
        load_corpus(tmp_path)


# -- CPU training runs -------------------------------------------------------------------------
def test_three_step_run_writes_png_and_json(tmp_path, capsys):
    summary = main(_cpu(tmp_path, "--steps", "3"))
    assert (tmp_path / "loss_curve.png").stat().st_size > 0
    with open(tmp_path / "summary.json", encoding="utf-8") as f:
        written = json.load(f)
    assert SUMMARY_KEYS <= set(written)
    assert written["losses"] == summary["losses"] and len(written["losses"]) == 3
    assert written["graphs"] is False
    assert written["config"]["steps"] == 3 and written["config"]["device"] == "cpu"
    assert written["config"]["dtype"] == "float32" and written["config"]["recompute"] == "none"
    assert written["median_step_ms"] > 0 and written["tokens_per_s"] > 0
    assert written["peak_memory_bytes"] > 0 and "RSS" in written["peak_memory_kind"]
    assert written["environment"]["torch"] == torch.__version__
    assert len(written["environment"]["devices"]) == 1 and written["environment"]["devices"][0].startswith("CPU")
    assert written["parallel"] == {"world_size": 1, "tensor_parallel": 1, "data_parallel": 1}
    out = capsys.readouterr().out
    assert "median step" in out and "tokens/s" in out and "peak memory" in out
    # Which code ran, and when.
    environment = written["environment"]
    setup = (train_gpt.REPO_ROOT / "setup.py").read_text(encoding="utf-8")
    assert f'version="{environment["te_graph"]}"' in setup
    if (train_gpt.REPO_ROOT / ".git").exists() and shutil.which("git"):
        head = subprocess.run(["git", "-C", str(train_gpt.REPO_ROOT), "rev-parse", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        assert environment["git_commit"] == head and isinstance(environment["git_dirty"], bool)
    else:
        assert environment["git_commit"] is None and environment["git_dirty"] is None
    started = datetime.datetime.strptime(written["started_utc"], "%Y-%m-%dT%H:%M:%SZ")
    now = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)
    assert datetime.timedelta(0) <= now - started < datetime.timedelta(minutes=10)


def test_provenance_without_git_or_a_checkout(tmp_path, monkeypatch):
    """No .git (an unpacked archive, an installed copy): no commit, and no error; the
    version then comes from the installed distribution, if any."""
    try:
        installed = importlib.metadata.version("te-graph")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    assert report.provenance(tmp_path) == {"te_graph": installed, "git_commit": None, "git_dirty": None}
    (tmp_path / ".git").mkdir()  # a .git that git does not take for a repository
    (tmp_path / "setup.py").write_text('setup(name="te-graph", version="9.8.7")\n')
    assert report.provenance(tmp_path) == {"te_graph": "9.8.7", "git_commit": None, "git_dirty": None}
    monkeypatch.setenv("PATH", str(tmp_path))  # no git program at all
    assert report.git_state(train_gpt.REPO_ROOT) == {"git_commit": None, "git_dirty": None}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the note printed without CUDA")
def test_without_cuda_trains_eagerly_with_a_note(tmp_path, capsys):
    summary = main(["--no-progress", "--out", str(tmp_path), *TINY, "--steps", "1", "--graphs"])
    assert summary["graphs"] is False
    assert "CUDA not available: training eagerly on CPU (graphs need a GPU)" in capsys.readouterr().out


def test_loss_is_finite_and_decreases_over_30_steps(tmp_path):
    summary = main(_cpu(tmp_path, "--steps", "30", "--seed", "5", "--lr", "3e-3", "--dropout", "0"))
    losses = summary["losses"]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, f"loss went from {first:.3f} to {last:.3f}"


def test_same_seed_same_run_on_cpu(tmp_path):
    args = _cpu(tmp_path, "--steps", "4", "--dropout", "0.1", "--recompute", "full")
    a, b = main(args), main(args)
    assert a["losses"] == b["losses"] and a["params_sha256"] == b["params_sha256"]


def test_compare_on_cpu_uses_the_eager_replay_wrapper(tmp_path, capsys):
    summary = main(_cpu(tmp_path, "--steps", "4", "--compare", "--dropout", "0.1", "--recompute", "full"))
    out = capsys.readouterr().out
    assert "eager-replay wrapper" in out and "speedup eager-replay vs eager" in out
    assert summary["graphed_name"] == "eager-replay"
    assert summary["eager-replay"]["eager_replay"] is True and summary["eager"]["graphs"] is False
    # The same static-buffer wrapper, run eagerly, gives bitwise the same training.
    assert summary["losses_match_bitwise"] and summary["weights_match_bitwise"]
    assert "losses matched bitwise: True" in out
    assert set(json.loads((tmp_path / "summary.json").read_text())) >= {"eager", "eager-replay", "speedup"}
    # The plot says so (the two curves lie on top of each other) ...
    runs = {"eager": summary["eager"], "eager-replay": summary["eager-replay"]}
    assert report.plot_losses(runs, tmp_path / "equal.png") == [
        "eager and eager-replay: losses bitwise equal at all 4 steps"]
    # ... and when runs differ, it says where and draws the difference.
    runs["eager-replay"] = copy.deepcopy(summary["eager-replay"])
    runs["eager-replay"]["losses"][2] += 0.25
    assert report.plot_losses(runs, tmp_path / "differ.png") == [
        "eager and eager-replay: losses differ at 1 of 4 steps (largest |difference| 0.25)"]
    from matplotlib.image import imread

    assert imread(tmp_path / "differ.png").shape[0] > imread(tmp_path / "equal.png").shape[0], "a second panel"


def test_graph_step_on_cpu_replays_the_whole_step_bitwise_like_eager_and_the_layer_wrapper(tmp_path, capsys):
    """--graph-step without CUDA: te_graph's eager-replay wrapper of the whole step (forward,
    loss, backward, clipping, AdamW) trains bitwise like eager and like the per-layer wrapper."""
    argv = _cpu(tmp_path, "--steps", "5", "--compare", "--dropout", "0.1", "--recompute", "full")
    summary = main([*argv, "--graph-step"])
    out = capsys.readouterr().out
    assert "eager-replay wrapper of the whole step on cpu" in out and "speedup eager-replay step vs eager" in out
    assert summary["graphed_name"] == "eager-replay step"
    step = summary["eager-replay step"]
    assert step["eager_replay"] is True and step["config"]["graph_step"] is True and len(step["losses"]) == 5
    assert summary["losses_match_bitwise"] and summary["weights_match_bitwise"]
    layers = main(argv)["eager-replay"]
    assert report.bitwise_equal(step["losses"], layers["losses"]), "the per-layer wrapper trained otherwise"
    assert step["params_sha256"] == layers["params_sha256"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the note printed without CUDA")
def test_graph_step_without_cuda_runs_the_eager_replay_wrapper_with_a_note(tmp_path, capsys):
    summary = main(["--no-progress", "--out", str(tmp_path), *TINY, "--steps", "2", "--graph-step"])
    assert summary["eager_replay"] is True and summary["config"]["graph_step"] is True
    assert ("No CUDA device: --graph-step runs te_graph's eager-replay wrapper of the whole step on cpu"
            in capsys.readouterr().out)


def test_graph_step_refuses_what_one_graph_of_the_step_cannot_hold():
    def resolve(argv, world=1):
        return train_gpt.resolve(train_gpt.build_parser().parse_args(["--device", "cpu", "--graph-step", *argv]), world)

    with pytest.raises(SystemExit, match=re.escape(
            "train_gpt: --graph-step graphs the whole training step; it cannot go with --no-graphs.")):
        resolve(["--no-graphs"])
    with pytest.raises(SystemExit, match=re.escape(
            "train_gpt: --graph-step captures the step for one batch shape; it cannot go with --seq-buckets")):
        resolve(["--seq-buckets", "8,16"])
    for argv, world in ((["--tensor-parallel", "2"], 2), (["--data-parallel"], 2)):
        with pytest.raises(SystemExit, match=re.escape(
                "train_gpt: --graph-step runs on one process; it cannot go with --tensor-parallel or --data-parallel")):
            resolve(argv, world)
    config, _ = resolve([])
    assert config.graph_step and config.graphs and config.eager_replay


def test_loss_comparison_is_bitwise():
    def runs(a, b):
        return {"x": {"losses": a}, "y": {"losses": b}}

    same = report.loss_comparison(runs([1.0, float("nan")], [1.0, float("nan")]))
    assert same["bitwise_equal"] and same["steps_differing"] == 0, "the same NaN is the same bits"
    signed = report.loss_comparison(runs([0.0, 2.0], [-0.0, 2.5]))
    assert not signed["bitwise_equal"] and signed["steps_differing"] == 2
    assert signed["names"] == ("x", "y") and signed["difference"] == [0.0, 0.5]
    assert report.loss_comparison({"x": {"losses": [1.0]}}) is None, "one run: nothing to compare"
    assert not report.bitwise_equal([1.0], [1.0, 2.0])


def test_cpu_defaults_pass_the_first_phase_without_a_loss_spike(tmp_path):
    """The CPU defaults train without a loss spike (a poorer choice jumped from 3.3 to 7.1
    at steps 19-20). The defaults' first ``warmup`` steps, run alone (the schedule is the same up to there),
    rise nowhere more than 1.0 above the lowest of the 10 steps before."""
    warmup = DEFAULTS["cpu"]["steps"] // WARMUP_DIVISOR["cpu"]
    losses = main(["--device", "cpu", "--no-progress", "--out", str(tmp_path), "--steps", str(warmup),
                   "--warmup", str(warmup)])["losses"]
    rise, step = max((losses[i] - min(losses[max(0, i - 10):i]), i + 1) for i in range(1, len(losses)))
    assert rise < 1.0, f"the loss rose by {rise:.2f} at step {step}"
    assert sum(losses[-5:]) < sum(losses[:5]) - 5 * 0.5


def test_progress_bar_is_quiet_when_output_is_not_a_terminal(tmp_path, capsys):
    main(["--device", "cpu", "--out", str(tmp_path), *TINY, "--steps", "2"])  # no --progress flag
    captured = capsys.readouterr()
    assert "it/s" not in captured.out + captured.err and "2/2" not in captured.out + captured.err


def _buckets(tmp_path, *extra):
    sizes = ["--layers", "2", "--hidden", "32", "--heads", "4", "--micro-batch", "4"]
    return ["--device", "cpu", "--no-progress", "--out", str(tmp_path), *sizes, "--seq-buckets", "8,16,24", *extra]


def test_seq_buckets_vary_the_length_and_replay_bitwise(tmp_path):
    """Each step one of the buckets, from the seed; the eager-replay wrapper, graphed once for
    all buckets (more_shapes), trains bitwise like eager on the same lengths."""
    summary = main(_buckets(tmp_path, "--steps", "8", "--compare", "--dropout", "0.1", "--recompute", "full"))
    eager, replay = summary["eager"], summary["eager-replay"]
    assert eager["seq_lengths"] == replay["seq_lengths"] and len(eager["seq_lengths"]) == 8
    assert set(eager["seq_lengths"]) <= {8, 16, 24} and len(set(eager["seq_lengths"])) > 1
    assert eager["config"]["seq"] == 24 and eager["config"]["seq_buckets"] == [8, 16, 24]
    assert summary["losses_match_bitwise"] and summary["weights_match_bitwise"]
    again = main(_buckets(tmp_path, "--steps", "8", "--dropout", "0.1"))
    assert again["seq_lengths"] == eager["seq_lengths"], "the same seed picks the same lengths"


def test_seq_buckets_are_checked(tmp_path):
    with pytest.raises(SystemExit, match="pass either --seq or --seq-buckets, not both"):
        main([*_buckets(tmp_path), "--seq", "16"])
    with pytest.raises(SystemExit, match="--seq-buckets '8,8' repeats a length"):
        main(["--device", "cpu", "--out", str(tmp_path), "--seq-buckets", "8,8"])
    with pytest.raises(SystemExit, match="give comma-separated lengths, e.g. 64,128,256"):
        main(["--device", "cpu", "--out", str(tmp_path), "--seq-buckets", "64;128"])


def test_parallel_flags_are_checked():
    def resolve(argv, world):
        return train_gpt.resolve(train_gpt.build_parser().parse_args(["--device", "cpu", *argv]), world)

    with pytest.raises(SystemExit, match="--tensor-parallel 2 needs 2 processes, one per GPU; launch with "
                       "torchrun --nproc-per-node 2 examples/train_gpt.py --tensor-parallel 2"):
        resolve(["--tensor-parallel", "2"], 1)
    with pytest.raises(SystemExit, match="4 processes but --tensor-parallel 2: pass --data-parallel"):
        resolve(["--tensor-parallel", "2"], 4)
    with pytest.raises(SystemExit, match="--heads 4 is not divisible by --tensor-parallel 8"):
        resolve(["--tensor-parallel", "8", "--heads", "4"], 8)
    with pytest.raises(SystemExit, match="--distribute-saved-activations with --sequence-parallel"):
        resolve(["--tensor-parallel", "2", "--sequence-parallel", "--distribute-saved-activations",
                 "--recompute", "full"], 2)
    with pytest.raises(SystemExit, match="sequence length 63 is not divisible by --tensor-parallel 2"):
        resolve(["--tensor-parallel", "2", "--sequence-parallel", "--seq", "63"], 2)
    config, _ = resolve(["--tensor-parallel", "2", "--data-parallel"], 4)
    assert config.tensor_parallel == 2 and config.data_parallel


def test_tensor_parallel_on_two_gloo_ranks_matches_one_process(tmp_path):
    """torchrun-style launch with --tensor-parallel 2 on the CPU: eager and the eager-replay
    wrapper agree bitwise on both ranks, and the run follows the single-process run (same
    weights at the start; the partial sums only change the rounding)."""
    argv = ["--device", "cpu", "--no-progress", *TINY, "--steps", "4", "--dropout", "0", "--compare"]
    ranks = run_train_gpt([*argv, "--tensor-parallel", "2", "--out", str(tmp_path / "tp")], tmp_path)
    for rank, summary in enumerate(ranks):
        assert summary["losses_match_bitwise"] and summary["weights_match_bitwise"], f"rank {rank}"
        assert summary["eager"]["parallel"] == {"world_size": 2, "tensor_parallel": 2, "data_parallel": 1}
    assert ranks[0]["eager"]["losses"] == ranks[1]["eager"]["losses"], "TP ranks report the same loss"
    hashes = ranks[0]["eager"]["params_sha256_per_rank"]
    assert len(hashes) == 2 and hashes[0] != hashes[1], "each rank holds its own shards"
    written = json.loads((tmp_path / "tp" / "summary.json").read_text())
    assert len(written["eager"]["environment"]["devices"]) == 2
    single = main([*argv, "--out", str(tmp_path / "one")])
    assert ranks[0]["eager"]["losses"] == pytest.approx(single["eager"]["losses"], rel=1e-4)


def test_data_parallel_on_two_gloo_ranks_keeps_replicas_identical(tmp_path):
    """torchrun-style launch with --data-parallel (DDP around the eager-replay wrapper), with
    seq buckets: each rank trains on its own batches, replicas stay bitwise identical, and
    the wrapper trains bitwise like eager DDP."""
    argv = ["--device", "cpu", "--no-progress", "--layers", "2", "--hidden", "32", "--heads", "4",
            "--micro-batch", "4", "--seq-buckets", "8,16", "--steps", "4", "--data-parallel",
            "--recompute", "full", "--compare", "--out", str(tmp_path / "dp")]
    ranks = run_train_gpt(argv, tmp_path)
    for rank, summary in enumerate(ranks):
        assert summary["losses_match_bitwise"] and summary["weights_match_bitwise"], f"rank {rank}"
        for run in ("eager", "eager-replay"):
            hashes = summary[run]["params_sha256_per_rank"]
            assert hashes[0] == hashes[1], f"rank {rank}, {run}: the replicas diverged"
    assert ranks[0]["eager"]["parallel"] == {"world_size": 2, "tensor_parallel": 1, "data_parallel": 2}
    assert (tmp_path / "dp" / "loss_curve.png").exists()


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    def config(*argv):
        return train_gpt.resolve(train_gpt.build_parser().parse_args(["--device", "cpu", *argv]))[0]

    assert config("--steps", "100").warmup == 20, "CPU default: steps / 5"
    assert config().steps == 400 and config().lr == 1e-3 and config().warmup == 80
    c = config("--steps", "100", "--lr", "1e-3", "--warmup", "10")
    lrs = [train_gpt.learning_rate(c, step) for step in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])), "cosine decay after warmup"
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="--hidden 30 is not divisible by --heads 4"):
        main(_cpu(tmp_path, "--hidden", "30", "--steps", "1"))


# -- GPU: graphed training ---------------------------------------------------------------------
GPU_TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--micro-batch", "4", "--no-progress"]


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_graphed_losses_equal_eager_bitwise_without_dropout(tmp_path, recompute):
    summary = main([*GPU_TINY, "--seq", "32", "--steps", "10", "--dropout", "0", "--recompute", recompute,
                    "--compare", "--out", str(tmp_path)])
    eager, graphed = summary["eager"], summary["graphed"]
    assert graphed["graphs"] is True and eager["graphs"] is False
    assert graphed["config"]["dtype"] == "bfloat16"
    assert len(graphed["losses"]) == 10
    assert graphed["losses"] == eager["losses"], "graphed and eager losses differ"
    assert summary["losses_match_bitwise"] and summary["weights_match_bitwise"]


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [32, 256], ids=["seq32", "seq256"])
def test_graphed_run_with_dropout_and_recompute_is_reproducible(tmp_path, seq):
    """seq 256 spans several flash-attention key blocks: bitwise needs deterministic mode."""
    args = [*GPU_TINY, "--seq", str(seq), "--steps", "10", "--dropout", "0.1", "--recompute", "full",
            "--graphs", "--out", str(tmp_path)]
    a, b = main(args), main(args)
    assert a["graphs"] is True
    assert a["losses"] == b["losses"], "same seed, same graphed run, different losses"
    assert a["params_sha256"] == b["params_sha256"]
    c = main([*args, "--seed", "99"])
    assert c["losses"] != a["losses"], "another seed gives another run"


@pytest.mark.gpu
def test_graphed_losses_equal_eager_bitwise_with_dropout_without_recompute(tmp_path):
    """Without recompute the graphs draw dropout from the live streams, exactly as eager does."""
    summary = main([*GPU_TINY, "--seq", "32", "--steps", "10", "--dropout", "0.1", "--recompute", "none",
                    "--compare", "--out", str(tmp_path)])
    assert summary["losses_match_bitwise"] and summary["weights_match_bitwise"]


@pytest.mark.gpu
def test_graphed_losses_equal_eager_bitwise_with_the_defaults(tmp_path):
    """Dropout 0.1 and full recompute (the GPU defaults): the recompute inside the graphs draws
    the eager masks, so graphed training equals eager training bitwise."""
    summary = main([*GPU_TINY, "--seq", "32", "--steps", "10", "--compare", "--out", str(tmp_path)])
    assert summary["eager"]["config"]["recompute"] == "full" and summary["eager"]["config"]["dropout"] == 0.1
    assert summary["losses_match_bitwise"] and summary["weights_match_bitwise"]


@pytest.mark.gpu
def test_graphed_seq_buckets_equal_eager_bitwise(tmp_path):
    """Three lengths graphed in one call (more_shapes), dropout and recompute on."""
    summary = main([*GPU_TINY, "--seq-buckets", "32,64,96", "--steps", "9", "--compare", "--out", str(tmp_path)])
    graphed = summary["graphed"]
    assert graphed["graphs"] is True and len(set(graphed["seq_lengths"])) > 1
    assert graphed["seq_lengths"] == summary["eager"]["seq_lengths"]
    assert summary["losses_match_bitwise"] and summary["weights_match_bitwise"]


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_graph_step_losses_equal_eager_and_the_per_layer_graphs_bitwise(tmp_path, recompute):
    """The whole step as one graph (forward, loss, backward, clipping, the fused AdamW step),
    dropout on: bitwise the eager run, and the per-layer graphs' run."""
    argv = [*GPU_TINY, "--seq", "32", "--steps", "10", "--recompute", recompute, "--compare", "--out", str(tmp_path)]
    summary = main([*argv, "--graph-step"])
    step = summary["graphed step"]
    assert step["graphs"] is True and step["config"]["graph_step"] is True and step["config"]["dropout"] == 0.1
    assert summary["losses_match_bitwise"] and summary["weights_match_bitwise"]
    layers = main(argv)["graphed"]
    assert step["losses"] == layers["losses"] and step["params_sha256"] == layers["params_sha256"]


@pytest.mark.multi_gpu
@pytest.mark.parametrize("parallelism", [["--tensor-parallel", "2"], ["--tensor-parallel", "2", "--sequence-parallel"],
                                         ["--data-parallel"]], ids=["tp2", "tp2-sp", "dp2"])
def test_two_gpu_graphed_training_equals_eager_bitwise(tmp_path, parallelism):
    """The example on 2 GPUs (NCCL), graphed with recompute and dropout: bitwise eager's."""
    argv = [*GPU_TINY, "--seq", "32", "--steps", "6", "--compare", *parallelism, "--out", str(tmp_path / "out")]
    ranks = run_train_gpt(argv, tmp_path)
    for rank, summary in enumerate(ranks):
        assert summary["graphed"]["graphs"] is True, f"rank {rank}"
        assert summary["losses_match_bitwise"] and summary["weights_match_bitwise"], f"rank {rank}"
    devices = ranks[0]["graphed"]["environment"]["devices"]
    assert len(devices) == 2 and all(devices), devices
    if "--data-parallel" in parallelism:
        hashes = ranks[0]["graphed"]["params_sha256_per_rank"]
        assert hashes[0] == hashes[1], "the replicas diverged"


def test_script_puts_the_repo_root_on_sys_path():
    assert train_gpt.REPO_ROOT.joinpath("te_graph", "__init__.py").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the README's Quick start (the GPU one is the example's)")
def test_the_readme_quick_start_runs_as_the_readme_says(tmp_path):
    """Saved outside the repository and run with the root on PYTHONPATH, as the README
    says, the Quick start trains its 10 steps (on a CPU in eager replay, in seconds)."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    code = readme[readme.index("## Quick start"):].split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": root}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("trained 10 steps on cpu")


def test_eager_replay_implies_graphs_and_is_refused_with_no_graphs():
    parser = train_gpt.build_parser()
    config, notes = train_gpt.resolve(parser.parse_args(["--device", "cpu", "--eager-replay"]), 1)
    assert config.graphs and config.eager_replay and not any("training eagerly" in n for n in notes)
    with pytest.raises(SystemExit, match=re.escape(
            "train_gpt: --eager-replay runs te_graph's graphed wrapper without graphs; it cannot go with --no-graphs.")):
        train_gpt.resolve(parser.parse_args(["--device", "cpu", "--eager-replay", "--no-graphs"]), 1)
