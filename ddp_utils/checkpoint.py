"""Checkpoints that survive anything: exact resume, atomic saves, preemption.

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

from .io import write_json
from .launch import EXIT_PREEMPTED, Preempted, UsageError

STATE_FILE = "trainer_state.json"
PREEMPTED_FILE = "preempted.json"  # in the output dir while a preempted run waits to be resumed
_NAME = re.compile(r"^checkpoint-(\d+)$")


def model_fingerprint(model) -> str:
    """A digest of parameter names and shapes: a checkpoint of another model will not match."""
    shapes = [(name.removeprefix("module."), tuple(p.shape)) for name, p in model.named_parameters()]
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
    """Write a complete checkpoint of the run at `state["step"]`; all ranks must call it together.

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
    checkpoint in output_dir, or None if there is none). Any rank may call it."""
    if not resume_from:
        return None
    if resume_from == "latest":
        checkpoints = list_checkpoints(output_dir)
        return checkpoints[-1] if checkpoints else None
    if not os.path.isdir(resume_from):
        raise UsageError(f"--resume_from_checkpoint {resume_from!r} is not a directory; give a checkpoint-<step> directory or 'latest'")
    return resume_from


def load_checkpoint(accelerator: Accelerator, path: str, expected: dict) -> dict:
    """Restore model, optimizer, scheduler, scaler and RNG states from `path`; all ranks call it.
    Returns the saved trainer state. `expected` holds the values the checkpoint must match
    (model fingerprint, world size, batch sizes); a mismatch or a damaged checkpoint is a
    `UsageError` that says so, not a stack trace from inside torch."""
    state_file = os.path.join(path, STATE_FILE)
    try:
        with open(state_file) as handle:
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
    try:
        accelerator.load_state(path)
    except Exception as exc:
        raise UsageError(f"checkpoint {path!r} is damaged and could not be loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from exc
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
        """True on every rank if any rank received a signal. All ranks call it once per optimizer
        step (one scalar all-reduce), so they all stop after the same step."""
        flag = torch.tensor(1.0 if self.received is not None else 0.0, device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)

    def stop(self, output_dir: str, checkpoint: str) -> None:
        """After the preemption checkpoint: leave `preempted.json` for the job script and raise
        `Preempted` on every rank (ddp_utils.run then exits with EXIT_PREEMPTED)."""
        name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
        write_json(self.accelerator, os.path.join(output_dir, PREEMPTED_FILE), {"signal": name, "checkpoint": checkpoint})
        raise Preempted(f"stopped by {name} after saving {checkpoint}; resume with --resume_from_checkpoint latest "
                        f"(every process exits with {EXIT_PREEMPTED})")


def clear_preempted_marker(accelerator: Accelerator, output_dir: str) -> None:
    """Remove `preempted.json` once a resumed run has finished. Any rank may call it."""
    marker = os.path.join(output_dir, PREEMPTED_FILE)
    if accelerator.is_main_process and os.path.exists(marker):
        os.remove(marker)
