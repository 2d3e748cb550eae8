"""Preference pairs in the shapes users bring: which shape a split's records have (`detect_pair_format`, per split),
and each record read as its prompt, chosen and rejected answer (`PairFormat.pair`), checked, with the fix in one line
naming the record. No communication; any rank may call these."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..data.raw_data import likely_column
from ..data.record_names import record_name
from .turns import alpaca_prompt_turns, json_turns, sharegpt_turns, text_content

logger = get_logger(__name__)

PAIR_FORMATS = (
    "prompt/chosen/rejected as strings or as conversations (TRL), chosen/rejected conversations that share their "
    "first turns (an implicit prompt), LLaMA-Factory's instruction/input/chosen/rejected, system/question/chosen/"
    "rejected (orca_dpo_pairs), system/input/chosen/rejected (argilla's distilabel pairs), or ShareGPT's "
    "conversations/chosen/rejected"
)
NAMES = {
    "strings": "prompt/chosen/rejected strings",
    "conversational": "prompt/chosen/rejected conversations",
    "implicit": "chosen/rejected with an implicit prompt",
    "alpaca": "LLaMA-Factory instruction/input/chosen/rejected",
    "question": "system/question/chosen/rejected (Intel's orca_dpo_pairs)",
    "input": "system/input/chosen/rejected (argilla's distilabel pairs)",
    "sharegpt": "ShareGPT conversations/chosen/rejected",
}


@dataclass(frozen=True)
class PairFormat:
    """How a preference dataset's records read as (prompt, chosen, rejected): `kind` is one of
    NAMES, found from its columns (`detect_pair_format`). Small and hashable: the tokenizing
    function closes over it, so a second launch on the same data finds the `datasets` cache."""

    kind: str
    chat_template: bool | None  # plain strings as chat turns; None: if the tokenizer has a template
    validation_kind: str | None = None  # a validation split in another shape, read in its own (`tokenize_pairs`)

    def pair(self, record: dict, index: int, split: str):
        """(prompt, chosen, rejected): three strings, or a prompt of turns and two answers of
        assistant turns. A record that does not fit, an empty side, or a pair whose two answers are
        the same is a UsageError that names the record and the fix."""
        where = record_name(split, index)
        record = {**record, **json_turns(record, ("prompt", "chosen", "rejected"))}  # a CSV's cells
        if self.kind == "implicit":
            prompt, chosen, rejected = _split_implicit(record["chosen"], record["rejected"], where)
        elif self.kind in ("alpaca", "question", "input"):  # orca_dpo_pairs, argilla's: a system text and a question
            asked = record if self.kind == "alpaca" else {**record, "instruction": record[self.kind]}
            if self.kind == "input":  # argilla's input is the question itself, not text after it
                asked["input"] = None
            question = asked.get("instruction")
            if self.kind != "alpaca" and not (isinstance(question, str) and question.strip()):  # a system text alone
                raise UsageError(f"{where}: its {self.kind} is empty; fill it or drop the record")
            prompt = alpaca_prompt_turns(asked, where)
            chosen, rejected = record["chosen"], record["rejected"]
            if isinstance(chosen, str) and isinstance(rejected, str) and len(prompt) == 1:
                prompt = prompt[0]["content"]  # a plain pair: rendered as the strings shape is
            elif self.chat_template is False:  # else some records by the template, others plain, in one run
                raise UsageError(f"{where} has a system text or a history, which only a chat template shows: "
                                 "drop --no-chat_template")  # fmt: skip
        elif self.kind == "sharegpt":
            fix = f"the formats: {PAIR_FORMATS}"
            prompt = sharegpt_turns(record["conversations"], where, "preference", fix)
            if record.get("system"):
                prompt.insert(0, {"role": "system", "content": record["system"]})
            chosen, rejected = (
                sharegpt_turns([record[side]], where, "preference", fix) for side in ("chosen", "rejected")
            )
        else:
            prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
            if _holds_prompt_turns(chosen) and _holds_prompt_turns(rejected):
                # Whole conversations next to their prompt (UltraFeedback's shape): their shared turns are the prompt.
                prompt, chosen, rejected = _split_implicit(chosen, rejected, where)
        return _checked(prompt, chosen, rejected, index, split)


def detect_pair_format(raw, chat_template: bool | None) -> PairFormat:
    """The preference format of `raw` from each split's columns, logged: a validation split in another shape is
    read in its own (before, in the training's: a raw KeyError). Data that is not preference pairs is a UsageError
    that says what it is and which script takes it."""
    train = raw["train"] if "train" in raw else next(iter(raw.values()))
    kind = _pair_kind(train, "train")
    logger.info(f"preference data format: {NAMES[kind]}")
    held_out = next((raw[split] for split in ("validation", "test") if split in raw and raw[split] is not train), None)
    validation = _pair_kind(held_out, "validation") if held_out is not None and len(held_out) else kind
    if validation != kind:
        logger.info(f"validation preference data format: {NAMES[validation]}")
    for split, data in (("train", train), ("validation", held_out)):
        if data is not None:
            _warn_of_ties(data, split)
    return PairFormat(kind, chat_template, validation if validation != kind else None)


def _pair_kind(data, split: str) -> str:
    """The kind (a key of NAMES) of a split's records, from its columns (and its first record's prompt)."""
    columns = data.column_names
    if not ("chosen" in columns and "rejected" in columns):
        sft = {"messages", "conversations", "completion", "output"} & set(columns)
        kto = any(getattr(data.features.get(c), "dtype", None) == "bool" for c in ("label", "kto_tag"))
        renames = {guess: c for c in ("chosen", "rejected") if (guess := likely_column(c, columns))}
        raise UsageError(
            f"the {split} data's columns {columns} hold no preference pairs (a 'chosen' and a 'rejected' answer per "
            "record); "
            + (
                "this looks like SFT data: scripts/train_sft.py takes it"
                if sft and not kto
                else "unpaired preference data (KTO) is not trained here (TRL's KTOTrainer does)"
                if kto
                else f"rename yours in the script's DATA section: data.rename_columns({renames})"
                if renames
                else f"the formats: {PAIR_FORMATS}"
            )
        )
    if "conversations" in columns:
        return "sharegpt"
    if "instruction" in columns:
        return "alpaca"
    first = data[0]
    asked = next((column for column in ("question", "input") if column in columns), None)  # orca's, argilla's
    if asked and "prompt" not in columns and not _holds_prompt_turns(first["chosen"]):  # else answers hold the prompt
        return asked
    if "prompt" in columns:
        return "conversational" if not isinstance(first["prompt"], str) or json_turns(first, ("prompt",)) else "strings"
    return "implicit"


def _score_columns(columns) -> tuple[str, str] | None:
    """The chosen and rejected answers' score columns, where the data has a pair named alike: UltraFeedback's
    score_chosen/score_rejected, argilla's chosen-rating/rejected-rating or rating_chosen/rating_rejected."""
    for column in columns:
        other = column.replace("chosen", "rejected")
        if other != column and other in columns and re.search("score|rating", column):
            return column, other
    return None


