"""Evaluation across processes: gather per-example results exactly once, compute metrics locally; and
the score that ranks checkpoints, checked against the scores the evaluation gives."""

from __future__ import annotations

import os

import numpy as np
import torch
from accelerate import Accelerator

from ..core.errors import UsageError

METRICS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics")  # installed with the package


def load_metric(name: str):
    """Load the `evaluate` module `ddp_utils/data/metrics/<name>.py` shipped in this package (no Hub needed).

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


def check_metric_for_best_model(args, scores, default: str | None = None) -> None:
    """Check --metric_for_best_model (`default` when not given) against `scores`, the eval_* names
    this run's evaluation gives, and settle it: the Trainer's names work (`accuracy` means
    `eval_accuracy`), a name the evaluation never gives is a `UsageError` that lists the ones it
    does, and --greater_is_better defaults as the Trainer's does (lower wins for a loss; here also
    for a perplexity). Every rank calls it before training (no communication); None ranks nothing."""
    name = args.metric_for_best_model = args.metric_for_best_model or default
    if name is None:
        return
    full = name if name.startswith("eval_") else f"eval_{name}"
    if full not in scores:
        given = ", ".join(score.removeprefix("eval_") for score in scores) or "no scores, with these options"
        raise UsageError(
            f"--metric_for_best_model {name!r} is not a score of this script's evaluation, so no checkpoint would "
            f"be ranked; it gives {given} (with or without the eval_ prefix)"
        )
    args.metric_for_best_model = full
    if args.greater_is_better is None:
        args.greater_is_better = not full.endswith(("loss", "perplexity"))
