"""GRPO's prompts: tokenized as the model is asked (its chat template, tools included), fitted with their answers in
the model's context, and batched on the left for generation."""

from __future__ import annotations

import torch
from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..data.dataloaders import SAMPLE_WEIGHT
from ..data.raw_data import RECORD_COLUMN, record_in_file
from ..data.record_names import record_name
from .chat import bos_head, check_tool_turns, cut_middle, cut_prompt, refused_by_template, render
from .turns import TEMPLATE_TOKENIZER, clean_turn, is_turn_list, json_turns, record_tools, sharegpt_turns, text_content

TEMPLATE_FIX = f"{TEMPLATE_TOKENIZER}, or give the prompts as text"

logger = get_logger(__name__)


def fit_prompts_in_block(args, context: int, evaluated: bool) -> None:
    """Lower --max_prompt_length so that a prompt and its longest answer (--max_completion_length, or
    --eval_max_new_tokens where the evaluation generates) fit in --block_size, else the model's whole `context`
    (not the 1024 the other scripts default to: reasoning answers run long); said once, or a `UsageError` where no
    prompt would fit. Past the context, learned positions index out of their table (GPT-2, OPT: an IndexError here,
    a device-side assert on a GPU) and rotary ones run where the model never trained. Every rank calls it with the
    same values (no communication)."""
    block = args.block_size or context
    longest = max(args.max_completion_length, args.eval_max_new_tokens if evaluated else 0)
    if longest >= block:
        raise UsageError(
            f"answers of {longest} tokens (--max_completion_length, --eval_max_new_tokens) leave no room for a prompt "
            f"in {block} tokens (--block_size, else the model's context): lower them, or raise --block_size"
        )
    if args.max_prompt_length + longest > block:
        logger.warning(
            f"prompts are cut to {block - longest} tokens (--max_prompt_length {args.max_prompt_length}), so "
            f"that an answer of {longest} fits in {block} (--block_size, else the model's context)"
        )
        args.max_prompt_length = block - longest


def held_out_answers(validation, args) -> list[str] | None:
    """The held-out prompts' "answer" column as the text their greedy answers are scored against: text as given,
    numbers as written (42, not 42.0: math sets store them as numbers), and a missing answer or a list refused in
    one line naming its record; None without the column or --eval_max_new_tokens (nothing scored). No communication."""
    if "answer" not in validation.column_names or not args.eval_max_new_tokens:
        return None
    columns = [column for column in ("answer", RECORD_COLUMN) if column in validation.column_names]
    references = []
    for index, record in enumerate(validation.select_columns(columns)):
        answer = record["answer"]
        if isinstance(answer, float) and answer.is_integer():
            answer = int(answer)
        if answer is None or answer != answer or isinstance(answer, (list, dict)):  # answer != answer: NaN
            number, split = record_in_file(record, index, "validation")
            raise UsageError(
                f"{record_name(split, number)}: its 'answer' is {answer!r}; give each held-out prompt one answer as "
                "text or a number (the greedy answer is scored against it), or drop the column to score none"
            )
        references.append(str(answer))
    return references


def asked_prompt(prompt, number: int, split: str):
    """A record's prompt as the model is asked it: text, or role/content turns that end with a turn the model
    answers (ShareGPT's from/value turns converted, content parts joined into text, a CSV cell's JSON turns parsed,
    tool calls as templates take them; the roles are the template's to take). A UsageError naming the record (`split`
    record `number`) for what would ask nothing or leak the answer: empty text, no turns, a turn without a role or a
    content, turns all empty, a last turn of the assistant's."""
    where = record_name(split, number)
    prompt = json_turns({"prompt": prompt}, ("prompt",)).get("prompt", prompt)  # text that is JSON turns: turns
    if isinstance(prompt, str):
        if not prompt.strip():
            raise UsageError(f"{where}: its prompt is empty; fill it or drop the record")
        return prompt
    if not isinstance(prompt, list) or not prompt or not all(isinstance(turn, dict) for turn in prompt):
        given = f"{str(prompt)[:60]!r} ({type(prompt).__name__})"
        raise UsageError(f"{where}: its prompt is {given}; give text or a list of chat turns ({{'role', 'content'}})")
    if is_turn_list(prompt, "from", "value"):
        prompt = sharegpt_turns(prompt, where, "GRPO", "give text or a list of chat turns")
    turns = [clean_turn(turn, where) for turn in prompt]
    if not is_turn_list(turns, "role", "content"):
        raise UsageError(f"{where}: its prompt's turns must each have a 'role' and a 'content': {str(prompt)[:90]!r}")
    turns = text_content(turns, number, split)
    if turns[-1].get("tool_calls"):  # an agent's call waits for its result, which the model would make up
        raise UsageError(f"{where}: its prompt ends with a tool call; add the tool's result after it")
    if turns[-1]["role"] == "assistant":  # rendered with the generation prompt after it, the answer is in the prompt
        raise UsageError(f"{where}: its prompt ends with an assistant turn, the answer GRPO samples; drop that turn")
    if not any(isinstance(t["content"], str) and t["content"].strip() for t in turns):  # a system turn asks too
        raise UsageError(f"{where}: its prompt's turns are empty; fill them or drop the record")
    return turns


