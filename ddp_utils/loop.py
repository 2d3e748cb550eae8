"""The parts of a training loop that every script shares: starting a run, one exact optimizer
step, and the bookkeeping around the steps (progress, logging, checkpoints, preemption, resume).

What differs between tasks, the loss, stays in the script: `train_step` takes it as a function.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration
from tqdm.auto import tqdm

from .checkpoint import (
    PreemptionHandler,
    clear_preempted_marker,
    load_checkpoint,
    model_fingerprint,
    resolve_resume_path,
    save_checkpoint,
)
from .data import SAMPLE_WEIGHT, StepSize, epoch_dataloader, global_mean_loss, optimizer_step_batches
from .io import check_output_dir, prepare_output_dir, write_json
from .launch import make_accelerator
from .report import ConfusionMatrix, summary_table, write_report
from .tracking import TENSORBOARD_DIR, RunLog, hide_secret_args, loggable_args, peak_memory_mb, tracker_config

logger = get_logger(__name__)


def start_run(args, **accelerator_options) -> Accelerator:
    """The Accelerator for a run, with the trackers of --report_to (started later, by
    `TrainingRun.start`), logging set up (warnings and errors only on the other ranks), the same
    seed on every rank (identical initialisation), and the output directory checked before any
    work is done. Every rank calls it first."""
    import datasets
    import transformers

    hide_secret_args(args)  # --hub_token becomes HF_TOKEN; no secret stays in sys.argv
    accelerator = make_accelerator(
        seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps, ddp_timeout=args.ddp_timeout,
        log_with=args.trackers or None,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, TENSORBOARD_DIR)),
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


@dataclass
class StepStats:
    """One optimizer step as `train_step` took it, for `TrainingRun.end_step`."""

    size: StepSize  # what the step held on all ranks
    loss_sum: torch.Tensor  # this rank's weighted loss sum (summed over ranks only when logged)
    grad_norm: torch.Tensor | None  # the global gradient norm before clipping (None if DeepSpeed keeps it)
    learning_rate: float  # the rate the step was taken with


def train_step(accelerator: Accelerator, model, optimizer, micro_batches, step_size: StepSize, loss_fn,
               max_grad_norm: float) -> StepStats:
    """One optimizer step over this rank's micro-batches from `optimizer_step_batches`, with the
    exact loss: the gradient is the mean over all the step's examples (or target tokens) on all
    ranks. All ranks call it, in step.

    `loss_fn(model, batch)` returns `(losses, weights)`: one loss per example (or per token), and
    its weight, 1.0 for what counts and 0.0 for fillers, prompt tokens and padding.
    """
    loss_sum = torch.zeros((), device=accelerator.device)
    grad_norm = None
    learning_rate = optimizer.param_groups[0]["lr"]
    for batch in micro_batches:
        with accelerator.accumulate(model):
            losses, weights = loss_fn(model, batch)
            accelerator.backward(global_mean_loss(losses, weights, step_size.weight, accelerator))
            if accelerator.sync_gradients:
                # Without clipping, a limit of inf still returns the norm (for the log) and scales by 1.
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf)
            optimizer.step()
            optimizer.zero_grad()
        loss_sum += (losses.detach().float() * weights).sum()
    return StepStats(step_size, loss_sum, grad_norm, learning_rate)


def describe(values: dict) -> str:
    """`key value, ...` with floats to 4 significant digits, for log lines."""
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


class TrainingRun:
    """Where a run stands, and the chores around its steps: the step plan, resuming, the
    progress bar, logging to the trackers and train_log.jsonl, checkpoints, preemption, and the
    report at the end. Every rank creates it and calls its methods in the same order.

        run = TrainingRun(accelerator, args, model, train_dataloader)   # before accelerator.prepare
        model, ... = accelerator.prepare(...)
        run.start()                                       # output dir, trackers; resumes if asked to
        for epoch in run.epochs():
            for micro_batches, step_size in run.optimizer_steps(train_dataloader, epoch):
                step = train_step(...); lr_scheduler.step()
                if run.end_step(step): break
            run.end_epoch(evaluation_scores)
        run.finish()                                      # metrics.json, report/

    `unit` names what the step weight counts ("samples", or "target_tokens" for a language
    model); the run reports `train_<unit>_seen` and `train_<unit>_per_second`, and always the
    samples and (non-padding input) tokens per second.
    """

    def __init__(self, accelerator: Accelerator, args, model, train_dataloader, unit: str = "samples",
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
        self.progress = {"step": 0, "epoch": 0, "step_in_epoch": 0, "trained_weight": 0.0, "samples_seen": 0.0,
                         "tokens_seen": 0.0, "train_time_s": 0.0}
        self.scores: dict = {}
        self.log = RunLog(accelerator, args.output_dir)
        self._window = self._empty_window()
        self._start_time = time.perf_counter()
        self._tick = None

    def start(self) -> None:
        """After `accelerator.prepare`, once the inputs are validated: create the output directory
        (emptied first with --overwrite_output_dir, unless resuming), resume from the checkpoint
        named by --resume_from_checkpoint, if any, start the trackers with the run's options
        (secrets redacted), and start listening for preemption signals."""
        args = self.args
        prepare_output_dir(self.accelerator, args.output_dir, args.overwrite_output_dir, bool(args.resume_from_checkpoint))
        resume_path = resolve_resume_path(args.output_dir, args.resume_from_checkpoint)
        if resume_path:
            self.progress = {**self.progress, **load_checkpoint(self.accelerator, resume_path, self.identity)}
            logger.info(f"resumed from {resume_path}: epoch {self.progress['epoch']}, step {self.progress['step']}")
        elif args.resume_from_checkpoint:
            logger.info(f"no complete checkpoint in {args.output_dir}: starting from scratch")
        shape = {"world_size": self.accelerator.num_processes, "max_train_steps": self.max_train_steps,
                 "global_batch_size": self.examples_per_step}
        self.log.start(args.project_name or script_name(), args.run_name or os.path.basename(os.path.abspath(args.output_dir)),
                       tracker_config(args, shape), resumed_step=self.progress["step"])
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
        """`(micro_batches, step_size)` for each optimizer step of `epoch` still to run: the
        prepared dataloader set to the epoch's shuffle, past the steps a resumed run already took."""
        batches = epoch_dataloader(self.accelerator, train_dataloader, epoch, steps_done=self.progress["step_in_epoch"])
        self._tick = time.perf_counter()
        yield from optimizer_step_batches(batches, self.accelerator, self.weight_key)

    def checkpoint(self) -> str:
        return save_checkpoint(self.accelerator, self.args.output_dir, {**self.identity, **self.progress},
                               self.args.checkpoints_total_limit)

    def end_step(self, step: StepStats) -> bool:
        """After each optimizer step: count it, log every --logging_steps (and the last step),
        save a checkpoint when one is due, stop for a preemption signal. Returns True when the
        last step has been taken."""
        progress, args, window = self.progress, self.args, self._window
        seconds = time.perf_counter() - self._tick
        size = step.size
        weight, samples, tokens = torch.stack([size.weight, size.examples, size.tokens]).tolist()  # one device sync
        progress["step"] += 1
        progress["step_in_epoch"] += 1
        progress["trained_weight"] += weight
        progress["samples_seen"] += samples
        progress["tokens_seen"] += tokens
        progress["train_time_s"] += seconds
        window["loss_sum"] += step.loss_sum
        if step.grad_norm is not None:
            window["grad_norm_sum"] += step.grad_norm.float()
        for key, value in (("weight", weight), ("samples", samples), ("tokens", tokens), ("seconds", seconds), ("steps", 1)):
            window[key] += value
        window["learning_rate"] = step.learning_rate
        window["has_grad_norm"] = step.grad_norm is not None
        self.bar.update(1)
        if progress["step"] % args.logging_steps == 0 or self.done:
            self._log_window()
        if self.preemption.requested():  # a signal on any rank: save together after this step, then exit 75
            self.preemption.stop(args.output_dir, self.checkpoint())
        if args.checkpointing_steps.isdigit() and progress["step"] % int(args.checkpointing_steps) == 0:
            self.checkpoint()
        self._tick = time.perf_counter()
        return self.done

    @staticmethod
    def _empty_window() -> dict:
        return {"loss_sum": 0.0, "grad_norm_sum": 0.0, "weight": 0.0, "samples": 0.0, "tokens": 0.0, "seconds": 0.0,
                "steps": 0, "learning_rate": None, "has_grad_norm": False}

    def _log_window(self) -> None:
        """Log the steps since the last record: the loss over all their examples (or tokens) on
        all ranks, the mean gradient norm, the last learning rate, global throughput and the
        peak memory of the busiest rank. One gather; every rank calls it."""
        window, accelerator = self._window, self.accelerator
        memory = peak_memory_mb(accelerator.device)
        local = torch.stack([torch.as_tensor(window["loss_sum"], dtype=torch.float32, device=accelerator.device).reshape(()),
                             *(torch.tensor(value, device=accelerator.device) for value in memory.values())])
        everyone = accelerator.gather(local[None]).cpu()  # (world size, 1 + memory kinds)
        loss = everyone[:, 0].sum().item() / max(window["weight"], 1.0)
        record = {"train/epoch": round(self.progress["epoch"] + self.progress["step_in_epoch"] / self.steps_per_epoch, 4),
                  "train/loss": loss, "train/learning_rate": window["learning_rate"]}
        if window["has_grad_norm"]:
            record["train/grad_norm"] = float(window["grad_norm_sum"]) / window["steps"]
        record["train/samples_per_second"] = window["samples"] / max(window["seconds"], 1e-9)
        if window["tokens"]:
            record["train/tokens_per_second"] = window["tokens"] / max(window["seconds"], 1e-9)
        for i, name in enumerate(memory, start=1):
            record[f"train/{name}"] = everyone[:, i].max().item()
        self.log.log(record, step=self.progress["step"])
        speed = f"{record['train/samples_per_second']:,.1f} samples/s"
        if window["tokens"]:
            speed += f", {record['train/tokens_per_second']:,.0f} tok/s"
        self.bar.set_postfix_str(f"loss {loss:.4f}, {speed}")
        self._window = self._empty_window()

    def end_epoch(self, scores: dict) -> None:
        """After each epoch's evaluation: log the scores (to the trackers and train_log.jsonl),
        checkpoint if one is due per epoch. Every rank calls it with the same scores."""
        logger.info(f"epoch {self.progress['epoch']}: {describe(scores)}")
        self.scores = scores
        self.progress.update(epoch=self.progress["epoch"] + 1, step_in_epoch=0)
        record = {"epoch": self.progress["epoch"]}
        record.update({f"eval/{name.removeprefix('eval_')}": value for name, value in scores.items() if isinstance(value, (int, float))})
        self.log.log(record, step=self.progress["step"])
        if self.args.checkpointing_steps == "epoch":
            self.checkpoint()

    def facts(self) -> dict:
        """How the run went: world size, steps, what was trained on, throughput, time."""
        progress, accelerator = self.progress, self.accelerator
        seconds = max(progress["train_time_s"], 1e-9)
        facts = {
            "world_size": accelerator.num_processes,
            "distributed_type": accelerator.distributed_type.value,
            "mixed_precision": accelerator.mixed_precision,
            "epochs": progress["epoch"],
            "optimizer_steps": progress["step"],
            "train_samples_seen": int(progress["samples_seen"]),
            "train_tokens_seen": int(progress["tokens_seen"]),
            f"train_{self.unit}_seen": int(progress["trained_weight"]),
            "train_samples_per_second": progress["samples_seen"] / seconds,
            "train_tokens_per_second": progress["tokens_seen"] / seconds,
            f"train_{self.unit}_per_second": progress["trained_weight"] / seconds,
            "train_runtime_s": progress["train_time_s"],
            "wall_time_s": time.perf_counter() - self._start_time,
        }
        if not progress["tokens_seen"]:  # inputs that are not tokens (images)
            del facts["train_tokens_seen"], facts["train_tokens_per_second"]
        return facts

    def finish(self, extra: dict | None = None, confusion: ConfusionMatrix | None = None) -> dict:
        """Write metrics.json (last scores + run facts + peak memory per rank + `extra`),
        training_args.json (secrets redacted) and the report (plots, summary; with `confusion`
        from the last evaluation, its picture too), and clear a preemption marker, on the
        main process. Every rank calls it (it gathers each rank's peak memory); returns the metrics."""
        self.bar.close()
        memory = peak_memory_mb(self.accelerator.device)
        per_rank = self.accelerator.gather(torch.tensor([list(memory.values())], device=self.accelerator.device)).cpu()
        facts = {**self.facts(), **{f"{name}_per_rank": [round(v, 1) for v in per_rank[:, i].tolist()] for i, name in enumerate(memory)}}
        metrics = {**self.scores, **facts, **(extra or {})}
        output_dir = self.args.output_dir
        write_json(self.accelerator, f"{output_dir}/metrics.json", metrics)
        write_json(self.accelerator, f"{output_dir}/training_args.json", loggable_args(self.args))
        if self.accelerator.is_main_process:
            write_report(output_dir, summary_table(self.args, facts, extra), self.scores, confusion)
        clear_preempted_marker(self.accelerator, output_dir)
        self.accelerator.wait_for_everyone()
        logger.info(f"saved to {output_dir}: {describe(self.facts())}; report in {output_dir}/report/README.md")
        return metrics


def script_name() -> str:
    """The running script's name without .py (train, train_clm, ...): the default tracker project."""
    return os.path.splitext(os.path.basename(sys.argv[0]))[0] or "fine-tuning"
