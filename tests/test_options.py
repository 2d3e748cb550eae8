"""The options users expect from a fine-tuning script: --lr_scheduler_type and --warmup_steps,
--eval_steps with the best checkpoint kept, --trust_remote_code, --push_to_hub, and the model
card every run writes."""

import json
import math
import os
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import (
    AUDIT_HOOK_DIR,
    REPO,
    assert_error_is_last,
    launch,
    load_script,
    refused_in_process,
    sft_args,
    train_args,
)
from ddp_utils import UsageError
from ddp_utils.lifecycle.args import SCHEDULES

TRAIN = REPO / "scripts" / "train.py"
TRAIN_SFT = REPO / "scripts" / "train_sft.py"
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
    from ddp_utils.data.classification import CLASSIFICATION_SCORES  # what --metric_for_best_model is checked against

    assert {key for key in metrics if key.startswith("eval_")} - {"eval_examples"} == set(CLASSIFICATION_SCORES)


def test_the_best_checkpoint_survives_a_resume_with_the_output_dir_spelled_another_way(tiny_model, tiny_data, tmp_path):
    """Ranked by the Trainer's name `loss` with --greater_is_better (so the first checkpoint, of
    the highest loss, stays the best), written under an absolute --output_dir, resumed under a
    relative one with --checkpoints_total_limit 1: the best is known by its directory's name,
    not by the path string, so the limit does not delete it."""
    output_dir = tmp_path / "run"
    ranking = ["--metric_for_best_model", "loss", "--greater_is_better", "--checkpoints_total_limit", 1]
    every_2 = ["--eval_steps", 2, "--checkpointing_steps", 2, "--report_to", "none", *ranking]
    first = launch(TRAIN, *train_args(tiny_model, tiny_data, output_dir, "--max_train_steps", 4, *every_2))
    assert first.returncode == 0, first.output[-3000:]
    relative = os.path.relpath(output_dir, REPO)  # the launch runs in the repository
    resumed = launch(
        TRAIN,
        *train_args(tiny_model, tiny_data, relative, "--max_train_steps", 8, *every_2),
        "--resume_from_checkpoint",
        "latest",
    )
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-8"]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["metric_for_best_model"] == "eval_loss" and metrics["greater_is_better"] is True
    assert metrics["best_step"] == 2 and os.path.basename(metrics["best_checkpoint"]) == "checkpoint-2"


@pytest.mark.fast
@pytest.mark.parametrize(
    "script, given, expected",
    [
        ("train_sft", ["--max_seq_length", "512"], "(--max_seq_length is --block_size here)"),
        ("train", ["--max_seq_length", "128"], "(--max_seq_length is --max_length here)"),  # run_glue's name
        ("train_dpo", ["--lr", "1e-5"], "unrecognized arguments: --lr 1e-5 (--lr is --learning_rate here)"),
        ("train_grpo", ["--compile"], "(--compile is --torch_compile here)"),  # not --compile_generation
        ("train_sft", ["--model", "m"], "(--model is --model_name_or_path here)"),
        ("train", ["--per_device_train", "4"], "unrecognized arguments: --per_device_train 4; "),  # no abbreviation
        ("train_grpo", ["--num-train-epochs", "2"], "(--num-train-epochs is --num_train_epochs here)"),
        ("train_clm", ["--dataset_text_field", "body"], "(--dataset_text_field is --text_column here)"),
        ("train_image", ["--bf16"], "(--bf16: mixed precision is the launch config's: accelerate launch"),
        ("train_sft", ["--deepspeed", "ds.json"], "(--deepspeed: sharding is the launch config's"),
        ("train_sft", ["--max_steps", "10", "--save_steps", "5"],
         "(--max_steps is --max_train_steps here; --save_steps is --checkpointing_steps here)"),
        ("train_sft", ["--lr=1e-5"], "(--lr is --learning_rate here)"),
        ("train_sft", ["--eval_strategy", "steps"], "(--eval_strategy: every epoch ends with an evaluation; --eval_"),
        ("train_sft", ["--no_such_option"], "unrecognized arguments: --no_such_option; "),  # none known: no hint
    ],
)  # fmt: skip
def test_another_trainers_option_name_is_answered_with_ours(script, given, expected):
    """TRL, the Trainer and axolotl name their options otherwise: their names (or ours spelled with dashes) are
    answered with ours, or with where the setting lives here, in the one line of the refusal. An abbreviation of
    ours is refused, never read as the option it begins."""
    with pytest.raises(UsageError) as refused:
        load_script(script).parse_args(given)
    assert expected in str(refused.value), str(refused.value)


