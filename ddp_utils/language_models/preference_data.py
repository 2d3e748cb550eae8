"""Preference pairs as training rows: each record's prompt, its chosen and its rejected answer, read in its shape
(`pair_formats`), tokenized the same way for both sides (`tokenize_pairs`), batched by `pair_batches.PairCollator`.
Nothing here communicates: the script calls `tokenize_pairs` inside `load_on_main_first`."""

from __future__ import annotations

import re

import datasets
import numpy as np
from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..data.raw_data import record_in_file
from ..data.record_names import record_name
from .chat import cut_middle, head_length, plain_prompt_ids, render
from .pair_formats import NAMES, PairFormat
from .sft_data import PROMPT_SEPARATOR, settle_chat_template

logger = get_logger(__name__)

ROLE_MARKERS = re.compile(r"(?:^|\n)\s*(?:Human|Assistant):")  # a prompt already formatted, Anthropic HH's way


def tokenize_pair(pair, fmt: PairFormat, tokenizer) -> tuple[list[int], list[int], list[int], str]:
    """(prompt ids, chosen ids, rejected ids, the chosen answer's text) of one pair, each answer
    tokenized on its own after the prompt, as the model generates it. Turns: the chat template,
    the prompt with its generation prompt and each answer what the template adds after it (with its
    end-of-turn marker). Strings: BOS + prompt + PROMPT_SEPARATOR (none for an implicit prompt,
    whose text is whole), and each answer + EOS."""
    prompt, chosen, rejected = pair
    if isinstance(prompt, str) and not fmt.chat_template:
        separator = "" if fmt.kind == "implicit" else PROMPT_SEPARATOR
        prompt_ids = plain_prompt_ids(tokenizer, prompt, separator)
        answers = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in pair[1:]]
        return prompt_ids, answers[0], answers[1], chosen
    if isinstance(prompt, str):
        prompt, chosen, rejected = (
            [{"role": "user", "content": prompt}],
            *([{"role": "assistant", "content": answer}] for answer in (chosen, rejected)),
        )
    if not tokenizer.chat_template:
        raise UsageError(
            f"these conversations need a chat template, and the tokenizer of {tokenizer.name_or_path!r} has none; "
            "use an instruct model's tokenizer, or give prompt/chosen/rejected as plain strings"
        )
    asked = render(tokenizer, prompt, generation_prompt=True)
    answers = []
    for answer in (chosen, rejected):
        whole = render(tokenizer, prompt + answer)
        if not whole.startswith(asked):
            raise UsageError(
                "this chat template renders the prompt differently once an answer follows, so the answer's tokens "
                "cannot be told from the prompt's; use a model whose template renders the prompt the same"
            )
        answers.append(tokenizer(whole[len(asked) :].rstrip(), add_special_tokens=False)["input_ids"])
    prompt_ids = tokenizer(asked, add_special_tokens=False)["input_ids"]
    return prompt_ids, answers[0], answers[1], "\n".join(turn["content"] for turn in chosen)


def prompt_head(prompt, fmt: PairFormat, tokenizer) -> int:
    """The first tokens of a pair's prompt that a cut keeps (`chat.head_length`): BOS, and a system turn (the
    template's own too, where it adds one); a string prompt rendered as a user turn, as `tokenize_pair` renders it."""
    if isinstance(prompt, str) and fmt.chat_template:
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and fmt.chat_template is not False and tokenizer.chat_template:
        return head_length(tokenizer, prompt, render(tokenizer, prompt, generation_prompt=True))
    return 1 if tokenizer.bos_token_id is not None else 0


