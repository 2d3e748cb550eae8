"""Resuming: which checkpoint (`find_resume_checkpoint`: the newest that checks out against its
manifest, checked by all ranks at once; one without a manifest is unverified, used only when none
checks out), whether it fits this run (`read_checkpoint_state`: the same model, global batch, seed and
training examples; under DeepSpeed also the same number of processes, `deepspeed_processes_problem`), and loading it
(`load_checkpoint`, which keeps this run's learning rate and weight decay).

A checkpoint resumes on any layout with the same global batch (examples per optimizer step): the
training order is drawn from (seed, epoch) and cut into global steps (`StepAlignedSampler`), and
the model, optimizer, scheduler and scaler states do not depend on the layout. Only the per-rank
RNG states do (`Checkpointer._resumed_elastically`).
"""

from __future__ import annotations

import json
import os
import re

from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, gather_object

from ..core.errors import UsageError
from ..core.ranks import from_main_process, refuse_together
from .frozen_weights import FROZEN_DIGEST, leaving_out_frozen
from .manifest import (
    MANIFEST_FILE,
    STATE_FILE,
    checkpoint_files,
    checksum_problem,
    list_checkpoints,
    read_manifest,
    share_of,
    size_problem,
)

logger = get_logger(__name__)

# How a global batch is split: saved with each checkpoint, and all a run may change when it resumes.
LAYOUT = ("world_size", "per_device_train_batch_size", "gradient_accumulation_steps")
# What the epochs' order is drawn from besides the seed (`training_order_identity`); not checked in older checkpoints.
TRAINING_ORDER = ("train_examples", "train_lengths")


# Why a checkpoint without a manifest is not trusted: it may be a copy that lost it, cut short.
UNVERIFIED = (
    f"has no {MANIFEST_FILE}, so its files cannot be checked (saved before manifests existed, or a copy that lost it)"
)


def find_resume_checkpoint(accelerator: Accelerator, output_dir: str, resume_from: str | None) -> str | None:
    """All ranks call this (a broadcast and a gather per checkpoint checked): the checkpoint that
    --resume_from_checkpoint names, checked against its manifest (`verify_checkpoint`). None: no
    resume. "latest": the newest checkpoint in `output_dir` that checks out, damaged ones skipped
    with a warning that names them; one without a manifest (unverified) only when none checks
    out, with a warning (None when there is none; a `UsageError` when every one is damaged). A
    path: that checkpoint (warned about when unverified), or a `UsageError` that says what is
    damaged and names the newest good one beside it. The checkpoints are listed on the main
    process and sent to every rank, so ranks with different views of a shared file system resume
    from the same one."""
    if not resume_from:
        return None
    if resume_from == "latest":
        found = from_main_process(accelerator, list_checkpoints, output_dir)
        path, verified, problems = _newest_usable(accelerator, found, warn=True)
        if path is None and found:
            raise UsageError(
                f"every checkpoint in {output_dir!r} is damaged (the newest, {found[-1]!r}: {problems[0]}); "
                "start afresh with --overwrite_output_dir instead of resuming"
            )
        if path and not verified:
            logger.warning(f"checkpoint {path!r} {UNVERIFIED}: none beside it checks out, so it is loaded unchecked")
        return path
    from_main_process(accelerator, _check_is_a_directory, resume_from)
    verified, problem = verify_checkpoint(accelerator, resume_from)
    if problem is None:
        if not verified:
            logger.warning(f"checkpoint {resume_from!r} {UNVERIFIED}: it is loaded unchecked")
        return resume_from
    beside = from_main_process(accelerator, list_checkpoints, os.path.dirname(os.path.abspath(resume_from)))
    others = [path for path in beside if os.path.basename(path) != os.path.basename(resume_from)]
    good, verified, _ = _newest_usable(accelerator, others, warn=False)
    if good is None:
        fix = "no checkpoint beside it checks out"
    elif verified:
        fix = f"the newest that checks out is {good!r}: resume from it"
    else:
        fix = f"none beside it checks out; the newest, {good!r}, {UNVERIFIED}: resume from it to load it unchecked"
    raise UsageError(f"checkpoint {resume_from!r} is damaged ({problem}); {fix}")


def _newest_usable(accelerator: Accelerator, paths: list[str], warn: bool) -> tuple[str | None, bool, list[str]]:
    """All ranks call this (`verify_checkpoint` for each checkpoint tried): the newest of `paths`
    (oldest first) that checks out against its manifest, or, if none does, the newest that has
    no manifest. Returns (that path or None, whether it was verified, the problems of the damaged
    ones, newest first). With `warn`, each damaged one is named in a warning, and so is a newer
    unverified one passed over for a verified one."""
    problems, unverified = [], None
    for path in reversed(paths):
        verified, problem = verify_checkpoint(accelerator, path)
        if problem is not None:
            if warn:
                logger.warning(f"checkpoint {path!r} is damaged ({problem}): skipped, an older one is used")
            problems.append(problem)
        elif verified:
            if warn and unverified:
                logger.warning(
                    f"checkpoint {unverified!r} {UNVERIFIED}: skipped for {path!r}, the newest that checks out; "
                    "to resume from it unchecked, name it with --resume_from_checkpoint"
                )
            return path, True, problems
        elif unverified is None:
            unverified = path
    return unverified, False, problems


