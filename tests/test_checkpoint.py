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

from conftest import AUDIT_HOOK_DIR, REPO, launch, make_tiny_model, train_args
from ddp_utils.errors import EXIT_PREEMPTED
from ddp_utils.preemption import PREEMPTED_FILE

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


@pytest.mark.parametrize("target", [pytest.param("launcher", marks=pytest.mark.fast), "workers"])
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


def test_resume_latest_without_checkpoints_starts_fresh(tiny_model, tiny_data, tmp_path):
    result = launch(
        TRAIN,
        *train_args(
            tiny_model, tiny_data, tmp_path / "new", "--max_train_steps", 2, "--resume_from_checkpoint", "latest"
        ),
    )
    assert result.returncode == 0, result.output[-3000:]
    assert "starting from scratch" in result.output


@pytest.mark.parametrize(
    "damage", ["truncated_weights", "truncated_weights_no_manifest", "no_trainer_state", "other_model"]
)
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
    else:
        model, expected = (
            make_tiny_model(tmp_path / "wider", hidden_size=48),
            "is from a different run (model: checkpoint",
        )
    result = run_train(model, tiny_data, tmp_path / "out", "plain", "--resume_from_checkpoint", checkpoint)
    assert result.returncode != 0 and result.seconds < 60
    for rank in (0, 1):
        assert f"[rank {rank}] error:" in result.output, result.output[-3000:]
    assert expected in result.output
    assert "Traceback" not in result.output.split("[rank 0] error:")[0][-2000:], "no stack trace from inside torch"


@pytest.mark.parametrize("mode", ["raise", "stuck"])
def test_one_failing_or_stuck_rank_ends_the_launch(mode):
    result = launch(REPO / "tests" / "launched" / "fail_one_rank.py", mode, 10, num_processes=2, timeout=120)
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
    it is refused with the good one named; `latest` warns, names it, and resumes from the one
    before, ending with the uninterrupted run's parameters; a checkpoint without a manifest (saved
    before manifests existed) still resumes. A file cut short is found by its size (test_ddp_utils)."""
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    for name in ("checkpoint-22", "checkpoint-24"):
        shutil.copytree(uninterrupted["plain"] / name, output_dir / name)
    weights = output_dir / "checkpoint-24" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    weights.write_bytes(bytes(data))
    (output_dir / "checkpoint-22" / "manifest.json").unlink()  # as an older checkpoint: trusted, loaded as before

    refused = run_train(
        dropout_model, tiny_data, output_dir, "plain", "--resume_from_checkpoint", output_dir / "checkpoint-24"
    )
    assert refused.returncode != 0 and refused.seconds < 60
    damaged = "is damaged (model.safetensors has changed since it was written (its checksum differs))"
    for rank in (0, 1):
        assert f"[rank {rank}] error: checkpoint {str(output_dir / 'checkpoint-24')!r} {damaged}" in refused.output, (
            refused.output[-3000:]
        )
    assert f"the newest that checks out is {str(output_dir / 'checkpoint-22')!r}: resume from it" in refused.output

    resumed = run_train(dropout_model, tiny_data, output_dir, "plain", "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"checkpoint {str(output_dir / 'checkpoint-24')!r} {damaged}: skipped, an older one is used" in (
        resumed.output
    )
    assert f"resumed from {output_dir / 'checkpoint-22'}" in resumed.output
    assert_same_parameters(output_dir, uninterrupted["plain"])
