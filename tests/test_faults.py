"""Faults users meet, each answered in one clear line on every rank with nothing broken saved: a
loss that turns NaN, a checkpoint or model that cannot be written (a full disk, a file size
limit). Damaged checkpoints are in test_checkpoint.py."""

import json
import math
import os

import pytest
from safetensors.numpy import load_file

from conftest import AUDIT_HOOK_DIR, REPO, assert_error_is_last, launch, train_args, write_examples

TRAIN = REPO / "scripts" / "train.py"
FAIL_WRITES = REPO / "tests" / "launched" / "fail_writes.py"


def assert_one_line_on_every_rank(result, expected: str):
    assert result.returncode == 1 and result.seconds < 60, result.output[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] error: {expected}" in result.output, result.output[-3000:]
    ours = result.output.split("[rank 0] error:")[0]  # the launcher prints its own traceback after
    assert "Traceback" not in ours, "one line, not a stack trace"
    assert_error_is_last(result, f"error: {expected}")


def test_a_diverging_run_stops_on_every_rank_and_saves_no_nan_weights(tiny_model, tiny_data, tmp_path):
    """A learning rate of 1e4: the loss turns NaN within a few steps. The run stops with one line
    naming the step, saves no model, and every checkpoint it kept holds finite weights."""
    output_dir = tmp_path / "run"
    args = train_args(tiny_model, tiny_data, output_dir, "--learning_rate", 1e4, "--max_train_steps", 12)
    args += ["--checkpointing_steps", 1, "--checkpoints_total_limit", 20, "--logging_steps", 10]
    result = launch(TRAIN, *args, real_launcher=True)  # the error as the launcher's last line
    assert_one_line_on_every_rank(result, "the ")
    line = result.output.split("[rank 0] error:")[1].splitlines()[0]
    assert "became NaN or infinite at optimizer step" in line and "Try a lower --learning_rate (it was 10000)" in line
    bad_step = int(line.split("at optimizer step ")[1].split()[0].rstrip(",("))
    assert 1 <= bad_step < 12, line
    assert not (output_dir / "model.safetensors").exists(), "no model of NaN weights"
    kept = sorted(int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*"))
    assert kept == list(range(1, bad_step)), f"a checkpoint for every good step and none after: {kept}"
    if kept:
        assert f"the newest checkpoint is {str(output_dir / f'checkpoint-{kept[-1]}')!r}" in line
    for step in kept:
        weights = load_file(str(output_dir / f"checkpoint-{step}" / "model.safetensors"))
        assert all(math.isfinite(float(abs(w).max())) for w in weights.values()), f"checkpoint-{step} is finite"


def test_ranks_wait_for_a_data_preparation_longer_than_the_ddp_timeout(tiny_model, tmp_path):
    """The first preparation of a large set (every image of an ImageNet folder decoded, a corpus tokenized) takes
    longer than --ddp_timeout (30 min by default), while the other ranks wait in a collective: they ended with the
    backend's timeout (gloo's "Timed out waiting 2000ms for recv operation"). Here rank 0 takes 8 s longer to
    write the data's cache than a collective may wait (--ddp_timeout 6); the ranks wait for it and train. (At 3 s,
    rank 0's own writes at the end of the run outlasted the timeout once on a loaded CI machine.)"""
    data = {split: write_examples(tmp_path / f"{split}.csv", rows, seed) for split, rows, seed in
            (("train", 24, 3), ("validation", 8, 4))}  # fmt: skip  # new files: rank 0 writes their cache
    args = train_args(tiny_model, data, tmp_path / "out", "--ddp_timeout", 6, "--max_train_steps", 2)
    hooks = {"PYTHONPATH": os.pathsep.join([str(AUDIT_HOOK_DIR), str(REPO)]), "SLOW_ON_WRITE": ".arrow:14"}
    result = launch(TRAIN, *args, env=hooks)
    assert result.returncode == 0, result.output[-3000:]
    assert result.seconds > 14, "rank 0 did not take longer than the timeout: the test shows nothing"
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["optimizer_steps"] == 2


def test_a_checkpoint_past_the_file_size_limit_stops_every_rank_with_one_line(tiny_model, tiny_data, tmp_path):
    """A file size limit that the optimizer state does not fit (ulimit -f): torch's writer says
    only "iostream error"; the line names the checkpoint, the limit, that none was saved, and the
    fix, and no half-written checkpoint is left."""
    output_dir = tmp_path / "run"
    model_bytes = (tiny_model / "model.safetensors").stat().st_size  # the optimizer state is about twice this
    args = train_args(tiny_model, tiny_data, output_dir, "--max_train_steps", 4, "--checkpointing_steps", 2)
    result = launch(TRAIN, *args, "--report_to", "none", file_size_limit=int(1.5 * model_bytes))
    assert_one_line_on_every_rank(result, f"could not write checkpoint {str(output_dir / 'checkpoint-2')!r} (")
    assert "files are limited to" in result.output and "no complete checkpoint was saved yet" in result.output
    assert "give an --output_dir on a larger disk, then resume with --resume_from_checkpoint latest" in result.output
    assert not [p.name for p in output_dir.iterdir() if "checkpoint" in p.name], "nothing half-written is left"


@pytest.mark.parametrize("what", ["checkpoint 2", "model"])
def test_a_full_disk_names_the_newest_complete_checkpoint(what, tiny_model, tiny_data, tmp_path):
    """No space left on device (rank 0's write fails, the other rank's does not): every rank says
    what could not be written, why, and which checkpoint to resume from."""
    output_dir = tmp_path / "run"
    args = train_args(tiny_model, tiny_data, output_dir, "--max_train_steps", 4, "--checkpointing_steps", 2)
    result = launch(FAIL_WRITES, what, *args, "--report_to", "none", real_launcher=True)
    target = (
        f"checkpoint {str(output_dir / 'checkpoint-4')!r}" if what != "model" else f"the model to {str(output_dir)!r}"
    )
    newest = "checkpoint-2" if what != "model" else "checkpoint-4"
    assert_one_line_on_every_rank(
        result,
        f"could not write {target} ([Errno 28] No space left on device); "
        f"the newest complete checkpoint is {str(output_dir / newest)!r}. Free space there",
    )
    assert not list(output_dir.glob(".tmp-*")), "the failed checkpoint's staging directory is removed"
    assert json.loads((output_dir / newest / "trainer_state.json").read_text())["step"] == int(newest.split("-")[1])
    assert os.path.isfile(output_dir / newest / "manifest.json")


@pytest.mark.fast
def test_a_fault_that_is_not_the_disks_is_named_so_with_its_traceback_and_no_disk_advice(tmp_path, capsys):
    """A merge or a save that fails for another reason than the disk (a bug, a model that cannot be merged) was
    reported with the free space and "Free space there": the user went looking at a disk that was fine, and the
    traceback was lost. It is now named as no disk fault, its traceback printed by the rank that met it."""
    from types import SimpleNamespace

    from ddp_utils.checkpoints.write_failure import agree_on_write
    from ddp_utils.core.errors import RunFailed

    one_process = SimpleNamespace(num_processes=1)

    def reported(error):
        try:
            raise error
        except Exception as raised:
            with pytest.raises(RunFailed) as failed:
                agree_on_write(one_process, raised, "the merged model to 'out/merged'", str(tmp_path))
        return str(failed.value), capsys.readouterr().err

    line, printed = reported(ValueError("size mismatch for lm_head.weight\nits shape in the checkpoint"))
    assert line.startswith(
        "could not write the merged model to 'out/merged': ValueError: size mismatch for lm_head.weight (not a disk "
        "fault: the traceback above shows where it arose); no complete checkpoint was saved yet. Fix the cause"
    )
    assert "GiB free" not in line and "Free space" not in line
    assert "Traceback" in printed and "size mismatch" in printed
    disk_faults = [
        OSError(28, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4288 vs 4176"),  # torch's writer
        RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
        RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })'),
        RuntimeError("File /ckpt/optimizer.bin cannot be opened."),
        RuntimeError("[enforce fail at inline_container.cc:859] . open file failed with strerror: Permission denied"),
    ]
    for fault in disk_faults:
        line, printed = reported(fault)
        assert "Free space there" in line and "not a disk fault" not in line, line
        assert printed == "", "a disk fault is one line"
    chained = RuntimeError("saving failed")
    chained.__cause__ = OSError(122, "Disk quota exceeded")  # the OS error found in the chain
    line, _ = reported(chained)
    assert "[Errno 122] Disk quota exceeded" in line and "Free space there" in line


