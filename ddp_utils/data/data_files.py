"""Reading the user's data files: local CSV, TSV, JSON, JSONL, Parquet or text, each read with one clear line for a
file that is missing, empty, not UTF-8 or unparsable, and a warning where its rows look merged or quoted as CSV in a
.tsv; a folder or glob of them too (a Hub dataset's shards, one split's); for raw text, code as whole files. Nothing
here communicates: any rank may call these functions."""

from __future__ import annotations

import csv
import functools
import glob
import os
import re

from accelerate.logging import get_logger

from ..core.errors import UsageError
from .file_lists import kind_of, named_files
from .record_names import forget_files, record_name, remember_files

logger = get_logger(__name__)


def read_data_files(data_files: dict[str, str], raw_text: bool = False, txt_records: str = "line"):
    """Read local CSV/TSV, JSON/JSONL, Parquet or text files into a `DatasetDict`, with a clear
    error for a missing, empty or unparsable file. `data_files` maps split name -> path.

    A path may also be a folder (its files, at every level; hidden ones and, said, those that are not data left
    out) or a quoted glob, of one kind of file and one split (`file_lists.named_files`). With `raw_text`
    (train_clm.py) every text file is data (binary ones left out, said): a file of another extension (code,
    Markdown, none) is one record, its whole text with its line breaks: as lines of a .txt, code would be cut apart.
    A .txt file's records are its lines, or with `txt_records` its paragraphs (blank lines between) or the file;
    read by lines, prose wrapped over lines is warned of."""
    import datasets

    forget_files()
    splits = {}
    for split, path in data_files.items():
        paths = named_files(path, split, raw_text)
        kind = kind_of(paths, path, split, raw_text)
        if kind == "text" and txt_records != "line":
            kind = {"paragraph": "paragraphs", "file": "document"}[txt_records]
        elif txt_records != "line":
            logger.warning(f"--{split}_file {path!r}: --txt_records {txt_records} reads .txt files only; not these")
        if len(paths) == 1:  # one file: refused when it holds nothing; in a folder, an empty one is left out
            extension = os.path.splitext(paths[0])[1].lower()
            if os.path.getsize(paths[0]) == 0:
                needs = "a header and at least one example" if kind in ("csv", "tsv") else "at least one example"
                raise UsageError(f"--{split}_file {path!r} is empty; it needs {needs}")
            if kind not in ("document", "paragraphs") and not _has_examples(paths[0], extension):
                raise UsageError(f"--{split}_file {path!r} holds no examples; add at least one row")
        else:
            empty = [name for name in paths if _holds_nothing(name)]
            if len(empty) == len(paths):
                raise UsageError(f"--{split}_file {path!r}: its {len(paths)} files are all empty")
            paths = [name for name in paths if name not in empty]
            left_out = f", {len(empty)} empty left out" if empty else ""
            logger.info(f"--{split}_file {path!r}: {len(paths)} files{left_out}")
        if kind == "document":
            logger.info(f"--{split}_file {path!r}: each file is one record, its whole text with its line breaks")
        builder = {"document": "text", "paragraphs": "text", "tsv": "csv"}.get(kind, kind)
        try:
            dataset = _read(paths, kind, split)
        except Exception as exc:
            problem = _first_line(exc)
            fix = "; save it as UTF-8" if "codec can't decode" in problem else ""
            if fix and len(paths) > 1:  # name the file (binary ones are left out already: this one is text)
                problem, fix = f"{_not_utf8(paths)!r} is not UTF-8 ({problem})", fix + ", or leave it out with a glob"
            raise UsageError(f"--{split}_file {path!r} could not be parsed as {builder}: {problem}{fix}") from exc
        remember_files(split, paths, functools.partial(_count_records, kind=kind))
        if len(dataset) == 0:
            raise UsageError(f"--{split}_file {path!r} holds no examples")
        if kind == "text" and raw_text:  # train_clm.py's --txt_records can read it otherwise
            warn_if_prose_in_lines(dataset, split, path)
        if kind == "json":
            _check_utf8(dataset, path, split)
        if kind in ("csv", "tsv"):
            warn_if_rows_look_merged(dataset, paths, split, path)
        if kind == "tsv":
            warn_if_quoted_as_csv(dataset, path, split)
        splits[split] = dataset
    return datasets.DatasetDict(splits)


def _holds_nothing(path: str) -> bool:
    """An empty file, or a Parquet file of no rows (its footer says so): in a folder, left out. datasets stopped at
    an empty Parquet shard ("BatchSize must be greater than 0")."""
    if os.path.getsize(path) == 0:
        return True
    if not path.lower().endswith(".parquet"):
        return False
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows == 0
    except Exception:  # noqa: BLE001 - not Parquet inside: reading it says so, in one line
        return False


def _read(paths: list[str], kind: str, split: str):
    import datasets

    builder = {"document": "text", "paragraphs": "text", "tsv": "csv"}.get(kind, kind)
    files = [glob.escape(name) for name in paths]  # datasets takes each as a glob: 'v[2]/a.txt' matched nothing
    dataset = datasets.load_dataset(builder, data_files={split: files}, split=split, **_builder_kwargs(kind))
    return dataset.map(_paragraphs, batched=True, desc="paragraphs") if kind == "paragraphs" else dataset


