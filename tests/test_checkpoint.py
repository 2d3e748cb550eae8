"""Checkpoints through real 2-process launches of scripts/train.py: a run killed mid-epoch (in the
middle of writing a checkpoint) or preempted by SIGTERM resumes to exactly the parameters of an
uninterrupted run; old checkpoints are pruned only after a new one is complete; a stuck or failing
rank ends the launch; damaged checkpoints are refused clearly."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import AUDIT_HOOK_DIR, REPO, launch, make_tiny_model, train_args, write_examples
from ddp_utils.checkpoints.preemption import PREEMPTED_FILE
from ddp_utils.core.errors import EXIT_PREEMPTED

TRAIN = REPO / "scripts" / "train.py"
HOOKS = {"PYTHONPATH": os.pathsep.join([str(AUDIT_HOOK_DIR), str(REPO)])}
# 60 examples, global batch 8: 8 optimizer steps per epoch, 3 epochs = 24 steps.
LAYOUTS = {
    "plain": ["--per_device_train_batch_size", 4],
    "accumulating": ["--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2],
}


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory):
    """With dropout, a resumed run matches only if every rank's RNG state was restored."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-bert-dropout"), dropout=0.1)


def run_train(model, data, output_dir, layout, *extra, env=None):
    args = train_args(model, data, output_dir, "--num_train_epochs", 3, "--seed", 7, *LAYOUTS[layout], *extra)
    return launch(TRAIN, *args, num_processes=2, env={**HOOKS, **(env or {})})


@pytest.fixture(scope="module")
def uninterrupted(dropout_model, tiny_data, tmp_path_factory):
    """The reference runs, checkpointing every 2 steps and keeping 2."""
    runs = {}
    for layout in LAYOUTS:
        output_dir = tmp_path_factory.mktemp(f"uninterrupted-{layout}")
        result = run_train(
            dropout_model, tiny_data, output_dir, layout, "--checkpointing_steps", 2, "--checkpoints_total_limit", 2
        )
        assert result.returncode == 0, result.output[-4000:]
        runs[layout] = output_dir
    return runs


TRAIN_TAGS = [
    "train/loss",
    "train/learning_rate",
    "train/grad_norm",
    "train/samples_per_second",
    "train/tokens_per_second",
    "train/peak_memory_mb",
    "train/epoch",
]


