"""Reading the user's data files: local CSV, TSV, JSON, JSONL, Parquet or text, each read with one clear line for a
file that is missing, empty, not UTF-8 or unparsable, and a warning where its rows look merged or quoted as CSV in a
.tsv. Nothing here communicates: any rank may call these functions."""

from __future__ import annotations

import csv
import os

from accelerate.logging import get_logger

from ..core.errors import UsageError

logger = get_logger(__name__)

# File extension -> the `datasets` builder that reads it.
_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


def read_data_files(data_files: dict[str, str]):
    """Read local CSV/TSV, JSON/JSONL, Parquet or text files into a `DatasetDict`, with a clear
    error for a missing, empty or unparsable file. `data_files` maps split name -> path."""
    import datasets

    splits = {}
    for split, path in data_files.items():
        if not os.path.isfile(path):
            problem = "is a folder" if os.path.isdir(path) else "does not exist"  # a folder of .txt files, say
            raise UsageError(
                f"--{split}_file {path!r} {problem}; give the path of one file: {', '.join(sorted(_BUILDERS))}"
            )
        extension = os.path.splitext(path)[1].lower()
        if extension not in _BUILDERS:
            raise UsageError(
                f"--{split}_file {path!r}: unknown extension {extension!r}; use one of {sorted(_BUILDERS)}"
            )
        if os.path.getsize(path) == 0:
            needs = "a header and at least one example" if extension in (".csv", ".tsv") else "at least one example"
            raise UsageError(f"--{split}_file {path!r} is empty; it needs {needs}")
        if not _has_examples(path, extension):
            raise UsageError(f"--{split}_file {path!r} holds no examples; add at least one row")
        # TSV as GLUE and SentEval ship it: tabs split the fields and a quote is text. With CSV quoting, a sentence
        # that starts with a quote swallowed the lines after it, silently.
        builder_kwargs = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if extension == ".tsv" else {}
        if extension in (".csv", ".tsv"):  # only an empty cell is missing: pandas took "None", "NA", "null" for one
            builder_kwargs.update(keep_default_na=False, na_values=[""])
        if extension == ".txt":  # each line a record; a BOM (Windows' Notepad) is not text to train on
            builder_kwargs.update(encoding="utf-8-sig")
        try:
            dataset = datasets.load_dataset(
                _BUILDERS[extension], data_files={split: path}, split=split, **builder_kwargs
            )
        except Exception as exc:
            fix = "; save it as UTF-8" if "codec can't decode" in _first_line(exc) else ""
            raise UsageError(
                f"--{split}_file {path!r} could not be parsed as {_BUILDERS[extension]}: {_first_line(exc)}{fix}"
            ) from exc
        if len(dataset) == 0:
            raise UsageError(f"--{split}_file {path!r} holds no examples")
        if extension in (".json", ".jsonl"):
            _check_utf8(dataset, path, split)
        if extension in (".csv", ".tsv"):
            warn_if_rows_look_merged(dataset, path, split)
        if extension == ".tsv":
            warn_if_quoted_as_csv(dataset, path, split)
        splits[split] = dataset
    return datasets.DatasetDict(splits)


def _check_utf8(dataset, path: str, split: str) -> None:
    """Refuse a JSON file that is not UTF-8 (Latin-1, Windows-1252): Arrow's JSON reader keeps the bytes as they
    are, and the first read of such a text, anywhere later, was a raw UnicodeDecodeError."""
    import pyarrow as pa

    try:
        dataset.data.validate(full=True)  # Arrow's own check, UTF-8 included; no copy
    except pa.ArrowInvalid as error:
        if "UTF8" in str(error):
            raise UsageError(
                f"--{split}_file {path!r} is not UTF-8 text ({_first_line(error)}); save it as UTF-8"
            ) from None
        raise


def warn_if_quoted_as_csv(dataset, path: str, split: str) -> None:
    """Warn, naming the row, when a .tsv file looks written with CSV's quoting (pandas' `to_csv(sep="\\t")`): a
    field wrapped in quotes with its own quotes doubled. A .tsv is read without quoting, as GLUE ships it, so such a
    field trains with its quotes, and a quoted newline splits its row."""
    import pyarrow.compute as pc

    quoted = _first_text_where(
        dataset, lambda values: pc.match_substring_regex(values, r'^"(?:[^"]|"")*""(?:[^"]|"")*"?$')
    )
    if quoted:
        row, column, text = quoted
        logger.warning(
            f"--{split}_file {path!r}: row {row}'s {column!r} looks quoted as in a CSV file ({text[:40]!r}): a .tsv "
            "is read without quoting, so its quotes are text. Write it without quoting (pandas: "
            "quoting=csv.QUOTE_NONE), or as a .csv"
        )


def _first_text_where(dataset, test):
    """(row, column, text) of the first text value of `dataset` for which `test` (Arrow values -> booleans) holds,
    column by column; None where none does."""
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")[:]
    for column in table.column_names:
        values = table[column]
        if not is_text(values):
            continue
        found = pc.fill_null(test(values), False)
        if pc.any(found).as_py():
            row = pc.index(found, True).as_py()
            return row, column, str(values[row].as_py())
    return None


def warn_if_rows_look_merged(dataset, path: str, split: str) -> None:
    """Warn, naming the row, when a CSV or TSV file's rows look merged: fewer rows than lines of
    data (a quoted field spanning lines), or a text field holding a newline or a tab (a row or a
    field swallowed by another). Legal in CSV, and in a file of sentences usually a mistake."""
    import pyarrow.compute as pc

    with open(path, errors="replace") as handle:
        lines = sum(1 for line in handle if line.strip()) - 1  # the header
    merged = _first_text_where(
        dataset, lambda values: pc.or_(pc.match_substring(values, "\n"), pc.match_substring(values, "\t"))
    )
    if merged:
        row, column, _ = merged
        logger.warning(
            f"--{split}_file {path!r}: row {row}'s {column!r} holds a newline or a tab ({len(dataset)} rows from "
            f"{lines} lines of data), so rows or fields may have merged: a quote opened a field that a later line "
            "closed. Check the file there; a tab-separated file without quoting should be named .tsv"
        )
        return
    if len(dataset) != lines:
        logger.warning(f"--{split}_file {path!r}: {len(dataset)} rows read from {lines} lines of data; check the file")


def _has_examples(path: str, extension: str) -> bool:
    """A cheap look at the start of the file: does it hold at least one example?
    (Unreadable files answer True, so the loader reports them as unparsable.)"""
    if extension == ".parquet":
        import pyarrow.parquet

        try:
            return pyarrow.parquet.ParquetFile(path).metadata.num_rows > 0
        except Exception:
            return True
    needed = 2 if extension in (".csv", ".tsv") else 1  # CSV/TSV: a header, then a row
    found = 0
    with open(path, errors="replace") as handle:
        for line in handle:
            if line.strip() not in ("", "[]"):
                found += 1
                if found == needed:
                    return True
    return False


def _first_line(exc: BaseException) -> str:
    while exc.__cause__ is not None or exc.__context__ is not None:  # the root cause names the problem
        exc = exc.__cause__ or exc.__context__
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def is_text(values) -> bool:
    """Whether an Arrow column holds text."""
    return str(values.type) in ("string", "large_string")