def _warn_of_ties(data, split: str) -> None:
    """A warning for pairs their own data marks as no preference: a chosen answer scored no higher than the
    rejected one (UltraFeedback binarized keeps its ties), or argilla's status "tie" (their card drops those). DPO
    pushes the two apart all the same; the data may mean it, so they are counted, not dropped."""
    scores, columns = _score_columns(data.column_names), data.column_names
    try:
        chosen, rejected = (np.asarray(data[c], dtype=float) for c in scores) if scores else ([], [])
    except (TypeError, ValueError):  # scores that are not numbers: not scores to compare
        chosen = rejected = []
    if len(chosen):
        tied, below = int(np.sum(chosen == rejected)), int(np.sum(chosen < rejected))
        if tied or below:
            logger.warning(
                f"{split}: in {tied} pairs {scores[0]} equals {scores[1]} and in {below} it is lower: nothing tells "
                f"their answers apart, and DPO pushes them apart all the same; to drop them, in the DATA section: "
                f"data = data.filter(lambda r: None in (r[{scores[0]!r}], r[{scores[1]!r}]) or "
                f"r[{scores[0]!r}] > r[{scores[1]!r}])"
            )
    if "status" in columns and (ties := sum(status == "tie" for status in data["status"])):
        logger.warning(
            f"{split}: {ties} pairs have status 'tie' (argilla's: the two answers rated the same), and DPO pushes them "
            "apart all the same; to drop them, in the DATA section: data = data.filter(lambda r: r['status'] != 'tie')"
        )


