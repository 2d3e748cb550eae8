"""What the two classification scripts (text and images) share: label ids, and evaluation over the
whole eval set with a confusion matrix; and `train.py`'s regression (a float label column, or
`--task regression`: one output, its squared error, scored by MSE, Pearson and Spearman); which task a label
column is (`label_task`; multi-label: multi_label.py). Their training loss is in each script's training step."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger

from ..core.errors import UsageError
from .dataloaders import SAMPLE_WEIGHT
from .evaluation import gather_for_eval
from .multi_label import holds_lists, multi_label_mapping

logger = get_logger(__name__)

# What `evaluate_classification` gives with the metrics both scripts load (accuracy, f1), for --metric_for_best_model.
CLASSIFICATION_SCORES = ("eval_loss", "eval_accuracy", "eval_f1")
REGRESSION_SCORES = ("eval_loss", "eval_mse", "eval_pearson", "eval_spearman")  # what `evaluate_regression` gives
MANY_CLASSES = 20  # an integer label column with more distinct values than this is said in the log; a float one
# of whole numbers, no more than this, is refused as ambiguous (classes or scores?)
FEW_PER_CLASS = 5  # and warned about where its classes have fewer training examples each, on average


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

    if holds_lists(raw["train"], label_column):
        raise UsageError(f"{label_column!r} holds lists of labels; this script takes one label per example")
    train, validation = (distinct_values(raw[split], label_column) for split in ("train", "validation"))
    feature = raw["train"].features[label_column]
    if isinstance(feature, datasets.ClassLabel):
        names, to_id, unseen = feature.names, int, sorted(set(validation) - set(train))
        for split in ("train", "validation"):
            _refuse_unlabelled(raw[split], label_column, split)
        if unseen:
            raise UsageError(
                f"validation labels {[names[i] for i in unseen][:10]} never occur in the training data; "
                "add training examples of them or drop them from the validation data"
            )
    else:
        padded = sorted({v for v in [*train, *validation] if isinstance(v, str) and v != v.strip()})
        if padded:  # "pos " and "pos" were two classes
            logger.warning(f"labels of {label_column!r} with spaces around them are read without: {padded[:5]}")
        to_id = LabelIds(sorted({LabelIds.key(v) for v in train}, key=lambda v: (isinstance(v, str), v)))
        names = to_id.names
        _refuse_unseen(sorted({LabelIds.key(v) for v in validation} - set(names), key=str), names)
    if len({to_id(value) for value in train}) < 2:  # the classes present, not those a ClassLabel names
        raise UsageError(
            f"the training data holds one class only ({names[to_id(train[0])]!r}); "
            "a classifier needs examples of at least two"
        )
    return [str(name) for name in names], to_id


def labels_numbered_as_training(raw, column: str):
    """`raw` with the validation split's labels numbered as the training split's, by name, where the two number
    them differently: two ClassLabels of other names or order (each split read with its own, as imagefolder does
    for a folder that lacks a class), or a ClassLabel beside names. Before, the validation ids were read as the
    training ones (a 'c' scored as 'b'), or a ClassLabel beside names failed with a traceback. A validation label
    that training lacks is refused in one line. Any rank may call it."""
    import datasets

    if "validation" not in raw or column not in raw["validation"].column_names:
        return raw
    train, validation = raw["train"].features[column], raw["validation"].features[column]
    named = isinstance(validation, datasets.ClassLabel)
    if isinstance(train, datasets.ClassLabel):
        if named and validation.names == train.names:
            return raw
        if not (named or _is_text(validation)):  # plain ids beside a ClassLabel: read as its ids
            return raw
        values = distinct_values(raw["validation"], column)
        names = {v: _name(validation, v) for v in values}
        _refuse_unseen(sorted({name for name in names.values() if name is not None} - set(train.names)), train.names)
        ids = {v: -1 if name is None else train.str2int(name) for v, name in names.items()}
        return _relabelled(raw, column, ids, train)
    if named and _is_text(train):  # names in training, ids in validation: the ids as names
        _refuse_unlabelled(raw["validation"], column, "validation")
        values = distinct_values(raw["validation"], column)
        return _relabelled(raw, column, {v: _name(validation, v) for v in values}, datasets.Value("string"))
    return raw


def _is_text(feature) -> bool:
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def _name(feature, value):
    """The class name of a label value: a ClassLabel's id by its names (None for -1, unlabelled), text stripped."""
    import datasets

    if isinstance(feature, datasets.ClassLabel):
        return None if value is None or value < 0 else feature.int2str(value)
    return LabelIds.key(value)