def tensorboard_steps(output_dir, tags):
    """The steps at which TensorBoard's own reader finds each tag, in the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(output_dir / "runs" / "train"))
    events.Reload()
    found = events.Tags()["scalars"]
    return {tag: [event.step for event in events.Scalars(tag)] if tag in found else [] for tag in tags}


def assert_same_parameters(output_dir, reference_dir):
    ours, reference = (
        load_file(str(output_dir / "model.safetensors")),
        load_file(str(reference_dir / "model.safetensors")),
    )
    assert sorted(ours) == sorted(reference)
    different = [key for key in reference if not np.array_equal(ours[key], reference[key])]
    assert different == [], f"not bit for bit equal to the uninterrupted run: {different[:5]}"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_killed_while_saving_resumes_bit_for_bit(layout, dropout_model, tiny_data, uninterrupted, tmp_path):
    output_dir = tmp_path / "run"
    # SIGKILL rank 0 as the checkpoint of step 15 is being written (its first Python-level write in the
    # staging directory, trainer_state.json, comes after model, optimizer and RNG states); the
    # launcher then kills rank 1. The staging directory is left half-written and never renamed.
    crash = {"CRASH_ON_WRITE": ".tmp-checkpoint-15/"}
    killed = run_train(dropout_model, tiny_data, output_dir, layout, "--checkpointing_steps", 3, env=crash)
    assert killed.returncode != 0
    entries = sorted(os.listdir(output_dir))
    assert "checkpoint-15" not in entries and ".tmp-checkpoint-15" in entries, entries
    assert "checkpoint-12" in entries, "the previous complete checkpoint must survive the crash"
    state = json.loads((output_dir / "checkpoint-12" / "trainer_state.json").read_text())
    assert (state["epoch"], state["step_in_epoch"]) == (1, 4), "mid-epoch, in an epoch after the first"

    resumed = run_train(
        dropout_model, tiny_data, output_dir, layout, "--checkpointing_steps", 3, "--resume_from_checkpoint", "latest"
    )
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "resumed from" in resumed.output and "checkpoint-12" in resumed.output
    assert_same_parameters(output_dir, uninterrupted[layout])
    scores, reference = (
        json.loads((output_dir / "metrics.json").read_text()),
        json.loads((uninterrupted[layout] / "metrics.json").read_text()),
    )
    assert scores["train_samples_seen"] == reference["train_samples_seen"] == 180, (
        "nothing lost or repeated across the resume"
    )
    assert scores["eval_accuracy"] == reference["eval_accuracy"]

    # train_log.jsonl: each logged step once (the crashed run had logged step 10; the resumed one
    # retook steps 13-15). The record at step 20 covers steps 13-20 only, so compare step 24's.
    logs = [train_log(d) for d in (output_dir, uninterrupted[layout])]
    for records in logs:
        assert [r["step"] for r in records if "train/loss" in r] == [10, 20, 24]
        assert [r["step"] for r in records if "eval/accuracy" in r] == [8, 16, 24]
    (last, *_), (reference_last, *_) = (
        [r for r in records if r["step"] == 24 and "train/loss" in r] for records in logs
    )
    assert last["train/loss"] == pytest.approx(reference_last["train/loss"], rel=1e-6)


def train_log(output_dir):
    return [json.loads(line) for line in (output_dir / "train_log.jsonl").read_text().splitlines()]


def test_total_limit_keeps_the_newest_complete_checkpoints_and_the_best(uninterrupted):
    entries = sorted(os.listdir(uninterrupted["plain"]))
    best = os.path.basename(json.loads((uninterrupted["plain"] / "metrics.json").read_text())["best_checkpoint"])
    assert best in ("checkpoint-8", "checkpoint-16", "checkpoint-24"), "ranked by the evaluations at epochs' ends"
    assert [e for e in entries if "checkpoint" in e] == sorted({"checkpoint-22", "checkpoint-24", best}), (
        "12 saves, the 2 newest kept and the best, no staging left"
    )


@pytest.mark.parametrize("target", ["launcher", "workers"])
def test_sigterm_saves_exits_75_and_resumes_exactly(target, dropout_model, tiny_data, uninterrupted, tmp_path):
    output_dir = tmp_path / "run"
    # While rank 0 writes the checkpoint of step 10, SIGTERM goes to the launcher (which forwards it
    # to every rank, as when SLURM signals the job) or to every rank directly; the ranks finish the
    # next optimizer step, save together and exit 75.
    preempt = {"SIGTERM_ON_WRITE": ".tmp-checkpoint-10/", "SIGTERM_TARGET": target}
    stopped = run_train(dropout_model, tiny_data, output_dir, "plain", "--checkpointing_steps", 2, env=preempt)
    assert stopped.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] preempted: stopped by SIGTERM" in stopped.output, stopped.output[-3000:]
    if target == "workers":  # torchrun reports the workers' exit codes only when it was not signalled itself
        assert stopped.output.count(f"exitcode  : {EXIT_PREEMPTED}") == 2, "every training process exits 75"
    marker = json.loads((output_dir / PREEMPTED_FILE).read_text())
    saved = os.path.basename(marker["checkpoint"])
    assert saved == "checkpoint-11" and saved in os.listdir(output_dir), "saved after the step in flight"
    assert not (output_dir / "model.safetensors").exists(), "a preempted run has not finished"
    # TensorBoard holds the last record before the preemption (step 10) whole.
    assert tensorboard_steps(output_dir, TRAIN_TAGS) == {tag: [10] for tag in TRAIN_TAGS}

    resumed = run_train(
        dropout_model, tiny_data, output_dir, "plain", "--checkpointing_steps", 2, "--resume_from_checkpoint", "latest"
    )
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert not (output_dir / PREEMPTED_FILE).exists(), "the marker goes once the run has finished"
    assert_same_parameters(output_dir, uninterrupted["plain"])


def test_latest_is_the_main_process_view_of_the_checkpoints(dropout_model, tiny_data, uninterrupted, tmp_path):
    """With node-local caches or NFS delays, ranks can list different checkpoints. The other ranks'
    view here lacks checkpoint-24; each rank picking its own "latest" would resume rank 1 at step
    22 and rank 0 at 24, and the ranks would then wait in different collectives."""
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    for name in ("checkpoint-22", "checkpoint-24"):
        shutil.copytree(uninterrupted["plain"] / name, output_dir / name)
    args = train_args(
        dropout_model,
        tiny_data,
        output_dir,
        "--num_train_epochs",
        3,
        "--seed",
        7,
        *LAYOUTS["plain"],
        "--checkpointing_steps",
        2,
        "--resume_from_checkpoint",
        "latest",
        "--ddp_timeout",
        30,
    )
    result = launch(
        REPO / "tests" / "launched" / "stale_checkpoint_view.py", *args, num_processes=2, env=HOOKS, timeout=180
    )
    assert result.returncode == 0, result.output[-4000:]
    assert f"resumed from {output_dir / 'checkpoint-24'}" in result.output
    assert_same_parameters(output_dir, uninterrupted["plain"])


def test_a_failed_attempt_after_a_preemption_leaves_no_marker(tiny_data, uninterrupted, tmp_path):
    """preempted.json tells the job script that *this* attempt was preempted. A requeued attempt
    that then fails for another reason (here: a checkpoint of another model) must not leave the
    earlier attempt's marker behind, or slurm/train.sbatch would requeue it for ever."""
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    shutil.copytree(uninterrupted["plain"] / "checkpoint-24", output_dir / "checkpoint-24")
    (output_dir / PREEMPTED_FILE).write_text('{"signal": "SIGTERM", "checkpoint": "checkpoint-24"}')
    wider = make_tiny_model(tmp_path / "wider", hidden_size=48)
    result = run_train(wider, tiny_data, output_dir, "plain", "--resume_from_checkpoint", "latest")
    assert result.returncode != 0 and "is from a different run (model: checkpoint" in result.output
    assert not (output_dir / PREEMPTED_FILE).exists(), "the marker of an earlier attempt outlived a failed one"