def _check_is_a_directory(path: str) -> None:
    if not os.path.isdir(path):
        raise UsageError(
            f"--resume_from_checkpoint {path!r} is not a directory; give a checkpoint-<step> directory or 'latest'"
        )


def verify_checkpoint(accelerator: Accelerator, path: str) -> tuple[bool, str | None]:
    """All ranks call this (one broadcast, one gather): (True, None) when the checkpoint at `path`
    checks out against its manifest, (False, what is wrong) when it does not, (False, None) when
    it has no manifest: unverified. The main process reads the manifest and checks every file's
    presence and size, at once; then every rank reads and checksums its share of the bytes
    (`manifest.share_of`), in parallel."""
    files, problem = from_main_process(accelerator, _manifest_with_sizes_checked, path)
    if files is None:
        return False, problem
    share = share_of(files, accelerator.process_index, accelerator.num_processes)
    try:
        mine = checksum_problem(path, share)
    except Exception as exc:  # reported by every rank below, as the damage it is
        mine = f"it cannot be read ({type(exc).__name__}: {exc})"
    problems = gather_object([mine]) if accelerator.num_processes > 1 else [mine]
    problem = next((found for found in problems if found), None)
    return problem is None, problem


def _manifest_with_sizes_checked(path: str) -> tuple[dict | None, str | None]:
    """(the manifest's files, None) when every file is there with its size; else (None, the problem)."""
    files, problem = read_manifest(path)
    if files is not None:
        problem = size_problem(path, files)
    return (None, problem) if problem else (files, None)


def describe_layout(layout: dict) -> str:
    """`2 processes x 4 x 1`: processes x per-device batch x accumulation steps."""
    processes = layout["world_size"]
    return (
        f"{processes} process{'es' if processes != 1 else ''} x {layout['per_device_train_batch_size']} "
        f"x {layout['gradient_accumulation_steps']}"
    )


def global_batch(state: dict) -> int | None:
    """Examples per optimizer step of a checkpoint's trainer state. Checkpoints written before the
    elastic resume have no `global_batch`; their layout gives it."""
    if "global_batch" in state:
        return state["global_batch"]
    if all(isinstance(state.get(key), int) for key in LAYOUT):
        return state["world_size"] * state["per_device_train_batch_size"] * state["gradient_accumulation_steps"]
    return None


