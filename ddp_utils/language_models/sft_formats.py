"""SFT data in the shapes users bring: which shape a dataset's records have (`detect_format`, from the training
split's columns, logged), each record read as role/content turns (`SFTFormat.turns`), and data that is not SFT data
refused naming the script that takes it, or the line that reads it. No communication; any rank may call these."""

from __future__ import annotations

from dataclasses import dataclass, replace

from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..data.raw_data import likely_column
from ..data.record_names import record_name
from .turns import (
    NEEDS_TEMPLATE,
    alpaca_prompt,
    alpaca_prompt_turns,
    as_json_turns,
    as_messages,
    check_answers_learned,
    check_messages,
    clean_turn,
    record_tools,
    sharegpt_turns,
    text_content,
)

logger = get_logger(__name__)


FORMATS = "messages ([{'role', 'content'}, ...]), ShareGPT ([{'from', 'value'}, ...]), prompt/completion, Alpaca"
# Columns of pictures, sound or video (LLaMA-Factory's multimodal sets): refused, this fine-tuning is text-only.
MEDIA_COLUMNS = ("images", "image", "videos", "video", "audios", "audio")


@dataclass(frozen=True)
class SFTFormat:
    """How an SFT dataset's records read as conversations: `kind` is "messages", "sharegpt",
    "prompt/completion" or "alpaca", found from its columns (`detect_format`). Small and hashable:
    it is what the tokenizing function closes over, so a second launch on the same data, tokenizer
    and options finds the `datasets` cache (the run's other options do not change the fingerprint)."""

    kind: str
    columns: tuple[str, ...]  # the columns read, in the order of `kind`
    chat_template: bool | None  # render plain prompt/completion strings as chat turns; None: if the tokenizer can
    loss_on: str
    tools: str | None = None  # the column of each record's tools (function schemas), where the data has one

    def turns(self, record: dict, index: int, split: str) -> list[dict] | None:
        """The record as role/content turns, or None for a plain prompt/completion pair trained
        without a chat template. A record that does not fit the format is a UsageError naming it."""
        where = record_name(split, index)
        if self.kind in ("messages", "sharegpt"):
            turns = as_json_turns(record[self.columns[0]], where)
            if self.kind == "sharegpt":
                fix = f"the formats: {FORMATS}; name the right column with --messages_column"
                turns = sharegpt_turns(turns, where, "SFT", fix)
                system = record.get("system")  # LLaMA-Factory's system column, where the turns have none
                if isinstance(system, str) and system.strip() and not (turns and turns[0]["role"] == "system"):
                    turns = [{"role": "system", "content": system}, *turns]
        else:
            prompt, completion = self.prompt_and_completion(record)
            earlier = alpaca_prompt_turns(record, where)[:-1] if self.kind == "alpaca" else []  # system, history
            if isinstance(prompt, str) and isinstance(completion, str) and not self.chat_template:
                if earlier:
                    raise UsageError(f"{where} has a system text or a history, which only a chat template shows: "
                                     f"{NEEDS_TEMPLATE}")  # fmt: skip
                return None
            turns = as_messages(prompt, completion)
            turns = [*earlier, *turns] if isinstance(turns, list) else turns
        if isinstance(turns, list):  # tool calls parsed, the keys `datasets` filled with None dropped
            turns = [clean_turn(turn, where) if isinstance(turn, dict) else turn for turn in turns]
        if self.kind in ("messages", "sharegpt"):
            check_messages(turns, index, split)
        turns = text_content(turns, index, split)
        if isinstance(turns, list):
            check_answers_learned(turns, self.loss_on, where)
        return turns

    def record_tools(self, record: dict, index: int, split: str) -> list[dict] | None:
        """The record's tools, as templates render them (`turns.record_tools`), or None."""
        return record_tools(record.get(self.tools), record_name(split, index)) if self.tools else None

    def prompt_and_completion(self, record: dict):
        """A prompt/completion or Alpaca record's prompt and answer (Alpaca: the instruction, then
        its input after a blank line when there is one)."""
        if self.kind == "alpaca":
            instruction, extra, output = (record.get(c) for c in self.columns)
            return alpaca_prompt(instruction, extra), output
        return record[self.columns[0]], record[self.columns[1]]


