"""Which files a --train_file or --validation_file names: the file itself, a folder's files at every level, or a quoted
glob's matches (a Hub dataset's shards), sorted; what file systems add and what is not data left out, said; a folder
of several splits' files refused; and the one way they are all read. Nothing here communicates: any rank may call
these functions."""

from __future__ import annotations

import glob
import os
import re
from collections import Counter

from accelerate.logging import get_logger

from ..core.errors import UsageError

logger = get_logger(__name__)

# File extension -> the `datasets` builder that reads it.
BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
# What file systems and archives add to a folder, never anyone's data: hidden files and folders (.git, .DS_Store,
# ._1.jpg), macOS's zip folder, a Synology NAS's thumbnails (@eaDir) and recycle bin, Windows' and ext4's own folders.
NOT_DATA = (
    ".", "__MACOSX", "@eaDir", "#recycle", "#snapshot", "$RECYCLE.BIN", "System Volume Information", "lost+found"
)  # fmt: skip
SKIPPED_FOLDERS = ("__pycache__", "node_modules")  # what a code checkout holds that is no one's text
PACKED = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip", ".tar", ".tgz", ".7z")  # raw text's: not a text file


def named_files(path: str, split: str, raw_text: bool) -> list[str]:
    """The files `path` names, sorted: itself, a folder's (every level, NOT_DATA left out) or a glob's matches, as a
    Hub dataset's shards come (train-00000-of-00004.parquet, ...). A folder's files that are not data (its README.md)
    are left out, said; with `raw_text` every text file is data, and binary ones are left out."""
    if os.path.isfile(path):
        return [path]
    pattern = not os.path.isdir(path) and any(sign in path for sign in "*?[")  # a folder named 'corpus [clean]'
    if not (pattern or os.path.isdir(path)):
        raise UsageError(f"--{split}_file {path!r} does not exist; give a file ({', '.join(sorted(BUILDERS))}), a "
                         "folder or a quoted glob")  # fmt: skip
    if pattern:
        found = [name for name in glob.glob(path, recursive=True) if os.path.isfile(name)]
    else:
        found = []
        for root, folders, names in os.walk(path, followlinks=True):  # symlinked folders too, as image folders
            folders[:] = [name for name in folders if not name.startswith(NOT_DATA) and name not in SKIPPED_FOLDERS]
            found += [os.path.join(root, name) for name in names if not name.startswith(NOT_DATA)]
    if not found:
        raise UsageError(f"--{split}_file {path!r} " + ("matches no file" if pattern else "holds no files"))
    _refuse_several_splits(found, path, split)
    if not raw_text:  # a folder, or a glob as 'snap/**', may hold a README, a LICENSE
        others = [name for name in found if os.path.splitext(name)[1].lower() not in BUILDERS]
        if len(others) == len(found):
            raise UsageError(f"--{split}_file {path!r} holds no data files ({', '.join(sorted(BUILDERS))})")
        if others:
            logger.info(f"--{split}_file {path!r}: {len(others)} files that are not data left out: {others[:3]}")
        return sorted(name for name in found if name not in others)
    # Parquet is binary by design; a checkout's logo.png, a .pdf, a downloaded .json.gz are not text
    binary = [name for name in found if not name.lower().endswith(".parquet") and _is_binary(name)]
    if binary:
        counts = Counter(os.path.splitext(name)[1].lower() or "no extension" for name in binary)
        kinds = ", ".join(f"{extension}: {count}" for extension, count in counts.most_common())
        if len(binary) == len(found):
            packed = any(extension in PACKED for extension in counts)
            raise UsageError(
                f"--{split}_file {path!r} holds no text files, {len(binary)} binary ones ({kinds}); "
                + ("decompress them (gunzip, unzip, ...)" if packed else "give text files")
            )
        logger.warning(f"--{split}_file {path!r}: {len(binary)} binary files left out ({kinds}): not text")
        return sorted(name for name in found if name not in binary)
    return sorted(found)


# A split's name in a file's or folder's name, at its start or after a separator, as datasets name their files
# (train-00000-of-00004.parquet, test.jsonl, validation/0.parquet, dev_matched.tsv, alpaca_test.json, partial-train/)
_SPLIT_NAMES = re.compile(
    r"(?:^|[-_.])(train|training|test|testing|valid|validation|dev|eval|evaluation)(?=$|[-_.\d])", re.I
)
_SPLITS = {"training": "train", "testing": "test", "valid": "validation", "dev": "validation", "eval": "validation"}