def fitting_layouts(examples: int, world_size: int) -> list[tuple[int, int]]:
    """The (per-device batch, accumulation steps) pairs that make `examples` per optimizer step on
    `world_size` processes, largest batch first."""
    if examples % world_size:
        return []
    per_process = examples // world_size
    return [(batch, per_process // batch) for batch in range(per_process, 0, -1) if per_process % batch == 0]


def _another_global_batch(path: str, saved: dict, examples: int, wanted: int, world_size: int) -> str:
    """The one-line refusal of a checkpoint trained with another global batch, with the layouts
    that would resume it on `world_size` processes."""
    layouts = fitting_layouts(examples, world_size)
    trained = f" ({describe_layout(saved)})" if all(key in saved for key in LAYOUT) else ""
    if layouts:
        fix = (
            f"resume it with the same global batch: on {world_size} process{'es' if world_size != 1 else ''}, "
            "--per_device_train_batch_size x --gradient_accumulation_steps "
            + ", ".join(f"{b} x {a}" for b, a in layouts)
        )
    else:
        counts = [n for n in range(1, examples + 1) if examples % n == 0]
        fix = f"no layout on {world_size} processes gives {examples}: resume on {', '.join(map(str, counts))} processes"
    return (
        f"checkpoint {path!r} was trained with {examples} examples per optimizer step{trained}, "
        f"this run takes {wanted}; "
        f"{fix}"
    )


def _another_training_order(path: str, saved: dict, expected: dict) -> str | None:
    """The one-line refusal of a checkpoint whose epochs were drawn from other training examples
    than this run's (`training_order_identity`), or None: resumed mid-epoch, the rest of the epoch
    would train some examples again and skip others. Checkpoints saved before it was recorded pass."""
    if any(key in expected and key in saved and saved[key] != expected[key] for key in TRAINING_ORDER):
        if saved["train_examples"] != expected["train_examples"]:
            why = f"on {saved['train_examples']} training examples, this run has {expected['train_examples']}"
        elif saved["train_lengths"] is None or expected["train_lengths"] is None:
            flag = "--group_by_length" if saved["train_lengths"] else "--no-group_by_length"
            why = f"with {flag} (pass it to resume), this run without it"
        else:
            why = (
                "grouped by length from other token lengths than this run's examples have (other data, tokenizer, "
                "chat template, or an option that limits the length)"
            )
        return (
            f"checkpoint {path!r} was trained {why}: the rest of its epoch would train some examples again and "
            "skip others; resume with the training data and settings it was saved with, or start a new run in "
            "another --output_dir"
        )
    return None


SAVED_BEFORE = {"load_in_4bit": False}  # what a checkpoint saved before its identity held the key was


def read_checkpoint_state(path: str, expected: dict, world_size: int = 1) -> dict:
    """The trainer state saved in checkpoint `path`, once it is known to match `expected` (the
    model fingerprint, the global batch, the seed and the training examples; this run has `world_size`
    processes). A missing or unreadable state file, another model, seed, global batch or training
    examples is a `UsageError` that says so
    (for the global batch: in one line, with the layouts that would fit). Reads this rank's view
    of the file system: `load_checkpoint` calls it on the main process only."""
    try:
        with open(os.path.join(path, STATE_FILE)) as handle:
            state = json.load(handle)
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"{path!r} is not a complete checkpoint ({STATE_FILE}: {exc.__class__.__name__}); "
            "resume from another checkpoint-<step> directory, or use --resume_from_checkpoint latest"
        ) from None
    state["global_batch"] = global_batch(state)
    mismatched = {
        key: (state.get(key, SAVED_BEFORE.get(key)), value)
        for key, value in expected.items()
        if key not in ("global_batch", FROZEN_DIGEST, *TRAINING_ORDER)
        and state.get(key, SAVED_BEFORE.get(key)) != value
        and not (key == "seed" and key not in state)  # saved before the seed was: not checked
    }
    if mismatched:
        details = ", ".join(
            f"{key}: checkpoint {saved!r}, this run {wanted!r}" for key, (saved, wanted) in mismatched.items()
        )
        raise UsageError(
            f"checkpoint {path!r} is from a different run ({details}); resume with the settings it was saved with"
        )
    another_order = _another_training_order(path, state, expected)
    if another_order:
        raise UsageError(another_order)
    if FROZEN_DIGEST in expected and state.get(FROZEN_DIGEST, expected[FROZEN_DIGEST]) != expected[FROZEN_DIGEST]:
        raise UsageError(
            f"checkpoint {path!r} was trained on other frozen weights than this run's model has (another base "
            "model or dtype): a checkpoint holds only the trained weights, such as LoRA's, and the frozen "
            "ones are read from --model_name_or_path; resume with the --model_name_or_path (and dtype) it was "
            "trained on"
        )
    if "global_batch" in expected and state["global_batch"] != expected["global_batch"]:
        if state["global_batch"] is None:
            raise UsageError(
                f"checkpoint {path!r} does not record its batch layout ({STATE_FILE}); it cannot be resumed safely"
            )
        raise UsageError(
            _another_global_batch(path, state, state["global_batch"], expected["global_batch"], world_size)
        )
    return state


# A ZeRO optimizer state partition, one per data-parallel rank, as DeepSpeed's engine names it in
# `save_checkpoint` (with a bf16_ prefix under its bf16 optimizer), under Accelerate's pytorch_model/.
_ZERO_PARTITION = re.compile(r"(?:^|/)(?:\w+_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def deepspeed_processes_problem(path: str, state: dict, world_size: int) -> str | None:
    """The one-line refusal of a DeepSpeed ZeRO checkpoint saved on another number of processes than
    this run's `world_size`, or None. ZeRO splits the optimizer state into one partition per
    process, and DeepSpeed loads it only on as many processes as saved it (its
    ZeRORuntimeException "The checkpoint being loaded used a DP world size of 2 but the current
    world size is 1"), which the load would report as a damaged checkpoint. `state` is the
    checkpoint's trainer state (its global batch names the layouts that fit). Reads this rank's
    view of the file system."""
    ranks = {int(match.group(1)) for match in map(_ZERO_PARTITION.search, checkpoint_files(path)) if match}
    saved = max(ranks) + 1 if ranks else None
    if saved is None or saved == world_size:
        return None
    layouts = ", ".join(f"{b} x {a}" for b, a in fitting_layouts(state.get("global_batch") or 0, saved))
    split = f" with --per_device_train_batch_size x --gradient_accumulation_steps {layouts}" if layouts else ""
    return (
        f"checkpoint {path!r} was saved under DeepSpeed ZeRO by {saved} processes, and this run has {world_size}: "
        f"ZeRO splits the optimizer state into one part per process, and DeepSpeed loads it only on as many "
        f"processes as saved it (the checkpoint is not damaged; under DDP and FSDP a checkpoint resumes on any "
        f"number). Resume it on {saved} processes{split}, or start afresh on {world_size}"
    )


def load_checkpoint(accelerator: Accelerator, path: str, expected: dict) -> dict:
    """All ranks call this: restore model, optimizer, scheduler, scaler and RNG states from `path`,
    this run's learning rate and weight decay kept (`_keep_given_rates`), and return the saved trainer
    state. The state is read and checked against `expected` on the main process and shared (one
    broadcast); each rank then loads its part (`accelerator.load_state`, a collective under FSDP and
    DeepSpeed), and a rank that cannot is reported on every rank (one gather). A mismatch or a damaged
    checkpoint is a `UsageError` that says so, on every rank, not a stack trace from inside torch.

    A checkpoint saved on another number of processes loads the same way: Accelerate saves and
    loads the model it was given to `prepare`, not its DDP wrapper, so the weights have the same
    names on any number of processes, and the optimizer, scheduler and scaler states are the same
    on every rank. Only the RNG states are per rank: each rank restores its own rank's if the
    checkpoint has one (Accelerate skips a missing one with an info line), and `Checkpointer.resume`
    replaces them on another layout. Under DeepSpeed a checkpoint of another number of processes is
    refused before anything is loaded (`deepspeed_processes_problem`)."""

    def read_and_check(path, expected, world_size):
        state = read_checkpoint_state(path, expected, world_size)
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            problem = deepspeed_processes_problem(path, state, world_size)
            if problem:
                raise UsageError(problem)
        return state

    state = from_main_process(accelerator, read_and_check, path, expected, accelerator.num_processes)
    given = _given_rates(accelerator)
    problem = None
    try:
        with leaving_out_frozen(accelerator, expected, loading=True) as kwargs:
            accelerator.load_state(path, **kwargs)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        problem = f"checkpoint {path!r} is damaged and could not be loaded ({reason})"
        if "different number of parameter groups" in str(exc):  # torch's optimizer, on a sound checkpoint
            problem = (
                f"checkpoint {path!r} holds an optimizer with another number of parameter groups than this run's: "
                "it was saved by an earlier version of these scripts, which kept an empty weight-decay group for "
                "LoRA (the checkpoint is not damaged); resume it with the scripts that saved it, or start afresh"
            )
    refuse_together(accelerator, problem)
    _keep_given_rates(accelerator, given)
    return state


def _given_rates(accelerator: Accelerator) -> list:
    """(schedule, the optimizer that trains, its peak rates, its weight decays) of each prepared schedule, as this
    run's options built them: transformers' schedules (every --lr_scheduler_type), each with its optimizer."""
    schedules = [getattr(wrapper, "scheduler", wrapper) for wrapper in accelerator._schedulers]
    pairs = zip(schedules, accelerator._optimizers)
    return [
        (schedule, trained, list(schedule.base_lrs), _decays(trained))
        for schedule, trained in pairs
        if hasattr(schedule, "lr_lambdas")
    ]


def _decays(optimizer) -> list[float]:
    return [group.get("weight_decay", 0.0) for group in optimizer.param_groups]


def _keep_given_rates(accelerator: Accelerator, given: list) -> None:
    """After `load_state`: the learning rate and weight decay this run was given, not the checkpoint's, said once
    where they differ. Accelerate restores the optimizer's groups and the schedule's peak rates from the checkpoint,
    so --learning_rate and --weight_decay given to a resume were ignored while training_args.json and the model card
    named them; the schedule's type, warm-up and length came from the command line already. Equal values change
    nothing: a resume with the same options continues bit for bit.

    The schedule steps the optimizer that trains: under DeepSpeed's optimizer offload that is a DeepSpeedCPUAdam
    built on the schedule's own groups, and loading its state gave it groups of its own, which the schedule no
    longer reached (the rate stayed the checkpoint's for the rest of the run). No communication."""
    for schedule, trained, base_lrs, decays in given:
        if schedule.optimizer.param_groups is not trained.param_groups:
            schedule.optimizer = trained
        groups = trained.param_groups
        saved = (list(schedule.base_lrs), _decays(trained))
        if saved == (base_lrs, decays):
            continue
        logger.warning(
            f"resumed with this run's learning rate {base_lrs[0]:g} and weight decay {max(decays):g} (the checkpoint "
            f"had {saved[0][0]:g} and {max(saved[1]):g}; give those to keep them): its optimizer's moments, step and "
            "schedule continue"
        )
        schedule.base_lrs = base_lrs
        for group, peak, decay, factor in zip(groups, base_lrs, decays, schedule.lr_lambdas):
            group["initial_lr"], group["weight_decay"] = peak, decay
            group["lr"] = peak * factor(schedule.last_epoch)
        schedule._last_lr = [group["lr"] for group in groups]
