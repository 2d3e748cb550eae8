"""Conversations as training rows: which tokens are targets, and what is cut when a record does
not fit. No communication; any rank may call these.

A record is a list of `{"role", "content"}` turns. The loss is on the assistant's turns (each
with the end-of-turn marker that follows it, so the model learns to stop), on the last assistant
turn only, or on every token. Most chat templates have no `{% generation %}` markers, so the
assistant spans are found by rendering growing prefixes of the conversation: the text an
assistant turn adds after the prompt that asks for it (`add_generation_prompt=True`).
"""

from __future__ import annotations

from typing import NamedTuple

from .causal_lm import IGNORE_INDEX
from .errors import UsageError

LOSS_ON = ("assistant", "last_assistant", "all")


class TokenizedRecord(NamedTuple):
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX where a token is not a target
    context_cut: int  # tokens cut from the start to fit the block (0: none)
    answers_dropped: int = 0  # earlier answers that did not fit whole: left in as context, not learned


# Content given as a list of parts (OpenAI's {"type": "text", "text": ...}, LLaMA-Factory's {"type": "text", "value":
# ...}): the text parts joined with this; a part of another type (an image, audio) is refused.
PART_SEPARATOR = "\n"


def as_messages(prompt, completion) -> list[dict]:
    """A prompt/completion record as turns: a prompt string is one user turn (a list of turns is
    taken as is), a completion string is one assistant turn."""
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return turns + ([{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion))


def text_content(messages: list[dict], record: int, split: str) -> list[dict]:
    """`messages` with each content given as a list of parts turned into text: the text parts
    joined with PART_SEPARATOR. A part of another type (an image, audio, a file) is a UsageError
    that names the record, the turn and the part: this fine-tuning is text-only."""
    out = []
    for turn, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, list):
            texts = []
            for part in content:
                part = part if isinstance(part, dict) else {"type": type(part).__name__}
                kind, text = part.get("type", "text"), part.get("text")
                text = text if text is not None else part.get("value")  # LLaMA-Factory's name for it
                if kind != "text" or not isinstance(text, str):
                    raise UsageError(
                        f"{split} record {record}, turn {turn} ({message['role']}) holds a part of type {kind!r}: this "
                        "script fine-tunes on text only, so it would be lost or learned as a placeholder word; drop "
                        "those parts or records, or use a vision-language fine-tuning script"
                    )
                texts.append(text)
            message = {**message, "content": PART_SEPARATOR.join(texts)}
        out.append(message)
    return out


def check_messages(messages, record: int, split: str) -> None:
    """A UsageError naming the record unless `messages` is a list of role/content turns with an
    assistant turn."""

    def fits(turn):
        return isinstance(turn, dict) and turn.get("role") is not None and turn.get("content") is not None

    if not isinstance(messages, list) or not all(fits(turn) for turn in messages):
        raise UsageError(
            f"{split} record {record} fits none of the SFT formats: a conversation must be a list of "
            f"{{'role': ..., 'content': ...}} turns (or ShareGPT's {{'from': ..., 'value': ...}}), "
            f"got {str(messages)[:120]!r}; name the right column with --messages_column"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise UsageError(
            f"{split} record {record} has no assistant turn, so nothing to learn or to answer; "
            "end each conversation with the assistant's answer"
        )


def _render(tokenizer, messages, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[dict], loss_on: str) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character spans of its targets). Each assistant span is
    what the turn adds after its generation prompt, trailing whitespace dropped: its content and
    end-of-turn marker. With loss_on="all" the span is the whole text. A template that renders
    earlier turns differently once later ones follow (some drop the reasoning of earlier
    answers) is refused with the fix."""
    text = _render(tokenizer, messages)
    if loss_on == "all":
        return text, [(0, len(text))]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if loss_on == "last_assistant":
        turns = turns[-1:]
    spans = []
    for i in turns:
        prompt = _render(tokenizer, messages[:i], generation_prompt=True)
        answered = _render(tokenizer, messages[: i + 1])
        if not text.startswith(answered):
            raise UsageError(
                f"this chat template renders assistant turn {i} differently once later turns follow, so the "
                "turns it trains on would not be the ones it sees; train on the final answer only with "
                "--loss_on last_assistant (or on every token with --loss_on all)"
            )
        if not answered.startswith(prompt):
            raise UsageError(
                f"this chat template renders the conversation before assistant turn {i} differently once the answer "
                "follows, so the answer's tokens cannot be told from the prompt's; train on every token with "
                "--loss_on all, or use a template that renders the prompt the same"
            )
        answer = answered[len(prompt) :].rstrip()
        spans.append((len(prompt), len(prompt) + len(answer)))
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], loss_on: str, block_size: int) -> TokenizedRecord | None:
    """The conversation's token ids and labels (the targets of `assistant_spans`), at most
    `block_size` tokens (`fit_block`). Needs a fast tokenizer (character offsets)."""
    text, spans = assistant_spans(tokenizer, messages, loss_on)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [
        token if any(start < span_end and end > span_start for span_start, span_end in spans) else IGNORE_INDEX
        for token, (start, end) in zip(ids, encoded["offset_mapping"])
    ]
    return fit_block(ids, labels, block_size, cut_targets=loss_on == "all")


def fit_block(ids: list[int], labels: list[int], block_size: int, cut_targets: bool = False) -> TokenizedRecord | None:
    """`ids`/`labels` cut from the start to their last `block_size` tokens: earlier context goes,
    never part of an answer (unless `cut_targets`: every token is a target). An answer (a run of
    targets) that does not fit whole is left in as context and not learned (`answers_dropped`), so
    a long conversation keeps its newest answers that fit, with their context. None when no answer
    is left: the caller counts the record as dropped. The first token kept is never a target,
    since nothing before it predicts it (`labels[i]` is predicted from < i)."""
    cut = max(len(ids) - block_size, 0)
    if cut_targets:
        return (
            TokenizedRecord(ids[cut:], labels[cut:], cut) if any(x != IGNORE_INDEX for x in labels[cut + 1 :]) else None
        )
    kept, dropped, start = list(labels), 0, None
    for i, label in enumerate(labels + [IGNORE_INDEX]):  # each run of targets: whole in the block, or not learned
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            if start <= cut and cut:
                kept[start:i] = [IGNORE_INDEX] * (i - start)
                dropped += 1
            start = None
    if all(label == IGNORE_INDEX for label in kept[cut:]):
        return None
    return TokenizedRecord(ids[cut:], kept[cut:], cut, dropped)


def generation_prompt(tokenizer, messages: list[dict]) -> tuple[str, str]:
    """(the conversation up to its last assistant turn, rendered to ask for that turn; the last
    assistant turn's content: the reference answer)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return _render(tokenizer, messages[:last], generation_prompt=True), messages[last]["content"]
