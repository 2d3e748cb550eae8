"""Checkpoints that survive anything: exact resume, atomic saves, preemption. `Checkpointer` is
what the scripts use; the functions below it do the work.

A checkpoint `<output_dir>/checkpoint-<step>/` holds what `accelerator.save_state` writes (model
as safetensors, optimizer, LR scheduler, gradient scaler, sampler, and every process's Python /
NumPy / torch RNG states) plus `trainer_state.json`: the step and epoch counters, the position in
the epoch, what a run must match to resume (the model and the global batch) and the layout it was
trained on (processes, per-device batch, accumulation).

It resumes on any layout with the same global batch (examples per optimizer step): the training
order is drawn from (seed, epoch) and cut into global steps (`StepAlignedSampler`), and the model,
optimizer, scheduler and scaler states do not depend on the layout. Only the per-rank RNG states
do: on another layout they are replaced by a seed drawn from (seed, step), the same on every rank.

It is written into `.tmp-checkpoint-<step>/`, flushed to disk, then renamed: a directory named
`checkpoint-<step>` is always complete. Old checkpoints are deleted only after the new one is in
place, so a crash during a save leaves the previous checkpoint to resume from.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import signal
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed

from .errors import EXIT_PREEMPTED, Preempted, RunFailed, UsageError
from .manifest import checkpoint_problem, write_manifest
from .output import agree_on_write, existing_parent, write_json
from .ranks import from_main_process, refuse_together

logger = get_logger(__name__)

STATE_FILE = "trainer_state.json"
PREEMPTED_FILE = "preempted.json"  # in the output dir while a preempted run waits to be resumed
_NAME = re.compile(r"^checkpoint-(\d+)$")
# How a global batch is split: saved with each checkpoint, and all a run may change when it resumes.
LAYOUT = ("world_size", "per_device_train_batch_size", "gradient_accumulation_steps")


def model_fingerprint(model) -> str:
    """A digest of parameter names and full shapes: a checkpoint of another model will not match.
    Under DeepSpeed ZeRO-3 a parameter is an empty partition by now; its full shape is `ds_shape`."""
    shapes = [
        (name.removeprefix("module."), tuple(getattr(p, "ds_shape", p.shape))) for name, p in model.named_parameters()
    ]
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


def save_checkpoint(
    accelerator: Accelerator, output_dir: str, state: dict, total_limit: int | None = None, keep: str | None = None
) -> str:
    """All ranks call this: write a complete checkpoint of the run at `state["step"]` (gathers
    that stand for barriers, and `accelerator.save_state`, a collective under FSDP and DeepSpeed).

    `state` is the script's progress (step, epoch, step_in_epoch, ...), stored as trainer_state.json,
    with a manifest of every file's size and checksum (`manifest.write_manifest`). It is written
    into `.tmp-checkpoint-<step>` and renamed once complete; then only the `total_limit` newest are
    kept, and `keep` (the best checkpoint's directory name) besides. A write that fails on any rank (no
    space, quota, file too large, permissions) stops every rank with one line (`RunFailed`: the
    directory, the cause, the newest complete checkpoint, the fix); the staging directory is
    removed and the older checkpoints are kept. Returns the checkpoint's path.
    """
    name = f"checkpoint-{state['step']}"
    final, staging = os.path.join(output_dir, name), os.path.join(output_dir, f".tmp-{name}")
    what = f"checkpoint {final!r}"

    def write(step):
        try:
            step()
        except Exception as exc:  # every rank reports it, in agree_on_write
            return exc
        return None

    def make_staging():
        shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save
        os.makedirs(staging)

    def seal():
        write_manifest(staging)
        _fsync_tree(staging)
        if os.path.isdir(final):  # the same step saved again (e.g. step and epoch interval coincide)
            shutil.rmtree(final)
        os.rename(staging, final)
        _fsync_dir(output_dir)
        if total_limit:
            for old in list_checkpoints(output_dir)[:-total_limit]:
                if os.path.basename(old) != keep:
                    shutil.rmtree(old)

    try:
        agree_on_write(accelerator, write(make_staging) if accelerator.is_main_process else None, what, output_dir)
        error = write(lambda: accelerator.save_state(staging))  # each rank writes its own RNG states
        if error is None and accelerator.is_main_process:
            error = write(lambda: write_json(accelerator, os.path.join(staging, STATE_FILE), state))
        agree_on_write(accelerator, error, what, output_dir)
        agree_on_write(accelerator, write(seal) if accelerator.is_main_process else None, what, output_dir)
    except RunFailed:
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)  # never half a checkpoint, and its space back
        raise
    return final


def newest_good_checkpoint(output_dir: str, skip_damaged: bool = True) -> str | None:
    """The newest complete checkpoint in `output_dir` that checks out against its manifest
    (`manifest.checkpoint_problem`); damaged ones are skipped with a warning that names them.
    None when there is none. Reads this rank's view of the file system."""
    for path in reversed(list_checkpoints(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if skip_damaged:
            logger.warning(f"checkpoint {path!r} is damaged ({problem}): skipped, an older one is used")
    return None


def resolve_resume_path(output_dir: str, resume_from: str | None) -> str | None:
    """`--resume_from_checkpoint`: None, a checkpoint path, or "latest" (the newest complete
    checkpoint in output_dir that checks out against its manifest, or None if there is none). A
    damaged checkpoint named explicitly is refused, naming the newest good one. It reads this
    rank's view of the file system: `Checkpointer.resume` calls it on the main process only and
    shares the answer."""
    if not resume_from:
        return None
    if resume_from == "latest":
        found = list_checkpoints(output_dir)
        path = newest_good_checkpoint(output_dir)
        if found and path is None:
            raise UsageError(
                f"every checkpoint in {output_dir!r} is damaged (the newest, {found[-1]!r}: "
                f"{checkpoint_problem(found[-1])}); start afresh with --overwrite_output_dir instead of resuming"
            )
        return path
    if not os.path.isdir(resume_from):
        raise UsageError(
            f"--resume_from_checkpoint {resume_from!r} is not a directory; "
            "give a checkpoint-<step> directory or 'latest'"
        )
    problem = checkpoint_problem(resume_from)
    if problem is not None:
        good = newest_good_checkpoint(os.path.dirname(os.path.abspath(resume_from)), skip_damaged=False)
        fix = (
            f"the newest that checks out is {good!r}: resume from it" if good else "no checkpoint beside it checks out"
        )
        raise UsageError(f"checkpoint {resume_from!r} is damaged ({problem}); {fix}")
    return resume_from


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


def read_checkpoint_state(path: str, expected: dict, world_size: int = 1) -> dict:
    """The trainer state saved in checkpoint `path`, once it is known to match `expected` (the
    model fingerprint and the global batch; this run has `world_size` processes). A missing or
    unreadable state file, another model or another global batch is a `UsageError` that says so
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
        key: (state.get(key), value)
        for key, value in expected.items()
        if key != "global_batch" and state.get(key) != value
    }
    if mismatched:
        details = ", ".join(
            f"{key}: checkpoint {saved!r}, this run {wanted!r}" for key, (saved, wanted) in mismatched.items()
        )
        raise UsageError(
            f"checkpoint {path!r} is from a different run ({details}); resume with the settings it was saved with"
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


def load_checkpoint(accelerator: Accelerator, path: str, expected: dict) -> dict:
    """All ranks call this: restore model, optimizer, scheduler, scaler and RNG states from `path`,
    and return the saved trainer state. The state is read and checked against `expected` on the
    main process and shared (one broadcast); each rank then loads its part (`accelerator.load_state`,
    a collective under FSDP and DeepSpeed), and a rank that cannot is reported on every rank (one
    gather). A mismatch or a damaged checkpoint is a `UsageError` that says so, on every rank, not
    a stack trace from inside torch.

    A checkpoint saved on another number of processes loads the same way: Accelerate saves and
    loads the model it was given to `prepare`, not its DDP wrapper, so the weights have the same
    names on any number of processes, and the optimizer, scheduler and scaler states are the same
    on every rank. Only the RNG states are per rank: each rank restores its own rank's if the
    checkpoint has one (Accelerate skips a missing one with an info line), and `Checkpointer.resume`
    replaces them on another layout."""
    state = from_main_process(accelerator, read_checkpoint_state, path, expected, accelerator.num_processes)
    problem = None
    try:
        accelerator.load_state(path)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        problem = f"checkpoint {path!r} is damaged and could not be loaded ({reason})"
    refuse_together(accelerator, problem)
    return state


class PreemptionHandler:
    """Turns SIGTERM / SIGUSR1 (what SLURM sends before a time limit or preemption) into a flag
    that `requested` shares across ranks. All ranks create it, after the Accelerator: on an
    accelerator that is a collective (it makes the CPU process group the flag travels in)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, accelerator: Accelerator, timeout_s: int = 1800):
        self.accelerator = accelerator
        self.received: int | None = None
        # The flag goes through a gloo group on the CPU: through the device's own backend, reading
        # it every step would wait for the device to finish the step (a host sync per step).
        self.group = None
        if accelerator.num_processes > 1 and torch.distributed.is_initialized():
            on_cpu = torch.distributed.get_backend() == "gloo"
            self.group = (
                torch.distributed.group.WORLD
                if on_cpu
                else torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            )
        for signum in self.SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame):
        self.received = signum

    def requested(self) -> bool:
        """All ranks call this once per optimizer step: True on every rank if any rank received a
        signal (one scalar all-reduce on the CPU, no device sync), so they all stop after the same step."""
        flag = torch.tensor(1 if self.received is not None else 0, dtype=torch.int32)
        if self.group is not None:
            torch.distributed.all_reduce(flag, group=self.group)
        elif self.accelerator.num_processes > 1:  # processes without torch.distributed (XLA): through the device
            flag = self.accelerator.reduce(flag.to(self.accelerator.device), reduction="sum")
        return bool(flag.item())

    def stop(self, output_dir: str, checkpoint: str) -> None:
        """Every rank calls this after the preemption checkpoint: the main process leaves
        `preempted.json` for the job script, and every rank raises `Preempted` (ddp_utils.run then
        exits with EXIT_PREEMPTED). No communication."""
        name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
        write_json(
            self.accelerator, os.path.join(output_dir, PREEMPTED_FILE), {"signal": name, "checkpoint": checkpoint}
        )
        raise Preempted(
            f"stopped by {name} after saving {checkpoint}; resume with --resume_from_checkpoint latest "
            f"(every process exits with {EXIT_PREEMPTED})"
        )


