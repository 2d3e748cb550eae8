"""Elastic resume and the out-of-memory back-off, through real launches of scripts/train.py
(a tiny BERT without dropout, 60 examples, a global batch of 8: 8 optimizer steps per epoch):

- a run killed mid-epoch resumes on another layout with the same global batch, and trains on
  exactly the examples, step by step, and to the parameters of the uninterrupted run;
- a checkpoint is refused, in one line on every rank and without writing, with another global batch;
- an out-of-memory error on one rank makes every rank take the step again in halves, and the run
  ends where one with the smaller micro-batch from the start ends; at one row it stops, clearly.

The plain (same-layout) resume stays bit for bit: tests/test_checkpoint.py."""

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.numpy import load_file
from test_image import image_args, make_tiny_vit, write_image_folder

from conftest import AUDIT_HOOK_DIR, REPO, launch, sft_args, train_args
from ddp_utils.checkpoints.checkpoint_load import fitting_layouts, read_checkpoint_state
from ddp_utils.core.errors import UsageError
from ddp_utils.training.oom_backoff import check_oom_backoff, split_batch

RECORD_STEPS = REPO / "tests" / "launched" / "record_steps.py"
INJECT_OOM = REPO / "tests" / "launched" / "inject_oom.py"
HOOKS = os.pathsep.join([str(AUDIT_HOOK_DIR), str(REPO)])


def layout(processes, batch, accumulation=1):
    return processes, ["--per_device_train_batch_size", batch, "--gradient_accumulation_steps", accumulation]


# (saved on, resumed on): the same 8 examples per optimizer step.
ELASTIC = {
    "2x4 onto 1x4x2": (layout(2, 4), layout(1, 4, 2), "2 processes x 4 x 1 onto 1 process x 4 x 2"),
    "1x8 onto 2x2x2": (layout(1, 8), layout(2, 2, 2), "1 process x 8 x 1 onto 2 processes x 2 x 2"),
}


def train(model, data, output_dir, on, *extra, env=None):
    """scripts/train.py through record_steps.py: 3 epochs, a checkpoint every 5 steps (the 5
    newest kept); each rank's steps go to <output_dir>.steps.rank<r>."""
    processes, batch_args = on
    args = train_args(
        model,
        data,
        output_dir,
        "--num_train_epochs",
        3,
        "--seed",
        7,
        "--checkpointing_steps",
        5,
        "--checkpoints_total_limit",
        5,
        *batch_args,
        *extra,
    )
    return launch(
        RECORD_STEPS,
        *args,
        num_processes=processes,
        env={"PYTHONPATH": HOOKS, "STEP_LOG": f"{output_dir}.steps", **(env or {})},
    )


def recorded_steps(output_dir) -> dict:
    """step -> the sorted ids of the examples it trained on, over all ranks."""
    steps = {}
    for path in output_dir.parent.glob(f"{output_dir.name}.steps.rank*"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).extend(record["ids"])
    return {step: sorted(ids) for step, ids in steps.items()}


def assert_same_parameters(output_dir, reference_dir):
    ours, reference = (
        load_file(str(output_dir / "model.safetensors")),
        load_file(str(reference_dir / "model.safetensors")),
    )
    assert sorted(ours) == sorted(reference)
    for key in reference:
        if key.endswith(("attention.self.key.bias", "attention.attention.key.bias")):  # BERT's, ViT's
            # Its exact gradient is zero, so Adam turns rounding noise into steps (see test_train.py).
            assert np.abs(ours[key]).max() < 1e-3 and np.abs(reference[key]).max() < 1e-3, key
            continue
        np.testing.assert_allclose(ours[key], reference[key], rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, tiny_data, tmp_path_factory):
    """The uninterrupted run on each layout a checkpoint is saved on, made when first asked for."""
    runs = {}

    def run(on):
        if on not in runs:
            output_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
            result = train(tiny_model, tiny_data, output_dir, on)
            assert result.returncode == 0, result.output[-4000:]
            runs[on] = output_dir
        return runs[on]

    return run


def freeze(on):
    return on[0], tuple(on[1])