@pytest.mark.fast
def test_the_non_finite_watch_names_the_first_bad_step_on_any_rank(tmp_path):
    from types import SimpleNamespace

    import torch

    from ddp_utils.core.errors import RunFailed
    from ddp_utils.training.nonfinite import NonFiniteWatch

    args = SimpleNamespace(output_dir=str(tmp_path), learning_rate=3e-4, max_grad_norm=0.0)
    accelerator = SimpleNamespace(
        device=torch.device("cpu"), state=SimpleNamespace(deepspeed_plugin=None), mixed_precision="no", scaler=None
    )
    watch = NonFiniteWatch(accelerator, args)
    watch.note(1, torch.tensor(2.0), torch.tensor(1.0))
    watch.check(watch.device_values()[None])  # all finite: nothing
    watch.note(2, torch.tensor(2.0), torch.tensor(float("inf")))
    watch.note(3, torch.tensor(float("nan")), torch.tensor(float("nan")))
    other_rank = torch.tensor([2.0, 0.0, 0.0])  # its own loss was NaN at step 2
    with pytest.raises(RunFailed, match=r"^the loss and the gradient norm became NaN or infinite at optimizer step 2,"):
        watch.check(torch.stack([watch.device_values(), other_rank]))
    with pytest.raises(
        RunFailed,
        match=r"^the gradient norm became NaN .* step 2 \(the loss later\).*no checkpoint "
        r"was saved. Try a lower --learning_rate \(it was 0.0003\).*clipping was off",
    ):
        watch.check(watch.device_values()[None])


@pytest.mark.fast
def test_the_disk_is_checked_for_the_checkpoints_kept_and_the_numbers_named(tmp_path, monkeypatch, caplog):
    import logging
    import shutil
    from collections import namedtuple

    import torch
    from accelerate import PartialState

    from ddp_utils.checkpoints import checkpoint_save as checkpoint

    PartialState(cpu=True)
    model = torch.nn.Linear(1000, 1000)  # 4 MB of fp32 weights, 8 MB of AdamW moments
    assert checkpoint.checkpoint_bytes(model) == 3 * 4 * (1000 * 1000 + 1000)
    usage = namedtuple("usage", "total used free")
    one = checkpoint.checkpoint_bytes(model)
    with caplog.at_level(logging.WARNING):
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 40 * 2**20))
        checkpoint.warn_if_the_disk_is_small(str(tmp_path / "new" / "dir"), one, 2)  # 2 kept + 1: 36 MB fit
        assert "GiB free" not in caplog.text
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 30 * 2**20))
        checkpoint.warn_if_the_disk_is_small(str(tmp_path / "new" / "dir"), one, 2)
    assert (
        "has 0.03 GiB free, and checkpoints take about 0.01 GiB each: --checkpoints_total_limit 2 keeps 2, "
        in caplog.text
    )
    assert "with one more being written 0.03 GiB" in caplog.text
