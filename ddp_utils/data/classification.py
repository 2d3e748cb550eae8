"""What the two classification scripts (text and images) share: label ids, and evaluation over the
whole eval set with a confusion matrix; and `train.py`'s regression (a float label column, or
`--task regression`: one output, its squared error, scored by MSE, Pearson and Spearman) and multi-label
classification (a column of lists of labels: one output per label, its binary cross-entropy, scored by exact
match and micro and macro F1). Their training loss is in each script's training step."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger

from ..core.errors import UsageError
from .dataloaders import SAMPLE_WEIGHT
from .evaluation import gather_for_eval

logger = get_logger(__name__)

# What `evaluate_classification` gives with the metrics both scripts load (accuracy, f1), for --metric_for_best_model.
CLASSIFICATION_SCORES = ("eval_loss", "eval_accuracy", "eval_f1")
REGRESSION_SCORES = ("eval_loss", "eval_mse", "eval_pearson", "eval_spearman")  # what `evaluate_regression` gives
MULTI_LABEL_SCORES = ("eval_loss", "eval_exact_match", "eval_f1_micro", "eval_f1_macro")  # `evaluate_multi_label`
MANY_CLASSES = 20  # an integer label column with more distinct values than this is said in the log


class ConfusionMatrix(NamedTuple):
    counts: np.ndarray  # counts[true label, predicted label]
    labels: list[str]  # the label names, in id order


def confusion_matrix(predictions, references, num_labels: int) -> np.ndarray:
    """counts[true label, predicted label] over all the examples given."""
    counts = np.zeros((num_labels, num_labels), dtype=np.int64)
    np.add.at(counts, (np.asarray(references, dtype=np.int64), np.asarray(predictions, dtype=np.int64)), 1)
    return counts


def label_mapping(raw, label_column: str):
    """(label names in id order, function mapping a raw label value to its id), from the "train"
    split of `raw`; a UsageError if training holds fewer than two classes or a validation label
    never occurs in training. Reads the distinct labels with Arrow, not every row into Python. Any
    rank may call it."""
    import datasets

    train, validation = (distinct_values(raw[split], label_column) for split in ("train", "validation"))
    feature = raw["train"].features[label_column]
    if isinstance(feature, datasets.ClassLabel):
        names, to_id, unseen = feature.names, int, sorted(set(validation) - set(train))
        if validation and min(validation) < 0:
            raise UsageError("the validation split has unlabelled examples (label -1); use a labelled split")
        if unseen:
            raise UsageError(
                f"validation labels {[names[i] for i in unseen][:10]} never occur in the training data; "
                "add training examples of them or drop them from the validation data"
            )
    else:
        names = sorted(train, key=lambda v: (isinstance(v, str), v))
        unseen = sorted(set(validation) - set(names), key=str)
        if unseen:
            raise UsageError(
                f"validation labels {unseen[:10]} never occur in the training data (training labels: {names[:20]}); "
                "fix the labels or give training data that covers them"
            )
        to_id = {value: i for i, value in enumerate(names)}.__getitem__
    if len(train) < 2:
        raise UsageError(
            f"the training data holds one class only ({names[to_id(train[0])]!r}); "
            "a classifier needs examples of at least two"
        )
    return [str(name) for name in names], to_id


def label_task(raw, label_column: str, task: str = "auto"):
    """(the task, the model config's label entries, the function that maps a raw label to the
    model's) for `train.py`: "regression" for --task regression or, with --task auto, a label
    column of floats (one output, the value as a float); "multi_label" for a column of lists of labels
    (`multi_label_mapping`); else "classification" (`label_mapping`), and the log says how many classes an
    integer column with many values made. Any rank may call it."""
    lists = _holds_lists(raw["train"], label_column)
    if task == "multi_label" or (task == "auto" and lists):
        names, to_labels = multi_label_mapping(raw, label_column)
        logger.info(f"task: multi-label classification on {label_column!r}: {len(names)} labels, each yes or no")
        return "multi_label", {**label_config(names), "problem_type": "multi_label_classification"}, to_labels
    if lists:
        raise UsageError(
            f"{label_column!r} holds lists of labels, which --task {task} cannot train on; give --task multi_label"
        )
    kind = _value_kind(raw["train"], label_column)
    written = [v for v in distinct_values(raw["train"], label_column) if isinstance(v, str)] if kind is None else []
    if task == "auto" and written and all(v.strip().startswith("[") and v.strip().endswith("]") for v in written):
        raise UsageError(  # a CSV cell "['sports', 'tech']": each combination would be a class of its own
            f"the labels of {label_column!r} are lists written as text ({written[0][:40]!r}); for multi-label "
            "classification give them as JSON lists (a .jsonl file), or --task classification to train them as classes"
        )
    if task == "regression" or (task == "auto" and kind == "float"):
        for split in ("train", "validation"):
            if _value_kind(raw[split], label_column) not in ("float", "int"):
                raise UsageError(
                    f"--task regression needs numbers in {label_column!r}, and the {split} data holds "
                    f"{raw[split].features[label_column]}; give numeric labels, or --task classification"
                )
        logger.info(f"task: regression on {label_column!r} (one output, its squared error)")
        return "regression", {"num_labels": 1, "problem_type": "regression"}, float
    names, to_id = label_mapping(raw, label_column)
    if kind == "int" and len(names) > MANY_CLASSES:
        logger.info(
            f"{label_column!r} holds {len(names)} distinct integers: a classifier of {len(names)} classes "
            "(--task regression predicts them as numbers)"
        )
    return "classification", label_config(names), to_id


def _holds_lists(dataset, column: str) -> bool:
    """Whether `column` holds lists (GoEmotions' sequence of class labels, a JSON list of label names)."""
    import datasets

    return isinstance(dataset.features[column], (datasets.List, datasets.LargeList))


def multi_label_mapping(raw, label_column: str):
    """(label names in id order, function mapping a raw list of labels to its multi-hot vector of floats) for a
    column of lists (an empty list: no label): the names of a sequence of `ClassLabel`, else the sorted distinct
    items of the training lists. A UsageError for a column that is not lists in every split, a validation label
    never seen in training, or fewer than two labels. Any rank may call it."""
    import datasets
    import pyarrow.compute as pc

    for split in ("train", "validation"):
        if not _holds_lists(raw[split], label_column):
            raise UsageError(
                f"multi-label classification needs a list of labels per example in {label_column!r}, and the {split} "
                f'data holds {raw[split].features[label_column]}; give lists (e.g. ["sports", "tech"], or [])'
            )

    def items(split):
        return pc.unique(pc.list_flatten(raw[split].with_format("arrow")[label_column])).drop_null().to_pylist()

    feature = raw["train"].features[label_column].feature
    if isinstance(feature, datasets.ClassLabel):
        names, index = feature.names, list(range(len(feature.names)))
    else:
        names = sorted(items("train"), key=lambda v: (isinstance(v, str), v))
        index = names
    unseen = sorted(set(items("validation")) - set(index), key=str)
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


def _value_kind(dataset, column: str) -> str | None:
    """ "float", "int" or None (text, a ClassLabel, anything else): the plain values of `column`."""
    import datasets

    dtype = (
        getattr(dataset.features[column], "dtype", "") if isinstance(dataset.features[column], datasets.Value) else ""
    )
    return "float" if dtype.startswith("float") else "int" if dtype.startswith(("int", "uint")) else None


def distinct_values(dataset, column: str) -> list:
    """The distinct values of `column`, read with Arrow (a few, however many rows there are)."""
    import pyarrow.compute as pc

    return pc.unique(dataset.with_format("arrow")[column]).to_pylist()


def label_config(label_names: list[str]) -> dict:
    """The config entries of a classifier for these labels: num_labels, id2label, label2id."""
    id2label = dict(enumerate(label_names))
    return {"num_labels": len(label_names), "id2label": id2label, "label2id": {name: i for i, name in id2label.items()}}


def classification_outputs(model, batch):
    """Per-example predictions, references and losses for one eval batch."""
    labels = batch.pop("labels")
    batch.pop(SAMPLE_WEIGHT, None)
    logits = model(**batch).logits
    loss = F.cross_entropy(logits.float(), labels, reduction="none")
    return {"predictions": logits.argmax(dim=-1), "references": labels, "loss": loss}


def evaluate_classification(accelerator: Accelerator, model, eval_dataloader, metrics):
    """All ranks call this (it gathers every rank's predictions): (scores, confusion) over the
    whole eval set, each example counted once whatever the number of processes: eval loss and
    count, each `evaluate` metric (accuracy, macro-F1, ...), and the `ConfusionMatrix` with the
    model's label names (for `write_results`). Every rank gets the same result."""
    results = gather_for_eval(accelerator, model, eval_dataloader, classification_outputs)
    scores = {"eval_loss": float(results["loss"].mean()), "eval_examples": len(results["references"])}
    for metric in metrics:
        for name, value in metric.compute(predictions=results["predictions"], references=results["references"]).items():
            scores[f"eval_{name}"] = value
    config = accelerator.unwrap_model(model).config
    labels = [config.id2label[i] for i in range(config.num_labels)]
    return scores, ConfusionMatrix(confusion_matrix(results["predictions"], results["references"], len(labels)), labels)


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


def regression_outputs(model, batch):
    """Per-example predictions (the one output), references and squared errors for one eval batch."""
    labels = batch.pop("labels").float()
    batch.pop(SAMPLE_WEIGHT, None)
    predictions = model(**batch).logits.float().squeeze(-1)
    return {"predictions": predictions, "references": labels, "loss": F.mse_loss(predictions, labels, reduction="none")}


def evaluate_regression(accelerator: Accelerator, model, eval_dataloader):
    """All ranks call this (it gathers every rank's predictions): (scores, None) over the whole eval
    set, each example counted once whatever the number of processes: the mean squared error (also
    the eval loss), and the Pearson and Spearman correlations of predictions and references, as
    `run_glue_no_trainer.py` scores STS-B. Every rank gets the same result."""
    from scipy.stats import pearsonr, spearmanr

    results = gather_for_eval(accelerator, model, eval_dataloader, regression_outputs)
    predictions, references = np.asarray(results["predictions"], float), np.asarray(results["references"], float)
    mse = float(np.mean(results["loss"]))
    constant = np.ptp(predictions) == 0 or np.ptp(references) == 0  # no correlation to speak of: 0
    scores = {
        "eval_loss": mse,
        "eval_mse": mse,
        "eval_pearson": 0.0 if constant else float(pearsonr(predictions, references)[0]),
        "eval_spearman": 0.0 if constant else float(spearmanr(predictions, references)[0]),
        "eval_examples": len(references),
    }
    return scores, None