def _check_regression_values(dataset, column: str, split: str) -> None:
    """A regression split whose label is one value in every example: refused where it is training's or -1 (STS-B's
    test split, unlabelled: it trained and scored as a success, an MSE against -1); warned of for a validation split
    (sparse scores held out may all be 0): its correlations are undefined, its loss still scores."""
    low, high = _min_max(dataset, column)
    if low is None or low != high or len(dataset) < 2:
        return
    if split == "train" or low == -1:
        unlabelled = " (an unlabelled split, as GLUE's STS-B test)" if low == -1 else ""
        raise UsageError(
            f"the {split} data's {column!r} is {low} in every example{unlabelled}, nothing to learn from or score; "
            f"give {split} data of labelled, varied values (of a Hub dataset: another split, --{split}_split)"
        )
    logger.warning(
        f"the validation data's {column!r} is {low} in every example: its Pearson and Spearman correlations are "
        "undefined (NaN); its loss still scores the model"
    )


def _refuse_unlabelled(dataset, column: str, split: str) -> None:
    """A UsageError where a split of ClassLabel ids holds -1, the Hub's mark of an unlabelled example: a split
    unlabelled throughout (GLUE's test splits) is replaced with --train_split or --validation_split; a few among
    labelled ones (SNLI's examples without a gold label) are dropped in the DATA section, which one split cannot."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = dataset.with_format("arrow")[column]
    if len(dataset) == 0 or not pa.types.is_integer(values.type):  # ids only: an empty split is refused elsewhere
        return
    unlabelled = pc.sum(pc.less(values, 0)).as_py() or 0
    if unlabelled == len(dataset):
        raise UsageError(
            f"the {split} split is unlabelled (label -1 in every example, as in GLUE's test splits); "
            f"name a labelled split with --{split}_split"
        )
    if unlabelled:
        raise UsageError(
            f"{unlabelled} of the {len(dataset)} {split} examples are unlabelled (label -1, as SNLI's without a gold "
            f"label); drop them in the DATA section: data = data.filter(lambda row: row[{column!r}] >= 0)"
        )


def _refuse_unseen(unseen: list, names: list) -> None:
    """A UsageError naming the validation labels that never occur in training, with training's."""
    if unseen:
        raise UsageError(
            f"validation labels {unseen[:10]} never occur in the training data (training labels: {names[:20]}); "
            "fix the labels or give training data that covers them"
        )


def _relabelled(raw, column: str, new: dict, feature):
    """`raw` with each validation label replaced by `new[label]`, the column then of `feature`."""
    validation = raw["validation"]
    features = validation.features.copy()
    features[column] = feature
    raw["validation"] = validation.map(
        lambda value: {column: new[value]}, input_columns=[column], features=features, desc="validation labels"
    )
    return raw


class LabelIds:
    """A raw label's class id, by its value; text labels without the spaces around them."""

    def __init__(self, names: list):
        self.names, self.ids = names, {name: i for i, name in enumerate(names)}

    @staticmethod
    def key(value):  # 1.0 and 1 one class, named "1" (a float column of classes: --task classification)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value.strip() if isinstance(value, str) else value

    def __call__(self, value) -> int:
        return self.ids[self.key(value)]