def test_a_failing_run_ends_its_trackers_before_it_exits(tiny_model, tiny_data, tmp_path):
    """ddp_utils.run leaves through os._exit (the gloo teardown can hang), which skips every exit
    hook: a failed run must end its trackers itself (wandb and mlflow would otherwise leave their
    run open; they go through the same call, but are not installed here). Its TensorBoard log
    holds every step logged before the failure."""
    output_dir, finish_log = tmp_path / "run", tmp_path / "finished.log"
    args = train_args(tiny_model, tiny_data, output_dir, "--per_device_train_batch_size", 4, "--logging_steps", 1)
    result = launch(
        REPO / "tests" / "launched" / "fail_at_step.py",
        6,
        *args,
        num_processes=2,
        env={"FINISH_LOG": str(finish_log)},
        timeout=120,
    )
    assert result.returncode != 0 and "injected failure in step 6" in result.output
    assert finish_log.read_text() == "tensorboard finished on rank 0\n", "the main process ends its tracker, once"
    assert tensorboard_steps(output_dir, TRAIN_TAGS) == {tag: [1, 2, 3, 4, 5] for tag in TRAIN_TAGS}


def test_a_resume_takes_the_learning_rate_and_weight_decay_it_is_given_and_says_so(
    dropout_model, tiny_data, uninterrupted, tmp_path
):
    """Accelerate restores the optimizer's groups and the schedule's peak from the checkpoint: a resume given another
    --learning_rate or --weight_decay trained on with the checkpoint's, while training_args.json and the model card
    named the new ones. Resumed at step 22 with a rate of 1e-12, the last 2 steps now barely move the weights."""
    output_dir = tmp_path / "resumed"
    shutil.copytree(uninterrupted["plain"] / "checkpoint-22", output_dir / "checkpoint-22")
    extra = ["--resume_from_checkpoint", "latest", "--learning_rate", 1e-12, "--weight_decay", 0.5]
    result = run_train(dropout_model, tiny_data, output_dir, "plain", *extra)
    assert result.returncode == 0, result.output[-3000:]
    said = "resumed with this run's learning rate 1e-12 and weight decay 0.5 (the checkpoint had 0.005 and 0.01; give"
    assert said in result.output
    log = [json.loads(line) for line in open(output_dir / "train_log.jsonl")]
    rates = [r["train/learning_rate"] for r in log if r["step"] > 22 and "train/learning_rate" in r]
    assert rates and max(rates) <= 1e-12, rates
    import torch

    saved = torch.load(output_dir / "checkpoint-24" / "optimizer.bin", weights_only=True)["param_groups"]
    assert [group["weight_decay"] for group in saved] == [0.5, 0.0], "the decay given, on the weights that take it"
    at_22 = load_file(str(output_dir / "checkpoint-22" / "model.safetensors"))
    final = load_file(str(output_dir / "model.safetensors"))
    assert max(float(np.abs(final[key] - at_22[key]).max()) for key in at_22) < 1e-9


