"""The checkpoints of a run: `Checkpointer` saves them when due (every --checkpointing_steps, and
on a preemption signal), ranks them by --metric_for_best_model and keeps the best, and resumes
from one, exactly on the same layout and on any other with the same global batch.

The work is done by `checkpoint_save` (atomic saves with a manifest), `checkpoint_load` (which
checkpoint, whether it fits, loading it), `manifest` (sizes and checksums, checked on every rank
in parallel), `preemption` (SIGTERM and SIGUSR1) and `frozen_weights` (a LoRA run's checkpoints
without its frozen base).
"""

from __future__ import annotations

import hashlib
import math
import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed

from ..core.errors import UsageError
from ..core.ranks import from_main_process
from .checkpoint_load import LAYOUT, describe_layout, find_resume_checkpoint, load_checkpoint
from .checkpoint_save import checkpoint_bytes, save_checkpoint, set_aside_later_checkpoints, warn_if_the_disk_is_small
from .frozen_weights import FROZEN_DIGEST, checkpoint_trainable_weights_only
from .preemption import PreemptionHandler

logger = get_logger(__name__)


def model_fingerprint(model) -> str:
    """A digest of parameter names and full shapes: a checkpoint of another model will not match.
    Under DeepSpeed ZeRO-3 a parameter is an empty partition by now; its full shape is `ds_shape`."""
    shapes = [
        (name.removeprefix("module."), tuple(getattr(p, "ds_shape", p.shape))) for name, p in model.named_parameters()
    ]
    return hashlib.sha1(repr(sorted(shapes)).encode()).hexdigest()[:16]


def _check_epoch_length(path: str, saved: dict, steps_per_epoch: int) -> None:
    """For a checkpoint saved before checkpoints recorded their training examples (`training_order_identity`) and
    resumed mid-epoch: a `UsageError` unless its progress fits this run's epochs of `steps_per_epoch` optimizer
    steps (step = epoch x steps per epoch + step in the epoch), which it does not, from its second epoch on, where
    the examples were other. Such are train_clm.py's and train_sft.py --packing's, whose data was prepared on
    several processes: they cut other blocks then. (A run that ended mid-epoch and was resumed with more steps
    starts its next epoch early: its older checkpoints after that are refused too.) Every rank calls it with the
    same values (no communication)."""
    epoch, step_in_epoch = saved.get("epoch"), saved.get("step_in_epoch")
    if "train_examples" in saved or not isinstance(epoch, int) or not isinstance(step_in_epoch, int):
        return  # checked by its identity, or too old to say
    if step_in_epoch and saved.get("step") != epoch * steps_per_epoch + step_in_epoch:
        raise UsageError(
            f"checkpoint {path!r}, saved before checkpoints recorded their training examples, is at step "
            f"{step_in_epoch} of epoch {epoch + 1} (step {saved.get('step')}), which this run's epochs of "
            f"{steps_per_epoch} steps do not reach: it was trained on other examples; resume with the training data "
            "and settings it was saved with, or start a new run in another --output_dir"
        )


