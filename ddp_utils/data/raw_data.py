"""Checking the splits a run trains and evaluates on (read by `data_files.read_data_files`, or a Hub dataset's), and
holding out a share for validation. Nothing here communicates: any rank may call these functions (the scripts call
them inside `load_on_main_first`)."""

from __future__ import annotations

import os

import numpy as np
from accelerate.logging import get_logger

from ..core.errors import UsageError
from .data_files import is_text
from .record_names import forget_files, record_name

logger = get_logger(__name__)

ROWS_PER_PROCESS = 25_000  # below this, starting a tokenizing process costs more than it saves
# A held-out split's records keep their row in the training file here (`check_splits`), for the messages that name a
# record: after the shuffle, a record's place in its split is not where the user finds it.
RECORD_COLUMN = "_record_in_train_file"


def named_splits(raw, train_split: str | None, validation_split: str | None):
    """A Hub dataset's splits under the names a run reads: `train_split` as "train" and `validation_split` as
    "validation" (--train_split and --validation_split: UltraChat's train_sft and test_sft, UltraFeedback's
    train_prefs and test_prefs). Either None: "train", and "validation" else "test", as they are. A name the data
    lacks, one split named for both, or no training split is a UsageError that lists its splits."""
    import datasets

    forget_files()  # its records are named by their number: no local files of an earlier reading

    if not (train_split or validation_split):
        return raw
    for option, name in (("--train_split", train_split), ("--validation_split", validation_split)):
        if name and name not in raw:
            raise UsageError(f"{option} {name}: the dataset has no such split; it has {sorted(raw)}")
    if train_split and train_split == validation_split:
        raise UsageError(f"--train_split and --validation_split both name {train_split!r}: give two splits")
    train = train_split or "train"
    if train not in raw:
        raise UsageError(f"the dataset has no 'train' split (it has {sorted(raw)}); name one with --train_split")
    validation = validation_split or next((name for name in ("validation", "test") if name in raw), None)
    picked = {"train": train, "validation": validation}
    unused = sorted(set(raw) - set(picked.values()))
    if unused and validation is None:
        logger.warning(f"the dataset's splits {unused} are not used; --validation_split names one to evaluate on")
    return datasets.DatasetDict({new: raw[old] for new, old in picked.items() if old in raw})