@pytest.mark.fast
def test_metric_for_best_model_takes_the_trainer_names_and_refuses_a_score_never_given():
    from types import SimpleNamespace as Args

    from ddp_utils import check_metric_for_best_model
    from ddp_utils.data.classification import CLASSIFICATION_SCORES

    for name, full, greater in (("accuracy", "eval_accuracy", True), ("eval_loss", "eval_loss", False)):
        args = Args(metric_for_best_model=name, greater_is_better=None)
        check_metric_for_best_model(args, CLASSIFICATION_SCORES)
        assert (args.metric_for_best_model, args.greater_is_better) == (full, greater)
    args = Args(metric_for_best_model="perplexity", greater_is_better=None)
    check_metric_for_best_model(args, ("eval_loss", "eval_perplexity"))
    assert args.greater_is_better is False
    args = Args(metric_for_best_model="loss", greater_is_better=True)  # the direction given wins
    check_metric_for_best_model(args, CLASSIFICATION_SCORES)
    assert args.greater_is_better is True
    with pytest.raises(UsageError, match=r"^--metric_for_best_model 'bleu' is not a score .* it gives loss, accuracy"):
        check_metric_for_best_model(Args(metric_for_best_model="bleu", greater_is_better=None), CLASSIFICATION_SCORES)


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


FAKE_TOKEN = "hf_FakeTokenForTheTests0001"


def hub_env(hub, run_id: str) -> dict:
    """A launch that talks to the stand-in Hub: online, a token, no Xet (plain HTTP commits)."""
    return {
        "HF_ENDPOINT": hub.endpoint,
        "HF_TOKEN": FAKE_TOKEN,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HUB_TEST_RUN": run_id,
    }


def ranks_alive(run_id: str) -> list[str]:
    """The RANK of every training process of the launch marked `run_id` that is still running."""
    import psutil

    ranks = []
    for process in psutil.process_iter():
        try:
            env = process.environ()
        except psutil.Error:
            continue
        if env.get("HUB_TEST_RUN") == run_id and "RANK" in env and process.status() != psutil.STATUS_ZOMBIE:
            ranks.append(env["RANK"])
    return sorted(ranks)


def test_push_to_hub_uploads_the_model_not_the_validation_data_after_every_rank_has_finished(
    tiny_lm, sft_data, tmp_path
):
    """Against a stand-in Hub that the real client talks to: the main process creates the private
    repository and uploads the model, tokenizer, card, metrics and report; not the checkpoints, not
    the predictions (every validation prompt with its reference answer), no file with the token. The
    upload starts after the other rank has exited, so no rank waits for it in a collective that
    --ddp_timeout would end."""
    from hub_standin import HubStandIn

    output_dir, alive_at_commit = tmp_path / "run", []
    args = sft_args(tiny_lm, sft_data, output_dir, "--max_train_steps", 4, "--checkpointing_steps", 2)
    args += ["--push_to_hub", "--hub_model_id", "someone/tiny-chat", "--hub_private_repo", "--language", "en"]
    with HubStandIn(tmp_path / "hub", on_commit=lambda: alive_at_commit.append(ranks_alive("push-ok"))) as hub:
        result = launch(TRAIN_SFT, *args, env=hub_env(hub, "push-ok"))
        assert result.returncode == 0, result.output[-3000:]
        (commit,) = hub.uploads()
        assert all(request["authorized"] for request in hub.requests())
    assert commit["repo_id"] == "someone/tiny-chat" and commit["private"] is True
    files = commit["files"]
    for name in ("README.md", "model.safetensors", "config.json", "tokenizer.json", "metrics.json", "report/README.md"):
        assert name in files, sorted(files)
    assert (output_dir / "predictions.jsonl").exists() and (output_dir / "predictions_zero_shot.jsonl").exists()
    assert not [name for name in files if name.startswith(("predictions", "checkpoint-"))], sorted(files)
    assert "checkpoint-4" in os.listdir(output_dir)
    assert not [name for name, data in files.items() if FAKE_TOKEN.encode() in data], "no secret uploaded"
    assert "--push_to_hub leaves them out, unless --push_predictions" in files["README.md"].decode()
    assert alive_at_commit == [["0"]], "the other rank had exited when the upload started"
    assert "pushed " in result.output and "/someone/tiny-chat" in result.output