def test_a_checkpoints_model_is_saved_by_resuming_it_into_a_new_directory_for_no_more_steps(
    dropout_model, tiny_data, uninterrupted, tmp_path
):
    """A checkpoint is not a model (`from_pretrained` cannot read it): given as --model_name_or_path it is refused,
    naming the way to its model that this test takes: resumed in another --output_dir with --max_train_steps at its
    step, the run trains no step and saves the model it holds."""
    checkpoint = uninterrupted["plain"] / "checkpoint-22"
    result = run_train(checkpoint, tiny_data, tmp_path / "refused", "plain")
    assert result.returncode != 0 and "is a training checkpoint (trainer_state.json), not a model" in result.output, (
        result.output[-3000:]
    )
    assert f"--resume_from_checkpoint {checkpoint} --max_train_steps 22 --output_dir <a new directory>" in result.output
    output_dir, before = tmp_path / "step-22", sorted(os.listdir(uninterrupted["plain"]))
    extra = ["--resume_from_checkpoint", checkpoint, "--max_train_steps", 22]
    result = run_train(dropout_model, tiny_data, output_dir, "plain", *extra)
    assert result.returncode == 0, result.output[-3000:]
    saved, held = load_file(str(output_dir / "model.safetensors")), load_file(str(checkpoint / "model.safetensors"))
    assert sorted(saved) == sorted(held) and all(np.array_equal(saved[key], held[key]) for key in held)
    assert sorted(os.listdir(uninterrupted["plain"])) == before, "the checkpoint's own run is left alone"
    # Before, a run resumed at its --max_train_steps took one step more (23 here): so did a finished run requeued
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 22
    assert metrics["best_checkpoint"] is None or os.path.isdir(metrics["best_checkpoint"]), "never one elsewhere"


def test_resume_latest_without_checkpoints_starts_fresh(tiny_model, tiny_data, tmp_path):
    result = launch(
        TRAIN,
        *train_args(
            tiny_model, tiny_data, tmp_path / "new", "--max_train_steps", 2, "--resume_from_checkpoint", "latest"
        ),
    )
    assert result.returncode == 0, result.output[-3000:]
    assert "starting from scratch" in result.output


DAMAGES = ["truncated_weights", "truncated_weights_no_manifest", "no_trainer_state", "other_model", "other_seed"]


@pytest.mark.parametrize("damage", [*DAMAGES, "other_data"])
def test_damaged_or_foreign_checkpoint_is_refused_clearly(damage, dropout_model, tiny_data, uninterrupted, tmp_path):
    checkpoint = tmp_path / "checkpoint-24"
    shutil.copytree(uninterrupted["plain"] / "checkpoint-24", checkpoint)
    model, expected = dropout_model, "is damaged (model.safetensors holds 1,000 bytes,"
    if damage.startswith("truncated_weights"):
        weights = checkpoint / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        if damage.endswith("no_manifest"):  # as saved before manifests existed: found when loading
            (checkpoint / "manifest.json").unlink()
            expected = "is damaged and could not be loaded"
    elif damage == "no_trainer_state":
        (checkpoint / "trainer_state.json").unlink()
        expected = "is damaged (trainer_state.json is missing); no checkpoint beside it checks out"
    elif damage == "other_model":
        model, expected = (
            make_tiny_model(tmp_path / "wider", hidden_size=48),
            "is from a different run (model: checkpoint",
        )
    elif damage == "other_seed":  # the rest of its epoch in another order: examples trained on again, others never
        expected = "a different run (seed: checkpoint 7, this run 8); resume with the settings it was saved with"
    else:  # a training file that grew: so would every epoch's order
        tiny_data = {**tiny_data, "train": write_examples(tmp_path / "train.csv", 64, seed=1)}
        expected = "was trained on 60 training examples, this run has 64: the rest of its epoch would train some"
    seed = ["--seed", 8] if damage == "other_seed" else []
    result = run_train(model, tiny_data, tmp_path / "out", "plain", "--resume_from_checkpoint", checkpoint, *seed)
    assert result.returncode != 0 and result.seconds < 60
    for rank in (0, 1):
        assert f"[rank {rank}] error:" in result.output, result.output[-3000:]
    assert expected in result.output
    assert "Traceback" not in result.output.split("[rank 0] error:")[0][-2000:], "no stack trace from inside torch"