@pytest.mark.parametrize("name", sorted(ELASTIC))
def test_killed_mid_epoch_resumes_on_another_layout_with_the_same_steps(
    name, tiny_model, tiny_data, uninterrupted, tmp_path
):
    saved_on, resumed_on, described = ELASTIC[name]
    reference = uninterrupted(freeze(saved_on))
    output_dir = tmp_path / "run"
    # SIGKILL as the checkpoint of step 20 is written: checkpoint-15 is the newest complete one,
    # mid-epoch (epoch 1, step 7 of 8) at an odd step, so accumulation over 2 micro-batches
    # must not take Accelerate's micro-batch counter (15 on the saving layout) as it was saved.
    killed = train(tiny_model, tiny_data, output_dir, saved_on, env={"CRASH_ON_WRITE": ".tmp-checkpoint-20/"})
    assert killed.returncode != 0
    state_file = output_dir / "checkpoint-15" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert (state["step"], state["epoch"], state["step_in_epoch"]) == (15, 1, 7)
    assert "checkpoint-20" not in os.listdir(output_dir)
    if name.startswith("1x8"):  # as written before checkpoints recorded their global batch: their layout gives it
        del state["global_batch"]
        state_file.write_text(json.dumps(state))
        for manifest in output_dir.glob("checkpoint-*/manifest.json"):  # nor had they a manifest
            manifest.unlink()
    before = recorded_steps(output_dir)

    for path in tmp_path.glob("run.steps.rank*"):
        path.unlink()
    resumed = train(tiny_model, tiny_data, output_dir, resumed_on, "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert f"resumed elastically from {described}" in resumed.output
    if name.startswith("1x8"):  # another per-device batch: other micro-batches, other dropout masks
        assert "the dropout masks of the remaining steps differ" in resumed.output
    else:
        assert "dropout masks" not in resumed.output

    after, expected = recorded_steps(output_dir), recorded_steps(reference)
    assert sorted(expected) == list(range(1, 25))
    assert sorted(after) == list(range(16, 25)), "the resumed run takes steps 16 to 24"
    assert {step: after[step] for step in range(16, 25)} == {step: expected[step] for step in range(16, 25)}, (
        "after the resume, each step trains on the examples the uninterrupted run's did"
    )
    assert {step: before[step] for step in range(1, 16)} == {step: expected[step] for step in range(1, 16)}
    assert_same_parameters(output_dir, reference)
    assert json.loads((output_dir / "metrics.json").read_text())["train_samples_seen"] == 180, (
        "nothing lost or repeated"
    )
    saved = json.loads((output_dir / "checkpoint-20" / "trainer_state.json").read_text())
    processes, (_, batch, _, accumulation) = resumed_on
    assert (
        saved["world_size"],
        saved["per_device_train_batch_size"],
        saved["gradient_accumulation_steps"],
        saved["global_batch"],
    ) == (processes, batch, accumulation, 8), "a checkpoint records the layout it was written on"


def snapshot(directory):
    """Every file and directory under `directory`, with its size and modification time."""
    found = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            info = os.stat(path)
            found[os.path.relpath(path, directory)] = (info.st_size, info.st_mtime_ns)
    return found


def test_another_global_batch_is_refused_in_one_line_on_every_rank_writing_nothing(
    tiny_model, tiny_data, uninterrupted, tmp_path
):
    reference = uninterrupted(freeze(layout(2, 4)))
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    shutil.copytree(reference / "checkpoint-15", output_dir / "checkpoint-15")
    before = snapshot(output_dir)
    result = train(tiny_model, tiny_data, output_dir, layout(2, 2), "--resume_from_checkpoint", "latest")
    assert result.returncode != 0 and result.seconds < 60
    expected = (
        f"[rank {{rank}}] error: checkpoint {str(output_dir / 'checkpoint-15')!r} was trained with 8 examples per "
        "optimizer "
        "step (2 processes x 4 x 1), this run takes 4; resume it with the same global batch: on 2 processes, "
        "--per_device_train_batch_size x --gradient_accumulation_steps 4 x 1, 2 x 2, 1 x 4\n"
    )
    for rank in (0, 1):
        assert expected.format(rank=rank) in result.output, result.output[-3000:]
    assert "Traceback" not in result.output.split("[rank 0] error:")[0][-2000:], "no stack trace from inside torch"
    assert snapshot(output_dir) == before, "a refused resume must not write into the output directory"


def test_an_out_of_memory_error_on_one_rank_retakes_the_step_in_halves(tiny_model, tiny_data, tmp_path):
    """Rank 1 holds at most 2 rows from its 3rd micro-batch on: step 3 (4 rows per rank) runs out
    of memory there, every rank drops it and takes it again as 2 x 2 rows, and so on to the end.
    The injection raises after the forward pass and before the backward pass of rank 1's only
    micro-batch, where plain DDP would leave rank 0 alone in the gradient all-reduce."""
    common = ["--num_train_epochs", 1, "--seed", 7, "--checkpointing_steps", "no"]
    backed_off, reference = tmp_path / "backed_off", tmp_path / "reference"
    result = launch(
        INJECT_OOM,
        "train",
        1,
        3,
        2,
        *train_args(tiny_model, tiny_data, backed_off, *common, "--per_device_train_batch_size", 4, "--oom_backoff"),
        num_processes=2,
        timeout=120,
    )
    assert result.returncode == 0, result.output[-4000:]
    assert result.output.count("injected: out of memory on rank 1") == 1
    assert (
        "rank 1 ran out of memory in step 3: every rank dropped the step and takes it again in micro-batches of 2"
        in result.output
    )
    metrics = json.loads((backed_off / "metrics.json").read_text())
    assert metrics["oom_backoffs"] == [{"step": 3, "ranks": [1], "micro_batch": 2, "micro_batches_per_step": 2}]
    assert (metrics["optimizer_steps"], metrics["train_samples_seen"]) == (8, 60), "the dropped step is taken once"

    smaller = launch(
        REPO / "scripts" / "train.py",
        *train_args(
            tiny_model,
            tiny_data,
            reference,
            *common,
            "--per_device_train_batch_size",
            2,
            "--gradient_accumulation_steps",
            2,
        ),
        num_processes=2,
    )
    assert smaller.returncode == 0, smaller.output[-4000:]
    assert_same_parameters(backed_off, reference)


def short_run_args(script, tiny_lm, sft_data, tmp_path):
    """The arguments of a one-epoch run of train_sft.py or train_image.py (a ViT: no BatchNorm,
    whose statistics depend on the micro-batch), as a function of the output directory."""
    if script == "train_sft":

        def args(output_dir, *extra):
            return sft_args(
                tiny_lm,
                sft_data,
                output_dir,
                "--num_train_epochs",
                1,
                "--eval_max_new_tokens",
                0,
                "--skip_zero_shot",
                "--seed",
                7,
                *extra,
            )

        return args
    images = {
        "train": write_image_folder(tmp_path / "train", {"dark": 14, "bright": 13, "striped": 13}, seed=1),
        "validation": write_image_folder(tmp_path / "validation", {"dark": 3, "bright": 2}, seed=2),
    }
    vit = make_tiny_vit(tmp_path / "vit")

    def args(output_dir, *extra):
        return image_args(vit, images, output_dir, "--num_train_epochs", 1, "--seed", 7, *extra)

    return args


@pytest.mark.parametrize("script", ["train_sft", "train_image"])
def test_the_other_scripts_back_off_the_same_way(script, tiny_lm, sft_data, tmp_path):
    """The same step change in train_sft.py (rows are sequences, the loss is per target token)
    and train_image.py: rank 1 holds 1 row from its 2nd micro-batch on."""
    args = short_run_args(script, tiny_lm, sft_data, tmp_path)
    backed_off, reference = tmp_path / "backed_off", tmp_path / "reference"
    result = launch(
        INJECT_OOM,
        script,
        1,
        2,
        1,
        *args(backed_off, "--per_device_train_batch_size", 2, "--oom_backoff"),
        num_processes=2,
    )
    assert result.returncode == 0, result.output[-4000:]
    assert json.loads((backed_off / "metrics.json").read_text())["oom_backoffs"] == [
        {"step": 2, "ranks": [1], "micro_batch": 1, "micro_batches_per_step": 2}
    ]
    smaller = launch(
        REPO / "scripts" / f"{script}.py",
        *args(reference, "--per_device_train_batch_size", 1, "--gradient_accumulation_steps", 2),
        num_processes=2,
    )
    assert smaller.returncode == 0, smaller.output[-4000:]
    assert_same_parameters(backed_off, reference)


def test_out_of_memory_at_one_row_stops_every_rank_clearly(tiny_model, tiny_data, tmp_path):
    result = launch(
        INJECT_OOM,
        "train",
        1,
        1,
        0,
        *train_args(
            tiny_model,
            tiny_data,
            tmp_path / "run",
            "--max_train_steps",
            2,
            "--per_device_train_batch_size",
            4,
            "--oom_backoff",
        ),
        num_processes=2,
        timeout=120,
    )
    assert result.returncode != 0 and result.seconds < 60
    assert result.output.count("injected: out of memory on rank 1") == 3, "4 rows, then 2, then 1"
    for rank in (0, 1):
        assert (
            f"[rank {rank}] error: rank 1 ran out of memory in step 1 with a micro-batch of 1 example per process: "
            "the model does not fit"
        ) in result.output, result.output[-3000:]


# --- no launch -------------------------------------------------------------------------------------


def write_state(directory, **state):
    directory.mkdir()
    (directory / "trainer_state.json").write_text(json.dumps({"model": "abc", "step": 3, **state}))
    return str(directory)


@pytest.mark.fast
def test_a_checkpoint_resumes_with_its_global_batch_old_or_new(tmp_path):
    old = write_state(tmp_path / "old", world_size=2, per_device_train_batch_size=4, gradient_accumulation_steps=1)
    new = write_state(
        tmp_path / "new", world_size=1, per_device_train_batch_size=2, gradient_accumulation_steps=4, global_batch=8
    )
    for path in (old, new):
        assert read_checkpoint_state(path, {"model": "abc", "global_batch": 8}, world_size=4)["global_batch"] == 8
        # saved before checkpoints recorded the seed: not checked against it
        assert read_checkpoint_state(path, {"model": "abc", "global_batch": 8, "seed": 3}, world_size=4)["step"] == 3
        with pytest.raises(
            UsageError,
            match="was trained with 8 examples per optimizer step .*, this run takes 12; no layout on 3 "
            "processes gives 8: resume on 1, 2, 4, 8 processes",
        ):
            read_checkpoint_state(path, {"model": "abc", "global_batch": 12}, world_size=3)
        with pytest.raises(UsageError, match=r"is from a different run \(model: checkpoint 'abc', this run 'xyz'\)"):
            read_checkpoint_state(path, {"model": "xyz", "global_batch": 8}, world_size=1)
    assert fitting_layouts(8, 2) == [(4, 1), (2, 2), (1, 4)]
    assert fitting_layouts(8, 16) == []


def train_loader(lengths, world_size, batch, accumulation, group_by_length=True):
    """The unprepared training loader of rows of these token lengths, split this way (data seed 7)."""
    import datasets

    from ddp_utils.data.dataloaders import make_train_dataloader

    rows = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in lengths]})
    args = SimpleNamespace(per_device_train_batch_size=batch, num_workers=0, group_by_length=group_by_length)
    accelerator = SimpleNamespace(
        dataloader_config=SimpleNamespace(data_seed=7),
        num_processes=world_size,
        gradient_accumulation_steps=accumulation,
        device=torch.device("cpu"),
    )
    return make_train_dataloader(rows, args, accelerator, collate_fn=list)


