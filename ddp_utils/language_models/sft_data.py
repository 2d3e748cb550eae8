"""SFT records as training rows: each record (a conversation, or a prompt/completion pair) as
token ids with labels -100 where a token is not learned, cut to the block from its start (never
the answer), counted when cut or dropped; the eval prompts answered by generation; packing.
Nothing here communicates: the script calls `tokenize_sft` inside `load_on_main_first`."""

from __future__ import annotations

from dataclasses import replace

import datasets
import numpy as np
from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..data.raw_data import record_in_file
from ..data.record_names import record_name
from .causal_lm import IGNORE_INDEX
from .chat import (
    PROMPT_SEPARATOR,
    bos_head,
    cut_middle,
    cut_prompt,
    fit_block,
    generation_prompt,
    plain_prompt_ids,
    tokenize_conversation,
)
from .sft_formats import SFTFormat
from .token_blocks import packed_examples
from .turns import (
    NEEDS_TEMPLATE,
)

logger = get_logger(__name__)


def tokenize_record(record: dict, fmt: SFTFormat, tokenizer, block_size: int, index: int = 0, split: str = "train"):
    """(input_ids, labels, tokens of context cut) of one SFT record, or None when its answer does
    not fit in `block_size` tokens. Conversations: the chat template, the loss on --loss_on's
    turns. Plain pairs: BOS + prompt + completion + EOS, the loss on the completion and EOS."""
    messages, tools = fmt.turns(record, index, split), fmt.record_tools(record, index, split)
    if messages is not None:
        where = record_name(split, index)
        return tokenize_conversation(tokenizer, messages, fmt.loss_on, block_size, tools=tools, where=where)
    if tools:
        raise UsageError(f"{record_name(split, index)} has tools, which only a chat template shows: {NEEDS_TEMPLATE}")
    prompt, completion = fmt.prompt_and_completion(record)
    prompt = plain_prompt_ids(tokenizer, prompt)
    completion = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    labels = (prompt if fmt.loss_on == "all" else [IGNORE_INDEX] * len(prompt)) + completion
    head = bos_head(tokenizer, prompt)
    return fit_block(prompt + completion, labels, block_size, cut_targets=fmt.loss_on == "all", head=head)


def generation_prompt_ids(record: dict, fmt: SFTFormat, tokenizer, max_prompt_tokens: int, index: int = 0):
    """(prompt ids that ask for the record's last answer, cut to `max_prompt_tokens` after BOS and
    the system turn as in training (`chat.head_length`); the reference answer; whether it was cut)."""
    messages, tools = fmt.turns(record, index, "validation"), fmt.record_tools(record, index, "validation")
    if messages is not None:
        text, reference = generation_prompt(tokenizer, messages, tools)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        prompt, reference = fmt.prompt_and_completion(record)
        ids = plain_prompt_ids(tokenizer, prompt)
    cut = max(len(ids) - max_prompt_tokens, 0)
    if not cut:
        return ids, reference, False
    if messages is None:
        return cut_middle(ids, bos_head(tokenizer, ids), cut), reference, True
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return cut_prompt(tokenizer, messages[:last], text, ids, tools, cut), reference, True


def warn_of_answers_that_never_stop(rows, tokenizer, fmt: SFTFormat, sample: int = 200) -> None:
    """Warn once when the answers learned do not end with a token generation stops at (EOS, or the
    chat template's end of turn, `chat.end_of_turn`): the model would learn no end of its answers,
    and every answer by generation would run to --eval_max_new_tokens. A template that ends turns
    with whitespace alone is named. Looks at the first `sample` rows; no communication."""
    from .chat import end_of_turn

    end, after = end_of_turn(tokenizer) if fmt.chat_template else (None, "")
    if fmt.chat_template and end is None:
        logger.warning(
            f"this chat template ends an assistant turn with whitespace alone ({after!r}), which is not learned: the "
            "model learns no end of its answers, and generation stops only at EOS or --eval_max_new_tokens; give a "
            "template that ends turns with a token"
        )
        return
    stops = {tokenizer.eos_token_id, end} - {None}
    last = [next((t for t in reversed(labels) if t != IGNORE_INDEX), None) for labels in rows[:sample]["labels"]]
    open_ended = [token for token in last if token is not None and token not in stops]
    if open_ended and fmt.loss_on != "all":
        logger.warning(
            f"{len(open_ended)} of the first {len(last)} answers end with {tokenizer.decode([open_ended[0]])!r}, "
            "not with a token generation stops at (EOS or the chat template's end of turn): the model will not learn "
            "to stop there"
        )


