"""The options users expect from a fine-tuning script: --lr_scheduler_type and --warmup_steps,
--eval_steps with the best checkpoint kept, --trust_remote_code, --push_to_hub, and the model
card every run writes."""

import json
import math
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import AUDIT_HOOK_DIR, REPO, launch, train_args
from ddp_utils import UsageError

TRAIN = REPO / "scripts" / "train.py"
# 60 examples, global batch 8: 8 optimizer steps per epoch, 24 in 3 epochs. Evaluations every 3 steps
# (and at each epoch's end), checkpoints every 3 steps, a cosine schedule after 2 warm-up steps.
EVAL_STEPS = [
    "--num_train_epochs",
    3,
    "--seed",
    7,
    "--eval_steps",
    3,
    "--checkpointing_steps",
    3,
    "--checkpoints_total_limit",
    2,
    "--lr_scheduler_type",
    "cosine",
    "--warmup_steps",
    2,
    "--logging_steps",
    1,
]
LAYOUTS = {
    "two_processes": (2, ["--per_device_train_batch_size", 4]),
    "one_process": (1, ["--per_device_train_batch_size", 8]),
}


@pytest.fixture(scope="module")
def eval_runs(tiny_model, tiny_data, tmp_path_factory):
    runs = {}
    for name, (processes, layout) in LAYOUTS.items():
        output_dir = tmp_path_factory.mktemp(name) / "run"
        result = launch(
            TRAIN, *train_args(tiny_model, tiny_data, output_dir, *EVAL_STEPS, *layout), num_processes=processes
        )
        assert result.returncode == 0, result.output[-4000:]
        runs[name] = output_dir
    return runs


def log(output_dir):
    return [json.loads(line) for line in open(output_dir / "train_log.jsonl")]


