"""Writing checkpoints: `save_checkpoint` (atomic: a staging directory, every file flushed and
listed in a manifest, then a rename), and what checkpoints need on disk.

A checkpoint `<output_dir>/checkpoint-<step>/` holds what `accelerator.save_state` writes (model
as safetensors, optimizer, LR scheduler, gradient scaler, sampler, and every process's Python /
NumPy / torch RNG states), `trainer_state.json` (the run's progress and identity, from
`Checkpointer`) and `manifest.json` (every file's size and checksum, `manifest.py`).

It is written into `.tmp-checkpoint-<step>/`, flushed to disk, then renamed: a directory named
`checkpoint-<step>` is always complete. Old checkpoints are deleted only after the new one is in
place, so a crash during a save leaves the previous checkpoint to resume from; a step saved again
renames its old checkpoint aside before the new one takes its name, and deletes it only then.
Pruning (--checkpoints_total_limit) never deletes the checkpoint just written. A resume sets aside
the checkpoints past its step, an abandoned run's (`set_aside_later_checkpoints`).
"""

from __future__ import annotations

import os
import shutil

from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import gather_object

from ..core.errors import RunFailed
from ..core.files import existing_parent, write_json
from .frozen_weights import leaving_out_frozen
from .manifest import (
    CHECKPOINT_NAME,
    STATE_FILE,
    checkpoint_files,
    hash_and_flush,
    list_checkpoints,
    write_manifest,
    written_by,
)
from .write_failure import agree_on_write

logger = get_logger(__name__)


def _fsync_dir(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def prune_checkpoints(output_dir: str, total_limit: int, keep: set) -> None:
    """Delete all but the `total_limit` newest checkpoints in `output_dir`, never one whose
    directory name is in `keep` (the one just written, and the best): the newest by step may be
    another run's, and the one just written is the one to resume from. The main process calls it."""
    for old in list_checkpoints(output_dir)[:-total_limit]:
        if os.path.basename(old) not in keep:
            shutil.rmtree(old)


def set_aside_later_checkpoints(output_dir: str, step: int) -> list[tuple[str, str]]:
    """Rename every `checkpoint-<N>` in `output_dir` with N past `step` (the step a run resumed
    from) to `abandoned-checkpoint-<N>` (`.2`, `.3`, ... if that name is taken): they belong to the
    run that went on after that step and was abandoned. Left where they were, `latest` would pick
    them and resume that run, pruning would keep them as the newest and delete what this run
    writes, and a save of the same step would replace them. Set aside, neither `latest` nor
    pruning sees them. Returns the (old, new) names. The main process calls it."""
    later = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        match = CHECKPOINT_NAME.match(name)
        if match and int(match.group(1)) > step and os.path.isdir(os.path.join(output_dir, name)):
            later.append((int(match.group(1)), name))
    moved = []
    for _, name in sorted(later):
        new, copy = f"abandoned-{name}", 1
        while os.path.exists(os.path.join(output_dir, new)):
            copy += 1
            new = f"abandoned-{name}.{copy}"
        os.rename(os.path.join(output_dir, name), os.path.join(output_dir, new))
        moved.append((name, new))
    if moved:
        _fsync_dir(output_dir)
    return moved


def save_checkpoint(
    accelerator: Accelerator, output_dir: str, state: dict, total_limit: int | None = None, keep: str | None = None
) -> str:
    """All ranks call this: write a complete checkpoint of the run at `state["step"]` (gathers
    that stand for barriers, and `accelerator.save_state`, a collective under FSDP and DeepSpeed).

    `state` is the script's progress (step, epoch, step_in_epoch, ...), stored as trainer_state.json.
    Once every rank has written its files, each hashes its own while flushing them to disk, and the
    main process writes the manifest of their sizes and checksums (`manifest.py`): no rank waits
    for another to hash what it did not write. It is all written into `.tmp-checkpoint-<step>` and
    renamed once complete (a checkpoint of the same step already there is renamed aside first, and
    deleted once the new one has its name, so a crash leaves one whole checkpoint of that step, or
    none under that name and the older ones); then only the `total_limit` newest are kept, and the
    new one and `keep` (the best checkpoint's directory name) besides (`prune_checkpoints`). A
    write that fails on any rank (no space, quota, file too large, permissions) stops every rank
    with one line (`RunFailed`: the directory, the cause, the newest complete checkpoint, the
    fix); the staging directory is removed and the older checkpoints are kept. Returns the
    checkpoint's path.
    """
    name = f"checkpoint-{state['step']}"
    final, staging = os.path.join(output_dir, name), os.path.join(output_dir, f".tmp-{name}")
    what = f"checkpoint {final!r}"
    rank, world_size = accelerator.process_index, accelerator.num_processes
    own, entries = {}, {}  # this rank's files, then every rank's: {name: {"bytes", "xxh3_128"}}

    def write(step):
        try:
            step()
        except Exception as exc:  # every rank reports it, in agree_on_write
            return exc
        return None

    def make_staging():
        shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save
        os.makedirs(staging)

    def hash_own_files():  # the files whose names carry this rank; the main process also those of no rank
        mine = [f for f in checkpoint_files(staging) if (written_by(f, world_size) or 0) == rank]
        own.update(hash_and_flush(staging, mine))

    def seal():
        write_manifest(staging, entries)
        for directory, _, _ in os.walk(staging):
            _fsync_dir(directory)
        # The same step saved again: the old checkpoint goes aside whole, and is deleted only once the new
        # one has its name. Deleted in place, a crash half-way left a half-deleted checkpoint-<step>.
        replaced = os.path.join(output_dir, f".replaced-{name}")
        shutil.rmtree(replaced, ignore_errors=True)  # left by a crash during an earlier save
        moved_aside = os.path.isdir(final)
        if moved_aside:
            os.rename(final, replaced)
        try:
            os.rename(staging, final)
        except OSError:
            if moved_aside:
                os.rename(replaced, final)  # the old one back under its name
            raise
        _fsync_dir(output_dir)
        shutil.rmtree(replaced, ignore_errors=True)
        if total_limit:
            prune_checkpoints(output_dir, total_limit, {name, keep})

    try:
        agree_on_write(accelerator, write(make_staging) if accelerator.is_main_process else None, what, output_dir)
        with leaving_out_frozen(accelerator, state, loading=False) as kwargs:  # LoRA: the base left out
            error = write(lambda: accelerator.save_state(staging, **kwargs))  # each rank: its RNG states too
        if error is None and accelerator.is_main_process:
            error = write(lambda: write_json(accelerator, os.path.join(staging, STATE_FILE), state))
        agree_on_write(accelerator, error, what, output_dir)  # every rank's files are written
        agree_on_write(accelerator, write(hash_own_files), what, output_dir)  # and flushed, each by its writer
        for part in gather_object([own]) if world_size > 1 else [own]:  # every rank's files, for the manifest
            entries.update(part)
        agree_on_write(accelerator, write(seal) if accelerator.is_main_process else None, what, output_dir)
    except RunFailed:
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)  # never half a checkpoint, and its space back
        raise
    return final