def _count_records(path: str, kind: str) -> int:
    """One file's records, counted as `_read` reads them, for a refused record's file (`record_names`). Parquet's
    count is in its footer; another kind is read alone (cached by datasets), once per file, and only when a message
    shows a record's name."""
    import datasets

    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    bars_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a bar per file, on every rank, before the one line that matters
    try:
        return len(_read([path], kind, "train"))
    except ValueError as exc:
        if "corresponds to no data" in str(exc):  # blank lines, [], a CSV's header alone: no record in the split
            return 0
        raise
    finally:
        if bars_on:
            datasets.enable_progress_bars()


def _builder_kwargs(kind: str) -> dict:
    # TSV as GLUE and SentEval ship it: tabs split the fields and a quote is text. With CSV quoting, a sentence
    # that starts with a quote swallowed the lines after it, silently.
    builder_kwargs = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if kind == "tsv" else {}
    if kind in ("csv", "tsv"):  # only an empty cell is missing: pandas took "None", "NA", "null" for one
        builder_kwargs.update(keep_default_na=False, na_values=[""])
    if kind in ("text", "document", "paragraphs"):  # a BOM (Windows' Notepad) is not text to train on
        builder_kwargs.update(encoding="utf-8-sig")
    if kind in ("document", "paragraphs"):
        builder_kwargs.update(sample_by={"document": "document", "paragraphs": "paragraph"}[kind])
    return builder_kwargs


def _paragraphs(batch: dict) -> dict:
    """datasets' paragraphs as a reader sees them: it splits at "\n\n" only, so a blank line of spaces (as editors
    and wikitext leave) joined two paragraphs, and a paragraph after two blank lines began with a line break. The
    lines a paragraph holds keep their indents; blank lines at its edges go."""
    parts = (part for text in batch["text"] for part in _BLANK_LINES.split(text))
    return {"text": [_EDGE_BLANK_LINES.sub("", part) for part in parts if part.strip()]}


_BLANK_LINES = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")  # one or more lines holding nothing but spaces
_EDGE_BLANK_LINES = re.compile(r"\A(?:[ \t\r\f\v]*\n)+|(?:\n[ \t\r\f\v]*)+\Z")


def warn_if_prose_in_lines(dataset, split: str, path: str, sample: int = 20_000) -> None:
    """Warn where a .txt read a line a record holds paragraphs of several lines between blank lines (a book, an
    article wrapped at 80 columns, a sentence a line with documents apart): each line becomes a document, BOS line
    EOS, and the model learns to stop at every line end. Wikitext's paragraph a line, and a document a line, pass."""
    lines = dataset[: min(sample, len(dataset))]["text"]
    runs, current = [], 0  # the number of lines in each run of non-blank ones
    for line in lines:
        if line.strip():
            current += 1
        elif current:
            runs.append(current)
            current = 0
    if len(runs) >= 3 and 2 <= sum(runs) / len(runs) <= 50:  # a few paragraphs, of several lines each
        logger.warning(
            f"--{split}_file {path!r}: its paragraphs span several lines ({sum(runs) / len(runs):.1f} on average, "
            "blank lines between), and each line is read as a document (BOS line EOS): the model would learn to "
            "stop at every line end; --txt_records paragraph (or file) keeps them whole"
        )


def _not_utf8(paths: list[str]) -> str | None:
    """The first of `paths` that is not UTF-8 text."""
    for name in paths:
        try:
            with open(name, encoding="utf-8-sig") as handle:
                while handle.read(1 << 24):
                    pass
        except UnicodeDecodeError:
            return name
    return None


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
            f"--{split}_file {path!r}: the {column!r} of {record_name(split, row, with_split=False)} looks quoted "
            f"as in a CSV file ({text[:40]!r}): a .tsv is read without quoting, so its quotes are text. Write it "
            "without quoting (pandas: quoting=csv.QUOTE_NONE), or as a .csv"
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


def warn_if_rows_look_merged(dataset, paths: list[str], split: str, path: str) -> None:
    """Warn, naming the row, when a CSV or TSV file's rows look merged: fewer rows than lines of
    data (a quoted field spanning lines), or a text field holding a newline or a tab (a row or a
    field swallowed by another). Legal in CSV, and in a file of sentences usually a mistake."""
    import pyarrow.compute as pc

    lines = 0
    for name in paths:
        with open(name, errors="replace") as handle:
            lines += sum(1 for line in handle if line.strip()) - 1  # the header
    merged = _first_text_where(
        dataset, lambda values: pc.or_(pc.match_substring(values, "\n"), pc.match_substring(values, "\t"))
    )
    if merged:
        row, column, _ = merged
        logger.warning(
            f"--{split}_file {path!r}: the {column!r} of {record_name(split, row, with_split=False)} holds a "
            f"newline or a tab ({len(dataset)} rows from {lines} lines of data), so rows or fields may have merged: a "
            "quote opened a field that a later line closed. Check the file there; a tab-separated file without "
            "quoting should be named .tsv"
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