def tokenize_pairs(raw, fmt: PairFormat, tokenizer, block_size: int, eval_max_new_tokens: int = 0, num_proc=None):
    """(tokenized splits, report). "train" and "validation": rows of prompt_ids, chosen_ids,
    rejected_ids, `length` (prompt + both answers: the pair's row in `pair_batches.PairCollator`) and `index`
    (the row's number, by which evaluation gathers each pair once). `block_size` bounds what the
    model sees as one sequence, the prompt and one answer: both sides keep the same prompt, cut after
    BOS and the system turn (`chat.head_length`) when it and the longer answer pass `block_size`; a
    pair whose longer answer alone does not fit is dropped; both counted in the report and logged. The report also
    names each split's shape (preference_format, and validation_preference_format where the validation's differs).
    "generate": the validation prompts (index, input_ids, reference: the chosen answer), when
    `eval_max_new_tokens`, for `generation.score_by_generation`."""

    def settled(kind):  # plain strings become chat turns as in train_sft.py; an implicit prompt's texts are whole
        return PairFormat(kind, kind != "implicit" and settle_chat_template(fmt.chat_template, tokenizer, NAMES[kind]))

    formats = {"train": settled(fmt.kind)}
    formats["validation"] = settled(fmt.validation_kind) if fmt.validation_kind else formats["train"]
    if fmt.validation_kind:
        _check_same_rendering(raw, formats)

    def encode(batch, indices, split):
        fmt = formats[split]
        columns = ("prompt_ids", "chosen_ids", "rejected_ids", "length", "prompt_cut", "prompt_head", "reference")
        columns += ("prompt_marked", "prompt_repeated")  # counted for a warning, then dropped
        out = {key: [] for key in columns}
        for n, index in enumerate(indices):
            record = {key: values[n] for key, values in batch.items()}
            where = record_in_file(record, index, split)
            pair = fmt.pair(record, *where)
            prompt, chosen, rejected, reference = tokenize_pair(pair, fmt, tokenizer)
            if chosen == rejected:  # texts that differ in trailing white space only: no gradient, nothing learned
                raise UsageError(
                    f"{record_name(where[1], where[0])}: its chosen and rejected answers are the same tokens (they "
                    "differ only in white space or in what the tokenizer drops), so it teaches nothing; drop it"
                )
            longest = max(len(chosen), len(rejected))
            cut = max(len(prompt) + longest - block_size, 0)
            fits = cut < len(prompt)  # a prompt token must be left to predict the answers' first token
            # BOS and the system turn stay, in training and where generation cuts the prompt further
            to_cut = cut or (split == "validation" and len(prompt) > block_size - eval_max_new_tokens)
            head = prompt_head(pair[0], fmt, tokenizer) if to_cut and fits else 0
            out["prompt_head"].append(head)
            out["prompt_ids"].append(cut_middle(prompt, head, cut) if fits else [])
            out["chosen_ids"].append(chosen if fits else [])
            out["rejected_ids"].append(rejected if fits else [])
            out["length"].append(len(prompt) - cut + len(chosen) + len(rejected) if fits else 0)
            out["prompt_cut"].append(cut if fits else -1)  # -1: dropped
            out["reference"].append(reference)
            marked = fmt.chat_template and isinstance(pair[0], str) and ROLE_MARKERS.search(pair[0])
            out["prompt_marked"].append(bool(marked))
            out["prompt_repeated"].append(_repeats_prompt(pair))
        return out

    tokenized, report = datasets.DatasetDict(), {"preference_format": fmt.kind}
    if fmt.validation_kind:  # the report tells what each split was read as
        report["validation_preference_format"] = fmt.validation_kind
    for split in ("train", "validation"):
        rows = raw[split].map(
            encode,
            batched=True,
            with_indices=True,
            fn_kwargs={"split": split},
            remove_columns=raw[split].column_names,
            num_proc=num_proc if split == "train" else None,
            desc=f"Tokenizing {split} pairs",
        )
        cut = np.asarray(rows.with_format("numpy")["prompt_cut"])
        report.update(_count_cuts(cut, split, block_size))
        _warn_of_prompts(rows, split)
        if split == "validation" and eval_max_new_tokens:
            tokenized["generate"] = _generation_prompts(rows, block_size - eval_max_new_tokens)
        rows = rows.filter(lambda c: c >= 0, input_columns="prompt_cut")
        rows = rows.remove_columns(["prompt_cut", "prompt_head", "reference", "prompt_marked", "prompt_repeated"])
        if len(rows) == 0:
            raise UsageError(f"no {split} pair's answers fit in --block_size {block_size} tokens; raise --block_size")
        tokenized[split] = rows.add_column("index", np.arange(len(rows)))
    return tokenized, report


