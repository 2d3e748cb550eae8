"""Seeing a run: TensorBoard events (read back with TensorBoard's own reader), train_log.jsonl,
the report in output_dir/report/, scripts/plot_runs.py, secrets kept out of every file and of
everything printed, and --report_to refusing a tracker that is not installed. One real
2-process launch of scripts/train.py serves most of them."""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import REPO, assert_fails_cleanly, launch, make_tiny_model, train_args, write_examples

TRAIN = REPO / "scripts" / "train.py"
RECORD_LOCAL_LOSSES = REPO / "tests" / "launched" / "record_local_losses.py"
ENV_TOKEN = "hf_FakeEnvToken4242aa"
ARG_TOKEN = "hf_FakeArgToken1717bb"
STEPS = 8  # 64 examples / (2 processes x 4): every rank holds 4 real examples in every step
TRAIN_TAGS = [
    "train/loss",
    "train/learning_rate",
    "train/grad_norm",
    "train/samples_per_second",
    "train/tokens_per_second",
    "train/peak_memory_mb",
    "train/epoch",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("tracking")
    model = make_tiny_model(base / "model")
    data = {
        "train": write_examples(base / "train.csv", 64, seed=1),
        "validation": write_examples(base / "validation.csv", 37, seed=2),
    }
    output_dir = base / "out"
    args = train_args(
        model,
        data,
        output_dir,
        "--per_device_train_batch_size",
        4,
        "--num_train_epochs",
        1,
        "--logging_steps",
        1,
        "--hub_token",
        ARG_TOKEN,
    )
    result = launch(
        RECORD_LOCAL_LOSSES, *args, num_processes=2, env={"HF_TOKEN": ENV_TOKEN, "LOCAL_LOSS_LOG": str(base / "local")}
    )
    assert result.returncode == 0, result.output[-4000:]
    local = {
        rank: [json.loads(line) for line in (base / f"local.rank{rank}").read_text().splitlines()] for rank in (0, 1)
    }
    return {"dir": output_dir, "output": result.output, "local": local}


def train_log(output_dir):
    return [json.loads(line) for line in (output_dir / "train_log.jsonl").read_text().splitlines()]


def test_tensorboard_holds_one_value_per_logging_step_in_one_run_directory(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = run["dir"] / "runs"
    assert [p.name for p in runs.iterdir()] == ["train"], "a 2-process job must make exactly one run"
    event_files = list((runs / "train").glob("events.out.tfevents.*"))
    assert len(event_files) == 1, f"one writer for the whole job, found {event_files}"
    events = EventAccumulator(str(runs / "train"))
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in TRAIN_TAGS:
        assert tag in tags, f"{tag} missing from {tags}"
        assert [e.step for e in events.Scalars(tag)] == list(range(1, STEPS + 1)), tag
    for tag in ("eval/accuracy", "eval/f1", "eval/loss"):
        assert [e.step for e in events.Scalars(tag)] == [STEPS], tag
    # The values are the ones train_log.jsonl holds.
    logged = {r["step"]: r["train/loss"] for r in train_log(run["dir"]) if "train/loss" in r}
    for event in events.Scalars("train/loss"):
        assert event.value == pytest.approx(logged[event.step], rel=1e-6)


def test_logged_loss_is_the_mean_of_both_processes_local_losses(run):
    records = [r for r in train_log(run["dir"]) if "train/loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    local = run["local"]
    differences = []
    for record in records:
        step = record["step"]
        rank_losses = [local[rank][step - 1]["loss_sum"] / local[rank][step - 1]["examples"] for rank in (0, 1)]
        assert local[0][step - 1]["examples"] == local[1][step - 1]["examples"] == 4
        assert record["train/loss"] == pytest.approx(np.mean(rank_losses), rel=1e-6, abs=0), f"step {step}"
        differences.append(abs(rank_losses[0] - rank_losses[1]))
        assert record["train/samples_per_second"] > 0 and record["train/peak_memory_mb"] > 50
        assert record["train/grad_norm"] > 0 and record["train/learning_rate"] >= 0
    assert max(differences) > 0.01, "the ranks' local losses must differ, or the mean would prove nothing"
    evaluations = [r for r in train_log(run["dir"]) if "eval/accuracy" in r]
    assert [(r["step"], r["epoch"], r["eval/examples"]) for r in evaluations] == [(STEPS, 1, 37)]


def test_report_pictures_exist_and_the_confusion_matrix_counts_each_eval_example_once(run):
    report = run["dir"] / "report"
    summary = (report / "README.md").read_text()
    for picture in ("training.png", "eval.png", "confusion_matrix.png"):
        assert f"]({picture})" in summary, f"the summary does not show {picture}"
        with Image.open(report / picture) as image:
            width, height = image.size
            assert 300 <= width <= 3000 and 200 <= height <= 3000, (picture, image.size)
            assert len(image.convert("RGB").getcolors(maxcolors=1_000_000)) > 20, f"{picture} looks blank"
    for fact in (
        "processes | 2 (MULTI_CPU",
        f"optimizer steps | {STEPS} (1 epochs)",
        "samples/s",
        "eval_accuracy",
        "wall time",
    ):
        assert fact in summary, fact
    confusion = json.loads((report / "confusion_matrix.json").read_text())
    counts = np.array(confusion["counts"])
    assert counts.sum() == 37, "37 eval examples, each counted once (no duplicated padding from the second process)"
    assert sorted(confusion["labels"]) == ["negative", "neutral", "positive"]
    metrics = json.loads((run["dir"] / "metrics.json").read_text())
    assert np.trace(counts) / counts.sum() == pytest.approx(metrics["eval_accuracy"])
    assert len(metrics["peak_memory_mb_per_rank"]) == 2


def test_no_secret_reaches_a_file_or_the_output(run):
    assert ENV_TOKEN not in run["output"] and ARG_TOKEN not in run["output"]
    checked = 0
    for path in run["dir"].rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            assert ENV_TOKEN.encode() not in content and ARG_TOKEN.encode() not in content, (
                f"a token leaked into {path}"
            )
            checked += 1
    assert checked > 10
    saved = json.loads((run["dir"] / "training_args.json").read_text())
    assert saved["hub_token"] == "<redacted>"
    hparams = next((run["dir"] / "runs" / "train").glob("*/hparams.yml")).read_text()
    assert "hub_token: <redacted>" in hparams and "learning_rate" in hparams, (
        "hyper-parameters logged, the token redacted"
    )


def test_plot_runs_draws_several_runs_on_shared_axes(run, tmp_path):
    out = tmp_path / "compare.png"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "plot_runs.py"), str(run["dir"]), str(run["dir"]), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "train/loss" in result.stdout and "eval/accuracy" in result.stdout
    with Image.open(out) as image:
        assert image.size[0] >= 600
    missing = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "plot_runs.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "no train_log.jsonl" in missing.stderr


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_a_tracker_that_is_not_installed_is_refused_on_every_rank_before_training(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    data = {
        "train": write_examples(tmp_path / "train.csv", 16, seed=1),
        "validation": write_examples(tmp_path / "val.csv", 8, seed=2),
    }
    output_dir = tmp_path / "out"
    args = train_args(model, data, output_dir, "--report_to", "tensorboard,wandb")
    result = launch(TRAIN, *args, num_processes=2, timeout=120, real_launcher=True)
    assert_fails_cleanly(
        result, "--report_to wandb needs the 'wandb' package, which is not installed: pip install wandb", output_dir
    )