def test_a_push_stopped_by_sigterm_is_one_line_that_the_launcher_shows_last(tiny_model, tiny_data, tmp_path):
    """A SIGTERM (a time limit) reaches the main process while the Hub is still taking the commit:
    the model is saved, the main process says in one line that the push did not finish, with the
    command that does it by hand (leaving out what the push leaves out), exits 1, and that line is
    the launcher's root cause, the last thing on the screen (torchrun's summary reads it from the
    process's error file). The other rank had finished: no failure of its own."""
    import signal

    from hub_standin import HubStandIn

    def sigterm_rank_0():
        import psutil

        for process in psutil.process_iter():
            try:
                env = process.environ()
            except psutil.Error:
                continue
            if env.get("HUB_TEST_RUN") == "push-stopped" and env.get("RANK") == "0":
                process.send_signal(signal.SIGTERM)

    output_dir = tmp_path / "tiny-bert"
    args = train_args(tiny_model, tiny_data, output_dir, "--max_train_steps", 2, "--push_to_hub")
    with HubStandIn(tmp_path / "hub", delay_s=20, on_commit=sigterm_rank_0) as hub:
        result = launch(TRAIN, *args, env=hub_env(hub, "push-stopped"))
    assert result.returncode == 1 and result.seconds < 60, result.output[-3000:]
    line = f"error: the run is saved in {str(output_dir)!r}, but the push to the Hub repository 'tiny-bert' failed"
    excluded = '--exclude "checkpoint-*/**" --exclude ".tmp-*/**" --exclude ".staging-*/**" --exclude "preempted.json"'
    # What the push leaves out, and the repository's other files deleted, as the push does.
    by_hand = f'`hf upload tiny-bert {output_dir} {excluded} --exclude "predictions*.jsonl" --delete "*"`'
    assert f"[rank 0] {line} (Interrupted: stopped by SIGTERM); push it later with {by_hand}" in result.output, (
        result.output[-2000:]
    )
    assert "[rank 1] error" not in result.output and "<NO_OTHER_FAILURES>" in result.output
    assert (output_dir / "model.safetensors").exists()
    assert_error_is_last(result, line)


@pytest.mark.fast
def test_a_refused_push_says_what_the_hub_answered_and_how_to_push_by_hand(tmp_path, monkeypatch):
    """The Hub refuses the commit (403), talked to by the real client in this process."""
    from hub_standin import HubStandIn
    from huggingface_hub import constants

    from ddp_utils.core.errors import RunFailed
    from ddp_utils.results.hub import push_to_hub

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    args = SimpleNamespace(output_dir=str(tmp_path / "run"), hub_model_id="someone/x", hub_private_repo=True)
    with HubStandIn(tmp_path / "hub", fail_with=403) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
        with pytest.raises(RunFailed, match=r"push to the Hub repository 'someone/x' failed \(HfHubHTTPError: 403 "):
            push_to_hub(args)
    # Made private before the upload: `hf upload --private` would leave an existing public repository public.
    private_first = "hf repos create someone/x --private --exist-ok && hf repos settings someone/x --private"
    by_hand = rf"push it later with `{private_first} && hf upload someone/x .*/run --exclude "
    with pytest.raises(RunFailed, match=by_hand):
        push_to_hub(args)  # the stand-in is gone: the connection is refused