class Checkpointer:
    """Saves the run's checkpoints (every --checkpointing_steps, and when the job is preempted) and
    resumes from one, on this layout or any other with the same global batch.

    Build it on every rank with the unwrapped model (it fingerprints it) and the run's `StepPlan`
    (what its training order is drawn from): `start.start_training` does. From then on SIGTERM /
    SIGUSR1 do not kill the process: they ask for a checkpoint after the optimizer step in flight,
    then every process exits with code 75. With `log` (the run's `TrainingLog`) set, a run whose
    loss or gradient norm turned NaN is stopped before any checkpoint of it is written, so the
    newest checkpoint stays a good one; and each checkpoint is ranked by the evaluation of its step
    (--metric_for_best_model), the best one kept.
    """

    def __init__(self, accelerator: Accelerator, args, model, plan):
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
        # What a checkpoint must match to resume this run, saved with its progress and layout; with frozen weights
        # (LoRA), also those weights, which its checkpoints leave out (all ranks: under FSDP a gather). The seed draws
        # each epoch's order from the training examples (their number, and their lengths with --group_by_length):
        # resumed mid-epoch with another, examples already trained on came again, others never.
        self.identity = {
            "model": model_fingerprint(model),
            "global_batch": math.prod(self.layout.values()),
            "seed": args.seed,
            "load_in_4bit": bool(getattr(args, "load_in_4bit", False)),  # QLoRA's base: another model's shapes
            **plan.training_order,
        }
        frozen = checkpoint_trainable_weights_only(accelerator, model)
        if frozen is not None:
            self.identity[FROZEN_DIGEST] = frozen
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
            one_checkpoint = checkpoint_bytes(model, with_frozen=frozen is None)
            warn_if_the_disk_is_small(self.output_dir, one_checkpoint, self.total_limit)

    def resume(self, plan) -> None:
        """All ranks call this once, after `accelerator.prepare` and `prepare_output_dir`: resume
        from --resume_from_checkpoint if it names a checkpoint, and restore `plan`'s progress.
        "latest" is resolved, and the checkpoint's state read and checked, on the main process and
        sent to every rank, so ranks with different views of a shared file system resume from the
        same one (see `load_checkpoint`). A checkpoint of another layout with the same global batch
        resumes elastically (see `_resumed_elastically`). The checkpoints in the output directory
        past the resumed step, an abandoned run's, are renamed aside with a warning, on the main
        process (`set_aside_later_checkpoints`)."""
        path = find_resume_checkpoint(self.accelerator, self.output_dir, self.resume_from)
        if path:
            saved = load_checkpoint(self.accelerator, path, self.identity)
            _check_epoch_length(path, saved, plan.steps_per_epoch)
            plan.progress.update({key: saved[key] for key in plan.progress if key in saved})
            self._set_aside_later_checkpoints(plan.step)
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

    def _set_aside_later_checkpoints(self, step: int) -> None:
        """All ranks call this after a resume from `step` (one broadcast): the main process renames
        the output directory's checkpoints past that step aside, and warns, naming them."""

        def set_aside():
            try:
                return set_aside_later_checkpoints(self.output_dir, step)
            except OSError as exc:
                raise UsageError(
                    f"resumed from step {step}, but could not set aside the later checkpoints in {self.output_dir!r}, "
                    f"an abandoned run's ({exc}); move them out of it, then resume again"
                ) from None

        moved = from_main_process(self.accelerator, set_aside)
        if moved:
            logger.warning(
                f"resumed from step {step}: the checkpoints past it in {self.output_dir!r} belong to a run that went "
                f"on from there, now abandoned, and are set aside where neither --resume_from_checkpoint latest nor "
                f"--checkpoints_total_limit sees them: {', '.join(f'{old} -> {new}' for old, new in moved)}. Delete "
                "them once you no longer need them"
            )

    def _resumed_elastically(self, saved_layout: dict, step: int) -> None:
        """After a resume onto another layout: the per-rank RNG states cannot be mapped onto it
        (each rank restored its own rank's, if the checkpoint has one), so every rank is seeded
        from (--seed, step) instead, as every rank of a fresh run is from --seed. The dropout masks
        are seeded per micro-batch anyway (`SeededMicroBatches`): the same as the uninterrupted run's
        when the per-device batch is the same. Every rank calls it; no communication."""
        set_seed((self.seed * 1_000_003 + step) % 2**32)
        logger.info(
            f"resumed elastically from {describe_layout(saved_layout)} onto {describe_layout(self.layout)} "
            f"(processes x per-device batch x accumulation; {self.identity['global_batch']} examples per "
            "optimizer step)"
        )
        other_micro_batches = saved_layout["per_device_train_batch_size"] != self.layout["per_device_train_batch_size"]
        if other_micro_batches:  # the same micro-batches draw the same dropout masks (SeededMicroBatches)
            logger.warning(
                "the dropout masks of the remaining steps differ from the uninterrupted run's: they are drawn per "
                f"micro-batch, and the per-device batch was {saved_layout['per_device_train_batch_size']}; resume "
                f"with --per_device_train_batch_size {saved_layout['per_device_train_batch_size']} to draw the same. "
                "The data order, model, optimizer, scheduler and scaler are resumed exactly"
            )
        if self.has_batchnorm and other_micro_batches:
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
        """What metrics.json records of the checkpoints: the best one, by --metric_for_best_model (its
        path where it is in the output directory: a run resumed into another one did not write it)."""
        if not self.best:
            return {}
        path = os.path.join(self.output_dir, self.best["checkpoint"])
        return {
            "metric_for_best_model": self.metric,
            "greater_is_better": self.greater_is_better,
            "best_checkpoint": path if os.path.isdir(path) else None,
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