def tokenize_prompts(raw, tokenizer, max_prompt_length: int, use_chat_template: bool, num_proc=None):
    """Every split's "prompt" column (a string, or a conversation of {"role", "content"} turns) as the ids that
    ask for an answer, with "index" (the record's place in its split: its samples' seed, and where the rewards
    find the record) and "length"; nothing else. A prompt past `max_prompt_length` tokens loses the tokens after
    BOS, the system turn and the tools that the template shows first (`chat.head_length`, as SFT's cuts), so it
    keeps what it is asked to do, how, and its newest turns; the prompts cut are counted in a warning per split.
    No communication."""
    from jinja2.exceptions import TemplateError

    def encode(record, index, split):
        number, source = record_in_file(record, index, split)
        where = record_name(source, number)
        prompt, tools = asked_prompt(record["prompt"], number, source), record_tools(record.get("tools"), where)
        if isinstance(prompt, str) and use_chat_template:
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) and tools or isinstance(prompt, list) and tokenizer.chat_template is None:
            raise UsageError(f"{where} has chat turns or tools, which only a chat template shows: {TEMPLATE_FIX}")
        if isinstance(prompt, list):
            try:
                text = render(tokenizer, prompt, generation_prompt=True, tools=tools)
            except (TemplateError, TypeError) as error:  # as chat.tokenize_conversation
                raise refused_by_template(tokenizer, where, error) from None
            check_tool_turns(tokenizer, text, prompt, tools, where)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
        cut = max(len(ids) - max_prompt_length, 0)
        if cut and isinstance(prompt, list):
            ids = cut_prompt(tokenizer, prompt, text, ids, tools, cut)
        elif cut:  # plain text: BOS stays
            ids = cut_middle(ids, bos_head(tokenizer, ids), cut)
        return {"input_ids": ids, "index": index, "length": len(ids), "cut": cut}

    import datasets

    tokenized = datasets.DatasetDict()
    for split, records in raw.items():
        options = {"remove_columns": records.column_names, "num_proc": num_proc}
        rows = records.map(encode, with_indices=True, fn_kwargs={"split": split}, **options)
        cut = rows.select_columns("cut").with_format("numpy")[:]["cut"]
        if cut.any():
            logger.warning(
                f"{split}: {(cut > 0).sum()} of {len(cut)} prompts were longer than {max_prompt_length} tokens "
                f"(--max_prompt_length, or what --block_size leaves beside the answers) and lost {cut.sum()} tokens: "
                "their oldest turns, or the start of their text, after BOS and the system turn where those fit; "
                "raise the length that limits them to keep them whole"
            )
        tokenized[split] = rows.remove_columns("cut")
    return tokenized


class PromptCollator:
    """Prompt rows (input_ids, index, sample_weight) into a batch padded on the left, as generation needs."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict:
        length = max(len(row["input_ids"]) for row in rows)
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            ids = torch.tensor(row["input_ids"])
            input_ids[i, length - len(ids) :], attention_mask[i, length - len(ids) :] = ids, 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "index": torch.tensor([row["index"] for row in rows]),
            SAMPLE_WEIGHT: torch.tensor([float(row.get(SAMPLE_WEIGHT, 1.0)) for row in rows]),
        }
