"""Loading data once for all ranks, and sharding it so no example is lost or counted twice."""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch.utils.data import DataLoader

from .launch import UsageError

# File extension -> the `datasets` builder that reads it.
_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}

SAMPLE_WEIGHT = "sample_weight"  # 1.0 for a real example, 0.0 for a filler that evens out the shards


def load_on_main_first(accelerator: Accelerator, load, *args, **kwargs):
    """Run `load(*args, **kwargs)` on the main process first, then on the others. All ranks call it.

    This is `accelerator.main_process_first()` (the main process downloads and fills the
    caches, the others then read them) made safe: if `load` raises on the main process, the
    other ranks are told and raise the same error at once, instead of waiting at the barrier
    until the distributed timeout.
    """
    error = None
    if accelerator.is_main_process:
        try:
            result = load(*args, **kwargs)
        except Exception as exc:  # reported to every rank below
            error = exc
    if accelerator.num_processes > 1:
        # [is a UsageError, message] from the main process; [False, None] when it succeeded.
        report = [isinstance(error, UsageError), None if error is None else str(error) or type(error).__name__]
        broadcast_object_list(report)
        is_usage, message = report
        if not accelerator.is_main_process and message is not None:
            raise UsageError(message) if is_usage else RuntimeError(f"the main process failed to load: {message}")
    if error is not None:
        raise error
    if not accelerator.is_main_process:
        result = load(*args, **kwargs)
    return result


def read_data_files(data_files: dict[str, str]):
    """Read local CSV/TSV, JSON/JSONL, Parquet or text files into a `DatasetDict`, with a clear
    error for a missing, empty or unparsable file. `data_files` maps split name -> path."""
    import datasets

    splits = {}
    for split, path in data_files.items():
        if not os.path.isfile(path):
            raise UsageError(f"--{split}_file {path!r} does not exist; give the path of a CSV, JSON/JSONL or Parquet file")
        extension = os.path.splitext(path)[1].lower()
        if extension not in _BUILDERS:
            raise UsageError(f"--{split}_file {path!r}: unknown extension {extension!r}; use one of {sorted(_BUILDERS)}")
        if os.path.getsize(path) == 0:
            raise UsageError(f"--{split}_file {path!r} is empty; it needs a header and at least one example")
        builder_kwargs = {"delimiter": "\t"} if extension == ".tsv" else {}
        try:
            dataset = datasets.load_dataset(_BUILDERS[extension], data_files={split: path}, split=split, **builder_kwargs)
        except Exception as exc:
            raise UsageError(f"--{split}_file {path!r} could not be parsed as {_BUILDERS[extension]}: {_first_line(exc)}") from exc
        if len(dataset) == 0:
            raise UsageError(f"--{split}_file {path!r} holds no examples")
        splits[split] = dataset
    return datasets.DatasetDict(splits)


def _first_line(exc: BaseException) -> str:
    while exc.__cause__ is not None or exc.__context__ is not None:  # the root cause names the problem
        exc = exc.__cause__ or exc.__context__
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


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


def make_train_dataloader(dataset, *, batch_size: int, num_processes: int, collate_fn) -> DataLoader:
    """The training DataLoader, before `accelerator.prepare`: shuffled (Accelerate replaces the
    sampler with its seedable one), evened out with `pad_to_even_shards`. Every rank calls it
    with the same arguments."""
    dataset = pad_to_even_shards(dataset, batch_size * num_processes)
    return DataLoader(dataset, shuffle=True, batch_size=batch_size, collate_fn=collate_fn)


def global_mean_loss(per_example_loss: torch.Tensor, weights: torch.Tensor, accelerator: Accelerator) -> torch.Tensor:
    """The mean loss over the real examples of the whole global batch (all ranks). All ranks call it
    on every micro-batch (one scalar all-reduce).

    DDP averages gradients over the ranks, so each rank's share is scaled by the number of
    processes; filler examples (weight 0.0) contribute nothing, and a rank whose batch holds only
    fillers still takes part in the gradient all-reduce, so no rank waits for another.
    """
    weights = weights.to(per_example_loss.dtype)
    global_count = accelerator.reduce(weights.sum().detach(), reduction="sum")
    return (per_example_loss * weights).sum() * accelerator.num_processes / global_count.clamp(min=1.0)
