"""The step plan: how many optimizer steps and epochs a run takes, and how far it has got."""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from ..data.dataloaders import epoch_dataloader, micro_batches_per_step, padding_waste, training_order_identity
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
        self.generators = random_generators(accelerator.device)  # what the micro-batches seed (dropout)
        self.padding_waste = padding_waste(train_dataloader)
        self.training_order = training_order_identity(train_dataloader)  # what a resume must match besides the seed
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
        --gradient_accumulation_steps batches (`SeededMicroBatches`: iterating them seeds the dropout
        masks): the prepared dataloader set to the epoch's shuffle, past the steps a resumed run
        already took. None once the run has taken its --max_train_steps: a run resumed from its last
        step's checkpoint then evaluates and ends as the uninterrupted run did after that step (it took
        a step more). No communication: the order is drawn from the seed and the epoch alone. It
        times each step, data loading included, for `advance`."""
        if self.done:
            return
        batches = epoch_dataloader(
            self.accelerator, train_dataloader, epoch, steps_done=self._progress["step_in_epoch"]
        )
        self._step_started = time.perf_counter()
        seed = self.accelerator.dataloader_config.data_seed or 0
        rank, world_size = self.accelerator.process_index, self.accelerator.num_processes
        for micro_batches in micro_batches_per_step(batches, self.accelerator.gradient_accumulation_steps):
            yield SeededMicroBatches(micro_batches, seed, self._progress["step"], rank, world_size, self.generators)
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


class SeededMicroBatches(list):
    """This rank's micro-batches of one optimizer step. Iterating them seeds torch's random number
    generators (CPU and GPU) before each micro-batch from (seed, step, the micro-batch's place in
    the global step) alone, so the dropout masks of a micro-batch do not depend on the layout:

    the global step's micro-batches are the same sets in the same order on any layout with the same
    per-device batch (`StepAlignedSampler`; Accelerate gives rank r the micro-batches r, r + N,
    r + 2N, ... of the step on N processes), so 1 process with accumulation, N processes, and a
    resume on another layout draw the same masks as the uninterrupted run, and train the same
    model. A micro-batch split by --oom_backoff draws new masks. Seeding costs about 8 microseconds
    per micro-batch (bench/bench_seeding.py). No communication."""

    def __init__(self, micro_batches, seed: int, step: int, rank: int, world_size: int, generators=None):
        super().__init__(micro_batches)
        self.seed, self.step, self.rank, self.world_size = seed, step, rank, world_size
        self.generators = generators
        self.iteration = 0

    def with_batches(self, batches: list, iteration: int = 0) -> SeededMicroBatches:
        """`batches` in place of these micro-batches, one for one (GRPO's samples of their prompts), seeded as
        these are; each further `iteration` over the same batches draws other masks. No communication."""
        seeded = SeededMicroBatches(batches, self.seed, self.step, self.rank, self.world_size, self.generators)
        seeded.iteration = iteration
        return seeded

    def __iter__(self):
        for k, batch in enumerate(super().__iter__()):
            seed = micro_batch_seed(self.seed, self.step, k * self.world_size + self.rank, self.iteration)
            if self.generators is None:
                torch.manual_seed(seed)  # every backend's generators: about 110 microseconds
            else:
                for generator in self.generators:
                    generator.manual_seed(seed)
            yield batch


def random_generators(device: torch.device) -> list | None:
    """The default random generators that a forward pass on `device` draws from: the CPU's, and the
    device's own on a GPU; None where only `torch.manual_seed` reaches it."""
    if device.type == "cpu":
        return [torch.default_generator]
    if device.type == "cuda":
        torch.cuda.init()  # fills torch.cuda.default_generators (a no-op once CUDA is up)
        return [torch.default_generator, torch.cuda.default_generators[device.index or 0]]
    return None


def micro_batch_seed(seed: int, step: int, place: int, iteration: int = 0) -> int:
    """The seed of the micro-batch at `place` in optimizer step `step` (0-based) of a run seeded
    with `seed` (and its pass over the same batch, for GRPO's --num_iterations): mixed by NumPy's
    SeedSequence, so nearby triples draw unrelated streams."""
    entropy = [seed, step, place] + ([iteration] if iteration else [])
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] % 2**63)
