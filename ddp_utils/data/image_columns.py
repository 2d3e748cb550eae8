"""A Hub dataset's columns (or those the DATA section returns) made what the image script reads: an image column of
file paths, of undecoded files or of pixel arrays read as images, and a validation split whose labels are numbered
otherwise than the training split's (another ClassLabel, or names beside ids) renumbered by name; a split cut by
--max_train_samples or --max_eval_samples shuffled first. Image folders (image_folders.py) need none of it. Nothing
here communicates: any rank may call these functions."""

from __future__ import annotations

import os

from ..core.errors import UsageError
from .classification import distinct_values

PATHS_CHECKED = 20  # a column of paths none of whose first 20 exist is read from the wrong folder


def mixed_before_limits(raw, limits: dict, seed: int):
    """`raw` with each split that `limits` ("train", "validation") cuts shuffled by `seed` first, so that its first
    N images are of every class. A Hub dataset's images are often in class order (one pushed from class folders):
    the first N were one class (refused as "one class only"), missed some (refused as validation labels never seen
    in training), or scored one class only. transformers' run_image_classification.py shuffles first too."""
    validation = "validation" if "validation" in raw else "test"
    for split, limit in (("train", limits.get("train")), (validation, limits.get("validation"))):
        if split in raw and limit and limit < len(raw[split]):
            raw[split] = raw[split].shuffle(seed=seed)
    return raw


def image_columns(raw, image_column: str, label_column: str):
    """`raw` with every split's `image_column` decoded as images, class names as `string` (not `large_string`) and
    the validation labels in the training split's ids (`_aligned_labels`). A column of paths is read as files; one
    of other values (numbers, text that is not a path) is refused in one line, as are relative paths that are not
    found from the working directory. Reads the columns as Arrow data, not the images."""
    import datasets

    for split in raw:
        feature = raw[split].features[image_column]
        if not (isinstance(feature, datasets.Image) and feature.decode):
            raw[split] = _as_images(raw[split], image_column, split)
        if raw[split].features[label_column] == datasets.Value("large_string"):  # CSV, JSON, Parquet class names
            # datasets' map keeps a large_string column so: the class ids were written back as '0', '1', ...
            raw[split] = raw[split].cast_column(label_column, datasets.Value("string"))
    return _aligned_labels(raw, label_column)


def _as_images(dataset, column: str, split: str):
    """`dataset` with `column` cast to `datasets.Image()`: it held paths (checked to exist), files not decoded
    ({"bytes", "path"}) or pixel arrays. Before, the collator met a path where it expected an image, at the first
    step, after the check of every image had passed."""
    import datasets
    import pyarrow as pa

    values = dataset.with_format("arrow")[column]
    feature = dataset.features[column]
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        paths = [path for path in values[:PATHS_CHECKED].to_pylist() if path]
        if paths and not any("://" in path or os.path.exists(path) for path in paths):
            raise UsageError(
                f"the {split} data's {column!r} holds file paths, and none of its first {len(paths)} exists from "
                f"the working directory {os.getcwd()!r} (first: {paths[0]!r}); give absolute paths, or launch from "
                "the folder they are relative to"
            )
    try:
        return dataset.cast_column(column, datasets.Image())
    except (TypeError, ValueError, pa.ArrowException):  # numbers, dicts of other keys, ...
        raise UsageError(
            f"the {split} data's {column!r} holds {feature}, not images (files, paths, pixel arrays); name the image "
            "column with --image_column"
        ) from None


def _aligned_labels(raw, column: str):
    """`raw` with the validation split's labels numbered as the training split's, by name, where the two number
    them differently: two ClassLabels of other names or order (each split read with its own, as imagefolder does
    for a folder that lacks a class), or a ClassLabel beside names. Before, the validation ids were read as the
    training ones (a 'c' scored as 'b'), or a ClassLabel beside names failed with a traceback."""
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
        unseen = sorted({name for name in names.values() if name is not None} - set(train.names))
        if unseen:
            raise UsageError(
                f"validation labels {unseen[:10]} never occur in the training data (training labels: "
                f"{train.names[:20]}); fix the labels or give training data that covers them"
            )
        ids = {v: -1 if name is None else train.str2int(name) for v, name in names.items()}
        return _relabelled(raw, column, ids, train)
    if named and _is_text(train):  # names in training, ids in validation: the ids as names
        values = distinct_values(raw["validation"], column)
        if any(value < 0 for value in values):
            raise UsageError("the validation split has unlabelled examples (label -1); use a labelled split")
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
    return value.strip() if isinstance(value, str) else value


def _relabelled(raw, column: str, new: dict, feature):
    """`raw` with each validation label replaced by `new[label]`, the column then of `feature`."""
    validation = raw["validation"]
    features = validation.features.copy()
    features[column] = feature
    raw["validation"] = validation.map(
        lambda value: {column: new[value]}, input_columns=[column], features=features, desc="validation labels"
    )
    return raw