def detect_format(raw, args) -> tuple[SFTFormat, dict[str, str]]:
    """The SFT format of `raw` from its training split's columns, and the columns it needs (each
    with the option that names it, for `check_splits`): a conversation column (--messages_column,
    else "conversations") of role/content turns (messages) or from/value turns (ShareGPT); else
    --prompt_column and --completion_column; else Alpaca's instruction, optional input, output.
    Logged. Data that fits none is a UsageError that lists the formats and the options."""
    train = raw["train"] if "train" in raw else next(iter(raw.values()))  # check_splits refuses data without one
    columns, options = train.column_names, dict(chat_template=args.chat_template, loss_on=args.loss_on)
    refuse_other_data(train)
    conversations = next((c for c in (args.messages_column, "conversations") if c in columns), None)
    if conversations is not None:
        first = next((turns for turns in train.select_columns(conversations).to_iterable_dataset() if turns), None)
        first = (first or {}).get(conversations) or [{}]
        try:  # a CSV's cell, or a column stored as text: the conversation as JSON
            first = as_json_turns(first, "") or [{}]
        except UsageError:
            pass  # refused by record, with its number, when it is read
        kind = "sharegpt" if isinstance(first[0], dict) and "from" in first[0] else "messages"
        fmt, needed = SFTFormat(kind, (conversations,), **options), {conversations: "--messages_column"}
    elif args.prompt_column in columns or args.completion_column in columns:
        fmt = SFTFormat("prompt/completion", (args.prompt_column, args.completion_column), **options)
        needed = {args.prompt_column: "--prompt_column", args.completion_column: "--completion_column"}
    elif "instruction" in columns and "output" in columns:
        fmt = SFTFormat("alpaca", ("instruction", "input", "output"), **options)
        needed = {"instruction": "the Alpaca format", "output": "the Alpaca format"}
    else:
        raise UsageError(f"the train data's columns {columns} fit none of the SFT formats: {FORMATS}; {_fix(columns)}")
    if "tools" in columns:  # each record's own (None where it has none); a validation file may lack the column
        fmt = replace(fmt, tools="tools")
    name = {
        "messages": "messages",
        "sharegpt": "ShareGPT",
        "prompt/completion": "prompt/completion",
        "alpaca": "Alpaca",
    }
    read = [c for c in (*fmt.columns, fmt.tools) if c in columns]
    logger.info(f"SFT data format: {name[fmt.kind]} (columns {', '.join(read)})")
    return fmt, needed


def _fix(columns: list[str]) -> str:
    """The fix for columns that fit no format: the options that name the likely prompt and answer columns (GSM8K's
    question/answer, MetaMathQA's query/response), Dolly's instruction/context/response renamed to Alpaca's."""
    asked = likely_column("prompt", columns)
    answer = likely_column("completion", columns)
    if asked == "instruction" and answer:  # Dolly: its context is Alpaca's input (where there is none yet)
        context = "context" in columns and "input" not in columns
        renames = {**({"context": "input"} if context else {}), answer: "output"}
        return f"read it as Alpaca's in the script's DATA section: data = data.rename_columns({renames})"
    if asked and answer:
        return f"name them: --prompt_column {asked} --completion_column {answer}"
    return (
        "name the conversation column with --messages_column, or the prompt and answer with --prompt_column and "
        "--completion_column"
    )


def refuse_other_data(train) -> None:
    """A UsageError that names what the data is, when it is not SFT data: preference pairs
    (chosen/rejected: TRL's and LLaMA-Factory's shape), unpaired preference data (KTO: a boolean
    label or kto_tag per answer), or records with pictures, sound or video (MEDIA_COLUMNS, not
    empty). No communication."""
    import pyarrow.compute as pc

    columns = train.column_names
    if "chosen" in columns and "rejected" in columns:
        raise UsageError(
            "this is preference data (a 'chosen' and a 'rejected' answer per record), for preference tuning: "
            "scripts/train_dpo.py takes it. For SFT, give the chosen answers as messages or prompt/completion"
        )
    for tag in ("label", "kto_tag"):
        if tag in columns and getattr(train.features[tag], "dtype", None) == "bool":
            raise UsageError(
                f"this is unpaired preference data (KTO: an answer per record with a boolean {tag!r}), which no "
                f"script here trains on (TRL's KTOTrainer does). For SFT, keep the records whose {tag} is true and "
                "drop that column"
            )
    for column in (c for c in MEDIA_COLUMNS if c in columns):  # an empty one (text-only records) is no matter
        values = train.with_format("arrow")[column]
        if str(values.type).startswith(("list", "large_list")):
            filled = pc.greater(pc.list_value_length(values), 0)
        elif str(values.type) in ("string", "large_string"):
            filled = pc.not_equal(values, "")
        else:
            filled = pc.invert(values.is_null())
        if pc.any(pc.fill_null(filled, False)).as_py():
            raise UsageError(
                f"the data has a {column!r} column (pictures, sound or video, LLaMA-Factory's multimodal shape), and "
                "this script fine-tunes on text only: it would learn their placeholders as words. Drop the column and "
                "those records, or use a vision-language fine-tuning script"
            )