def order_identity(lengths, world_size, batch, accumulation, group_by_length=True):
    from ddp_utils.data.dataloaders import training_order_identity

    return training_order_identity(train_loader(lengths, world_size, batch, accumulation, group_by_length))


@pytest.mark.fast
def test_a_checkpoint_of_other_training_examples_is_refused(tmp_path):
    lengths = [3 + i % 7 for i in range(60)]
    ours = order_identity(lengths, world_size=2, batch=4, accumulation=1)
    # What the identity leaves out, the layout, changes no global step's examples: a checkpoint resumes on any.
    for group_by_length in (True, False):
        steps = [
            [sorted(order[i : i + 8]) for i in range(0, len(order), 8)]
            for order in (
                train_loader(lengths, *layout, group_by_length).sampler.order() for layout in ((2, 4, 1), (1, 2, 4))
            )
        ]
        assert steps[0] == steps[1]
    assert ours["train_examples"] == 60 and ours["train_lengths"]
    path = write_state(tmp_path / "saved", global_batch=8, seed=7, **ours)
    expected = {"model": "abc", "global_batch": 8, "seed": 7}
    assert read_checkpoint_state(path, {**expected, **ours})["step"] == 3
    others = {
        "on 60 training examples, this run has 61": order_identity([*lengths, 5], 2, 4, 1),
        "with --group_by_length \\(pass it to resume\\), this run without it": order_identity(
            lengths, 2, 4, 1, group_by_length=False
        ),
        "grouped by length from other token lengths than this run's examples have": order_identity(
            [*lengths[:-1], 20], 2, 4, 1
        ),
    }
    for why, theirs in others.items():
        with pytest.raises(UsageError, match=f"was trained {why}.*: the rest of its epoch would train some examples"):
            read_checkpoint_state(path, {**expected, **theirs})
    # saved before checkpoints recorded their training examples: not checked against them, but against their
    # progress from the second epoch on (train_clm.py's blocks, cut per preparing process then, are other blocks now)
    old = write_state(tmp_path / "old", global_batch=8, seed=7)
    assert read_checkpoint_state(old, {**expected, **others["on 60 training examples, this run has 61"]})["step"] == 3
    from ddp_utils.checkpoints.checkpoint import _check_epoch_length

    progress = {"step": 11, "epoch": 1, "step_in_epoch": 3}
    _check_epoch_length("old", progress, steps_per_epoch=8)
    _check_epoch_length("old", {"step": 3, "epoch": 0, "step_in_epoch": 3}, steps_per_epoch=4)  # not seen in epoch 1
    _check_epoch_length("old", {"step": 22, "epoch": 3, "step_in_epoch": 0}, steps_per_epoch=8)  # ended at step 22
    _check_epoch_length("new", {**progress, "train_examples": 60}, steps_per_epoch=9)  # checked by its identity
    for steps_per_epoch in (7, 9, 2):
        with pytest.raises(
            UsageError,
            match="'old', saved before checkpoints recorded their training examples, is at step 3 of epoch 2 "
            f"\\(step 11\\), which this run's epochs of {steps_per_epoch} steps do not reach: it was trained on",
        ):
            _check_epoch_length("old", progress, steps_per_epoch)


