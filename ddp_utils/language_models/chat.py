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

from jinja2.exceptions import TemplateError

from ..core.errors import UsageError
from .causal_lm import IGNORE_INDEX
from .turns import check_tools_rendered, shown, tool_support, tools_end, uses_tools

LOSS_ON = ("assistant", "last_assistant", "all")

# Without a chat template a prompt and its answer are joined with this (BOS before, EOS after), so that the answer
# does not run on from the prompt's last word.
PROMPT_SEPARATOR = "\n\n"


class TokenizedRecord(NamedTuple):
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX where a token is not a target
    context_cut: int  # tokens cut from the start to fit the block (0: none)
    answers_dropped: int = 0  # earlier answers that did not fit whole: left in as context, not learned


PROBE_ANSWER = "Kq7Zx"  # an answer no chat template rewrites, to find what the template puts after one


def end_of_turn(tokenizer) -> tuple[int | None, str]:
    """(the token the chat template puts right after an assistant answer, or None; the text it puts
    there). Training learns that marker with each answer (`assistant_spans`), so generation must stop
    at it: Qwen2.5 base ends turns with <|im_end|> but its EOS is <|endoftext|>, Llama 3.1 base with
    <|eot_id|> but <|end_of_text|>. None for a template that ends turns with whitespace alone (no stop
    to learn), or no template. No communication."""
    if not getattr(tokenizer, "chat_template", None):
        return None, ""

    def find():
        asked = [{"role": "user", "content": "Hi"}]
        answered = render(tokenizer, asked + [{"role": "assistant", "content": PROBE_ANSWER}])
        after = answered[answered.rindex(PROBE_ANSWER) + len(PROBE_ANSWER) :]
        ids = tokenizer(after.strip(), add_special_tokens=False)["input_ids"] if after.strip() else []
        return (ids[0] if ids else None), after

    return per_template(tokenizer, "_end_of_turn", find)


def per_template(tokenizer, name: str, compute):
    """`compute()`, kept on the tokenizer under `name` for as long as its chat template and
    --chat_template_kwargs stay the same: what a template does is found once, not per record."""
    kwargs = getattr(tokenizer, "chat_template_kwargs", None) or {}
    key = (tokenizer.chat_template, repr(sorted(kwargs.items())))
    known = getattr(tokenizer, name, None)
    if known is None or known[0] != key:
        known = (key, compute())
        setattr(tokenizer, name, known)
    return known[1]


def render(tokenizer, messages, generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
    """`messages` rendered by the tokenizer's chat template, with the record's `tools` (function schemas), the run's
    --chat_template_kwargs (`tokenizer.chat_template_kwargs`, e.g. Qwen3's enable_thinking) and a system turn folded
    into the first user turn where the template would drop or move it (`folds_system`). No communication."""
    if messages and messages[0]["role"] == "system" and folds_system(tokenizer):
        messages = fold_system(messages)
    kwargs = dict(getattr(tokenizer, "chat_template_kwargs", None) or {}, **({"tools": tools} if tools else {}))
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)


def fold_system(messages: list[dict]) -> list[dict]:
    """The system turn's text put before the first user turn's, in that turn."""
    system, rest = messages[0], list(messages[1:])
    first = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
    if first is None:  # nowhere to fold it into: the template gets it as it is
        return messages
    rest[first] = {**rest[first], "content": f"{system['content']}\n\n{rest[first]['content']}"}
    return rest


def folds_system(tokenizer) -> bool:
    """Whether the chat template needs a system turn folded into the first user turn: it raises on
    one (Gemma 2), or puts it elsewhere than once before the first user turn, in the prompt and in
    the whole conversation alike (Mistral and Mixtral v0.1 to v0.3 put it into the last user turn
    only, so a prompt and its answered conversation differ). Decided once per tokenizer."""
    return per_template(tokenizer, "_folds_system", lambda: not _system_kept(tokenizer))


def _system_kept(tokenizer) -> bool:
    kwargs = getattr(tokenizer, "chat_template_kwargs", None) or {}
    talk = [{"role": "system", "content": "Sx9q"}, {"role": "user", "content": "U1x"}]
    talk += [{"role": "assistant", "content": "A1x"}, {"role": "user", "content": "U2x"}]
    try:
        texts = [
            tokenizer.apply_chat_template(talk[:2], tokenize=False, add_generation_prompt=True, **kwargs),
            tokenizer.apply_chat_template(talk, tokenize=False, add_generation_prompt=True, **kwargs),
        ]
    except Exception:  # a template that refuses system turns (raise_exception)
        return False
    return all(text.count("Sx9q") == 1 and text.index("Sx9q") < text.index("U1x") for text in texts)