def label_task(raw, label_column: str, task: str = "auto"):
    """(the task, the model config's label entries, the function that maps a raw label to the
    model's) for `train.py`: "regression" for --task regression or, with --task auto, a label
    column of floats (one output, the value as a float; a few whole ones, 0.0 and 1.0, are refused as ambiguous);
    "multi_label" for a column of lists of labels (`multi_label_mapping`); else "classification" (`label_mapping`),
    and the log says how many classes an integer column with many values made. Any rank may call it."""
    import datasets

    for split in raw:
        if isinstance(raw[split].features[label_column], getattr(datasets, "Json", ())):  # JSON records: 0 and "1"
            raise UsageError(
                f"the {split} data's {label_column!r} mixes types from record to record (numbers and text, or lists "
                f"and text); give every record's label as the same type, as in {raw[split][0][label_column]!r}"
            )
    lists = holds_lists(raw["train"], label_column)
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
    if task != "classification":  # given, the numbers are classes and "NA" one of them
        _refuse_missing_written_as_text(raw, label_column)
    if task == "auto" and written and all(v.strip().startswith("[") and v.strip().endswith("]") for v in written):
        raise UsageError(  # a CSV cell "['sports', 'tech']": each combination would be a class of its own
            f"the labels of {label_column!r} are lists written as text ({written[0][:40]!r}); for multi-label "
            "classification give them as JSON lists (a .jsonl file), or --task classification to train them as classes"
        )
    combined = [v for v in written if "," in v and all(part.strip() in written for part in v.split(","))]
    if task == "auto" and combined:  # GoEmotions' TSV: "2,14" is labels 2 and 14, not a class
        raise UsageError(
            f"some labels of {label_column!r} join others with commas ({combined[0][:40]!r}); for multi-label "
            f'classification split them into lists in the DATA section (row["{label_column}"].split(",")), or give '
            "--task classification to train each combination as a class"
        )
    whole = _few_whole_numbers(raw, label_column) if task == "auto" and kind == "float" else None
    if whole:  # 0.0 and 1.0: a CSV written by pandas from a column that once held a gap; classes or scores?
        raise UsageError(
            f"the labels of {label_column!r} are floats, all whole numbers ({', '.join(map(str, whole[:5]))}"
            f"{', ...' if len(whole) > 5 else ''}): classes or scores? give --task classification ({len(whole)} "
            "classes) or --task regression"
        )
    if task == "regression" or (task == "auto" and kind == "float"):
        for split in ("train", "validation"):
            if _value_kind(raw[split], label_column) not in ("float", "int"):
                raise UsageError(
                    f"--task regression needs numbers in {label_column!r}, and the {split} data holds "
                    f"{raw[split].features[label_column]}; give numeric labels, or --task classification"
                )
            _check_regression_values(raw[split], label_column, split)
        logger.info(f"task: regression on {label_column!r} (one output, its squared error)")
        return "regression", {"num_labels": 1, "problem_type": "regression"}, float
    names, to_id = label_mapping(raw, label_column)
    if kind == "int" and len(names) > MANY_CLASSES:
        each = len(raw["train"]) / len(names)  # a year, a price, an id: few examples a class, nothing learned
        said = f"{label_column!r} holds {len(names)} distinct integers: a classifier of {len(names)} classes "
        said += "(--task regression predicts them as numbers)"
        if each < FEW_PER_CLASS:
            logger.warning(f"{said}; {each:.1f} training examples a class, too few to learn one: are they classes?")
        else:
            logger.info(said)
    # Said, not left to the config read: a multi-label or regression checkpoint's would choose the wrong loss.
    return "classification", {**label_config(names), "problem_type": "single_label_classification"}, to_id


MISSING_WRITTEN = {"na", "n/a", "nan", "none", "null", "-", "?"}  # what R, pandas and spreadsheets write for a gap


def _refuse_missing_written_as_text(raw, label_column: str) -> None:
    """Refuse a label column of numbers with a gap written as text ("NA" from R's write.csv, "nan" from pandas'
    astype(str)): read as text, it made the numbers classes, a regression trained as a classifier of '0.25',
    '0.5', ..., 'NA'. Only an empty cell is missing in a CSV (so that an intent class "None" stays a class)."""
    for split in raw:
        values = distinct_values(raw[split], label_column)
        if not values or not all(isinstance(v, str) for v in values):
            continue
        gaps = [v for v in values if v.strip().lower() in MISSING_WRITTEN]
        numbers = [v for v in values if v not in gaps and _is_number(v)]
        if gaps and numbers and len(gaps) + len(numbers) == len(values):
            raise UsageError(
                f"the {split} data's {label_column!r} holds numbers and {gaps[0]!r}, a gap written as text: "
                "leave those cells empty (refused then, by record) or drop their rows; or, to train the numbers as "
                f"classes and {gaps[0]!r} as one, give --task classification"
            )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _value_kind(dataset, column: str) -> str | None:
    """ "float", "int" or None (text, a ClassLabel, anything else): the plain values of `column`."""
    import datasets

    dtype = (
        getattr(dataset.features[column], "dtype", "") if isinstance(dataset.features[column], datasets.Value) else ""
    )
    return "float" if dtype.startswith("float") else "int" if dtype.startswith(("int", "uint")) else None


def _few_whole_numbers(raw, column: str) -> list | None:
    """The distinct values of a float `column` in the training and validation splits of `raw`, sorted, where they
    are all whole, no more than MANY_CLASSES and at least 2 in training (a regression's scores have fractions or many
    values; one value in training is refused as nothing to learn); else None."""
    train = set(distinct_values(raw["train"], column))
    values = train | (set(distinct_values(raw["validation"], column)) if "validation" in raw else set())
    if len(train) < 2 or len(values) > MANY_CLASSES or not all(v is not None and float(v).is_integer() for v in values):
        return None
    return sorted(values)


def _min_max(dataset, column: str) -> tuple:
    """The smallest and largest value of a numeric column ((None, None) for none); nulls and NaN are not counted,
    which `check_splits` refuses first."""
    import pyarrow.compute as pc

    found = pc.min_max(dataset.with_format("arrow")[column])
    return found["min"].as_py(), found["max"].as_py()


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
