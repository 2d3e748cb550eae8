"""The training order: the data padded to whole optimizer steps, shuffled from (seed, epoch)
alone, and dealt to the ranks, so no example is lost or counted twice and the examples of each
optimizer step do not depend on how many processes share it. Nothing here communicates.
"""

from __future__ import annotations

import hashlib
import signal

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from ..core.errors import PREEMPTION_SIGNALS

SAMPLE_WEIGHT = "sample_weight"  # 1.0 for a real example, 0.0 for a filler that evens out the shards
EPOCH = "epoch"  # in the rows of make_train_dataloader(epoch_in_rows=True): the epoch they are drawn for


class StepAlignedSampler(torch.utils.data.Sampler):
    """The training order: each epoch, `num_real` examples in a fresh order drawn from (seed,
    epoch) alone, padded with filler indices (`num_real` and up; `_TrainingRows` gives them weight
    0.0) to whole optimizer steps of `batch_size` x `num_processes` x `accumulation` examples, so the
    examples of each optimizer step do not depend on how the global batch is split over processes
    and micro-batches, and every real example comes once per epoch.

    Accelerate evens out the shards itself by repeating examples on some ranks, which trains them
    twice in that epoch; here every rank gets the same number of whole steps instead. In the last,
    partial step, the real examples are dealt out evenly over its micro-batches on every rank and
    the fillers take the remaining slots (Accelerate gives rank r batch j of the order when
    j % num_processes == r), so that dropping the fillers (`make_train_dataloader` does) balances
    the ranks' work.

    With `lengths` (tokens per example), the shuffled order is cut into groups of `group_steps`
    optimizer steps; each group is sorted by length, cut into its steps, and the steps shuffled
    again, so every micro-batch holds examples of about one length and pads little. Each step's
    rows, longest first, are then dealt round-robin over its micro-batches, so every micro-batch
    (and rank) gets the same mix of lengths. A global step is still formed before it is dealt,
    from (seed, epoch) alone. The order is a NumPy array of indices: a few bytes per example.
    """

    def __init__(
        self,
        num_real: int,
        batch_size: int,
        num_processes: int,
        accumulation: int,
        seed: int,
        lengths: np.ndarray | None = None,
        group_steps: int = 16,
    ):
        self.num_real, self.seed, self.epoch = num_real, seed, 0
        self.batch_size, self.micro_batches_per_step = batch_size, num_processes * accumulation
        self.step_size = batch_size * self.micro_batches_per_step
        self.num_total = num_real + (-num_real % self.step_size)
        self.lengths, self.group_steps = None if lengths is None else np.asarray(lengths), group_steps

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_total

    def __iter__(self):
        return map(int, self.order())

    def order(self) -> np.ndarray:
        """This epoch's indices, in training order (fillers are `num_real` and up)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.num_real, generator=generator).numpy()
        full = self.num_real - self.num_real % self.step_size
        if self.lengths is not None and full:
            order[:full] = self._grouped_by_length(order[:full], generator)
        # The last step: the i-th real example goes to micro-batch i % n, row i // n of it.
        tail, slots = order[full:], np.arange(self.num_real, self.num_total)
        if len(tail):
            i = np.arange(len(tail))
            position = (i % self.micro_batches_per_step) * self.batch_size + i // self.micro_batches_per_step
            filler = np.ones(self.step_size, dtype=bool)
            filler[position] = False
            last = np.empty(self.step_size, dtype=order.dtype)
            last[position], last[filler] = tail, slots[: filler.sum()]
            tail = last
        return np.concatenate([order[:full], tail])

    def _grouped_by_length(self, order: np.ndarray, generator: torch.Generator) -> np.ndarray:
        step, micro = self.step_size, self.micro_batches_per_step
        steps = []
        for start in range(0, len(order), step * self.group_steps):
            group = order[start : start + step * self.group_steps]
            # Longest first within a group; ties keep the shuffled order (a stable sort).
            group = group[np.argsort(-self.lengths[group], kind="stable")].reshape(-1, step)
            # Not always the longest steps first: that would put every group's peak memory and
            # its largest gradients at the same place in the epoch.
            steps.append(group[torch.randperm(len(group), generator=generator).numpy()])
        steps = np.concatenate(steps)
        # Row r of a sorted step goes to micro-batch r % micro: the ranks get the same mix of lengths.
        return steps.reshape(-1, self.batch_size, micro).transpose(0, 2, 1).reshape(-1)


class _TrainingRows(torch.utils.data.Dataset):
    """`dataset` read by the indices of a `StepAlignedSampler`: a real example with weight 1.0 under
    SAMPLE_WEIGHT, or for a filler index (`num_real` and up) a copy of an early example with weight
    0.0. With `with_epoch`, each key is an (epoch, index) pair and the row carries its epoch under
    EPOCH: a persistent loader worker keeps the collate function it started with, so an epoch set
    in the training process would never reach it. A class, not a closure, so that loader workers
    started with `spawn` can unpickle it."""

    def __init__(self, dataset, num_real: int, num_total: int, with_epoch: bool = False):
        self.dataset, self.num_real, self.num_total, self.with_epoch = dataset, num_real, num_total, with_epoch

    def __len__(self) -> int:
        return self.num_total

    def __getitem__(self, key):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys):
        epochs, indices = zip(*keys) if self.with_epoch else (None, keys)
        rows_at = [index if index < self.num_real else (index - self.num_real) % self.num_real for index in indices]
        read_rows = getattr(self.dataset, "__getitems__", None)  # one read per batch (datasets.Dataset has it)
        rows = read_rows(rows_at) if read_rows else [self.dataset[i] for i in rows_at]
        for n, (row, index) in enumerate(zip(rows, indices)):
            row[SAMPLE_WEIGHT] = 1.0 if index < self.num_real else 0.0
            if self.with_epoch:
                row[EPOCH] = epochs[n]
        return rows


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
    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


class _EpochTaggedSampler(torch.utils.data.Sampler):
    """`sampler`'s order as (epoch, index) pairs. The epoch travels with each index to the loader's
    workers (see `_TrainingRows`)."""

    def __init__(self, sampler: StepAlignedSampler):
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        epoch = self.sampler.epoch
        return ((epoch, index) for index in self.sampler)


def make_train_dataloader(
    dataset,
    args,
    accelerator: Accelerator,
    collate_fn,
    *,
    epoch_in_rows: bool = False,
    group_steps: int = 16,
    length_column: str = "input_ids",
) -> DataLoader:
    """The training DataLoader, before `accelerator.prepare`: padded with weightless fillers to
    whole optimizer steps, so every rank takes the same number of micro-batches and every optimizer
    step has all of its micro-batches; shuffled each epoch by `StepAlignedSampler` (from the
    Accelerator's data seed), grouped by the length of `input_ids` with --group_by_length; fillers
    dropped from the batches. Every rank calls it with the same arguments (no communication).
    `length_column`: what --group_by_length sorts by (token lists, or a column of lengths).

    `args` gives --per_device_train_batch_size, --group_by_length (if the script has it) and
    --num_workers: processes per rank that load and collate batches (persistent across epochs;
    pinned memory on CUDA, for copies that do not wait). With `epoch_in_rows`, every row reaches
    `collate_fn` with its epoch under EPOCH, so random draws made there (augmentation) can be
    seeded from (seed, epoch, example) in any worker."""
    batch_size, num_workers = args.per_device_train_batch_size, args.num_workers
    lengths = token_lengths(dataset, length_column) if getattr(args, "group_by_length", False) else None
    seed = accelerator.dataloader_config.data_seed or 0
    layout = (batch_size, accelerator.num_processes, accelerator.gradient_accumulation_steps)
    sampler = StepAlignedSampler(len(dataset), *layout, seed, lengths=lengths, group_steps=group_steps)
    rows = _TrainingRows(dataset, len(dataset), len(sampler), with_epoch=epoch_in_rows)
    if epoch_in_rows:
        sampler = _EpochTaggedSampler(sampler)
    # Its own generator: starting an iterator draws a seed from the loader's generator, which would
    # otherwise be the global torch RNG, and a run resumed mid-epoch (one extra iterator) would then
    # draw different dropout masks.
    return DataLoader(
        rows,
        sampler=sampler,
        batch_size=batch_size,
        collate_fn=_WithoutFillers(collate_fn),
        generator=torch.Generator().manual_seed(0),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=accelerator.device.type == "cuda",
        worker_init_fn=_leave_signals_to_the_training_process if num_workers else None,
    )


def training_order_identity(train_dataloader) -> dict:
    """What the epochs' order of an unprepared training dataloader from `make_train_dataloader` is
    drawn from, besides the seed and the global batch (a checkpoint records those itself): the
    number of training examples, and with --group_by_length a digest of their lengths (None
    without). A run resumed mid-epoch with other ones would train some examples of that epoch
    again and others never. Any rank may call it (no communication)."""
    sampler = getattr(train_dataloader.sampler, "sampler", train_dataloader.sampler)  # under _EpochTaggedSampler
    lengths = None
    if sampler.lengths is not None:
        digest = hashlib.sha1(f"{sampler.group_steps} steps per group;".encode())
        digest.update(np.ascontiguousarray(sampler.lengths, dtype=np.int64).tobytes())
        lengths = digest.hexdigest()[:16]
    return {"train_examples": sampler.num_real, "train_lengths": lengths}


def pad_multiple(accelerator: Accelerator) -> int | None:
    """What a batch's length is padded to a multiple of: 8 under mixed precision (tensor cores want multiples of 8,
    and fewer lengths mean fewer cuDNN attention graphs and recompiles), None in fp32. No communication."""
    return 8 if accelerator.mixed_precision != "no" else None


def make_eval_dataloader(dataset, args, collate_fn, length_column: str = "input_ids") -> DataLoader:
    """An evaluation DataLoader of --per_device_eval_batch_size, longest first when the rows are
    token sequences (`longest_first` by `length_column`). Prepare it with the Accelerator. No
    communication."""
    if length_column in dataset.column_names:
        dataset = longest_first(dataset, length_column)
    return DataLoader(dataset, batch_size=args.per_device_eval_batch_size, collate_fn=collate_fn)


def token_lengths(dataset, column: str = "input_ids") -> np.ndarray:
    """The length of each row's `column` (a list of token ids; a column of numbers is taken as the
    lengths), read with Arrow's vectorised list lengths: never a Python loop over the token lists."""
    import pyarrow.compute as pc

    values = dataset.with_format("arrow")[column]
    if not str(values.type).startswith(("list", "large_list")):
        return values.to_numpy(zero_copy_only=False)
    return pc.list_value_length(values).to_numpy(zero_copy_only=False)


