"""Image folders read and checked: each image labelled by its class subfolder, the formats this Pillow opens, the
unreadable images found once per node (their answer kept in the datasets cache) and refused or skipped.

PIL only: torchvision has no CPU wheel on many machines and pulls CUDA packages.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import multiprocessing
import os
import tempfile
import unicodedata
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from accelerate.logging import get_logger

from ..core.errors import UsageError
from .file_lists import NOT_DATA
from .raw_data import available_cores

logger = get_logger(__name__)
FOLDER_PER_CLASS = "cat/1.jpg, cat/2.jpg, dog/1.jpg, ..."  # an image folder's layout, as errors show it
IMAGES_PER_PROCESS = 2_000  # decoding takes about 5 ms an image: one more process per 10 s of work, up to the cores


def find_bad_images(dataset, image_column: str) -> list[tuple[int, str]]:
    """`(row, name)` of every image in `dataset` that PIL cannot open or fully decode (not an image, truncated,
    damaged), named by its folder and file (cat/3.png), or by its row. Decodes each image once, on as many processes
    as the work is worth (`IMAGES_PER_PROCESS`), and keeps the answer in the datasets cache (`_checked_images_key`):
    the other ranks, which prepare the data after the main process, read it instead of decoding every image again
    (an ImageNet folder: about 100 minutes each). Any rank may call it."""
    import datasets

    raw = dataset.cast_column(image_column, datasets.Image(decode=False))
    key = _checked_images_key(raw, image_column)
    path = os.path.join(datasets.config.HF_DATASETS_CACHE, "checked_images", f"{key}.json") if key else None
    try:
        with open(path) as file:
            return [tuple(found) for found in json.load(file)]
    except (TypeError, OSError, ValueError):  # no key, not there yet, or half a file: checked below
        pass
    processes = min(available_cores(), len(raw) // IMAGES_PER_PROCESS)
    problems = []
    # Forked, as datasets.map(num_proc) does. A worker that dies (the kernel's OOM killer) ends the check with one
    # line: multiprocessing.Pool would wait for it for ever.
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork")) if processes > 1 else (
        contextlib.nullcontext()
    ) as pool:  # fmt: skip
        for start in range(0, len(raw), 10_000):  # a Hub dataset's images are bytes in the data: not all at once
            values = raw.with_format("arrow")[start : start + 10_000][image_column].to_pylist()
            try:
                problems += pool.map(_image_problem, values, chunksize=64) if pool else map(_image_problem, values)
            except BrokenProcessPool:
                raise RuntimeError(
                    "a process checking the images died (out of memory?): free memory, or check them on fewer "
                    "processes by launching with fewer CPUs (taskset)"
                ) from None
    bad = [(row, f"{problem[0] or f'row {row}'} ({problem[1]})") for row, problem in enumerate(problems) if problem]
    if path:
        _keep(path, bad)
    return bad


def _keep(path: str, bad: list) -> None:
    """The check's answer written to `path`, whole or not at all; where the cache cannot be written, only said."""
    partial = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".partial")
        with os.fdopen(handle, "w") as file:
            json.dump(bad, file)
        os.replace(partial, path)
    except OSError as error:  # a read-only or full cache: every rank checks the images itself
        if partial and os.path.exists(partial):
            os.remove(partial)
        logger.warning(f"the image check's answer was not kept in the datasets cache ({error}): each rank checks")


