"""Checkpoints that survive anything: exact resume, atomic saves, preemption. `Checkpointer` is
what the scripts use; the functions below it do the work.

A checkpoint `<output_dir>/checkpoint-<step>/` holds what `accelerator.save_state` writes (model
as safetensors, optimizer, LR scheduler, gradient scaler, sampler, and every process's Python /
NumPy / torch RNG states) plus `trainer_state.json`: the step and epoch counters, the position in
the epoch, and what the run must match to resume (model, world size, batch sizes).

It is written into `.tmp-checkpoint-<step>/`, flushed to disk, then renamed: a directory named
`checkpoint-<step>` is always complete. Old checkpoints are deleted only after the new one is in
place, so a crash during a save leaves the previous checkpoint to resume from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from .errors import EXIT_PREEMPTED, Preempted, UsageError
from .io import write_json
from .ranks import from_main_process, refuse_together

logger = get_logger(__name__)

STATE_FILE = "trainer_state.json"
PREEMPTED_FILE = "preempted.json"  # in the output dir while a preempted run waits to be resumed
_NAME = re.compile(r"^checkpoint-(\d+)$")


def model_fingerprint(model) -> str:
    """A digest of parameter names and full shapes: a checkpoint of another model will not match.
    Under DeepSpeed ZeRO-3 a parameter is an empty partition by now; its full shape is `ds_shape`."""
    shapes = [(name.removeprefix("module."), tuple(getattr(p, "ds_shape", p.shape))) for name, p in model.named_parameters()]
    return hashlib.sha1(repr(sorted(shapes)).encode()).hexdigest()[:16]


def _fsync_tree(directory: str) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(root)


def _fsync_dir(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints in `output_dir`, oldest first (temporary directories are ignored)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _NAME.match(name)
        if match and os.path.isfile(os.path.join(output_dir, name, STATE_FILE)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def save_checkpoint(accelerator: Accelerator, output_dir: str, state: dict, total_limit: int | None = None) -> str:
    """All ranks call this: write a complete checkpoint of the run at `state["step"]` (barriers,
    and `accelerator.save_state`, a collective under FSDP and DeepSpeed).

    `state` is the script's progress (step, epoch, step_in_epoch, ...), stored as trainer_state.json.
    Returns the checkpoint's path.
    """
    name = f"checkpoint-{state['step']}"
    final, staging = os.path.join(output_dir, name), os.path.join(output_dir, f".tmp-{name}")
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save
        os.makedirs(staging)
    accelerator.wait_for_everyone()
    accelerator.save_state(staging)  # each rank writes its own RNG states
    write_json(accelerator, os.path.join(staging, STATE_FILE), state)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _fsync_tree(staging)
        if os.path.isdir(final):  # the same step saved again (e.g. step and epoch interval coincide)
            shutil.rmtree(final)
        os.rename(staging, final)
        _fsync_dir(output_dir)
        if total_limit:
            for old in list_checkpoints(output_dir)[:-total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def resolve_resume_path(output_dir: str, resume_from: str | None) -> str | None:
    """`--resume_from_checkpoint`: None, a checkpoint path, or "latest" (the newest complete
    checkpoint in output_dir, or None if there is none). It reads this rank's view of the file
    system: `Checkpointer.resume` calls it on the main process only and shares the answer."""
    if not resume_from:
        return None
    if resume_from == "latest":
        checkpoints = list_checkpoints(output_dir)
        return checkpoints[-1] if checkpoints else None
    if not os.path.isdir(resume_from):
        raise UsageError(f"--resume_from_checkpoint {resume_from!r} is not a directory; give a checkpoint-<step> directory or 'latest'")
    return resume_from


def read_checkpoint_state(path: str, expected: dict) -> dict:
    """The trainer state saved in checkpoint `path`, once it is known to match `expected` (model
    fingerprint, world size, batch sizes); a missing or unreadable state file, or a mismatch, is a
    `UsageError` that says so. Reads this rank's view of the file system: `load_checkpoint` calls
    it on the main process only."""
    try:
        with open(os.path.join(path, STATE_FILE)) as handle:
            state = json.load(handle)
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"{path!r} is not a complete checkpoint ({STATE_FILE}: {exc.__class__.__name__}); "
            "resume from another checkpoint-<step> directory, or use --resume_from_checkpoint latest"
        ) from None
    mismatched = {key: (state.get(key), value) for key, value in expected.items() if state.get(key) != value}
    if mismatched:
        details = ", ".join(f"{key}: checkpoint {saved!r}, this run {wanted!r}" for key, (saved, wanted) in mismatched.items())
        raise UsageError(f"checkpoint {path!r} is from a different run ({details}); resume with the settings it was saved with")
    return state


def load_checkpoint(accelerator: Accelerator, path: str, expected: dict) -> dict:
    """All ranks call this: restore model, optimizer, scheduler, scaler and RNG states from `path`,
    and return the saved trainer state. The state is read and checked against `expected` on the
    main process and shared (one broadcast); each rank then loads its part (`accelerator.load_state`,
    a collective under FSDP and DeepSpeed), and a rank that cannot is reported on every rank (one
    gather). A mismatch or a damaged checkpoint is a `UsageError` that says so, on every rank, not
    a stack trace from inside torch."""
    state = from_main_process(accelerator, read_checkpoint_state, path, expected)
    problem = None
    try:
        accelerator.load_state(path)
    except Exception as exc:
        problem = f"checkpoint {path!r} is damaged and could not be loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    refuse_together(accelerator, problem)
    return state


class PreemptionHandler:
    """Turns SIGTERM / SIGUSR1 (what SLURM sends before a time limit or preemption) into a flag
    that `requested` shares across ranks. Create it on every rank, after the Accelerator."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.received: int | None = None
        for signum in self.SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame):
        self.received = signum

    def requested(self) -> bool:
        """All ranks call this once per optimizer step: True on every rank if any rank received a
        signal (one scalar all-reduce), so they all stop after the same step."""
        flag = torch.tensor(1.0 if self.received is not None else 0.0, device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)

    def stop(self, output_dir: str, checkpoint: str) -> None:
        """Every rank calls this after the preemption checkpoint: the main process leaves
        `preempted.json` for the job script, and every rank raises `Preempted` (ddp_utils.run then
        exits with EXIT_PREEMPTED). No communication."""
        name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
        write_json(self.accelerator, os.path.join(output_dir, PREEMPTED_FILE), {"signal": name, "checkpoint": checkpoint})
        raise Preempted(f"stopped by {name} after saving {checkpoint}; resume with --resume_from_checkpoint latest "
                        f"(every process exits with {EXIT_PREEMPTED})")