@pytest.mark.parametrize("mode", ["raise", "stuck"])
def test_one_failing_or_stuck_rank_ends_the_launch(mode):
    script = REPO / "tests" / "launched" / "fail_one_rank.py"
    result = launch(script, mode, 10, num_processes=2, timeout=120, real_launcher=True)  # torchrun ends the other
    assert result.returncode != 0
    assert "rank 0 passed the barrier" not in result.output
    if mode == "raise":
        assert "boom on rank 1" in result.output and result.seconds < 30
    else:  # rank 0 waits in a collective that rank 1 never reaches: the 10 s timeout ends it
        assert result.seconds < 45, f"took {result.seconds:.0f}s with a 10s --ddp_timeout"


def test_a_damaged_newest_checkpoint_is_skipped_by_latest_and_refused_by_name(
    dropout_model, tiny_data, uninterrupted, tmp_path
):
    """Bytes flipped in the middle of the newest checkpoint's weights, the size kept (bit rot, a bad
    copy): only the checksum finds it, the ranks checking their shares of the bytes. Naming
    it is refused with the one before named; `latest` warns, names it, and resumes from the one
    before, ending with the uninterrupted run's parameters. That one has no manifest (as saved
    before manifests existed): unverified, it still resumes, with a warning, as no other checks
    out; the damaged one past it is set aside. A file cut short is found by its size (test_ddp_utils)."""
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    for name in ("checkpoint-22", "checkpoint-24"):
        shutil.copytree(uninterrupted["plain"] / name, output_dir / name)
    weights = output_dir / "checkpoint-24" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    weights.write_bytes(bytes(data))
    (output_dir / "checkpoint-22" / "manifest.json").unlink()  # as an older checkpoint: unverified, loaded unchecked

    refused = run_train(
        dropout_model, tiny_data, output_dir, "plain", "--resume_from_checkpoint", output_dir / "checkpoint-24"
    )
    assert refused.returncode != 0 and refused.seconds < 60
    damaged = "is damaged (model.safetensors has changed since it was written (its checksum differs))"
    for rank in (0, 1):
        assert f"[rank {rank}] error: checkpoint {str(output_dir / 'checkpoint-24')!r} {damaged}" in refused.output, (
            refused.output[-3000:]
        )
    assert (
        f"none beside it checks out; the newest, {str(output_dir / 'checkpoint-22')!r}, has no manifest.json, so its "
        "files cannot be checked (saved before manifests existed, or a copy that lost it): resume from it to load it "
        "unchecked"
    ) in refused.output

    resumed = run_train(dropout_model, tiny_data, output_dir, "plain", "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"checkpoint {str(output_dir / 'checkpoint-24')!r} {damaged}: skipped, an older one is used" in (
        resumed.output
    )
    assert f"resumed from {output_dir / 'checkpoint-22'}" in resumed.output
    assert (
        f"checkpoint {str(output_dir / 'checkpoint-22')!r} has no manifest.json, so its files cannot be checked (saved "
        "before manifests existed, or a copy that lost it): none beside it checks out, so it is loaded unchecked"
    ) in resumed.output
    assert "checkpoint-24 -> abandoned-checkpoint-24" in resumed.output
    assert_same_parameters(output_dir, uninterrupted["plain"])


