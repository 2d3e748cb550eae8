"""A Hub dataset's columns (or those the DATA section returns) made what the image script reads: an image column of
file paths, of undecoded files or of pixel arrays read as images. Image folders (image_folders.py) need none of it.
Nothing here communicates: any rank may call these functions."""

from __future__ import annotations

import os

from ..core.errors import UsageError

PATHS_CHECKED = 20  # a column of paths none of whose first 20 exist is read from the wrong folder


def image_columns(raw, image_column: str, label_column: str):
    """`raw` with every split's `image_column` decoded as images and class names as `string` (not `large_string`).
    A column of paths is read as files; one of other values (numbers, text that is not a path) is refused in one
    line, as are relative paths that are not found from the working directory. Reads the columns as Arrow data, not
    the images."""
    import datasets

    for split in raw:
        feature = raw[split].features[image_column]
        if not (isinstance(feature, datasets.Image) and feature.decode):
            raw[split] = _as_images(raw[split], image_column, split)
        if raw[split].features[label_column] == datasets.Value("large_string"):  # CSV, JSON, Parquet class names
            # datasets' map keeps a large_string column so: the class ids were written back as '0', '1', ...
            raw[split] = raw[split].cast_column(label_column, datasets.Value("string"))
    return raw


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