def tokenize_sft(
    raw,
    fmt: SFTFormat,
    tokenizer,
    block_size: int,
    eval_max_new_tokens: int = 0,
    packing: bool = False,
    num_proc: int | None = None,
):
    """(tokenized splits, report). "train" and "validation": one sequence per record (or packed,
    with `packing`), with labels -100 where a token is not learned; "generate": the validation
    prompts answered by generation, with their references (when `eval_max_new_tokens`). The report
    counts records whose context was cut, earlier answers left out of the loss because they did not
    fit whole, and records dropped (not even their last answer fits), per split. Plain
    prompt/completion strings are rendered as a user and an assistant turn when the tokenizer has a
    chat template (unless --no-chat_template), else joined with PROMPT_SEPARATOR; the log says
    which. `num_proc` processes tokenize (`raw_data.preparation_processes`). The functions given to
    `datasets.map` see only `fmt`, the tokenizer and the sizes, so the `datasets` cache serves a
    second launch on the same data and options."""
    fmt = _settle_chat_template(fmt, tokenizer)
    if fmt.kind in ("messages", "sharegpt") and not tokenizer.chat_template:
        raise UsageError(
            f"these conversations need a chat template, and the tokenizer of {tokenizer.name_or_path!r} "
            "has none; use an instruct model's tokenizer, or give plain prompt/completion strings "
            "without --chat_template"
        )

    def encode(batch, indices, split):
        out = {"input_ids": [], "labels": [], "context_cut": [], "answers_dropped": []}
        for n, index in enumerate(indices):
            record = {key: values[n] for key, values in batch.items()}
            row = tokenize_record(record, fmt, tokenizer, block_size, *record_in_file(record, index, split))
            out["input_ids"].append(row.input_ids if row else [])
            out["labels"].append(row.labels if row else [])
            out["context_cut"].append(row.context_cut if row else -1)  # -1: dropped
            out["answers_dropped"].append(row.answers_dropped if row else 0)
        return out

    tokenized, report = datasets.DatasetDict(), {}
    for split in ("train", "validation"):
        rows = raw[split].map(
            encode,
            batched=True,
            with_indices=True,
            fn_kwargs={"split": split},
            remove_columns=raw[split].column_names,
            num_proc=num_proc if split == "train" else None,  # the validation split is small
            desc=f"Tokenizing {split}",
        )
        counts = rows.select_columns(["context_cut", "answers_dropped"]).with_format("numpy")[:]
        report.update(_count_cuts(counts["context_cut"], counts["answers_dropped"], split, block_size))
        tokenized[split] = rows.filter(lambda cut: cut >= 0, input_columns="context_cut").remove_columns(
            ["context_cut", "answers_dropped"]
        )
        if len(tokenized[split]) == 0:
            raise UsageError(
                f"no {split} record's last answer fits in --block_size {block_size} tokens; raise --block_size "
                "(--loss_on last_assistant learns the last answer only, it would not fit either)"
            )
    warn_of_answers_that_never_stop(tokenized["train"], tokenizer, fmt)
    if eval_max_new_tokens:
        tokenized["generate"], report["eval_prompts_cut"] = _eval_prompts(
            raw["validation"], fmt, tokenizer, block_size - eval_max_new_tokens
        )
    if packing:
        tokenized["train"] = packed_examples(tokenized["train"], block_size)
    return tokenized, report