@pytest.mark.fast
def test_predictions_are_uploaded_only_when_asked(tmp_path):
    from huggingface_hub.utils import filter_repo_objects

    from ddp_utils.results.hub import push_ignore_patterns

    files = ["model.safetensors", "predictions.jsonl", "predictions_zero_shot.jsonl", "checkpoint-4/optimizer.bin"]
    for asked, expected in ((False, ["model.safetensors"]), (True, files[:3])):
        patterns = push_ignore_patterns(SimpleNamespace(push_predictions=asked))
        assert list(filter_repo_objects(files, ignore_patterns=patterns)) == expected


@pytest.mark.fast
def test_push_to_hub_is_refused_offline_or_without_a_token(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from ddp_utils.results.hub import check_hub_push

    args = SimpleNamespace(hub_token=None, hub_model_id=None, output_dir=str(tmp_path / "out"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UsageError, match=r"HF_HUB_OFFLINE is set; .* `hf upload out "):
        check_hub_push(args)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(UsageError, match="--push_to_hub needs a Hub token with write access"):
        check_hub_push(args)
    check_hub_push(SimpleNamespace(**{**vars(args), "hub_token": "hf_x"}))


def standin_hub(monkeypatch, hub) -> None:
    """Point this process's `huggingface_hub` client at the stand-in, online, with a token."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)


def run_dir(path, files: dict, **options) -> SimpleNamespace:
    """An output directory holding `files`, and the options of a push of it to someone/x."""
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    defaults = {"hub_model_id": "someone/x", "hub_private_repo": False, "push_predictions": False}
    return SimpleNamespace(output_dir=str(path), **{**defaults, **options})


@pytest.mark.fast
def test_hub_private_repo_makes_an_existing_public_repository_private_before_uploading(tmp_path, monkeypatch):
    """create_repo leaves an existing repository as it is: --hub_private_repo makes a public one
    private (the Hub's settings call) before the commit, so no file of the run is ever public."""
    from hub_standin import HubStandIn

    from ddp_utils.results.hub import push_to_hub

    with HubStandIn(tmp_path / "hub") as hub:
        standin_hub(monkeypatch, hub)
        hub.add_repo("someone/x", private=False, files={"config.json": b"{}", "training_args.json": b"{}"})
        push_to_hub(run_dir(tmp_path / "run", {"README.md": b"# x\n", "config.json": b"{}"}, hub_private_repo=True))
        (commit,) = hub.uploads()
        calls = [(request["method"], request["path"].split("?")[0]) for request in hub.requests()]
    assert commit["private"] is True and hub.repos["someone/x"]["private"] is True
    assert calls.index(("PUT", "/api/models/someone/x/settings")) < calls.index(
        ("POST", "/api/models/someone/x/commit/main")
    ), calls


@pytest.mark.fast
def test_hub_private_repo_uploads_nothing_when_the_hub_will_not_make_the_repository_private(tmp_path, monkeypatch):
    """A member who may write to an organisation's public repository but not change its
    visibility: the push uploads nothing and says so in one line, with commands that make it
    private first."""
    from hub_standin import HubStandIn

    from ddp_utils.core.errors import RunFailed
    from ddp_utils.results.hub import push_to_hub

    with HubStandIn(tmp_path / "hub", settings_fail_with=403) as hub:
        standin_hub(monkeypatch, hub)
        hub.add_repo("someone/x", private=False, files={"config.json": b"{}", "training_args.json": b"{}"})
        with pytest.raises(RunFailed) as failed:
            push_to_hub(run_dir(tmp_path / "run", {"README.md": b"# x\n"}, hub_private_repo=True))
        assert hub.uploads() == [] and hub.repos["someone/x"]["private"] is False
    message = str(failed.value)
    assert "\n" not in message and "the push to the Hub repository 'someone/x' failed (it is public and " in message
    assert "--hub_private_repo could not make it private (HfHubHTTPError: 403 " in message
    assert "nothing uploaded); push it later with `hf repos create someone/x --private --exist-ok && " in message
    assert "&& hf repos settings someone/x --private && hf upload someone/x " in message


@pytest.mark.fast
def test_a_push_replaces_the_files_of_an_earlier_push_in_one_commit(tmp_path, monkeypatch):
    """A full model pushed with its predictions, then a LoRA adapter to the same repository: the
    second push deletes what it did not write (the full weights, the config, the predictions it now
    leaves out) in the commit that adds its own files, keeping .gitattributes; unchanged files stay."""
    from hub_standin import GITATTRIBUTES, HubStandIn

    from ddp_utils.results.hub import push_to_hub

    shared = {"tokenizer.json": b"{}", "report/README.md": b"report", "training_args.json": b"{}"}
    full = {"README.md": b"# full\n", "config.json": b"{}", "model.safetensors": b"full", "predictions.jsonl": b"{}\n"}
    lora = {"README.md": b"# lora\n", "adapter_config.json": b"{}", "adapter_model.safetensors": b"lora"}
    with HubStandIn(tmp_path / "hub") as hub:
        standin_hub(monkeypatch, hub)
        push_to_hub(run_dir(tmp_path / "full", {**full, **shared}, push_predictions=True))
        extra = {"predictions.jsonl": b"{}\n", "checkpoint-2/model.safetensors": b"ckpt"}  # written, never uploaded
        line = push_to_hub(run_dir(tmp_path / "lora", {**lora, **shared, **extra}))
        first, second = hub.uploads()
        held = hub.files("someone/x")
    assert held == {".gitattributes": GITATTRIBUTES, **lora, **shared}, sorted(held)
    deleted = [op["value"]["path"] for op in second["other_operations"] if op["key"] == "deletedFile"]
    assert sorted(deleted) == ["config.json", "model.safetensors", "predictions.jsonl"]
    assert sorted(second["files"]) == sorted(lora), "the unchanged files are not sent again"
    assert "deleting the 3 file(s) of an earlier push: config.json, model.safetensors, predictions.jsonl" in line


@pytest.mark.fast
def test_a_push_to_a_repository_of_other_files_deletes_nothing_and_says_so(tmp_path, monkeypatch):
    """An adapter pushed by mistake to one's own base-model repository would have deleted its weights."""
    from hub_standin import HubStandIn

    from ddp_utils.core.errors import RunFailed
    from ddp_utils.results.hub import push_to_hub

    with HubStandIn(tmp_path / "hub") as hub:
        standin_hub(monkeypatch, hub)
        hub.add_repo("someone/x", files={"model.safetensors": b"base", "README.md": b"# base\n"})
        with pytest.raises(
            RunFailed, match="holds files that no run of these scripts pushed .*give a new --hub_model_id"
        ):
            push_to_hub(run_dir(tmp_path / "lora", {"adapter_model.safetensors": b"lora", "training_args.json": b"{}"}))
        assert set(hub.files("someone/x")) >= {"model.safetensors", "README.md"}


@pytest.mark.fast
def test_a_push_overtaken_by_another_commit_fails_and_deletes_nothing(tmp_path, monkeypatch):
    """The files to delete are those of the commit the push read: another push landing in between
    makes the Hub refuse this commit (its parent is no longer the head), and keeps that push's files."""
    from hub_standin import HubStandIn
    from huggingface_hub import HfApi

    from ddp_utils.core.errors import RunFailed
    from ddp_utils.results.hub import push_to_hub

    def another_push():
        if not overtaken:
            overtaken.append(True)
            HfApi().upload_file(path_or_fileobj=b"other", path_in_repo="other.txt", repo_id="someone/x")

    overtaken = []
    with HubStandIn(tmp_path / "hub", on_commit=another_push) as hub:
        standin_hub(monkeypatch, hub)
        hub.add_repo("someone/x", files={"config.json": b"{}", "training_args.json": b"{}"})
        refused = r"failed \(HfHubHTTPError: .*412 Precondition Failed.*: A commit has happened since"
        with pytest.raises(RunFailed, match=refused):
            push_to_hub(run_dir(tmp_path / "run", {"README.md": b"# x\n"}))
        assert sorted(hub.files("someone/x")) == [".gitattributes", "config.json", "other.txt", "training_args.json"]


@pytest.mark.fast
def test_push_to_hub_refuses_the_default_output_dir_names_without_hub_model_id(tmp_path, monkeypatch):
    """Without --hub_model_id the repository is the output directory's name: a name that the scripts,
    the Makefile or the docs give would be one repository for many runs, each push replacing the
    last. Every script refuses its default while parsing; any other name, or --hub_model_id, goes."""
    import re

    from huggingface_hub import constants

    from ddp_utils.results.hub import check_hub_push

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for script in ("train", "train_sft", "train_dpo", "train_grpo", "train_clm", "train_image"):
        expected = f"--push_to_hub without --hub_model_id pushes to the repository named after --output_dir, '{script}'"
        refused_in_process(script, ["--model_name_or_path", "someone/model", "--push_to_hub"], expected)
    sources = [REPO / "Makefile", REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    names = {"run"} | set(re.findall(r"--output_dir outputs/(\w+)\b", "".join(p.read_text() for p in sources)))
    assert {"demo", "demo_sft", "sft"} <= names, names
    for name in names:
        args = SimpleNamespace(hub_token="hf_x", hub_model_id=None, output_dir=f"outputs/{name}")
        with pytest.raises(UsageError, match=rf"'{name}', a default name that other runs share, .* --hub_model_id "):
            check_hub_push(args)
        check_hub_push(SimpleNamespace(**{**vars(args), "hub_model_id": "someone/x"}))
    check_hub_push(SimpleNamespace(hub_token="hf_x", hub_model_id=None, output_dir="outputs/minilm-reviews-lr3e-5"))


@pytest.mark.fast
def test_a_hub_token_on_the_command_line_is_warned_about_once_per_job(monkeypatch, caplog):
    """/proc/<pid>/cmdline shows --hub_token to every user of the machine, whatever sys.argv
    becomes: rank 0 says so, and what to do instead; the token still works, and is never logged."""
    import logging
    import sys

    from ddp_utils.core.redact import hide_secret_args

    def warnings(rank: str, token: str | None) -> list[str]:
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr(sys, "argv", ["train.py", *(["--hub_token", token] if token else [])])
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            hide_secret_args(SimpleNamespace(hub_token=token))
        return [record.getMessage() for record in caplog.records]

    token = "hf_OnTheCommandLine0001"
    monkeypatch.setenv("HF_TOKEN", "hf_restored_after_the_test")
    (warning,) = warnings("0", token)
    assert sys.argv == ["train.py", "--hub_token", "<redacted>"] and os.environ["HF_TOKEN"] == token
    assert "every user of this machine can read" in warning and "/proc/<pid>/cmdline" in warning, warning
    assert warning.endswith("set HF_TOKEN in the environment or run `hf auth login` instead") and token not in warning
    assert warnings("1", token) == [], "once per job: rank 0 only"
    assert warnings("0", None) == [], "no warning without --hub_token"


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
    with pytest.raises(UsageError, match="--lr_scheduler_kwargs takes a JSON object"):
        parse("--lr_scheduler_kwargs", "min_lr_rate=0.1")
    with pytest.raises(UsageError, match="--lr_scheduler_type cosine with --lr_scheduler_kwargs .*min_lr_rate"):
        parse("--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}')
    with pytest.raises(UsageError, match="--lr_scheduler_type constant takes no --lr_scheduler_kwargs"):
        parse("--lr_scheduler_type", "constant", "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}')
    # train_dpo.py's rate, 5e-5 with LoRA, is set after the shared options are checked: checked again against it
    dpo = ["--model_name_or_path", "m", "--train_file", "t.jsonl", "--lora_r", 8, "--output_dir", tmp_path]
    schedule = ["--lr_scheduler_type", "polynomial", "--lr_scheduler_kwargs", '{"lr_end": 0.0001}']
    refused_in_process("train_dpo", [*dpo, *schedule], "lr_end (0.0001) must be smaller than initial lr (5e-05)")
    with pytest.raises(UsageError, match="lr_end .* must be smaller than initial lr"):  # checked against the rate
        parse("--lr_scheduler_type", "polynomial", "--lr_scheduler_kwargs", '{"lr_end": 0.1}', "--learning_rate", ".01")


@pytest.mark.fast
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_offered_runs_with_its_defaults(schedule, tmp_path):
    """Each --lr_scheduler_type that --help lists builds and runs with no --lr_scheduler_kwargs: transformers'
    cosine_with_min_lr and warmup_stable_decay raised before the first step, wanting settings no option gave."""
    import argparse

    import torch

    import ddp_utils

    parser = argparse.ArgumentParser()
    ddp_utils.add_training_args(parser)
    argv = ["--output_dir", str(tmp_path), "--report_to", "none", "--lr_scheduler_type", schedule]
    args = parser.parse_args([*argv, "--warmup_steps", "2"])
    ddp_utils.check_training_args(args)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = ddp_utils.make_lr_scheduler(optimizer, args, max_train_steps=20)
    rates = []
    for _ in range(20):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    if schedule != "constant":  # transformers' constant ignores the warm-up, as --help says
        assert rates[:3] == [0.0, 0.5, 1.0], rates
    if schedule == "cosine_with_min_lr":
        assert min(rates[2:]) >= 0.1 and rates[-1] == pytest.approx(0.1, abs=0.01), "a floor of a tenth of the peak"
    if schedule == "warmup_stable_decay":
        assert rates[2:18] == [1.0] * 16 and rates[19] < 1.0, "stable, then the last tenth of the steps decays"
    given = {"cosine_with_min_lr": '{"min_lr_rate": 0.5}', "warmup_stable_decay": '{"num_decay_steps": 10}'}
    if schedule in given:
        args = parser.parse_args([*argv, "--warmup_steps", "2", "--lr_scheduler_kwargs", given[schedule]])
        ddp_utils.check_training_args(args)
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = ddp_utils.make_lr_scheduler(optimizer, args, max_train_steps=20)
        for _ in range(19):
            optimizer.step()
            scheduler.step()
        assert scheduler.get_last_lr()[0] == pytest.approx(0.5 if schedule == "cosine_with_min_lr" else 0.024, abs=0.01)


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


@pytest.mark.fast
@pytest.mark.parametrize("script", ["train", "train_sft", "train_dpo", "train_grpo", "train_clm", "train_image"])
def test_help_shows_each_options_default_where_it_has_one(script, capsys):
    """A user choosing a batch size or a LoRA rank read the code for the defaults: --help gave none. Each option
    with a value to show has it once; None (the script picks after parsing) and off switches show nothing, or the
    shared help's words for the script's choice, which a script's own default replaces."""
    with pytest.raises(SystemExit):
        load_script(script).parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert re.search(r"examples per process per micro-batch \(default: \d+\)", text)  # 8; images 32
    assert "--seed SEED seed for initialisation, shuffling and dropout (default: 42)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    # the shared help's words for None, or the value a script set: GRPO's rate was hidden behind the words
    rate = "(default: 1e-05)" if script == "train_grpo" else "(default: the script's, by method)"
    assert f"peak AdamW learning rate {rate} " in text and text.count("peak AdamW learning rate") == 1
    best = {"train_clm": "eval_loss", "train_image": "eval_accuracy"}.get(script, "the script's")
    assert f"picks the best checkpoint, e.g. accuracy or eval_loss (default: {best})" in text
    assert "The demo has settings of its own" in text or script in ("train", "train_image")


@pytest.mark.fast
def test_a_default_named_in_the_helps_own_words_is_not_shown_twice():
    """Only the shared "(default: ...)" words for None give way to a value a script sets; a help that names its
    default otherwise (--lora_dropout's "(default 0.05; 0 on fused MoE experts)") is left as written."""
    import argparse

    from ddp_utils import HelpFormatter

    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    parser.add_argument("--rate", type=float, default=None, help="a rate (default: the script's)")
    parser.add_argument("--dropout", type=float, default=0.05, help="dropout (default 0.05; 0 on fused experts)")
    parser.add_argument("--plain", type=int, default=None, help="unset, nothing is shown")
    parser.set_defaults(rate=1e-5, dropout=0.0)
    text = " ".join(parser.format_help().split())
    assert "a rate (default: 1e-05)" in text and "the script's" not in text
    assert "dropout (default 0.05; 0 on fused experts) --plain" in text
    assert "unset, nothing is shown" in text and text.count("(default") == 2
