"""The parts of a training loop that every script shares: starting a run, one exact optimizer
step, and the bookkeeping around the steps (progress, logging, checkpoints, preemption, resume).

What differs between tasks, the loss, stays in the script: `train_step` takes it as a function.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from tqdm.auto import tqdm

from .checkpoint import (
    PreemptionHandler,
    clear_preempted_marker,
    load_checkpoint,
    model_fingerprint,
    resolve_resume_path,
    save_checkpoint,
)
from .data import SAMPLE_WEIGHT, epoch_dataloader, global_mean_loss, optimizer_step_batches
from .io import check_output_dir, prepare_output_dir, write_json
from .launch import make_accelerator

logger = get_logger(__name__)


def start_run(args, **accelerator_options) -> Accelerator:
    """The Accelerator for a run, with logging set up (warnings and errors only on the other
    ranks), the same seed on every rank (identical initialisation), and the output directory
    checked before any work is done. Every rank calls it first."""
    import datasets
    import transformers

    accelerator = make_accelerator(
        seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps, ddp_timeout=args.ddp_timeout,
        **accelerator_options,
    )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not accelerator.is_main_process:
        for library in (datasets.utils.logging, transformers.utils.logging):
            library.set_verbosity_error()
            library.disable_progress_bar()
    logger.info(f"{accelerator.num_processes} process(es), {accelerator.distributed_type.value}, device {accelerator.device}")
    transformers.set_seed(args.seed)
    check_output_dir(args.output_dir, args.overwrite_output_dir, resuming=bool(args.resume_from_checkpoint))
    return accelerator


def train_step(accelerator: Accelerator, model, optimizer, micro_batches, step_weight, loss_fn, max_grad_norm: float):
    """One optimizer step over this rank's micro-batches from `optimizer_step_batches`, with the
    exact loss: the gradient is the mean over all the step's examples (or target tokens) on all
    ranks. All ranks call it, in step.

    `loss_fn(model, batch)` returns `(losses, weights)`: one loss per example (or per token), and
    its weight, 1.0 for what counts and 0.0 for fillers, prompt tokens and padding.
    Returns this rank's weighted loss sum (a tensor; no communication).
    """
    loss_sum = torch.zeros((), device=accelerator.device)
    for batch in micro_batches:
        with accelerator.accumulate(model):
            losses, weights = loss_fn(model, batch)
            accelerator.backward(global_mean_loss(losses, weights, step_weight, accelerator))
            if accelerator.sync_gradients and max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
        loss_sum += (losses.detach().float() * weights).sum()
    return loss_sum


def describe(values: dict) -> str:
    """`key value, ...` with floats to 4 significant digits, for log lines."""
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


class TrainingRun:
    """Where a run stands, and the chores around its steps: the step plan, resuming, the
    progress bar, loss logging, checkpoints and preemption. Every rank creates it and calls its
    methods in the same order.

        run = TrainingRun(accelerator, args, model, train_dataloader)   # before accelerator.prepare
        model, ... = accelerator.prepare(...)
        run.start()                                       # output dir; resumes if asked to
        for epoch in run.epochs():
            for micro_batches, step_weight in run.optimizer_steps(train_dataloader, epoch):
                loss_sum = train_step(...); lr_scheduler.step()
                if run.end_step(step_weight, loss_sum): break
            run.end_epoch(evaluation_scores)
        run.finish()

    `unit` names what the step weight counts ("examples", or "tokens" for a language model);
    the run reports `train_<unit>_seen` and `train_<unit>_per_second`.
    """

    def __init__(self, accelerator: Accelerator, args, model, train_dataloader, unit: str = "examples",
                 weight_key: str = SAMPLE_WEIGHT):
        self.accelerator, self.args, self.unit, self.weight_key = accelerator, args, unit, weight_key
        accumulation = accelerator.gradient_accumulation_steps
        # The unprepared dataloader holds every rank's batches, padded to whole optimizer steps.
        self.steps_per_epoch = len(train_dataloader) // (accelerator.num_processes * accumulation)
        self.max_train_steps = args.max_train_steps or args.num_train_epochs * self.steps_per_epoch
        self.num_epochs = math.ceil(self.max_train_steps / self.steps_per_epoch)
        self.examples_per_step = args.per_device_train_batch_size * accelerator.num_processes * accumulation
        # What a checkpoint must match to resume this run, saved with its progress.
        self.identity = {"model": model_fingerprint(model), "world_size": accelerator.num_processes,
                         "per_device_train_batch_size": args.per_device_train_batch_size,
                         "gradient_accumulation_steps": accumulation}
        self.progress = {"step": 0, "epoch": 0, "step_in_epoch": 0, "trained_weight": 0.0, "train_time_s": 0.0}
        self.scores: dict = {}
        self._start_time = time.perf_counter()
        self._tick = None

    def start(self) -> None:
        """After `accelerator.prepare`, once the inputs are validated: create the output directory
        (emptied first with --overwrite_output_dir, unless resuming), resume from the checkpoint
        named by --resume_from_checkpoint, if any, and start listening for preemption signals."""
        args = self.args
        prepare_output_dir(self.accelerator, args.output_dir, args.overwrite_output_dir, bool(args.resume_from_checkpoint))
        resume_path = resolve_resume_path(args.output_dir, args.resume_from_checkpoint)
        if resume_path:
            self.progress = load_checkpoint(self.accelerator, resume_path, self.identity)
            logger.info(f"resumed from {resume_path}: epoch {self.progress['epoch']}, step {self.progress['step']}")
        elif args.resume_from_checkpoint:
            logger.info(f"no complete checkpoint in {args.output_dir}: starting from scratch")
        self.preemption = PreemptionHandler(self.accelerator)
        logger.info(f"{self.num_epochs} epochs, {self.max_train_steps} optimizer steps of {self.examples_per_step} examples")
        self.bar = tqdm(total=self.max_train_steps, initial=self.progress["step"], desc="train",
                        disable=not self.accelerator.is_main_process)

    @property
    def done(self) -> bool:
        return self.progress["step"] >= self.max_train_steps

    def epochs(self):
        """The epochs still to run (all of them, or those after a resumed checkpoint)."""
        return range(self.progress["epoch"], self.num_epochs)

    def optimizer_steps(self, train_dataloader, epoch: int):
        """`(micro_batches, step_weight)` for each optimizer step of `epoch` still to run: the
        prepared dataloader set to the epoch's shuffle, past the steps a resumed run already took."""
        batches = epoch_dataloader(self.accelerator, train_dataloader, epoch, steps_done=self.progress["step_in_epoch"])
        self._tick = time.perf_counter()
        yield from optimizer_step_batches(batches, self.accelerator, self.weight_key)

    def checkpoint(self) -> str:
        return save_checkpoint(self.accelerator, self.args.output_dir, {**self.identity, **self.progress},
                               self.args.checkpoints_total_limit)

    def end_step(self, step_weight: torch.Tensor, loss_sum: torch.Tensor) -> bool:
        """After each optimizer step: count it, show the loss, save a checkpoint when one is due,
        stop for a preemption signal. Returns True when the last step has been taken."""
        progress, args = self.progress, self.args
        progress["step"] += 1
        progress["step_in_epoch"] += 1
        progress["trained_weight"] += step_weight.item()
        progress["train_time_s"] += time.perf_counter() - self._tick
        self.bar.update(1)
        if progress["step"] % args.logging_steps == 0:  # the step's mean loss over all ranks
            mean_loss = self.accelerator.reduce(loss_sum, "sum") / step_weight.clamp(min=1.0)
            self.bar.set_postfix(loss=f"{mean_loss.item():.4f}")
        if self.preemption.requested():  # a signal on any rank: save together after this step, then exit 75
            self.preemption.stop(args.output_dir, self.checkpoint())
        if args.checkpointing_steps.isdigit() and progress["step"] % int(args.checkpointing_steps) == 0:
            self.checkpoint()
        self._tick = time.perf_counter()
        return self.done

    def end_epoch(self, scores: dict) -> None:
        """After each epoch's evaluation: log the scores, checkpoint if one is due per epoch."""
        logger.info(f"epoch {self.progress['epoch']}: {describe(scores)}")
        self.scores = scores
        self.progress.update(epoch=self.progress["epoch"] + 1, step_in_epoch=0)
        if self.args.checkpointing_steps == "epoch":
            self.checkpoint()

    def facts(self) -> dict:
        """How the run went: world size, steps, what was trained on, throughput, time."""
        progress, accelerator = self.progress, self.accelerator
        return {
            "world_size": accelerator.num_processes,
            "distributed_type": accelerator.distributed_type.value,
            "mixed_precision": accelerator.mixed_precision,
            "epochs": progress["epoch"],
            "optimizer_steps": progress["step"],
            f"train_{self.unit}_seen": int(progress["trained_weight"]),
            f"train_{self.unit}_per_second": progress["trained_weight"] / max(progress["train_time_s"], 1e-9),
            "train_runtime_s": progress["train_time_s"],
            "wall_time_s": time.perf_counter() - self._start_time,
        }

    def finish(self, extra: dict | None = None) -> dict:
        """Write metrics.json (last scores + run facts + `extra`) and training_args.json, and clear
        a preemption marker, on the main process. Every rank calls it; returns the metrics."""
        self.bar.close()
        metrics = {**self.scores, **self.facts(), **(extra or {})}
        output_dir = self.args.output_dir
        write_json(self.accelerator, f"{output_dir}/metrics.json", metrics)
        write_json(self.accelerator, f"{output_dir}/training_args.json", vars(self.args))
        clear_preempted_marker(self.accelerator, output_dir)
        logger.info(f"saved to {output_dir}: {describe(self.facts())}")
        return metrics