def assistant_spans(
    tokenizer, messages: list[dict], loss_on: str, tools: list[dict] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character spans of its targets). Each assistant span is
    what the turn adds after its generation prompt, trailing whitespace dropped: its content (or its
    tool calls) and end-of-turn marker. An earlier turn that the template renders otherwise once later ones follow
    (Qwen3 drops the reasoning of earlier answers) is learned as the conversation shows it, up to its
    end-of-turn marker; not a turn with "weight": 0 (OpenAI's). With loss_on="all" the span is the whole text.
    `tools`: the record's, in every rendering."""
    text = render(tokenizer, messages, tools=tools)
    if loss_on == "all":
        lost = [m["role"] for m in messages if m["content"].strip() and not shown(m["content"].strip(), text)]
        if lost:
            raise UsageError(
                f"this chat template leaves out of the conversation a {lost[0]} turn's text, which --loss_on all "
                "would then train without; train on the answers with --loss_on assistant"
            )
        return text, [(0, len(text))]
    # OpenAI's chat fine-tuning shape: an assistant turn with "weight": 0 is context, not learned.
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("weight", 1) != 0]
    if not turns:
        raise UsageError("every assistant turn has weight 0, so there is nothing to learn; drop the record")
    if loss_on == "last_assistant":
        turns = turns[-1:]
    spans, marker = [], None
    for i in turns:
        prompt = render(tokenizer, messages[:i], generation_prompt=True, tools=tools)
        answered = render(tokenizer, messages[: i + 1], tools=tools)
        if not (answered.startswith(prompt) and text.startswith(prompt)):
            raise UsageError(
                f"this chat template renders the conversation before assistant turn {i} differently once the answer "
                "follows, so the answer's tokens cannot be told from the prompt's; train on the last answer with "
                "--loss_on last_assistant or on every token with --loss_on all, or use a template that renders the "
                "prompt the same"
            )
        if text.startswith(answered):
            end = len(prompt) + len(answered[len(prompt) :].rstrip())
        else:  # an earlier turn, rendered otherwise once later turns follow (Qwen3 drops its reasoning, Phi-3 its EOS):
            if marker is None:  # the end-of-turn token's own text (Phi-3 puts EOS after it, at the very end only)
                end = end_of_turn(tokenizer)[0]
                marker = tokenizer.decode([end]) if end is not None else ""
            found = text.find(marker, len(prompt)) if marker else -1
            if found < 0:
                raise UsageError(
                    f"this chat template renders assistant turn {i} differently once later turns follow and ends turns "
                    "with no marker to find it by; train on the final answer only with --loss_on last_assistant"
                )
            end = found + len(marker)
        spans.append((len(prompt), end))
    return text, spans


def tokenize_conversation(
    tokenizer, messages: list[dict], loss_on: str, block_size: int, tools: list[dict] | None = None, where: str = ""
) -> TokenizedRecord | None:
    """The conversation's token ids and labels (the targets of `assistant_spans`), at most
    `block_size` tokens (`fit_block`, cut after BOS, the system turn and the `tools` where they come before the first
    answer), or None when no answer fits (with the tools, where they are kept). A conversation with tools, calls or
    results is a UsageError naming the record (`where`) when the template leaves them out (`check_tool_turns`).
    Needs a fast tokenizer (character offsets)."""
    where = where or "a record"
    try:
        text, spans = assistant_spans(tokenizer, messages, loss_on, tools)
    except (TemplateError, TypeError) as error:  # its raise_exception, or a value of a type it cannot render
        raise refused_by_template(tokenizer, where, error) from None
    except UsageError as error:
        raise UsageError(f"{where}: {error}") from None
    check_tool_turns(tokenizer, text, messages, tools, where)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [
        token if any(start < span_end and end > span_start for span_start, span_end in spans) else IGNORE_INDEX
        for token, (start, end) in zip(ids, encoded["offset_mapping"])
    ]
    head = 0
    if len(ids) > block_size:
        keep = tools_kept(tokenizer, messages, text, tools)
        head = head_length(tokenizer, messages, text, keep=keep)
        if keep and head >= block_size:  # no room after the tools: an answer learned without them would be wrong
            return None
    return fit_block(ids, labels, block_size, cut_targets=loss_on == "all", head=head)