def clear_preempted_marker(accelerator: Accelerator, output_dir: str) -> None:
    """Remove a `preempted.json` left by an earlier attempt, on the main process, as a run starts
    (`start_run` calls it): the marker tells the job script that *this* attempt was preempted, so
    it must not outlive the attempt that wrote it (a requeued run that then fails for another
    reason, even while loading its data, would otherwise be requeued for ever). Any rank may call
    it; the others do nothing."""
    marker = os.path.join(output_dir, PREEMPTED_FILE)
    if accelerator.is_main_process and os.path.isfile(marker):
        os.remove(marker)


class Checkpointer:
    """Saves the run's checkpoints (every --checkpointing_steps, and when the job is preempted) and
    resumes from one.

    Build it on every rank before `accelerator.prepare` (it fingerprints the unwrapped model).
    From then on SIGTERM / SIGUSR1 do not kill the process: they ask for a checkpoint after the
    optimizer step in flight, then every process exits with code 75.
    """

    def __init__(self, accelerator: Accelerator, args, model):
        self.accelerator, self.output_dir = accelerator, args.output_dir
        self.every, self.total_limit, self.resume_from = args.checkpointing_steps, args.checkpoints_total_limit, args.resume_from_checkpoint
        # What a checkpoint must match to resume this run, saved with its progress.
        self.identity = {"model": model_fingerprint(model), "world_size": accelerator.num_processes,
                         "per_device_train_batch_size": args.per_device_train_batch_size,
                         "gradient_accumulation_steps": accelerator.gradient_accumulation_steps}
        self.preemption = PreemptionHandler(accelerator)

    def resume(self, plan) -> None:
        """All ranks call this once, after `accelerator.prepare` and `prepare_output_dir`: resume
        from --resume_from_checkpoint if it names a checkpoint, and restore `plan`'s progress.
        "latest" is resolved, and the checkpoint's state read and checked, on the main process and
        sent to every rank, so ranks with different views of a shared file system resume from the
        same one (see `load_checkpoint`)."""
        path = from_main_process(self.accelerator, resolve_resume_path, self.output_dir, self.resume_from)
        if path:
            saved = load_checkpoint(self.accelerator, path, self.identity)
            plan.progress.update({key: saved[key] for key in plan.progress if key in saved})
            logger.info(f"resumed from {path}: epoch {plan.progress['epoch']}, step {plan.step}")
        elif self.resume_from:
            logger.info(f"no complete checkpoint in {self.output_dir}: starting from scratch")

    def save(self, plan) -> str:
        """All ranks call this: a checkpoint of the run as it stands. Returns its path."""
        return save_checkpoint(self.accelerator, self.output_dir, {**self.identity, **plan.progress}, self.total_limit)

    def step(self, plan) -> None:
        """All ranks call this after every optimizer step: stop for a preemption signal on any rank
        (one scalar all-reduce; then a checkpoint, preempted.json and `Preempted`), and save a
        checkpoint when one is due every --checkpointing_steps steps."""
        if self.preemption.requested():
            self.preemption.stop(self.output_dir, self.save(plan))
        if self.every.isdigit() and plan.step % int(self.every) == 0:
            self.save(plan)

    def epoch(self, plan) -> None:
        """All ranks call this after each epoch (its evaluation done): a checkpoint when one is due
        per epoch."""
        if self.every == "epoch":
            self.save(plan)
