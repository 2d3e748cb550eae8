"""The training order: the data padded to whole optimizer steps, shuffled from (seed, epoch)
alone, and dealt to the ranks, so no example is lost or counted twice and the examples of each
optimizer step do not depend on how many processes share it. Nothing here communicates.
"""

from __future__ import annotations

import signal

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from .checkpoint import PreemptionHandler

SAMPLE_WEIGHT = "sample_weight"  # 1.0 for a real example, 0.0 for a filler that evens out the shards
EPOCH = "epoch"  # in the rows of make_train_dataloader(epoch_in_rows=True): the epoch they are drawn for


def pad_to_even_shards(dataset, multiple: int):
    """Append filler examples (copies of the first ones, weight 0.0) so the dataset's length is
    a multiple of `multiple` = processes x per-device batch size, and add a `sample_weight` column.

    Accelerate evens out the shards itself by repeating examples on some ranks, which trains
    those examples twice in that epoch. With the length a multiple of the global batch, every
    rank gets the same number of full batches, every real example appears exactly once per
    epoch, and the fillers weigh nothing in `global_mean_loss`.
    """
    import datasets

    real = len(dataset)
    fillers = -real % multiple
    weights = [1.0] * real + [0.0] * fillers
    if fillers:
        filler_rows = dataset.select([i % real for i in range(fillers)])
        dataset = datasets.concatenate_datasets([dataset, filler_rows])
    return dataset.add_column(SAMPLE_WEIGHT, weights)