def _settle_chat_template(fmt: SFTFormat, tokenizer) -> SFTFormat:
    """`fmt` with its chat_template settled for this tokenizer (`settle_chat_template`);
    conversations always use the template (`tokenize_sft` refuses a tokenizer without one)."""
    if fmt.kind in ("messages", "sharegpt"):
        return fmt
    return replace(fmt, chat_template=settle_chat_template(fmt.chat_template, tokenizer, fmt.kind))


def settle_chat_template(chat_template: bool | None, tokenizer, kind: str) -> bool:
    """Whether plain prompt/answer strings are rendered as chat turns, said in the log: the
    template's user and assistant turns when the tokenizer has one (`chat_template` None, or
    --chat_template), else (or with --no-chat_template) the raw strings joined with
    PROMPT_SEPARATOR. --chat_template without a template is a UsageError. `kind` names the data
    in the log. No communication."""
    if chat_template and not tokenizer.chat_template:
        raise UsageError(
            f"--chat_template: the tokenizer of {tokenizer.name_or_path!r} has no chat template; use an instruct "
            "model's, or drop --chat_template and put the prompt format in the data"
        )
    chat_template = bool(tokenizer.chat_template) if chat_template is None else chat_template
    if chat_template:
        logger.info(f"{kind} records: the tokenizer's chat template, a user turn and an assistant turn")
    else:
        logger.info(
            f"{kind} records: BOS, the prompt, {PROMPT_SEPARATOR!r}, the answer, EOS (no chat template: "
            + ("--no-chat_template)" if tokenizer.chat_template else "the tokenizer has none)")
        )
    return chat_template


def _count_cuts(cut: np.ndarray, answers_dropped: np.ndarray, split: str, block_size: int) -> dict:
    """The report's counts for one split, from each record's tokens of context cut (-1: dropped)
    and its earlier answers left out of the loss, logged."""
    counts = {
        f"{split}_records_context_cut": int((cut > 0).sum()),
        f"{split}_context_tokens_cut": int(cut[cut > 0].sum()),
        f"{split}_records_answers_left_out": int((answers_dropped > 0).sum()),
        f"{split}_answers_left_out": int(answers_dropped.sum()),
        f"{split}_records_dropped": int((cut < 0).sum()),
    }
    if counts[f"{split}_records_context_cut"]:
        logger.info(
            f"{split}: {counts[f'{split}_records_context_cut']} records longer than --block_size {block_size} "
            f"lost {counts[f'{split}_context_tokens_cut']} tokens of context after BOS and the system turn; "
            "their answers that are learned are whole"
        )
    if counts[f"{split}_answers_left_out"]:
        logger.info(
            f"{split}: {counts[f'{split}_records_answers_left_out']} conversations longer than --block_size "
            f"{block_size} kept their newest answers that fit, with their context; "
            f"{counts[f'{split}_answers_left_out']} earlier answers did not fit whole and are not learned"
        )
    if counts[f"{split}_records_dropped"]:
        logger.warning(
            f"{split}: {counts[f'{split}_records_dropped']} records dropped: not even their last answer fits in "
            f"--block_size {block_size} tokens; raise --block_size (--loss_on last_assistant learns the last answer "
            "only, it would not fit either)"
        )
    return counts


def _eval_prompts(validation, fmt: SFTFormat, tokenizer, max_prompt: int):
    """(the prompts answered by generation: index, input_ids, reference; how many were cut to fit
    `max_prompt` tokens, the block less the room for the answer)."""
    if max_prompt < 1:
        raise UsageError("--eval_max_new_tokens leaves no room for a prompt in --block_size; lower it")

    def prompts(batch, indices):
        rows = [
            generation_prompt_ids({key: values[n] for key, values in batch.items()}, fmt, tokenizer, max_prompt, index)
            for n, index in enumerate(indices)
        ]
        return {
            "index": indices,
            "input_ids": [r[0] for r in rows],
            "reference": [r[1] for r in rows],
            "cut": [r[2] for r in rows],
        }

    generate = validation.map(
        prompts, batched=True, with_indices=True, remove_columns=validation.column_names, desc="Eval prompts"
    )
    return generate.remove_columns("cut"), int(np.asarray(generate.with_format("numpy")["cut"]).sum())