def test_a_resume_sets_later_checkpoints_aside_and_pruning_keeps_the_one_just_written(
    dropout_model, tiny_data, uninterrupted, tmp_path
):
    """The output directory holds checkpoint-24, written by a run that went on past step 22, and
    this run resumes from checkpoint-22 by name, saving every step and keeping 1. It used to prune
    by step: the save of step 23 kept checkpoint-24, the abandoned run's, and deleted checkpoint-23,
    the one just written, so a crash at the next save left only checkpoint-24 for `latest` to
    resume. Now the resume sets checkpoint-24 aside, with a warning, and pruning never deletes the
    checkpoint just written."""
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    for name in ("checkpoint-22", "checkpoint-24"):
        shutil.copytree(uninterrupted["plain"] / name, output_dir / name)
    crash = {"CRASH_ON_WRITE": ".tmp-checkpoint-24/"}  # rank 0 dies as it writes the checkpoint of step 24
    args = ["--checkpointing_steps", 1, "--checkpoints_total_limit", 1]
    resumed = run_train(
        dropout_model,
        tiny_data,
        output_dir,
        "plain",
        *args,
        "--resume_from_checkpoint",
        output_dir / "checkpoint-22",
        env=crash,
    )
    assert resumed.returncode != 0 and f"resumed from {output_dir / 'checkpoint-22'}" in resumed.output
    entries = sorted(entry for entry in os.listdir(output_dir) if "checkpoint" in entry)
    assert entries == [".tmp-checkpoint-24", "abandoned-checkpoint-24", "checkpoint-23"], entries
    assert (
        f"resumed from step 22: the checkpoints past it in {str(output_dir)!r} belong to a run that went on from there"
    ) in resumed.output
    assert "checkpoint-24 -> abandoned-checkpoint-24" in resumed.output


# --- no launch: one process, in this one ---------------------------------------------------------


class Crash(BaseException):
    """The process dies here (a BaseException: no handler of the save catches it)."""


@pytest.fixture
def one_process():
    """An Accelerator of this process alone, with a small model and optimizer to checkpoint."""
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    return accelerator


def test_a_save_never_prunes_the_checkpoint_just_written(one_process, tmp_path):
    """A newer checkpoint by step, another run's, is there: with --checkpoints_total_limit 1 the
    save of step 500 used to keep checkpoint-600 and delete checkpoint-500, the one just written."""
    from ddp_utils.checkpoints.checkpoint_save import save_checkpoint
    from ddp_utils.checkpoints.manifest import list_checkpoints

    for step in (400, 600, 500):
        save_checkpoint(one_process, str(tmp_path), {"step": step}, total_limit=1)
    assert [os.path.basename(path) for path in list_checkpoints(str(tmp_path))] == ["checkpoint-500", "checkpoint-600"]


def test_a_crash_while_a_step_is_saved_again_leaves_one_whole_checkpoint(one_process, tmp_path, monkeypatch):
    """A step saved again used to delete its old checkpoint-<step> in place, then rename the new one:
    a crash half-way through the deletion left a half-deleted checkpoint-<step> under that name. Now
    the old one is renamed aside first; a crash while it is deleted leaves the new one, whole."""
    from ddp_utils.checkpoints.checkpoint_save import save_checkpoint
    from ddp_utils.checkpoints.manifest import checkpoint_problem, list_checkpoints

    save_checkpoint(one_process, str(tmp_path), {"step": 8, "attempt": 1})
    real_unlink, removed = os.unlink, []

    def crash_on_the_second_file(path, *, dir_fd=None):  # what shutil.rmtree calls, file by file
        removed.append(path)
        if len(removed) == 2:
            raise Crash
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", crash_on_the_second_file)
    with pytest.raises(Crash):
        save_checkpoint(one_process, str(tmp_path), {"step": 8, "attempt": 2})
    monkeypatch.undo()
    checkpoint = tmp_path / "checkpoint-8"
    assert list_checkpoints(str(tmp_path)) == [str(checkpoint)], sorted(os.listdir(tmp_path))
    assert (checkpoint / "manifest.json").exists() and checkpoint_problem(str(checkpoint)) is None
    assert json.loads((checkpoint / "trainer_state.json").read_text())["attempt"] == 2