def _holds_prompt_turns(answer) -> bool:
    """Whether an answer is a conversation that holds a turn that is not the assistant's (its prompt)."""
    return isinstance(answer, list) and any(isinstance(t, dict) and t.get("role") != "assistant" for t in answer)


def _shared_length(first, second) -> int:
    """How many items (turns or characters) `first` and `second` share at their start."""
    shared = 0
    while shared < min(len(first), len(second)) and first[shared] == second[shared]:
        shared += 1
    return shared


def _split_implicit(chosen, rejected, where: str):
    """(prompt, chosen answer, rejected answer) of two full conversations (or texts) that share
    their start: the shared turns are the prompt; for texts, the shared characters up to the last
    white space before they differ."""
    if chosen == rejected:
        raise UsageError(f"{where}: its chosen and rejected answers are the same, so it teaches nothing; drop it")
    if isinstance(chosen, str) and isinstance(rejected, str):
        shared = _shared_length(chosen, rejected)
        # The prompt ends before the last white space the two share: both answers start at a word.
        spaces = [i for i, char in enumerate(chosen[:shared]) if char.isspace()]
        prompt = chosen[: spaces[-1]].rstrip() if spaces else ""
        return prompt, chosen[len(prompt) :], rejected[len(prompt) :]
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise UsageError(
            f"{where}: without a prompt column, 'chosen' and 'rejected' must both be conversations (lists of turns) "
            f"or both texts; the formats: {PAIR_FORMATS}"
        )
    shared = _shared_length(chosen, rejected)
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _checked(prompt, chosen, rejected, index: int, split: str):
    """The pair with each answer as a list of assistant turns when the prompt is turns (or an
    answer is); a UsageError for an empty side, answers that are not the assistant's, or two
    answers that are the same."""
    where = record_name(split, index)
    for side, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if value is None:  # a null, a missing key, an empty CSV cell
            raise UsageError(f"{where}: its {side} is missing; fill it or drop the record")
    if isinstance(prompt, list) or not (isinstance(chosen, str) and isinstance(rejected, str)):
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        chosen, rejected = (_as_turns(answer) for answer in (chosen, rejected))
        if not all(isinstance(turns, list) for turns in (prompt, chosen, rejected)):
            raise UsageError(f"{where} fits none of the preference formats: {PAIR_FORMATS}")
        turns = prompt + chosen + rejected
        if any(isinstance(t, dict) and (t.get("tool_calls") or t.get("role") == "tool") for t in turns):
            raise UsageError(f"{where} holds tool calls or results: DPO here learns text; train_sft.py learns calls")
        if not all(isinstance(t, dict) and t.get("role") and t.get("content") is not None for t in turns):
            raise UsageError(f"{where}: every turn needs a 'role' and a 'content', got {str(turns)[:160]!r}")
        prompt, chosen, rejected = (text_content(turns, index, split) for turns in (prompt, chosen, rejected))
        for side, answer in (("chosen", chosen), ("rejected", rejected)):
            other = next((turn["role"] for turn in answer if turn["role"] != "assistant"), None)
            if other is not None:
                raise UsageError(
                    f"{where}: its {side} answer holds a {other!r} turn where only the assistant's turns may be: the "
                    "two answers must differ only after the prompt's last turn"
                )
    for side, answer in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        text = answer if isinstance(answer, str) else "".join(turn["content"] for turn in answer)
        if not text.strip():
            raise UsageError(f"{where}: its {side} is empty; fill it or drop the record")
    if chosen == rejected:
        raise UsageError(f"{where}: its chosen and rejected answers are the same, so it teaches nothing; drop it")
    return prompt, chosen, rejected


def _as_turns(answer):
    """An answer as a list of turns: a string is one assistant turn, a dict one turn."""
    if isinstance(answer, str):
        return [{"role": "assistant", "content": answer}]
    return [answer] if isinstance(answer, dict) else answer
