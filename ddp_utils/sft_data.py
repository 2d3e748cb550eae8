"""SFT records as training rows: each record (a conversation, or a prompt/completion pair) as
token ids with labels -100 where a token is not learned, cut to the block from its start (never
the answer), counted when cut or dropped; the eval prompts answered by generation; packing.
Nothing here communicates: the script calls `tokenize_sft` inside `load_on_main_first`."""

from __future__ import annotations

import datasets
import numpy as np
from accelerate.logging import get_logger

from .causal_lm import IGNORE_INDEX, pack_sequences
from .chat import as_messages, check_messages, fit_block, generation_prompt, tokenize_conversation
from .errors import UsageError

logger = get_logger(__name__)


def sft_columns(raw, args) -> dict[str, str]:
    """The columns an SFT run reads, each with the option that names it: the conversations of
    --messages_column if the data has them, else --prompt_column and --completion_column."""
    if args.messages_column in next(iter(raw.values())).column_names:
        return {args.messages_column: "--messages_column"}
    return {args.prompt_column: "--prompt_column (or --messages_column)", args.completion_column: "--completion_column"}


def conversation(record: dict, args) -> list[dict] | None:
    """An SFT record as turns, or None for a plain prompt/completion pair trained without a chat
    template."""
    if args.messages_column in record:
        return record[args.messages_column]
    prompt, completion = record[args.prompt_column], record[args.completion_column]
    if isinstance(prompt, str) and isinstance(completion, str) and not args.chat_template:
        return None
    return as_messages(prompt, completion)


def _bos(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def tokenize_record(record: dict, tokenizer, args, block_size: int):
    """(input_ids, labels, tokens of context cut) of one SFT record, or None when its answer does
    not fit in `block_size` tokens. Conversations: the chat template, the loss on --loss_on's
    turns. Plain pairs: BOS + prompt + completion + EOS, the loss on the completion and EOS."""
    messages = conversation(record, args)
    if messages is not None:
        return tokenize_conversation(tokenizer, messages, args.loss_on, block_size)
    prompt = _bos(tokenizer) + tokenizer(record[args.prompt_column], add_special_tokens=False)["input_ids"]
    completion = tokenizer(record[args.completion_column], add_special_tokens=False)["input_ids"]
    completion = completion + [tokenizer.eos_token_id]
    labels = (prompt if args.loss_on == "all" else [IGNORE_INDEX] * len(prompt)) + completion
    return fit_block(prompt + completion, labels, block_size, cut_targets=args.loss_on == "all")


def generation_prompt_ids(record: dict, tokenizer, args, max_prompt_tokens: int):
    """(prompt ids that ask for the record's last answer, cut from the start to
    `max_prompt_tokens`; the reference answer; whether it was cut)."""
    messages = conversation(record, args)
    if messages is not None:
        text, reference = generation_prompt(tokenizer, messages)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = _bos(tokenizer) + tokenizer(record[args.prompt_column], add_special_tokens=False)["input_ids"]
        reference = record[args.completion_column]
    return ids[-max_prompt_tokens:], reference, len(ids) > max_prompt_tokens


def tokenize_sft(raw, tokenizer, args, block_size: int):
    """(tokenized splits, report). "train" and "validation": one sequence per record (or packed,
    with --packing), with labels -100 where a token is not learned; "generate": the validation
    prompts answered by generation, with their references (with --eval_max_new_tokens). The
    report counts records whose context was cut and records dropped (their answer alone does not
    fit), per split."""
    if (args.messages_column in raw["train"].column_names or args.chat_template) and not tokenizer.chat_template:
        raise UsageError(
            f"these conversations need a chat template, and the tokenizer of {args.model_name_or_path!r} "
            "has none; use an instruct model's tokenizer, or give plain prompt/completion strings "
            "without --chat_template"
        )

    def encode(batch, indices, split):
        out = {"input_ids": [], "labels": [], "context_cut": []}
        for n, index in enumerate(indices):
            record = {key: values[n] for key, values in batch.items()}
            if args.messages_column in record:
                check_messages(record[args.messages_column], index, split)
            row = tokenize_record(record, tokenizer, args, block_size)
            out["input_ids"].append(row.input_ids if row else [])
            out["labels"].append(row.labels if row else [])
            out["context_cut"].append(row.context_cut if row else -1)  # -1: dropped
        return out

    tokenized, report = datasets.DatasetDict(), {}
    for split in ("train", "validation"):
        rows = raw[split].map(
            encode,
            batched=True,
            with_indices=True,
            fn_kwargs={"split": split},
            remove_columns=raw[split].column_names,
            desc=f"Tokenizing {split}",
        )
        report.update(_count_cuts(np.array(rows["context_cut"]), split, block_size))
        tokenized[split] = rows.filter(lambda cut: cut >= 0, input_columns="context_cut").remove_columns("context_cut")
        if len(tokenized[split]) == 0:
            raise UsageError(f"no {split} record's answer fits in --block_size {block_size} tokens; raise --block_size")
    if args.eval_max_new_tokens:
        tokenized["generate"], report["eval_prompts_cut"] = _eval_prompts(
            raw["validation"], tokenizer, args, block_size
        )
    if args.packing:
        tokenized["train"] = tokenized["train"].map(
            pack_sequences, batched=True, batch_size=10_000, fn_kwargs={"block_size": block_size}, desc="Packing"
        )
    return tokenized, report


def _count_cuts(cut: np.ndarray, split: str, block_size: int) -> dict:
    """The report's counts for one split, from each record's tokens of context cut (-1: dropped), logged."""
    counts = {
        f"{split}_records_context_cut": int((cut > 0).sum()),
        f"{split}_context_tokens_cut": int(cut[cut > 0].sum()),
        f"{split}_records_dropped": int((cut < 0).sum()),
    }
    if counts[f"{split}_records_context_cut"]:
        logger.info(
            f"{split}: {counts[f'{split}_records_context_cut']} records longer than --block_size {block_size} "
            f"lost {counts[f'{split}_context_tokens_cut']} tokens of context from their start; their answers "
            "are whole"
        )
    if counts[f"{split}_records_dropped"]:
        logger.warning(
            f"{split}: {counts[f'{split}_records_dropped']} records dropped: their answers alone do not fit "
            f"in --block_size {block_size} tokens; raise --block_size"
        )
    return counts


def _eval_prompts(validation, tokenizer, args, block_size: int):
    """(the prompts answered by generation: index, input_ids, reference; how many were cut to fit
    the block with room for --eval_max_new_tokens)."""
    max_prompt = block_size - args.eval_max_new_tokens
    if max_prompt < 1:
        raise UsageError(
            f"--eval_max_new_tokens {args.eval_max_new_tokens} leaves no room for a prompt in --block_size {block_size}"
        )

    def prompts(batch, indices):
        rows = [
            generation_prompt_ids({key: values[n] for key, values in batch.items()}, tokenizer, args, max_prompt)
            for n in range(len(indices))
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
    return generate.remove_columns("cut"), int(sum(generate["cut"]))