def clear_preempted_marker(accelerator: Accelerator, output_dir: str) -> None:
    """Remove a `preempted.json` left by an earlier attempt, on the main process, as a run starts
    (`start_run` calls it): the marker tells the job script that *this* attempt was preempted, so
    it must not outlive the attempt that wrote it (a requeued run that then fails for another
    reason, even while loading its data, would otherwise be requeued for ever). Any rank may call
    it; the others do nothing."""
    marker = os.path.join(output_dir, PREEMPTED_FILE)
    if accelerator.is_main_process and os.path.isfile(marker):
        os.remove(marker)


def checkpoint_bytes(model) -> int:
    """About what one checkpoint of `model` takes on disk: every weight as stored, and AdamW's two
    fp32 moments per trainable weight (the sampler, scheduler and RNG states are small). Under
    DeepSpeed ZeRO-3 a weight's full size is its `ds_numel`."""
    weights = trainable = 0
    for p in model.parameters():
        numel = getattr(p, "ds_numel", p.numel())
        weights += numel * p.element_size()
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


class Checkpointer:
    """Saves the run's checkpoints (every --checkpointing_steps, and when the job is preempted) and
    resumes from one, on this layout or any other with the same global batch.

    Build it on every rank with the unwrapped model (it fingerprints it): `start.start_training`
    does. From then on SIGTERM / SIGUSR1 do not kill the process: they ask for a checkpoint after
    the optimizer step in flight, then every process exits with code 75. With `log` (the run's
    `TrainingLog`) set, a run whose loss or gradient norm turned NaN is stopped before any
    checkpoint of it is written, so the newest checkpoint stays a good one; and each checkpoint
    is ranked by the evaluation of its step (--metric_for_best_model), the best one kept.
    """

    def __init__(self, accelerator: Accelerator, args, model):
        self.accelerator, self.output_dir, self.seed = accelerator, args.output_dir, args.seed
        self.every, self.total_limit, self.resume_from = (
            args.checkpointing_steps,
            args.checkpoints_total_limit,
            args.resume_from_checkpoint,
        )
        self.layout = {
            "world_size": accelerator.num_processes,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
        }
        # What a checkpoint must match to resume this run, saved with its progress and layout.
        self.identity = {"model": model_fingerprint(model), "global_batch": math.prod(self.layout.values())}
        self.has_batchnorm = any(
            isinstance(module, torch.nn.modules.batchnorm._BatchNorm) for module in model.modules()
        )
        self.preemption = PreemptionHandler(accelerator, args.ddp_timeout)
        self.log = None  # the TrainingLog (its NonFiniteWatch and newest evaluation), set by start_training
        self.metric = getattr(args, "metric_for_best_model", None)  # ranks the checkpoints: check_metric_for_best_model
        self.greater_is_better = getattr(args, "greater_is_better", None)
        # {"checkpoint": its directory's name in output_dir, "metric", "step"} of the best checkpoint so far: a name,
        # not a path, so a resume that spells output_dir another way (relative, absolute, moved) still keeps it.
        self.best: dict | None = None
        self._after_evaluation = False  # a checkpoint due at an epoch's last step, saved after its evaluation
        if accelerator.is_main_process and self.every != "no":
            warn_if_the_disk_is_small(self.output_dir, checkpoint_bytes(model), self.total_limit)

    def resume(self, plan) -> None:
        """All ranks call this once, after `accelerator.prepare` and `prepare_output_dir`: resume
        from --resume_from_checkpoint if it names a checkpoint, and restore `plan`'s progress.
        "latest" is resolved, and the checkpoint's state read and checked, on the main process and
        sent to every rank, so ranks with different views of a shared file system resume from the
        same one (see `load_checkpoint`). A checkpoint of another layout with the same global batch
        resumes elastically (see `_resumed_elastically`)."""
        path = from_main_process(self.accelerator, resolve_resume_path, self.output_dir, self.resume_from)
        if path:
            saved = load_checkpoint(self.accelerator, path, self.identity)
            plan.progress.update({key: saved[key] for key in plan.progress if key in saved})
            # Accelerate's micro-batch counter decides which micro-batch of a step synchronises the
            # gradients. It was saved per rank, in the checkpoint's micro-batches: count it in this run's.
            self.accelerator.step = plan.step * self.accelerator.gradient_accumulation_steps
            logger.info(f"resumed from {path}: epoch {plan.progress['epoch']}, step {plan.step}")
            ranked_the_same = (
                saved.get("metric_for_best_model") == self.metric
                and saved.get("greater_is_better", not str(self.metric).endswith(("loss", "perplexity")))
                == self.greater_is_better
            )  # checkpoints before --greater_is_better: lower won for a loss or perplexity
            if ranked_the_same and saved.get("best"):  # the best so far; older checkpoints recorded its path
                self.best = {**saved["best"], "checkpoint": os.path.basename(saved["best"]["checkpoint"])}
            saved_layout = {key: saved.get(key) for key in LAYOUT}
            if saved_layout != self.layout:
                self._resumed_elastically(saved_layout, plan.step)
        elif self.resume_from:
            logger.info(f"no complete checkpoint in {self.output_dir}: starting from scratch")

    def _resumed_elastically(self, saved_layout: dict, step: int) -> None:
        """After a resume onto another layout: the per-rank RNG states cannot be mapped onto it
        (each rank restored its own rank's, if the checkpoint has one), so every rank is seeded
        from (--seed, step) instead, as every rank of a fresh run is from --seed. Every rank
        calls it; no communication."""
        set_seed((self.seed * 1_000_003 + step) % 2**32)
        logger.info(
            f"resumed elastically from {describe_layout(saved_layout)} onto {describe_layout(self.layout)} "
            f"(processes x per-device batch x accumulation; {self.identity['global_batch']} examples per "
            "optimizer step)"
        )
        logger.warning(
            "the random draws of the remaining steps (dropout) differ from the uninterrupted run's: a process's RNG "
            "state cannot be carried onto another layout, so every process is seeded from --seed and the step; "
            "the data order, model, optimizer, scheduler and scaler are resumed exactly"
        )
        if (
            self.has_batchnorm
            and saved_layout["per_device_train_batch_size"] != self.layout["per_device_train_batch_size"]
        ):
            logger.warning(
                "BatchNorm normalises over each micro-batch: with another per-device batch the remaining steps "
                "compute another function than the uninterrupted run's"
            )

    def save(self, plan) -> str:
        """All ranks call this: a checkpoint of the run as it stands, unless a step's loss or
        gradient norm was not finite (then `RunFailed`, on every rank). When the log's newest
        evaluation is of this step, its --metric_for_best_model ranks the checkpoint: the best so
        far is recorded with it and kept whatever --checkpoints_total_limit. Returns its path."""
        if self.log is not None:
            self.log.finite.check_now()  # never a checkpoint of NaN weights
        name = f"checkpoint-{plan.step}"
        evaluated = self.log.last_evaluation if self.log is not None else None
        if self.metric and evaluated and evaluated[0] == plan.step and self.metric in evaluated[1]:
            value = float(evaluated[1][self.metric])
            best = None if self.best is None else self.best["metric"]
            if best is None or (value > best if self.greater_is_better else value < best):
                self.best = {"checkpoint": name, "metric": value, "step": plan.step}
        state = {
            **self.identity,
            **self.layout,
            **plan.progress,
            "best": self.best,
            "metric_for_best_model": self.metric,
            "greater_is_better": self.greater_is_better,
        }
        keep = self.best["checkpoint"] if self.best else None
        return save_checkpoint(self.accelerator, self.output_dir, state, self.total_limit, keep=keep)

    def facts(self) -> dict:
        """What metrics.json records of the checkpoints: the best one, by --metric_for_best_model."""
        if not self.best:
            return {}
        return {
            "metric_for_best_model": self.metric,
            "greater_is_better": self.greater_is_better,
            "best_checkpoint": os.path.join(self.output_dir, self.best["checkpoint"]),
            "best_metric": self.best["metric"],
            "best_step": self.best["step"],
        }

    def step(self, plan) -> None:
        """All ranks call this after every optimizer step: stop for a preemption signal on any rank
        (one scalar all-reduce; then a checkpoint, preempted.json and `Preempted`), and save a
        checkpoint when one is due every --checkpointing_steps steps. One due at an epoch's last
        step waits for the epoch's evaluation (`epoch`), which ranks it."""
        if self.preemption.requested():
            self.preemption.stop(self.output_dir, self.save(plan))
        if self.every.isdigit() and plan.step % int(self.every) == 0:
            if plan.progress["step_in_epoch"] == plan.steps_per_epoch or plan.done:
                self._after_evaluation = True
            else:
                self.save(plan)

    def epoch(self, plan) -> None:
        """All ranks call this after each epoch (its evaluation done): a checkpoint when one is due
        per epoch, or was due at its last step."""
        if self.every == "epoch" or self._after_evaluation:
            self._after_evaluation = False
            self.save(plan)