def longest_first(dataset, column: str = "input_ids"):
    """`dataset` reordered by the length of `column`, longest first, for evaluation: batches of
    one length pad little, and the first batch shows the peak memory. Evaluation results must be
    gathered by example (an index column, or order-free sums). No communication."""
    return dataset.select(np.argsort(-token_lengths(dataset, column), kind="stable"))


def padding_waste(train_dataloader) -> float | None:
    """Padded positions / real tokens in the first epoch of an unprepared training dataloader from
    `make_train_dataloader` over rows of `input_ids`: its sampler's order, cut into per-device
    batches, each padded to its longest row (fillers dropped), as training does; None for rows
    that are not token sequences. Computed with NumPy from the token lengths. Any rank may call it
    (no communication)."""
    rows = train_dataloader.dataset
    if "input_ids" not in getattr(rows.dataset, "column_names", ()):
        return None
    sampler = getattr(train_dataloader.sampler, "sampler", train_dataloader.sampler)  # under _EpochTaggedSampler
    lengths = np.append(token_lengths(rows.dataset).astype(np.int64), 0)  # index -1: a filler, length 0
    order = sampler.order()
    batches = lengths[np.where(order < sampler.num_real, order, -1)].reshape(-1, train_dataloader.batch_size)
    padded = (batches.max(axis=1, keepdims=True) - batches)[batches > 0].sum()
    return float(padded / max(batches.sum(), 1))


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