@pytest.mark.fast
def test_split_batch_cuts_every_row_aligned_tensor_and_leaves_the_batch_whole():
    batch = {
        "input_ids": torch.arange(10).reshape(5, 2),
        "sample_weight": torch.ones(5),
        "scale": torch.tensor(2.0),
        "name": "x",
    }
    parts = split_batch(batch, 2)
    assert [part["input_ids"].tolist() for part in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9]]]
    assert all(part["scale"] is batch["scale"] and part["name"] == "x" for part in parts)
    parts[0].pop("sample_weight")
    assert "sample_weight" in batch, "the step pops keys from its parts, never from the batch a retry splits again"


@pytest.mark.fast
def test_oom_backoff_is_refused_where_a_forward_or_backward_pass_communicates():
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        with pytest.raises(UsageError, match=f"--oom_backoff works with DDP only, not {kind.value}"):
            check_oom_backoff(SimpleNamespace(distributed_type=kind), plain)
    synced = torch.nn.Sequential(torch.nn.SyncBatchNorm(2))
    with pytest.raises(UsageError, match="--oom_backoff cannot be used with --sync_batchnorm"):
        check_oom_backoff(SimpleNamespace(distributed_type=DistributedType.MULTI_GPU), synced)
    check_oom_backoff(SimpleNamespace(distributed_type=DistributedType.MULTI_GPU), plain)