def plain_prompt_ids(tokenizer, prompt: str, separator: str = PROMPT_SEPARATOR) -> list[int]:
    """A plain-text prompt as training shows it: BOS (where the tokenizer has one), the prompt and `separator`."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer(prompt + separator, add_special_tokens=False)["input_ids"]


def bos_head(tokenizer, ids: list[int]) -> int:
    """1 where `ids` start with the tokenizer's BOS, which a cut keeps, else 0."""
    return int(bool(ids) and tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id)


def head_length(tokenizer, messages: list[dict] | None, text: str, keep: int = 0) -> int:
    """How many of the first tokens of `text` (tokenized without special tokens added) a cut keeps:
    BOS, and the system turn's text with the special tokens that close it, where the conversation
    `messages` starts with one that the rendering shows first (in its own turn, or folded into the
    first user turn). Without one, the system turn the template adds of its own, where it adds one
    (`template_head_end`). A model degrades without BOS (Gemma most), and the system turn says what to do.
    At least the tokens of the first `keep` characters (the tools' text, `tools_kept`). Plain text (`messages` None)
    keeps BOS."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    head = bos_head(tokenizer, ids)
    system = messages[0]["content"].strip() if messages and messages[0]["role"] == "system" else ""
    where = text.find(system) if system else -1
    end = max(where + len(system) if where >= 0 else 0, keep)
    if messages and not system:
        end = max(end, template_head_end(tokenizer, messages, text))
    if not end:
        return head
    head = max(head, sum(1 for _, token_end in offsets if token_end <= end))
    special = set(tokenizer.all_special_ids)
    while head < len(ids) and ids[head] in special:  # the marker that closes the system turn
        head += 1
    return head


def template_head_end(tokenizer, messages: list[dict], text: str) -> int:
    """Where the system turn that the template adds of its own ends in `text` (`messages` rendered, with no system
    turn of their own): Qwen 2.5's "You are Qwen...", Llama 3's dates, SmolLM2's; 0 where it adds none. Found by
    rendering markers for a system turn's text and the first turn's: the text before the first turn's must be the
    template's system turn around text of its own. 0 too where the renderings differ otherwise (tools)."""
    first, system = "\u2983first\u2984", "\u2983system\u2984"  # text no template adds
    if not isinstance(messages[0].get("content"), str):
        return 0
    turns = [{**messages[0], "content": first}, *messages[1:]]
    try:
        plain, framed = render(tokenizer, turns), render(tokenizer, [{"role": "system", "content": system}, *turns])
    except (TemplateError, TypeError):  # the template's own refusal: no head found, the cut takes from the start
        return 0
    head = plain[: max(plain.find(first), 0)]  # what comes before the first turn's text
    opened, ends = framed.find(system), framed.find(first)
    at = opened + len(system)
    if not head or opened < 0 or ends < at or not text.startswith(head):
        return 0
    before, after = framed[:opened], framed[at:ends]  # the system turn's opening; its close and the next turn's header
    if head.startswith(before) and head.endswith(after) and len(head) >= len(before) + len(after):
        return len(head) - len(after)
    return 0


def tools_kept(tokenizer, messages: list[dict], text: str, tools: list[dict] | None, generation_prompt=False) -> int:
    """Where the text of the `tools` ends in `text` (`messages` rendered with them): what a cut keeps with the
    head, so that the calls learned keep their tools. 0 without tools, or where they end after the first user
    turn's text: a template that shows them late (Mistral's, before the last user turn) keeps them without help,
    since a cut takes the oldest turns first, and keeping all before them would cut the newest question."""
    if not tools:
        return 0
    first_user = next((m["content"].strip() for m in messages if m["role"] == "user" and m["content"].strip()), "")
    end = tools_end(text, render(tokenizer, messages, generation_prompt))
    return end if first_user and 0 < end <= text.find(first_user) else 0