def test_eval_steps_evaluate_mid_epoch_the_same_on_one_and_two_processes(eval_runs):
    evaluations = {
        name: [(r["step"], r["eval/accuracy"], r["eval/loss"]) for r in log(d) if "eval/loss" in r]
        for name, d in eval_runs.items()
    }
    steps = [step for step, _, _ in evaluations["two_processes"]]
    assert steps == [3, 6, 8, 9, 12, 15, 16, 18, 21, 24], "every 3 steps, and each epoch's end once"
    epochs = [r["epoch"] for r in log(eval_runs["two_processes"]) if "eval/loss" in r]
    assert epochs[:3] == [0.375, 0.75, 1], "mid-epoch evaluations at their fractional epoch"
    one, two = (np.array([(a, b) for _, a, b in evaluations[n]]) for n in ("one_process", "two_processes"))
    np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-5)
    reference = load_file(str(eval_runs["one_process"] / "model.safetensors"))
    for key, value in load_file(str(eval_runs["two_processes"] / "model.safetensors")).items():
        np.testing.assert_allclose(value, reference[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_the_schedule_is_the_named_one_with_its_warm_up(eval_runs):
    rates = [r["train/learning_rate"] for r in log(eval_runs["two_processes"]) if "train/learning_rate" in r]
    peak, warmup, total = 5e-3, 2, 24  # train_args' learning rate
    expected = [
        peak * step / warmup
        if step < warmup
        else peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
        for step in range(total)
    ]
    np.testing.assert_allclose(rates, expected, rtol=1e-6, atol=1e-12)


def test_the_best_checkpoint_is_kept_recorded_and_named_in_metrics(eval_runs):
    output_dir = eval_runs["two_processes"]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    scored = {r["step"]: r["eval/accuracy"] for r in log(output_dir) if "eval/accuracy" in r and r["step"] % 3 == 0}
    best_step = max(scored, key=lambda step: (scored[step], -step))  # the first of equals: a later one must beat it
    assert metrics["metric_for_best_model"] == "eval_accuracy" and metrics["best_step"] == best_step
    assert metrics["best_checkpoint"] == str(output_dir / f"checkpoint-{best_step}")
    assert metrics["best_metric"] == pytest.approx(scored[best_step])
    kept = sorted(int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*"))
    assert kept == sorted({21, 24, best_step}), "the 2 newest, and the best whatever --checkpoints_total_limit"


def test_a_run_resumed_through_mid_epoch_evaluations_is_bit_exact(tiny_model, tiny_data, eval_runs, tmp_path):
    """Killed while the checkpoint of step 12 is written: it resumes from checkpoint-9 (mid-epoch,
    just after an evaluation) and ends with the uninterrupted run's parameters, evaluations and best checkpoint."""
    output_dir, args = tmp_path / "run", [*EVAL_STEPS, *LAYOUTS["two_processes"][1]]
    hooks = {"PYTHONPATH": os.pathsep.join([str(AUDIT_HOOK_DIR), str(REPO)])}
    killed = launch(
        TRAIN,
        *train_args(tiny_model, tiny_data, output_dir, *args),
        env={**hooks, "CRASH_ON_WRITE": ".tmp-checkpoint-12/"},
    )
    assert killed.returncode != 0
    resumed = launch(TRAIN, *train_args(tiny_model, tiny_data, output_dir, *args, "--resume_from_checkpoint", "latest"))
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert f"resumed from {output_dir / 'checkpoint-9'}" in resumed.output
    reference = eval_runs["two_processes"]
    ours, theirs = load_file(str(output_dir / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert all(np.array_equal(ours[key], theirs[key]) for key in theirs), "bit for bit"
    evaluations = [
        [(r["step"], r["eval/accuracy"]) for r in log(d) if "eval/accuracy" in r] for d in (output_dir, reference)
    ]
    assert evaluations[0] == evaluations[1]
    best = [json.loads((d / "metrics.json").read_text())["best_step"] for d in (output_dir, reference)]
    assert best[0] == best[1]


# --- --trust_remote_code --------------------------------------------------------------------------

CUSTOM_CONFIG = """from transformers import BertConfig


class CustomBertConfig(BertConfig):
    model_type = "custom-bert"
"""
CUSTOM_MODEL = """from transformers import BertForSequenceClassification

from .configuration_custom import CustomBertConfig


class CustomBertForSequenceClassification(BertForSequenceClassification):
    config_class = CustomBertConfig
"""


def custom_code_model(tiny_model, directory):
    """The tiny BERT as a model with code of its own (auto_map), as some Hub models are."""
    shutil.copytree(tiny_model, directory)
    (directory / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    (directory / "modeling_custom.py").write_text(CUSTOM_MODEL)
    config = json.loads((directory / "config.json").read_text())
    config.update(
        model_type="custom-bert",
        auto_map={
            "AutoConfig": "configuration_custom.CustomBertConfig",
            "AutoModelForSequenceClassification": "modeling_custom.CustomBertForSequenceClassification",
        },
    )
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_model_with_its_own_code_needs_trust_remote_code(tiny_model, tiny_data, tmp_path):
    model = custom_code_model(tiny_model, tmp_path / "custom")
    refused = launch(TRAIN, *train_args(model, tiny_data, tmp_path / "refused", "--max_train_steps", 1), timeout=120)
    assert refused.returncode != 0 and refused.seconds < 60
    for rank in (0, 1):
        assert (
            f"[rank {rank}] error: --model_name_or_path {str(model)!r} holds Python code of its own" in refused.output
        )
    assert "read that code, then pass --trust_remote_code" in refused.output and not (tmp_path / "refused").exists()
    trusted = launch(
        TRAIN, *train_args(model, tiny_data, tmp_path / "trusted", "--max_train_steps", 2, "--trust_remote_code")
    )
    assert trusted.returncode == 0, trusted.output[-3000:]
    assert json.loads((tmp_path / "trusted" / "config.json").read_text())["architectures"] == [
        "CustomBertForSequenceClassification"
    ]


# --- --push_to_hub and the model card ----------------------------------------------------------


def test_push_to_hub_uploads_the_output_once_from_the_main_process_without_secrets(tiny_model, tiny_data, tmp_path):
    """Up to the network call (there is no Hub here): the main process creates the repository and
    uploads the output directory (model, tokenizer, card, metrics, report), not the checkpoints,
    and no file holds the token."""
    output_dir, calls = tmp_path / "run", tmp_path / "hub-calls"
    args = train_args(
        tiny_model,
        tiny_data,
        output_dir,
        "--max_train_steps",
        4,
        "--checkpointing_steps",
        2,
        "--push_to_hub",
        "--hub_model_id",
        "someone/tiny-reviews",
        "--hub_private_repo",
        "--hub_token",
        "hf_FakeTokenForTheTests0001",
        "--language",
        "en",
    )
    result = launch(REPO / "tests" / "launched" / "fake_hub.py", *args, env={"HUB_CALLS": str(calls)})
    assert result.returncode == 0, result.output[-3000:]
    assert not os.path.exists(f"{calls}.rank1"), "only the main process talks to the Hub"
    made, uploaded = (json.loads(line) for line in open(f"{calls}.rank0"))
    assert made == {"call": "create_repo", "repo_id": "someone/tiny-reviews", "private": True, "exist_ok": True}
    assert uploaded["repo_id"] == "someone/tiny-reviews" and not uploaded["token_in_files"]
    files = uploaded["files"]
    for name in ("README.md", "model.safetensors", "config.json", "tokenizer.json", "metrics.json", "report/README.md"):
        assert name in files, name
    assert not [f for f in files if f.startswith("checkpoint-")] and "checkpoint-4" in os.listdir(output_dir)
    assert "pushed to https://huggingface.co/someone/tiny-reviews" in result.output


@pytest.mark.fast
def test_push_to_hub_is_refused_offline_or_without_a_token(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from ddp_utils.hub import check_hub_push

    args = SimpleNamespace(hub_token=None, hub_model_id=None, output_dir=str(tmp_path / "out"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UsageError, match=r"HF_HUB_OFFLINE is set; .* `hf upload out "):
        check_hub_push(args)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(UsageError, match="--push_to_hub needs a Hub token with write access"):
        check_hub_push(args)
    check_hub_push(SimpleNamespace(**{**vars(args), "hub_token": "hf_x"}))


@pytest.mark.fast
def test_bad_schedule_or_eval_options_are_refused_naming_them(tmp_path):
    import argparse

    import ddp_utils

    def parse(*argv):
        parser = argparse.ArgumentParser()
        ddp_utils.add_training_args(parser)
        args = parser.parse_args(["--output_dir", str(tmp_path), "--report_to", "none", *argv])
        ddp_utils.check_training_args(args)
        return args

    with pytest.raises(UsageError, match="--lr_scheduler_type 'reduce_lr_on_plateau' is not one of linear, cosine"):
        parse("--lr_scheduler_type", "reduce_lr_on_plateau")
    with pytest.raises(UsageError, match="--checkpointing_steps 10 is not a multiple of --eval_steps 4"):
        parse("--eval_steps", "4", "--checkpointing_steps", "10")
    assert parse("--eval_steps", "5", "--checkpointing_steps", "10").eval_steps == 5


def test_every_script_writes_a_model_card_the_hub_reads(tiny_model, tiny_data, tmp_path):
    from huggingface_hub import ModelCard

    output_dir = tmp_path / "run"
    result = launch(TRAIN, *train_args(tiny_model, tiny_data, output_dir, "--max_train_steps", 2, "--language", "en"))
    assert result.returncode == 0, result.output[-3000:]
    card = ModelCard.load(output_dir / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-classification"
    assert card.data.language == "en" and "ddp-finetune" in card.data.tags and card.data.base_model is None, card.data
    for fact in (
        "A fine-tune of",
        "| `learning_rate` | 0.005 |",
        "2 process(es), MULTI_CPU",
        "## Evaluation",
        "| accuracy |",
        'pipeline("text-classification", model="run")',
        "report/README.md",
    ):
        assert fact in card.text, fact
    assert (output_dir / "report" / "README.md").exists(), "the card does not replace the report"
