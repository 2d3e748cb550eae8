"""Evaluation across processes: gather per-example results exactly once, compute metrics locally."""

from __future__ import annotations

import os

import numpy as np
import torch
from accelerate import Accelerator

from .errors import UsageError

METRICS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics")  # installed with the package


def load_metric(name: str):
    """Load the `evaluate` module `ddp_utils/metrics/<name>.py` shipped in this package (no Hub needed).

    Kept in memory, so each rank may compute it without sharing a cache file. Any rank may call it.
    """
    import evaluate

    path = os.path.join(METRICS_DIR, f"{name}.py")
    if not os.path.isfile(path):
        raise UsageError(f"metric {name!r} not found: expected the evaluate module {path}")
    return evaluate.load(path, keep_in_memory=True)


@torch.no_grad()
def gather_for_eval(accelerator: Accelerator, model, dataloader, step) -> dict[str, np.ndarray]:
    """All ranks call this (a gather per batch): run `step(model, batch) -> {name: tensor with one
    row per example}` over a prepared eval dataloader and return, on every rank, each name's rows
    from all ranks, concatenated as NumPy.

    `gather_for_metrics` drops the examples Accelerate repeats to even
    out the last batches, so N examples give exactly N rows, whatever the number of processes.
    """
    was_training = model.training  # an evaluation in the middle of an epoch hands the model back to training
    model.eval()
    gathered: dict[str, list[np.ndarray]] = {}
    for batch in dataloader:
        outputs = step(model, batch)
        outputs = accelerator.gather_for_metrics(outputs)
        for name, value in outputs.items():
            gathered.setdefault(name, []).append(
                value.detach().float().cpu().numpy() if value.is_floating_point() else value.cpu().numpy()
            )
    model.train(was_training)
    return {name: np.concatenate(chunks) for name, chunks in gathered.items()}