def checkpoint_bytes(model, with_frozen: bool = True) -> int:
    """About what one checkpoint of `model` takes on disk: every weight as stored (the trained ones only
    without `with_frozen`: `frozen_weights.py`), and AdamW's two fp32 moments per trainable weight (the
    sampler, scheduler and RNG states are small). Under DeepSpeed ZeRO-3 a weight's full size is its
    `ds_numel`."""
    weights = trainable = 0
    for p in model.parameters():
        numel = getattr(p, "ds_numel", p.numel())
        weights += numel * p.element_size() if with_frozen or p.requires_grad else 0
        trainable += numel if p.requires_grad else 0
    return weights + 2 * 4 * trainable


def warn_if_the_disk_is_small(output_dir: str, one_checkpoint: int, total_limit: int | None) -> None:
    """Warn, naming the numbers, when the disk of `output_dir` cannot hold the checkpoints that
    --checkpoints_total_limit keeps plus the one being written. The main process calls it."""

    kept = (total_limit or 1) + 1
    free = shutil.disk_usage(existing_parent(output_dir)).free
    if free < kept * one_checkpoint:
        gib = 2**30
        logger.warning(
            f"the disk of {output_dir!r} has {free / gib:.2f} GiB free, and checkpoints take about "
            f"{one_checkpoint / gib:.2f} GiB each: --checkpoints_total_limit {total_limit} keeps {kept - 1}, "
            f"with one more being written {kept * one_checkpoint / gib:.2f} GiB; free space, lower "
            "--checkpoints_total_limit, or "
            "checkpoint less often (--checkpointing_steps)"
        )