def refused_by_template(tokenizer, where: str, error: Exception) -> UsageError:
    """The UsageError for a record that the chat template refuses (its raise_exception: roles out of order, a role
    it lacks, ids of the wrong shape) or cannot render (a TypeError: DeepSeek V3's wants a call's arguments as a
    string, where the others take the object that `turns.tool_call` gives), naming the record (`where`)."""
    message = str(error) if isinstance(error, TemplateError) else f"{type(error).__name__}: {error}"
    return UsageError(f"{where}: the chat template of {tokenizer.name_or_path!r} refuses it: {message}; fix or drop it")


def check_tool_turns(tokenizer, text: str, messages: list[dict], tools: list[dict] | None, where: str) -> None:
    """Where a conversation has tools, calls or results: a UsageError naming the record (`where`) unless its chat
    template shows them, as found once per template (`turns.tool_support`), and `text` (the conversation rendered)
    shows each of its own (`turns.check_tools_rendered`)."""
    if uses_tools(messages, tools):
        support = per_template(tokenizer, "_tool_support", lambda: tool_support(tokenizer, render))
        check_tools_rendered(text, messages, tools, tokenizer, where, support)


def cut_prompt(tokenizer, prompt: list[dict], text: str, ids: list, tools: list[dict] | None, cut: int) -> list:
    """`ids` (the turns `prompt` rendered as `text`, asking for an answer) less `cut` tokens after BOS, the system
    turn and the `tools` the template shows first (`head_length`, `tools_kept`): the oldest turns go, and what to
    do, how, and the newest turns stay. From the start where that head leaves no room (`cut_middle`)."""
    keep = tools_kept(tokenizer, prompt, text, tools, generation_prompt=True)
    return cut_middle(ids, head_length(tokenizer, prompt, text, keep), cut)


def cut_middle(ids: list, head: int, cut: int) -> list:
    """`ids` less `cut` tokens after its first `head` (all from the start when the head is too long)."""
    head = head if head + cut < len(ids) else 0
    return ids[:head] + ids[head + cut :]


def fit_block(
    ids: list[int], labels: list[int], block_size: int, cut_targets: bool = False, head: int = 0
) -> TokenizedRecord | None:
    """`ids`/`labels` cut to `block_size` tokens by dropping tokens after the first `head` (BOS and the
    system turn, `head_length`), so the oldest context goes and the newest turns stay; never part of
    an answer (unless `cut_targets`: every token is a target). An answer (a run of targets) the cut
    reaches, or that starts right after it, is left in as context and not learned (`answers_dropped`):
    a long conversation keeps its newest answers that fit, with their context. None when no answer is
    left: the caller counts the record as dropped. The token right after a cut is never a target: the
    head before it does not predict it (`labels[i]` is predicted from < i)."""
    cut = max(len(ids) - block_size, 0)
    if not cut:
        return TokenizedRecord(ids, labels, 0) if any(x != IGNORE_INDEX for x in labels[1:]) else None
    head = head if head + cut < len(ids) else 0
    kept, dropped, start = list(labels), 0, None
    if cut_targets:
        kept[head + cut] = IGNORE_INDEX
    else:
        for i, label in enumerate(labels + [IGNORE_INDEX]):  # each run of targets: whole after the cut, or not learned
            if label != IGNORE_INDEX and start is None:
                start = i
            elif label == IGNORE_INDEX and start is not None:
                if start <= head + cut and i > head:
                    kept[start:i] = [IGNORE_INDEX] * (i - start)
                    dropped += 1
                start = None
    kept = cut_middle(kept, head, cut)
    if all(label == IGNORE_INDEX for label in kept):
        return None
    return TokenizedRecord(cut_middle(ids, head, cut), kept, cut, dropped)


def generation_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, str]:
    """(the conversation up to its last assistant turn, rendered with the `tools` to ask for that turn; the reference
    answer: the last assistant turn's content, or, when it calls tools, the text the template renders for it up to
    its end-of-turn marker: the calls as the model learns to write them)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = render(tokenizer, messages[:last], generation_prompt=True, tools=tools)
    if not messages[last].get("tool_calls"):
        return prompt, messages[last]["content"]
    answer = render(tokenizer, messages[: last + 1], tools=tools)[len(prompt) :]
    end = end_of_turn(tokenizer)[0]
    marker = tokenizer.decode([end]) if end is not None else ""
    return prompt, (answer[: answer.find(marker)] if marker and marker in answer else answer).strip()
