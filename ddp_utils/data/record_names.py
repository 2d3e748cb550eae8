"""A refused record's name in a message: "train record 1234", and where a split was read from several files (a folder
or glob of shards), the file that holds it and its row there. The split's number runs across the files in their order;
before, a user with 40 shards was told "train record 912345" and had to count. Nothing here communicates: any rank
may call these functions."""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable

# split -> its files in the order read, a function counting one file's records as that split's reader counts them,
# each file's last record's number + 1 as far as counted, and whether counting failed; set by read_data_files for
# each split it reads, emptied when a run reads its data anew. A name keeps the entry of its own reading.
_FILES: dict[str, dict] = {}


def forget_files() -> None:
    """Start anew: the splits about to be read come from other files (or from the Hub, which names no file)."""
    _FILES.clear()


def remember_files(split: str, paths: list[str], count_records: Callable[[str], int]) -> None:
    """The files `split` was read from, in order; `count_records(path)` counts one file's records, called only when a
    record of a split of several files is shown in a message, and for the files up to the one that holds it."""
    _FILES[split] = {"paths": list(paths), "count": count_records, "ends": [], "uncountable": False}


def record_name(split: str, number: int, with_split: bool = True) -> str | LazyName:
    """ "train record 1234 (row 34 of 'shards/train-00003.parquet')", or "train record 1234" from one file or the Hub
    (and whenever the file cannot be found: the name must never fail the message it is part of). The scripts name
    every record they read, in case it is refused: from several files the name is a `LazyName`, whose file is looked
    for only when a message shows it."""
    name = f"{split} record {number}" if with_split else f"record {number}"
    files = _FILES.get(split)
    if files is None or len(files["paths"]) < 2:
        return name
    return LazyName(name, files, number)


class LazyName:
    """A record's name whose file and row are found (`_file_of`) when it is shown, in a message: a run that refuses
    nothing counts no file. Only f-strings and str() show it; it is not a str."""

    def __init__(self, name: str, files: dict, number: int):
        self.name, self.files, self.number = name, files, number

    def __str__(self) -> str:
        try:
            found = _file_of(self.files, int(self.number))
        except Exception:  # noqa: BLE001 - a file gone or unreadable since: the split's number still names it
            self.files["uncountable"] = True  # not counted again for each record after it
            found = None
        return f"{self.name} (row {found[1]} of {found[0]!r})" if found else self.name

    def __repr__(self) -> str:  # a debugger's view: no file read
        return f"LazyName({self.name!r})"


def _file_of(files: dict, number: int) -> tuple[str, int] | None:
    paths, count_records, ends = files["paths"], files["count"], files["ends"]
    if number < 0 or files["uncountable"]:
        return None
    while (not ends or ends[-1] <= number) and len(ends) < len(paths):  # count the files up to the one holding it
        ends.append((ends[-1] if ends else 0) + count_records(paths[len(ends)]))
    place = bisect.bisect_right(ends, number)
    if place == len(ends):  # past the last file's records: not a number of this split's files
        return None
    return os.path.normpath(paths[place]), number - (ends[place - 1] if place else 0)