def test_latest_prefers_a_verified_checkpoint_to_a_newer_one_without_manifest(one_process, tmp_path, caplog):
    """A checkpoint without manifest.json (a copy that lost it, cut short) used to be loaded
    unchecked, as one saved before manifests existed. Now it is unverified: `latest` takes an older
    one that checks out instead, and uses it only when none does; each time a warning names it."""
    from ddp_utils.checkpoints.checkpoint_load import find_resume_checkpoint
    from ddp_utils.checkpoints.checkpoint_save import save_checkpoint

    older, newer = (save_checkpoint(one_process, str(tmp_path), {"step": step}) for step in (2, 4))
    os.remove(os.path.join(newer, "manifest.json"))
    os.remove(os.path.join(newer, "optimizer.bin"))  # the copy was cut short too
    unverified = f"checkpoint {newer!r} has no manifest.json, so its files cannot be checked"

    assert find_resume_checkpoint(one_process, str(tmp_path), "latest") == older
    assert (
        f"{unverified} (saved before manifests existed, or a copy that lost it): skipped for {older!r}" in caplog.text
    )
    caplog.clear()
    assert find_resume_checkpoint(one_process, str(tmp_path), newer) == newer, "named, it is loaded unchecked"
    assert (
        f"{unverified} (saved before manifests existed, or a copy that lost it): it is loaded unchecked" in caplog.text
    )
    caplog.clear()
    shutil.rmtree(older)
    assert find_resume_checkpoint(one_process, str(tmp_path), "latest") == newer, "the only one left"
    assert "none beside it checks out, so it is loaded unchecked" in caplog.text


def test_a_deepspeed_checkpoint_of_another_number_of_processes_is_refused_with_its_cause_and_fix(tmp_path):
    """DeepSpeed ZeRO loads its optimizer partitions only on as many processes as saved them; its
    exception, from inside the load, used to be reported as a damaged checkpoint. Now the checkpoint
    is refused before anything is loaded, naming the cause and the layouts that resume it.
    (A unit test: the checkpoint is laid out as DeepSpeed writes one under Accelerate, and the Accelerator
    is a stand-in; tests/test_deepspeed.py refuses one that ZeRO-2 wrote.)"""
    from types import SimpleNamespace

    from accelerate import PartialState
    from accelerate.utils import DistributedType

    from ddp_utils.checkpoints.checkpoint_load import load_checkpoint
    from ddp_utils.core.errors import UsageError

    PartialState(cpu=True)  # the checks log through Accelerate's logger
    checkpoint = tmp_path / "checkpoint-8"
    (checkpoint / "pytorch_model").mkdir(parents=True)
    for name in (
        "pytorch_model/mp_rank_00_model_states.pt",
        "pytorch_model/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "pytorch_model/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "latest",
        "zero_to_fp32.py",
        "scheduler.bin",
        "random_states_0.pkl",
        "random_states_1.pkl",
    ):
        (checkpoint / name).write_bytes(b"x")
    state = {"model": "abc", "step": 8, "world_size": 2, "per_device_train_batch_size": 4}
    state.update(gradient_accumulation_steps=1, global_batch=8)
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))

    def deepspeed_load(path):  # what DeepSpeed's engine raises from inside accelerator.load_state
        raise RuntimeError(
            "The checkpoint being loaded used a DP world size of 2 but the current world size is 1. Automatic "
            "adjustment of ZeRO's optimizer state partitioning with a new world size is not currently supported."
        )

    accelerator = SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED,
        num_processes=1,
        process_index=0,
        is_main_process=True,
        load_state=deepspeed_load,
        _schedulers=[],
        _optimizers=[],
    )
    with pytest.raises(UsageError) as refused:
        load_checkpoint(accelerator, str(checkpoint), {"model": "abc", "global_batch": 8})
    message = str(refused.value)
    assert message == (
        f"checkpoint {str(checkpoint)!r} was saved under DeepSpeed ZeRO by 2 processes, and this run has 1: ZeRO "
        "splits the optimizer state into one part per process, and DeepSpeed loads it only on as many processes as "
        "saved it (the checkpoint is not damaged; under DDP and FSDP a checkpoint resumes on any number). Resume it "
        "on 2 processes with --per_device_train_batch_size x --gradient_accumulation_steps 4 x 1, 2 x 2, 1 x 4, or "
        "start afresh on 1"
    )
    from ddp_utils.checkpoints.checkpoint_load import deepspeed_processes_problem

    assert deepspeed_processes_problem(str(checkpoint), state, 2) is None, "on 2 processes it loads"
    ddp = tmp_path / "checkpoint-ddp"
    ddp.mkdir()
    (ddp / "optimizer.bin").write_bytes(b"x")
    assert deepspeed_processes_problem(str(ddp), state, 1) is None, "no ZeRO partitions: not DeepSpeed's"