def check_splits(
    raw,
    columns: dict[str, str],
    data_options: str = "--train_file/--validation_file or --dataset_name",
    *,
    limits: dict | None = None,
    hold_out_percentage: int | None = None,
    seed: int = 0,
    stratify_by: str | None = None,
    blank: str = "keep",
    text: tuple = (),
    text_pairs: bool = False,
    sample_limits: bool = False,
):
    """The data check of every script: refuse data a run cannot use, naming the problem and the
    fix, and return a `DatasetDict` with the "train" and "validation" splits.

    - Validation is the "validation" split, else "test", else `hold_out_percentage` % of the
      training data (stratified by `stratify_by` where that column holds classes), else an error.
    - `columns` maps each column the run needs to the option that names it (or what data holds it, for scripts
      without such an option: renamed in their DATA section): a missing column, or
      a missing value in one (NaN too), is refused with that option; so is a column of `text` that holds other
      values (numbers, or types that differ by record).
    - Text columns: `blank="refuse"` refuses empty or blank values too, `"drop"` drops their rows
      (blank lines of a .txt file), `"keep"` keeps them. `text_pairs`: the option takes a pair of text columns
      (train.py), named in the fix of a missing one, and one column of a known pair given alone is warned about.
    - An empty split is refused. Each split is then cut to its entry in `limits` (None: all): its first rows, or
      with `sample_limits` a sample drawn by `seed` from a split the data gives (a Hub split in class order gave one
      class, as transformers' run_image_classification.py knows); a held-out share is drawn shuffled anyway, and
      the same with a limit as without. Record numbers in later messages then count the sample's rows.
    - A held-out share numbers the training records first (`RECORD_COLUMN`, read by `record_in_file`), except
      where blank rows were dropped.

    Reads the columns as Arrow data (images are not decoded). Any rank may call it.
    """
    import datasets

    if "train" not in raw:
        named = [split for split in sorted(raw) if split.startswith("train")]  # train_sft, train_prefs: a Hub dataset's
        fix = f"--train_split, one of {named} (and --validation_split)" if named else data_options
        raise UsageError(f"the data has no 'train' split (it has {sorted(raw)}); give {fix}")
    validation = "validation" if "validation" in raw else "test" if "test" in raw else None
    others = sorted(set(raw) - {"train"})
    if validation is None and others and hold_out_percentage is not None:  # a "dev" split: said, not ignored
        logger.warning(f"splits {others} are not read as validation data, a share of 'train' is: --validation_split")
    if validation is None and hold_out_percentage is None:
        raise UsageError(f"the data has no 'validation' split (it has {sorted(raw)}); give {data_options}")
    splits = {"train": raw["train"], **({"validation": raw[validation]} if validation else {})}
    for split in list(splits):
        splits[split] = _checked_split(splits[split], split, columns, blank, text, text_pairs)
    partner = text_pair(text[0], splits["train"].column_names) if text_pairs and len(text) == 1 else None
    if partner:  # MNLI's premise alone: the hypothesis dropped, and the task with it
        other = next(c for c in partner if c != text[0])
        logger.warning(f"{other!r} is not read, only {text[0]!r}; for the pair: --text_column {','.join(partner)}")
    limits = limits or {}
    for split in list(splits) if sample_limits and validation else ():  # the given splits: a sample, not the head
        if limits.get(split) and limits[split] < len(splits[split]):
            splits[split] = splits[split].shuffle(seed=seed)
    if validation is None:
        train = splits["train"]
        if blank != "drop" and RECORD_COLUMN not in train.column_names:  # rows as given: a column, not a copy
            train = train.add_column(RECORD_COLUMN, np.arange(len(train)))
        splits = _hold_out(train, hold_out_percentage, seed, stratify_by, data_options)
    return datasets.DatasetDict(
        {split: data.select(range(min(len(data), limits.get(split) or len(data)))) for split, data in splits.items()}
    )


def record_in_file(record: dict, index: int, split: str) -> tuple[int, str]:
    """Where the user finds a record, for a message: (its number, the split of the file holding it). A held-out
    share's records (either part) are rows of the training file (`RECORD_COLUMN`); others are where they stand."""
    if RECORD_COLUMN in record:
        return int(record[RECORD_COLUMN]), "train"
    return index, split


# Other datasets' names for the columns the scripts read (GSM8K's question, MATH's problem, the Stack's content): named
# in the fix of a missing column, as the option's value or as a rename in the DATA section.
OTHER_COLUMN_NAMES = {
    "prompt": ("question", "problem", "query", "instruction", "input"),
    "completion": ("answer", "response", "output", "solution", "target"),  # GSM8K's, MetaMathQA's, Dolly's, MATH's
    "chosen": ("preferred", "good", "accepted"),
    "rejected": ("dispreferred", "bad"),
    "text": ("content", "body", "document", "article", "raw_content", "story", "passage", "sentence", "review",
             "tweet", "utterance", "comment_text", "question", "title"),
    "label": ("labels", "target", "category", "class", "sentiment", "stars", "rating", "emotion", "intent", "score"),
}  # fmt: skip
# Hub datasets' sentence pairs (GLUE's MRPC, QQP, MNLI, QNLI; BoolQ; Amazon polarity), in their order.
TEXT_PAIRS = (
    ("sentence1", "sentence2"), ("question1", "question2"), ("premise", "hypothesis"), ("question", "sentence"),
    ("question", "passage"), ("title", "content"),
)  # fmt: skip


def likely_column(column: str, names: list[str]) -> str | None:
    """The column of `names` that likely holds what `column` names, for the fix of a missing one; None: none.
    The same name in other capitals ("Text", "Label") first."""
    same = [name for name in names if name != column and name.lower() == column.lower()]  # not itself: DPO asks both
    return next(iter(same), None) or next((name for name in OTHER_COLUMN_NAMES.get(column, ()) if name in names), None)