def _check_same_rendering(raw, formats: dict) -> None:
    """A UsageError where the chat template renders one split's pairs and the other's are plain text: the
    validation scores would measure a format training never showed (each split's first pair decides)."""
    seen = {}
    for split, fmt in formats.items():
        record = raw[split][0]
        prompt = fmt.pair(record, *record_in_file(record, 0, split))[0]
        seen[split] = "as plain text" if isinstance(prompt, str) and not fmt.chat_template else "by the chat template"
    if seen["train"] != seen["validation"]:
        raise UsageError(
            f"the train pairs ({NAMES[formats['train'].kind]}) are rendered {seen['train']}, the validation pairs "
            f"({NAMES[formats['validation'].kind]}) {seen['validation']}: give them in the training's shape"
        )


def _repeats_prompt(pair) -> bool:
    """Whether both answers start with the prompt's text (its last turn's): the prompt then trains as theirs. A prompt
    of fewer than 12 characters ("Hi") is not counted: answers may well start with it (characters, not words, as
    Chinese and Japanese write no spaces)."""
    asked = (pair[0] if isinstance(pair[0], str) else pair[0][-1]["content"]).strip()
    answers = [(text if isinstance(text, str) else text[0]["content"]).lstrip() for text in pair[1:]]
    return len(asked) >= 12 and all(answer.startswith(asked) for answer in answers)


def _warn_of_prompts(rows, split: str) -> None:
    """Warnings (the data may mean it): prompts with a format of their own (Dahoas' "Human: ... Assistant:") that
    the chat template wraps too, said only at INFO before; pairs whose answers both repeat their prompt."""
    marked, repeated = (int(np.sum(rows.with_format("numpy")[key])) for key in ("prompt_marked", "prompt_repeated"))
    if marked:
        logger.warning(
            f"{split}: {marked} prompts carry 'Human:'/'Assistant:' markers, a format of their own, and the chat "
            "template wraps them in its turns too; --no-chat_template trains them as written"
        )
    if repeated:
        logger.warning(
            f"{split}: in {repeated} pairs both answers start with their prompt's text, which trains as part of the "
            "answers then (with --sft_weight, in SimPO's mean per token); drop it from them if it is not theirs"
        )


def _count_cuts(cut: np.ndarray, split: str, block_size: int) -> dict:
    counts = {
        f"{split}_pairs": int((cut >= 0).sum()),
        f"{split}_pairs_prompt_cut": int((cut > 0).sum()),
        f"{split}_prompt_tokens_cut": int(cut[cut > 0].sum()),
        f"{split}_pairs_dropped": int((cut < 0).sum()),
    }
    if counts[f"{split}_pairs_prompt_cut"]:
        logger.info(
            f"{split}: {counts[f'{split}_pairs_prompt_cut']} pairs longer than --block_size {block_size} lost "
            f"{counts[f'{split}_prompt_tokens_cut']} prompt tokens after BOS and the system turn, the same on both "
            "sides; their answers are whole"
        )
    if counts[f"{split}_pairs_dropped"]:
        logger.warning(
            f"{split}: {counts[f'{split}_pairs_dropped']} pairs dropped: an answer of theirs does not fit in "
            f"--block_size {block_size} tokens with a token of its prompt; raise --block_size"
        )
    return counts


def _generation_prompts(rows, max_prompt: int):
    """The validation prompts answered by generation: index (the record's), input_ids (cut to
    `max_prompt` tokens after BOS and the system turn, as in training), reference (the chosen answer)."""
    if max_prompt < 1:
        raise UsageError("--eval_max_new_tokens leaves no room for a prompt in --block_size; lower it")

    def prompts(batch, indices):
        cut = [
            cut_middle(ids, head, max(len(ids) - max_prompt, 0))
            for ids, head in zip(batch["prompt_ids"], batch["prompt_head"])
        ]
        return {"index": indices, "input_ids": cut}

    rows = rows.filter(lambda c: c >= 0, input_columns="prompt_cut")
    unused = [column for column in rows.column_names if column != "reference"]
    return rows.map(prompts, batched=True, with_indices=True, remove_columns=unused, desc="Eval prompts")