def _split_named(name: str, root: str) -> tuple[str, str] | None:
    """(the split, the name as written) that a data file's path below `root` names, its deepest naming part's last
    mention (data/train/0.parquet, train-00000-of-00004.parquet); None where nothing names one."""
    for part in reversed(os.path.relpath(os.path.splitext(name)[0], root).split(os.sep)):
        found = _SPLIT_NAMES.findall(part)
        if found:
            return _SPLITS.get(found[-1].lower(), found[-1].lower()), found[-1]
    return None


def _folder_of(path: str) -> str:
    """The folder `path` names, or for a glob the folder before its first wildcard."""
    if os.path.isdir(path):
        return path.rstrip(os.sep) or os.sep
    return os.path.dirname(re.split(r"[*?\[]", path, maxsplit=1)[0]) or "."


def _refuse_several_splits(found: list[str], path: str, split: str) -> None:
    """Refuse a folder or glob whose data files belong to several splits (a Hub dataset's snapshot: its train and
    test shards side by side), or to another split beside files that name none: all of them would be read as
    `split`'s, the test data trained on. Only data files count (a code checkout's test_*.py is text to train on)."""
    root = _folder_of(path)
    named = {}  # split -> [(file, the name as written)]
    unnamed = 0
    for name in found:
        if os.path.splitext(name)[1].lower() in BUILDERS:
            kind = _split_named(name, root)
            if kind:
                named.setdefault(kind[0], []).append((name, kind[1]))
            else:
                unnamed += 1
    wanted = {"train": ("train",), "validation": ("validation", "test")}.get(split, (split,))
    others = [kind for kind in named if kind not in wanted]
    if len(named) < 2 and not (unnamed and others):
        return
    counts = ", ".join(f"{kind}: {len(files)}" for kind, files in sorted(named.items()))
    counts += f", no split named: {unnamed}" if unnamed else ""
    mine = next((named[kind] for kind in wanted if kind in named), None)
    if mine:  # a glob of the files that name this split: the folder they share, the name as they write it
        folder = os.path.commonpath([os.path.dirname(name) for name, _ in mine])
        written = mine[0][1]
        in_folder = written in os.path.relpath(folder, root).split(os.sep)
        fix = f"give {split} files alone with a quoted glob, '{folder}/*{'' if in_folder else written + '*'}', or "
    else:
        fix = f"give {split} files alone (a quoted glob), or "
    raise UsageError(
        f"--{split}_file {path!r} holds the files of several splits ({counts}), which would all be read as {split} "
        f"data; {fix}the folder as --dataset_name, which reads each split"
    )


def _is_binary(path: str) -> bool:
    """Whether a file holds a NUL byte in its first 8 KiB, as git tells binary files from text (UTF-16 too)."""
    with open(path, "rb") as handle:
        return b"\0" in handle.read(8192)


def kind_of(paths: list[str], path: str, split: str, raw_text: bool) -> str:
    """How `paths` are read, one way for all: a `datasets` builder, "tsv", or "document" (a file a record)."""
    kinds = {}
    for name in paths:
        extension = os.path.splitext(name)[1].lower()
        if extension not in BUILDERS and not raw_text:
            raise UsageError(f"--{split}_file {path!r}: unknown extension {extension!r}; use one of {sorted(BUILDERS)}")
        if extension in PACKED and raw_text:  # datasets opens a .gz as it is: C4's .json.gz would be one record
            where = f"--{split}_file {path!r}" + (f": {name!r}" if name != path else "")
            raise UsageError(f"{where} is compressed; decompress it (gunzip, unzip, ...)")
        kind = "tsv" if extension == ".tsv" else BUILDERS.get(extension, "document")
        kinds.setdefault(kind, set()).add(extension or "no extension")
    if len(kinds) > 1:
        found = ", ".join(sorted(extension for extensions in kinds.values() for extension in extensions))
        folder = _folder_of(path)
        most = Counter(os.path.splitext(name)[1].lower() for name in paths).most_common(1)[0][0] or ".txt"
        raise UsageError(
            f"--{split}_file {path!r} holds files read in different ways ({found}); give one kind, with a glob: "
            f"'{folder}/**/*{most}', say"
        )
    return next(iter(kinds))