class StepAlignedSampler(torch.utils.data.Sampler):
    """The training order for a dataset from `pad_to_even_shards`: each epoch, the real examples in
    a fresh order drawn from (seed, epoch) alone, so the examples of each optimizer step do not
    depend on how the global batch is split over processes and micro-batches.

    Every optimizer step but the last is all real examples. In the last, partial one, the real
    examples are dealt out evenly over its micro-batches on every rank and the fillers take the
    remaining slots (Accelerate gives rank r batch j of the order when j % num_processes == r),
    so that dropping the fillers (`make_train_dataloader` does) balances the ranks' work.

    With `lengths` (tokens per example), the shuffled order is cut into groups of `group_steps`
    optimizer steps; each group is sorted by length, cut into its steps, and the steps shuffled
    again, so every micro-batch holds examples of about one length and pads little. A global
    step is still formed before it is dealt to the ranks, from (seed, epoch) alone.
    """

    def __init__(
        self,
        num_real: int,
        num_total: int,
        batch_size: int,
        num_processes: int,
        accumulation: int,
        seed: int,
        lengths: list[int] | None = None,
        group_steps: int = 16,
    ):
        self.num_real, self.num_total, self.seed, self.epoch = num_real, num_total, seed, 0
        self.batch_size, self.micro_batches_per_step = batch_size, num_processes * accumulation
        self.lengths, self.group_steps = lengths, group_steps

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_total

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.num_real, generator=generator).tolist()
        step_size = self.batch_size * self.micro_batches_per_step
        full = self.num_real - self.num_real % step_size
        if self.lengths is not None:
            order[:full] = self._grouped_by_length(order[:full], step_size, generator)
        tail, last_step = order[full:], [None] * step_size if full < self.num_real else []
        for i, index in enumerate(tail):  # the i-th goes to micro-batch i % n, row i // n of it
            last_step[(i % self.micro_batches_per_step) * self.batch_size + i // self.micro_batches_per_step] = index
        fillers = iter(range(self.num_real, self.num_total))
        return iter(order[:full] + [next(fillers) if index is None else index for index in last_step])

    def _grouped_by_length(self, order: list[int], step_size: int, generator: torch.Generator) -> list[int]:
        grouped, group_size = [], step_size * self.group_steps
        for start in range(0, len(order), group_size):
            # Longest first within a group; ties keep the shuffled order (a stable sort).
            group = sorted(order[start : start + group_size], key=lambda index: -self.lengths[index])
            steps = [group[i : i + step_size] for i in range(0, len(group), step_size)]
            # Not always the longest steps first: that would put every group's peak memory and
            # its largest gradients at the same place in the epoch.
            for k in torch.randperm(len(steps), generator=generator).tolist():
                grouped += steps[k]
        return grouped


class _WithoutFillers:
    """Collate only the real rows of a micro-batch (one filler if it has none, so that the rank
    still takes part in the gradient all-reduce): fillers weigh nothing, so computing them is waste.
    A class, not a closure, so that loader workers started with `spawn` can unpickle it."""

    def __init__(self, collate_fn):
        self.collate_fn = collate_fn

    def __call__(self, rows):
        real = [row for row in rows if row[SAMPLE_WEIGHT] > 0]
        return self.collate_fn(real or rows[:1])


def _leave_signals_to_the_training_process(worker_id: int) -> None:
    """A loader worker's start: ignore SIGTERM and SIGUSR1. A preemption signal often reaches every
    process of a job (torchrun signals each rank's process group; SLURM signals the job step), and
    a worker killed by it makes the training process fail instead of saving its checkpoint (seen
    in a test). The training process stops the workers itself; so does their watchdog if it dies."""
    for signum in PreemptionHandler.SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


class _EpochTaggedSampler(torch.utils.data.Sampler):
    """`sampler`'s order as (epoch, index) pairs. The epoch travels with each index to the loader's
    workers: a persistent worker keeps the collate function it started with, so an epoch set on
    that in the training process would never reach it."""

    def __init__(self, sampler: StepAlignedSampler):
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        epoch = self.sampler.epoch
        return ((epoch, index) for index in self.sampler)


class _EpochTaggedRows(torch.utils.data.Dataset):
    """`dataset` read by (epoch, index): the row, with its epoch under EPOCH."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        return {**self.dataset[index], EPOCH: epoch}

    def __getitems__(self, keys):
        indices = [index for _, index in keys]
        read_rows = getattr(self.dataset, "__getitems__", None)  # one read per batch (datasets.Dataset has it)
        rows = read_rows(indices) if read_rows else [self.dataset[index] for index in indices]
        return [{**row, EPOCH: epoch} for row, (epoch, _) in zip(rows, keys)]


def make_train_dataloader(
    dataset, args, accelerator: Accelerator, collate_fn, *, epoch_in_rows: bool = False, group_steps: int = 16
) -> DataLoader:
    """The training DataLoader, before `accelerator.prepare`: padded by `pad_to_even_shards` to
    whole optimizer steps, so every rank takes the same number of micro-batches and every optimizer
    step has all of its micro-batches; shuffled each epoch by `StepAlignedSampler` (from the
    Accelerator's data seed), grouped by the length of `input_ids` with --group_by_length; fillers
    dropped from the batches. Every rank calls it with the same arguments (no communication).

    `args` gives --per_device_train_batch_size, --group_by_length (if the script has it) and
    --num_workers: processes per rank that load and collate batches (persistent across epochs;
    pinned memory on CUDA, for copies that do not wait). With `epoch_in_rows`, every row reaches
    `collate_fn` with its epoch under EPOCH, so random draws made there (augmentation) can be
    seeded from (seed, epoch, example) in any worker."""
    batch_size, num_workers = args.per_device_train_batch_size, args.num_workers
    accumulation = accelerator.gradient_accumulation_steps
    lengths = token_lengths(dataset) if getattr(args, "group_by_length", False) else None
    padded = pad_to_even_shards(dataset, batch_size * accelerator.num_processes * accumulation)
    seed = accelerator.dataloader_config.data_seed or 0
    sampler = StepAlignedSampler(
        len(dataset),
        len(padded),
        batch_size,
        accelerator.num_processes,
        accumulation,
        seed,
        lengths=lengths,
        group_steps=group_steps,
    )
    if epoch_in_rows:
        padded, sampler = _EpochTaggedRows(padded), _EpochTaggedSampler(sampler)
    # Its own generator: starting an iterator draws a seed from the loader's generator, which would
    # otherwise be the global torch RNG, and a run resumed mid-epoch (one extra iterator) would then
    # draw different dropout masks.
    return DataLoader(
        padded,
        sampler=sampler,
        batch_size=batch_size,
        collate_fn=_WithoutFillers(collate_fn),
        generator=torch.Generator().manual_seed(0),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=accelerator.device.type == "cuda",
        worker_init_fn=_leave_signals_to_the_training_process if num_workers else None,
    )


def make_eval_dataloader(dataset, args, collate_fn) -> DataLoader:
    """An evaluation DataLoader of --per_device_eval_batch_size, longest first when the rows are
    token sequences (`longest_first`). Prepare it with the Accelerator. No communication."""
    if "input_ids" in dataset.column_names:
        dataset = longest_first(dataset)
    return DataLoader(dataset, batch_size=args.per_device_eval_batch_size, collate_fn=collate_fn)


def token_lengths(dataset, column: str = "input_ids") -> np.ndarray:
    """The length of each row's `column` (a list of token ids), read with Arrow's vectorised list
    lengths: never a Python loop over the token lists."""
    import pyarrow.compute as pc

    return pc.list_value_length(dataset.with_format("arrow")[column]).to_numpy(zero_copy_only=False)


def longest_first(dataset, column: str = "input_ids"):
    """`dataset` reordered by the length of `column`, longest first, for evaluation: batches of
    one length pad little, and the first batch shows the peak memory. Evaluation results must be
    gathered by example (an index column, or order-free sums). No communication."""
    return dataset.select(np.argsort(-token_lengths(dataset, column), kind="stable"))


def padding_waste(train_dataloader) -> float | None:
    """Padded positions / real tokens in the first epoch of an unprepared training dataloader from
    `make_train_dataloader` over rows of `input_ids`: its sampler's order, cut into per-device
    batches, each padded to its longest row (fillers dropped), as training does; None for rows
    that are not token sequences. Any rank may call it (no communication)."""
    dataset = getattr(train_dataloader.dataset, "dataset", train_dataloader.dataset)  # under _EpochTaggedRows
    if "input_ids" not in getattr(dataset, "column_names", ()):
        return None
    sampler, batch_size = train_dataloader.sampler, train_dataloader.batch_size
    sampler = getattr(sampler, "sampler", sampler)  # under _EpochTaggedSampler
    lengths = token_lengths(dataset).astype(np.int64)
    order = np.fromiter(iter(sampler), dtype=np.int64, count=len(sampler))
    rows = np.where(order < sampler.num_real, lengths[order], 0).reshape(-1, batch_size)  # fillers: length 0
    padded = (rows.max(axis=1, keepdims=True) - rows)[rows > 0].sum()
    return float(padded / max(rows.sum(), 1))


def epoch_dataloader(accelerator: Accelerator, dataloader, epoch: int, steps_done: int = 0):
    """The prepared training dataloader set for `epoch` (its own shuffle, the same on every rank)
    and, when resuming mid-epoch, past the `steps_done` optimizer steps already taken. No
    communication: every rank skips the same steps on its own.

    The skip is counted in micro-batches (steps x accumulation), and it skips sampler indices
    without loading data. `StepAlignedSampler` draws the epoch's order from seed + epoch
    alone, so the resumed run sees exactly the batches the uninterrupted run would have.
    """
    dataloader.set_epoch(epoch)
    if steps_done:
        skipping = accelerator.skip_first_batches(dataloader, steps_done * accelerator.gradient_accumulation_steps)
        skipping.set_epoch(epoch)
        # Accelerate 1.15 builds the skipping loader without the prepared one's non-blocking copies.
        skipping._non_blocking = getattr(dataloader, "_non_blocking", False)
        dataloader = skipping
    return dataloader


def micro_batches_per_step(batches, accumulation: int):
    """Group a rank's batches into lists of `accumulation` micro-batches, one list per optimizer
    step. No communication. The dataloader of `make_train_dataloader` always holds whole steps;
    anything else is a bug, refused here rather than trained as a short step."""
    micro_batches = []
    for batch in batches:
        micro_batches.append(batch)
        if len(micro_batches) == accumulation:
            yield micro_batches
            micro_batches = []
    if micro_batches:
        raise RuntimeError(
            f"{len(micro_batches)} micro-batches left over: build the dataloader with make_train_dataloader, "
            "which pads the data to whole optimizer steps"
        )