def text_pair(column: str, names: list[str]) -> tuple | None:
    """The known pair of text columns (`TEXT_PAIRS`) of `names` that holds `column` ("" : any); None: none."""
    return next((p for p in TEXT_PAIRS if all(c in names for c in p) and (not column or column in p)), None)


def _checked_split(dataset, split: str, columns: dict[str, str], blank: str, text=(), text_pairs=False):
    """`dataset` with its columns checked (and the rows of blank text dropped, with blank="drop"); the `text`
    columns must hold text. Record numbers in the messages count the rows as given, before anything is dropped.
    `text_pairs`: a missing text column's fix names a known pair of the data (`text_pair`)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")
    keep = None
    for column, option in columns.items():
        if column not in dataset.column_names:
            names = dataset.column_names
            separator = next((s for s in (";", "\t", "|") if len(names) == 1 and s in names[0]), None)
            guess, rename = likely_column(column, names), f"Rename yours to {column!r} in the script's DATA section"
            pair = text_pair("", names) if text_pairs and column in text else None
            guess = ",".join(pair) if pair and (guess is None or guess in pair) else guess  # MRPC: both sentences
            if separator:  # Excel in many locales saves "CSV" with semicolons: one column whose name holds them all
                fix = (
                    f"Its header looks separated by {separator!r}: save it separated by commas as .csv, or tabs as .tsv"
                )
            elif option.startswith("--"):  # a text column of another name (the Stack's "content"): named
                fix = f"Name the right one with {option}" + (f" {guess}" if guess else "")
            elif guess:  # a script without a column option: renamed in its DATA section
                fix = f"{rename}: data.rename_columns({{{guess!r}: {column!r}}})"
            else:
                fix = f"{rename} (the column of {option})"
            raise UsageError(f"the {split} data has no column {column!r}; its columns are {names}. {fix}")
        values = table[column]
        bad, what = values.is_null(), "an empty or missing"
        if blank == "refuse" and is_text(values):
            bad = pc.or_(bad, _is_blank(values))
        if pa.types.is_floating(values.type):  # JSON's NaN: a NaN loss at the first step, or NaN scores reported
            bad, what = pc.or_(bad, pc.fill_null(pc.invert(pc.is_finite(values)), False)), "a missing, NaN or infinite"
        count = pc.sum(bad).as_py() or 0
        if count:
            raise UsageError(
                f"{count} {split} records have {what} {column!r} "
                f"(first: {record_name(split, pc.index(bad, True).as_py(), with_split=False)}); fill or drop them"
            )
        if column in text and not is_text(values):
            row = _first_not_text(values)
            raise UsageError(
                f"the {split} data's {column!r} holds {_type_name(values.type)}, not text "
                f"(first: {record_name(split, row, with_split=False)}, {str(values[row].as_py())[:40]!r}); name a text "
                f"column with {option}, or give every record text there"
            )
        if blank == "drop" and is_text(values):
            keep = pc.invert(_is_blank(values)) if keep is None else pc.and_(keep, pc.invert(_is_blank(values)))
    if keep is not None:
        dataset = dataset.select(pc.indices_nonzero(keep).to_pylist())
    if len(dataset) == 0:
        raise UsageError(f"the {split} data holds no examples")
    return dataset


def _type_name(arrow_type) -> str:
    """What a column holds, in words: "int64 numbers", "values of mixed types (JSON)", "lists", ..."""
    import pyarrow as pa

    if isinstance(arrow_type, pa.BaseExtensionType):  # datasets' Json (Arrow's JsonType): records differ in type
        return "values of mixed types (text in some records, numbers or lists in others)"
    if pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type):
        return f"numbers ({arrow_type})"
    return "lists" if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) else str(arrow_type)


def _first_not_text(values) -> int:
    """The first record of a column that is not all text: of a column of mixed types (datasets' Json, each value
    JSON), the first whose value is not a JSON string; else the first."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not isinstance(values.type, pa.BaseExtensionType):
        return 0
    storage = pa.chunked_array([chunk.storage for chunk in values.chunks], values.type.storage_type)
    found = pc.invert(pc.fill_null(pc.starts_with(storage, '"'), False))
    return pc.index(found, True).as_py() if pc.any(found).as_py() else 0


