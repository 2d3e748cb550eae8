"""The step plan: how many optimizer steps and epochs a run takes, and how far it has got."""

from __future__ import annotations

import math
import time

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from .dataloaders import epoch_dataloader, micro_batches_per_step, padding_waste
from .exact_loss import StepSize

logger = get_logger(__name__)


class StepPlan:
    """How many optimizer steps the run takes, and how far it has got: the step, the epoch, the
    position in the epoch and what has been trained so far (what a checkpoint saves as progress).

    Build it on every rank before `accelerator.prepare`, from the unprepared training dataloader
    (it holds every rank's batches, padded to whole optimizer steps). No method communicates.
    What the steps held stays on the device until `progress` is read (by the log every
    --logging_steps steps, a checkpoint, the results), so counting a step costs no host sync.

    `unit` names what the loss's weight counts ("samples", or "target_tokens" for a language
    model): `facts()` reports `train_<unit>_seen` and `train_<unit>_per_second`, and always the
    samples and (non-padding input) tokens per second, and for token rows the padding of the first
    epoch's batches (`train_padding_waste`: padded positions / real tokens).
    """

    def __init__(self, accelerator: Accelerator, args, train_dataloader, unit: str = "samples"):
        self.accelerator, self.unit = accelerator, unit
        accumulation = accelerator.gradient_accumulation_steps
        self.steps_per_epoch = len(train_dataloader) // (accelerator.num_processes * accumulation)
        self.max_train_steps = args.max_train_steps or args.num_train_epochs * self.steps_per_epoch
        self.num_epochs = math.ceil(self.max_train_steps / self.steps_per_epoch)
        self.examples_per_step = args.per_device_train_batch_size * accelerator.num_processes * accumulation
        self.eval_steps = getattr(args, "eval_steps", None)
        self._progress = {
            "step": 0,
            "epoch": 0,
            "step_in_epoch": 0,
            "trained_weight": 0.0,
            "samples_seen": 0.0,
            "tokens_seen": 0.0,
            "train_time_s": 0.0,
        }
        self._pending = None  # the weight, samples and tokens of the steps not yet read, on the device
        self.padding_waste = padding_waste(train_dataloader)
        self.start_time = time.perf_counter()
        self._step_started = self.start_time
        logger.info(
            f"{self.num_epochs} epochs, {self.max_train_steps} optimizer steps of {self.examples_per_step} examples"
        )

    @property
    def progress(self) -> dict:
        """Where the run stands (what a checkpoint saves). Reading it brings the counts of the
        steps since the last read from the device: one host sync."""
        return self.read()[0]

    def read(self, device_values: torch.Tensor | None = None) -> tuple[dict, torch.Tensor | None]:
        """`progress`, and `device_values` (a float tensor on the device, or None) copied to the
        host in the same sync: the log reads its window's losses with the steps' counts in one.
        The wait for the device to finish the steps counts as training time. No communication."""
        pending = self._pending
        if pending is None and device_values is None:
            return self._progress, None
        parts = [] if pending is None else [pending]
        if device_values is not None:
            parts.append(device_values.reshape(-1).to(parts[0].dtype if parts else torch.float64))
        started = time.perf_counter()
        values = torch.cat(parts).tolist()  # the one host sync
        if pending is not None:
            self._pending = None
            progress = self._progress
            progress["trained_weight"] += values[0]
            progress["samples_seen"] += values[1]
            progress["tokens_seen"] += values[2]
            progress["train_time_s"] += time.perf_counter() - started
            values = values[3:]
        return self._progress, None if device_values is None else torch.tensor(values, dtype=torch.float64).reshape(
            device_values.shape
        )

    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""
        return self._progress["step"]

    @property
    def done(self) -> bool:
        return self._progress["step"] >= self.max_train_steps

    def epochs(self):
        """The epochs still to run (all of them, or those after a resumed checkpoint)."""
        return range(self._progress["epoch"], self.num_epochs)

    def optimizer_steps(self, train_dataloader, epoch: int):
        """This rank's micro-batches of each optimizer step of `epoch` still to take, as lists of
        --gradient_accumulation_steps batches: the prepared dataloader set to the epoch's shuffle,
        past the steps a resumed run already took. No communication: the order is drawn from the
        seed and the epoch alone. It times each step, data loading included, for `advance`."""
        batches = epoch_dataloader(
            self.accelerator, train_dataloader, epoch, steps_done=self._progress["step_in_epoch"]
        )
        self._step_started = time.perf_counter()
        for micro_batches in micro_batches_per_step(batches, self.accelerator.gradient_accumulation_steps):
            yield micro_batches
            self._step_started = time.perf_counter()  # what the loop did after the step (logging, saving) is not timed
        self.read()  # the epoch's last steps finish on the device before its evaluation starts, timed as training

    def advance(self, size: StepSize) -> None:
        """Count an optimizer step just taken: what it held on all ranks (from `count_step`) and
        the seconds since this step's data was asked for. No host sync: on a GPU the seconds of a
        step are those of queueing its work, and the sync when `progress` is next read brings the
        sum back to the work done."""
        counts = torch.stack([size.weight, size.examples, size.tokens]).double()
        self._pending = counts if self._pending is None else self._pending + counts
        progress = self._progress
        progress["step"] += 1
        progress["step_in_epoch"] += 1
        progress["train_time_s"] += time.perf_counter() - self._step_started

    def evaluation_due(self) -> bool:
        """Whether an evaluation is due after the step just taken: every --eval_steps steps, but
        not at an epoch's last step or the run's, where the epoch's own evaluation follows."""
        progress = self._progress
        at_the_end = progress["step_in_epoch"] == self.steps_per_epoch or self.done
        return bool(self.eval_steps) and progress["step"] % self.eval_steps == 0 and not at_the_end

    def end_epoch(self) -> None:
        """Count an epoch as finished (its evaluation done)."""
        self._progress.update(epoch=self._progress["epoch"] + 1, step_in_epoch=0)

    @property
    def fractional_epoch(self) -> float:
        """Epochs done so far, counting the steps of the current one."""
        return round(self._progress["epoch"] + self._progress["step_in_epoch"] / self.steps_per_epoch, 4)

    def facts(self) -> dict:
        """How the run went: world size, steps, what was trained on, throughput, time."""
        progress, accelerator = self.progress, self.accelerator
        seconds = max(progress["train_time_s"], 1e-9)
        facts = {
            "world_size": accelerator.num_processes,
            "distributed_type": accelerator.distributed_type.value,
            "mixed_precision": accelerator.mixed_precision,
            "epochs": progress["epoch"],
            "epochs_trained": round(
                progress["step"] / self.steps_per_epoch, 3
            ),  # the data passed over, a run cut short
            "optimizer_steps": progress["step"],
            "train_samples_seen": int(progress["samples_seen"]),
            "train_tokens_seen": int(progress["tokens_seen"]),
            f"train_{self.unit}_seen": int(progress["trained_weight"]),
            "train_samples_per_second": progress["samples_seen"] / seconds,
            "train_tokens_per_second": progress["tokens_seen"] / seconds,
            f"train_{self.unit}_per_second": progress["trained_weight"] / seconds,
            "train_runtime_s": progress["train_time_s"],
            "wall_time_s": time.perf_counter() - self.start_time,
        }
        if not progress["tokens_seen"]:  # inputs that are not tokens (images)
            del facts["train_tokens_seen"], facts["train_tokens_per_second"]
        if self.padding_waste is not None:
            facts["train_padding_waste"] = self.padding_waste
        return facts
