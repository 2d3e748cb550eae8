"""`train.py`'s multi-label classification: a label column of lists (GoEmotions' sequence of class labels, JSON
lists of names, or multi-hot vectors of 0 and 1), one output per label trained by its binary cross-entropy (in the
script's training step), scored over the whole eval set by exact match and micro and macro F1."""

from __future__ import annotations

import numpy as np
import torch.nn.functional as F
from accelerate import Accelerator

from ..core.errors import UsageError
from .dataloaders import SAMPLE_WEIGHT
from .evaluation import gather_for_eval

MULTI_LABEL_SCORES = ("eval_loss", "eval_exact_match", "eval_f1_micro", "eval_f1_macro")  # `evaluate_multi_label`


def holds_lists(dataset, column: str) -> bool:
    """Whether `column` holds lists (GoEmotions' sequence of class labels, a JSON list of label names)."""
    import datasets

    return isinstance(dataset.features[column], (datasets.List, datasets.LargeList))


def multi_label_mapping(raw, label_column: str):
    """(label names in id order, function mapping a raw list of labels to its multi-hot vector of floats) for a
    column of lists (an empty list: no label): the names of a sequence of `ClassLabel`; for vectors already
    multi-hot (floats or booleans, or integers 0 and 1, all of one length), LABEL_0, LABEL_1, ... (name them in the
    DATA section); else the sorted distinct items of the training lists. A UsageError for a column that is not
    lists in every split, a missing item, a validation label never seen in training, or fewer than two labels. Any
    rank may call it."""
    import datasets
    import pyarrow.compute as pc

    columns = {}
    for split in ("train", "validation"):
        if not holds_lists(raw[split], label_column):
            raise UsageError(
                f"multi-label classification needs a list of labels per example in {label_column!r}, and the {split} "
                f'data holds {raw[split].features[label_column]}; give lists (e.g. ["sports", "tech"], or [])'
            )
        columns[split] = raw[split].with_format("arrow")[label_column]
        missing = pc.sum(pc.list_flatten(columns[split]).is_null()).as_py() or 0
        if missing:
            raise UsageError(f"{missing} items of the {split} label lists in {label_column!r} are null; drop them")
    items = {split: pc.unique(pc.list_flatten(column)).to_pylist() for split, column in columns.items()}
    lengths = {length for column in columns.values() for length in pc.unique(pc.list_value_length(column)).to_pylist()}
    feature = raw["train"].features[label_column].feature
    dtype = getattr(feature, "dtype", "")
    if isinstance(feature, datasets.Value) and (
        dtype.startswith("float") or dtype == "bool" or (set(items["train"]) <= {0, 1} and len(lengths) == 1)
    ):
        if len(lengths) != 1:
            raise UsageError(
                f"{label_column!r} holds multi-hot vectors of different lengths {sorted(lengths)[:5]}; give every "
                "example one 0 or 1 per label, or lists of label names"
            )
        names = [f"LABEL_{i}" for i in range(lengths.pop())]
        if len(names) < 2:
            raise UsageError(f"{label_column!r} holds one value per example: a single-label task, not multi-label")
        return names, lambda values: [float(value) for value in values]
    if isinstance(feature, datasets.ClassLabel):
        names, index = feature.names, list(range(len(feature.names)))
    else:
        names = sorted(items["train"], key=lambda v: (isinstance(v, str), v))
        index = names
    unseen = sorted(set(items["validation"]) - set(index), key=str)
    if unseen:
        raise UsageError(
            f"validation labels {unseen[:10]} never occur in the training data (training labels: {names[:20]}); "
            "fix the labels or give training data that covers them"
        )
    if len(names) < 2:
        raise UsageError(f"the training data holds {len(names)} label(s); multi-label classification needs two or more")
    position = {value: i for i, value in enumerate(index)}

    def to_labels(values: list) -> list[float]:
        hot = [0.0] * len(names)
        for value in values or []:
            hot[position[value]] = 1.0
        return hot

    return [str(name) for name in names], to_labels


def multi_label_outputs(model, batch):
    """Per-example predictions (a label is predicted where its logit is above 0: probability above one half),
    references (multi-hot) and losses (the mean binary cross-entropy over the labels) for one eval batch."""
    labels = batch.pop("labels").float()
    batch.pop(SAMPLE_WEIGHT, None)
    logits = model(**batch).logits.float()
    loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="none").mean(-1)
    return {"predictions": (logits > 0).long(), "references": labels.long(), "loss": loss}


def evaluate_multi_label(accelerator: Accelerator, model, eval_dataloader):
    """All ranks call this (it gathers every rank's predictions): (scores, None) over the whole eval set, each
    example counted once whatever the number of processes (`multi_label_scores`). Every rank gets the same result."""
    results = gather_for_eval(accelerator, model, eval_dataloader, multi_label_outputs)
    return multi_label_scores(results["predictions"], results["references"], results["loss"]), None


def multi_label_scores(predictions: np.ndarray, references: np.ndarray, losses: np.ndarray) -> dict:
    """The eval loss; exact match (every label of an example right); micro F1 (over all the example-label pairs)
    and macro F1 (the mean over labels of each one's F1, 0 for a label never predicted nor present, as
    scikit-learn's zero_division=0), from multi-hot `predictions` and `references` (examples, labels)."""
    predicted, present = predictions.astype(bool), references.astype(bool)
    hits = (predicted & present).sum(0)
    misses = (predicted ^ present).sum(0)  # false positives and false negatives, per label

    def f1(hits, misses):
        return float(np.mean(np.where(hits > 0, 2 * hits / np.maximum(2 * hits + misses, 1), 0.0)))

    return {
        "eval_loss": float(losses.mean()),
        "eval_exact_match": float((predicted == present).all(1).mean()),
        "eval_f1_micro": f1(hits.sum(), misses.sum()),
        "eval_f1_macro": f1(hits, misses),
        "eval_examples": len(present),
    }