def _image_problem(value: dict) -> tuple[str | None, str] | None:
    """(folder/file or None, the error's name) where PIL cannot open or fully decode the image (a row of
    `Image(decode=False)`); None where it can."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]) as image:
            image.load()  # verify() misses truncated files; load() decodes every pixel
    except Exception as error:  # PIL raises several types: UnidentifiedImageError, OSError, SyntaxError, ...
        name = value.get("path")
        where = os.path.join(*os.path.normpath(name).split(os.sep)[-2:]) if name and not value.get("bytes") else name
        return where, type(error).__name__
    return None


def _checked_images_key(raw, image_column: str) -> str | None:
    """What identifies a check's answer: the images' files (path, size, time of change), or for images held in the
    data (a Hub dataset's) its fingerprint where the datasets cache gives it one; None where neither tells (the
    check then runs again). Reads each file's metadata, not its pixels. Pillow's size limit is part of it: a run that
    raised it checks its images again."""
    import pyarrow.compute as pc
    from PIL import Image

    values = raw.with_format("arrow")[image_column]
    paths, held = pc.struct_field(values, "path").to_pylist(), pc.struct_field(values, "bytes").null_count < len(values)
    digest = hashlib.sha256(f"{len(values)}\0{Image.MAX_IMAGE_PIXELS}".encode())
    if not held and all(paths):
        for path in paths:
            try:
                stat = os.stat(path)
            except OSError:  # gone: unreadable, which the check reports
                return None
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        return digest.hexdigest()
    if raw.cache_files:  # loaded from the datasets cache: its fingerprint follows its content
        digest.update(f"{raw._fingerprint}\0{image_column}".encode())
        return digest.hexdigest()
    return None


def image_folders(train_dir: str, validation_dir: str | None = None):
    """A DatasetDict of the images under `train_dir` ("train") and `validation_dir` ("validation"), each labelled
    by the subfolder of the folder it is in (train/cat/a.jpg and train/cat/closeup/b.jpg: "cat"). Every file whose
    extension this Pillow reads is an image; other files are left out with a warning that counts them by extension
    (.heic without its plugin), hidden ones silently. Each split is in a fixed order that mixes the classes (by a
    hash of each file's path), so --max_train_samples N takes images of every class. A missing folder, images
    outside class subfolders, no images and one class only are refused in one line. Any rank may call it."""
    import datasets

    splits = {"train": _class_images(train_dir, "--train_dir")}
    if len(set(splits["train"]["label"])) < 2:
        raise UsageError(
            f"--train_dir {train_dir!r} holds images of one class only ({splits['train']['label'][0]!r}); a classifier "
            f"needs at least two: put each class's images in its own subfolder ({FOLDER_PER_CLASS})"
        )
    if validation_dir:
        splits["validation"] = _class_images(validation_dir, "--validation_dir")
    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())
            for split, rows in splits.items()
        }
    )


METADATA = ("metadata.csv", "metadata.jsonl", "metadata.parquet")  # what datasets' imagefolder read labels from


def _class_images(folder: str, option: str) -> dict:
    """{"image": paths, "label": class names} of the images in `folder`'s class subfolders (`image_folders`)."""
    from PIL import Image

    if not os.path.isdir(folder):
        problem = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise UsageError(f"{option} {folder!r} {problem}; give the folder that holds a subfolder per class")
    Image.init()  # the formats it opens, not those it only writes (.pdf, .palm)
    readable = {extension.lower() for extension, kind in Image.registered_extensions().items() if kind in Image.OPEN}
    try:
        entries = sorted((entry for entry in os.scandir(folder) if not entry.name.startswith(NOT_DATA)), key=_name)
    except OSError as error:
        _unreadable(error)
    metadata = [entry.name for entry in entries if entry.name in METADATA and entry.is_file()]
    images, loose, left_out, inner = [], [], {}, {}
    for entry in entries:
        if not entry.is_dir():
            loose += [entry.name] if os.path.splitext(entry.name)[1].lower() in readable else []
            continue
        label = unicodedata.normalize("NFC", entry.name)  # macOS writes names decomposed (NFD)
        seen = set()  # the folders walked, by their real path: a link to a folder above would repeat them
        for root, dirs, files in os.walk(entry.path, onerror=_unreadable, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith(NOT_DATA))
            if os.path.realpath(root) in seen:
                dirs[:], files = [], []
            seen.add(os.path.realpath(root))
            if root == entry.path:
                inner[label] = set(dirs)
            for name in (name for name in files if not name.startswith(NOT_DATA)):
                extension = os.path.splitext(name)[1].lower()
                if extension in readable:
                    images.append((os.path.join(root, name), label))
                else:
                    left_out[extension or name] = left_out.get(extension or name, 0) + 1
    if metadata and (loose or not images):  # datasets' imagefolder read labels from it
        raise UsageError(
            f"{option} {folder!r} holds {metadata[0]}, which this script does not read: it labels each image by its "
            f"class subfolder ({FOLDER_PER_CLASS}); move the images into them, or read {metadata[0]} in "
            "load_raw_datasets (the script's DATA section)"
        )
    if metadata:
        logger.warning(f"{option}: {metadata[0]} is not read; each image's class is its subfolder's name")
    if loose:
        raise UsageError(
            f"{option} {folder!r} holds {len(loose)} image(s) outside class subfolders (first: {loose[0]!r}); put "
            f"each class's images in its own subfolder ({FOLDER_PER_CLASS})"
        )
    if not images:
        raise UsageError(
            f"{option} {folder!r} holds no images in class subfolders ({FOLDER_PER_CLASS})"
            + (f"; left out, not a format this Pillow reads: {_counted(left_out)}" if left_out else "")
        )
    if left_out:
        logger.warning(f"{option}: {sum(left_out.values())} file(s) left out, not images this Pillow reads: "
                       f"{_counted(left_out)}")  # fmt: skip
    shared = set.intersection(*inner.values()) if len(inner) > 1 else set()
    if len(shared) > 1:  # one shared name is a layout (Tiny ImageNet's <class>/images/), several are splits
        logger.warning(
            f"{option}: the class folders {sorted(inner)[:5]} all hold subfolders named {sorted(shared)[:3]}: the "
            f"classes are the folders right under {folder!r}; where they are deeper, give the folder above them"
        )
    images.sort(key=lambda image: hashlib.sha1(os.path.relpath(image[0], folder).encode()).digest())
    return {"image": [path for path, _ in images], "label": [label for _, label in images]}


def _name(entry) -> str:
    return entry.name


def _unreadable(error: OSError):
    raise UsageError(f"cannot read the image folder {error.filename!r} ({error.strerror}); fix its permissions")


def _counted(counts: dict) -> str:
    """'.heic (4), .txt (1)': the most frequent first, at most 8."""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ", ".join(f"{name} ({count})" for name, count in ranked[:8]) + (", ..." if len(ranked) > 8 else "")


def drop_bad_images(raw, image_column: str, skip: bool) -> dict:
    """Check every split's images; refuse unreadable ones with their count and names, or with
    `skip`, drop them and return how many each split lost (for the report). Images over Pillow's size limit (twice
    MAX_IMAGE_PIXELS) are whole: their fix is named apart. Any rank may call it."""
    from PIL import Image

    skipped = {}
    for split in raw:
        bad = find_bad_images(raw[split], image_column)
        large = [name for _, name in bad if name.endswith("(DecompressionBombError)")]  # whole and readable
        if large and not skip and len(large) == len(bad):
            raise UsageError(
                f"{len(bad)} {split} image(s) are over Pillow's limit of {2 * Image.MAX_IMAGE_PIXELS:,} pixels, its "
                f"guard against decompression bombs: {', '.join(large[:10])}. Downscale them, or where you trust the "
                "files raise PIL.Image.MAX_IMAGE_PIXELS in load_raw_datasets (the script's DATA section); or pass "
                "--skip_bad_images to train without them"
            )
        if bad and not skip:
            names = ", ".join(name for _, name in bad[:10]) + (", ..." if len(bad) > 10 else "")
            raise UsageError(
                f"{len(bad)} {split} image(s) cannot be read: {names}. Fix or remove them, "
                "or pass --skip_bad_images to train without them"
                + (f" ({len(large)} only over Pillow's size limit: PIL.Image.MAX_IMAGE_PIXELS)" if large else "")
            )
        if bad:
            logger.warning(
                f"{split}: skipping {len(bad)} unreadable image(s): {', '.join(name for _, name in bad[:10])}"
            )
            bad_rows = {row for row, _ in bad}
            raw[split] = raw[split].select([i for i in range(len(raw[split])) if i not in bad_rows])
        skipped[f"{split}_images_skipped"] = len(bad)
    return skipped