@pytest.mark.fast
def test_a_checkpoint_with_an_empty_optimizer_group_from_an_earlier_version_is_not_called_damaged(tmp_path):
    """LoRA's optimizer had an empty no-decay group until ZeRO-3 was found to drop it (its schedule then failed);
    such a checkpoint no longer loads into the one-group optimizer, and it is not damaged: the refusal says so."""
    from types import SimpleNamespace

    import torch
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    from ddp_utils.checkpoints.checkpoint_load import load_checkpoint
    from ddp_utils.core.errors import UsageError
    from ddp_utils.training.optimizer import make_adamw

    PartialState(cpu=True)  # the checks log through Accelerate's logger
    checkpoint = tmp_path / "checkpoint-8"
    checkpoint.mkdir()
    state = {"model": "abc", "step": 8, "world_size": 1, "per_device_train_batch_size": 4}
    state.update(gradient_accumulation_steps=1, global_batch=4)
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    adapters = torch.nn.Linear(4, 4, bias=False)  # LoRA's trainable weights all take decay: one group now
    before = torch.optim.AdamW([{"params": list(adapters.parameters())}, {"params": []}])  # as it was saved

    def load_state(path):  # what Accelerate's load_state does with the optimizer's saved state
        make_adamw(adapters, 1e-3, 0.01).load_state_dict(before.state_dict())

    accelerator = SimpleNamespace(
        distributed_type=DistributedType.NO, num_processes=1, process_index=0, is_main_process=True,
        load_state=load_state, _schedulers=[], _optimizers=[],
    )  # fmt: skip
    with pytest.raises(UsageError) as refused:
        load_checkpoint(accelerator, str(checkpoint), {"model": "abc", "global_batch": 4})
    assert "(the checkpoint is not damaged)" in str(refused.value)
    assert "is damaged and could not be loaded" not in str(refused.value)


@pytest.mark.fast
def test_a_checkpoint_without_the_frozen_weights_saves_tied_ones_once_and_loads_over_the_frozen(tmp_path):
    """The hooks of `frozen_weights.py` through Accelerate's own save and load, on one process: a model whose
    embedding and head are tied and trained, with a frozen layer between. The file holds the trained weights (the
    tied one under one name: safetensors refuses shared tensors, and Accelerate drops the second name only from an
    OrderedDict) and no frozen one; loaded into a fresh copy, it restores the trained weights over the frozen
    ones already there, and a file that lacks a trained weight is refused."""
    import torch
    from accelerate import Accelerator
    from safetensors.torch import load_file as load_tensors
    from safetensors.torch import save_file

    from ddp_utils.checkpoints.frozen_weights import checkpoint_trainable_weights_only

    def tied_model():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 10))
        model[2].weight = model[0].weight  # tied, as an LM's input and output embeddings
        model[1].requires_grad_(False)  # the frozen base
        return model

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(tied_model())
    assert checkpoint_trainable_weights_only(accelerator, model) is not None
    with torch.no_grad():
        model[0].weight.add_(1.0)  # "trained"
        model[2].bias.add_(1.0)
    accelerator.save_state(str(tmp_path / "saved"))
    saved = load_tensors(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(saved) in (["0.weight", "2.bias"], ["2.bias", "2.weight"]), sorted(saved)
    trained = {key: value.clone() for key, value in model.state_dict().items()}

    accelerator._models.clear()
    fresh = accelerator.prepare(tied_model())
    accelerator.load_state(str(tmp_path / "saved"))
    assert all(torch.equal(fresh.state_dict()[key], trained[key]) for key in trained)
    assert fresh[2].weight is fresh[0].weight, "still tied"

    del saved["2.bias"]
    save_file(saved, str(tmp_path / "saved" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors does not fit this model: it lacks \['2.bias'\]"):
        accelerator.load_state(str(tmp_path / "saved"))