def _is_blank(values):
    """True where a text value is empty or white space (False where it is missing)."""
    import pyarrow.compute as pc

    return pc.fill_null(pc.equal(pc.utf8_trim_whitespace(values), ""), False)


def _hold_out(train, percentage: int, seed: int, stratify_by: str | None, data_options: str) -> dict:
    """{"train": ..., "validation": ...}: `percentage` % of `train` held out (at least one record), by `seed`;
    stratified by the `stratify_by` column where it holds classes (`_stratified`)."""
    held_out = max(1, round(len(train) * percentage / 100))
    if len(train) - held_out < 1:
        raise UsageError(
            f"{len(train)} training record(s) are too few to hold out a validation split; "
            f"give more data or a validation split ({data_options})"
        )
    chosen = _stratified(train, stratify_by, held_out, seed) if stratify_by in train.column_names else None
    if chosen is None:
        parts = train.train_test_split(test_size=held_out, seed=seed)
        return {"train": parts["train"], "validation": parts["test"]}
    kept = np.ones(len(train), dtype=bool)
    kept[chosen] = False
    rng = np.random.default_rng([seed, 1])  # each part shuffled, as datasets' split does: --max_train_samples N
    parts = {"train": np.flatnonzero(kept), "validation": np.asarray(chosen, dtype=np.int64)}  # is then a sample
    return {split: train.select(rng.permutation(rows)) for split, rows in parts.items()}


def _stratified(train, column: str, held_out: int, seed: int) -> list[int] | None:
    """The rows to hold out, `held_out` of them, drawn from each class of `column` in proportion to its size
    (largest remainders first), each class keeping at least one row in training, so that no validation label is
    missing from training; within a class, by `seed`. None where `column` holds no classes (fractions, lists) or
    the classes cannot spare the rows. `datasets`' own stratified split refused a class of one example, and
    more classes than rows held out."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = train.with_format("arrow")[column]
    kind = values.type.value_type if pa.types.is_dictionary(values.type) else values.type
    # Whole numbers written as floats (0.0 and 1.0) are classes as integers are (--task classification gives them).
    whole = pa.types.is_floating(kind) and all(v.is_integer() for v in pc.unique(values).to_pylist() if v is not None)
    if not (is_text(values) or pa.types.is_integer(kind) or pa.types.is_boolean(kind) or whole):
        return None
    rows = {}
    for row, label in enumerate(values.to_pylist()):
        rows.setdefault(label, []).append(row)
    classes = sorted(rows, key=lambda label: (label is None, str(type(label)), str(label)))
    share = {label: len(rows[label]) * held_out / len(train) for label in classes}
    take = {label: min(int(share[label]), len(rows[label]) - 1) for label in classes}
    by_remainder = sorted(classes, key=lambda label: (-(share[label] - int(share[label])), -len(rows[label])))
    while sum(take.values()) < held_out:
        room = [label for label in by_remainder if take[label] < len(rows[label]) - 1]
        if not room:
            return None
        for label in room[: held_out - sum(take.values())]:
            take[label] += 1
    rng = np.random.default_rng(seed)
    return sorted(row for label in classes for row in rng.permutation(rows[label])[: take[label]].tolist())


def available_cores() -> int:
    """The cores this process may run on (its affinity under SLURM or taskset), for the data's preparation."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def preparation_processes(args, rows: int) -> int | None:
    """How many processes `datasets.map` tokenizes `rows` rows with (its num_proc; None: in this
    process): --preprocessing_num_workers if given, else one per 25,000 rows, up to the cores this
    process may run on. The other ranks of the node wait meanwhile (`load_on_main_first`), so the
    cores are free. No communication."""
    wanted = getattr(args, "preprocessing_num_workers", None)
    if wanted is None:
        cores = available_cores()
        wanted = min(cores, rows // ROWS_PER_PROCESS)
    return wanted if wanted > 1 else None
