"""Conversation turns in the shapes users bring, as the role/content turns and tools that chat templates render:
ShareGPT's from/value turns, and tool calls (function calling) in OpenAI's chat JSONL (assistant turns with
`tool_calls`, whose arguments are a JSON string, `tool` turns with the results, a `tools` column of function schemas)
or LLaMA-Factory's ShareGPT shape (`function_call` and `observation` turns, `tools` as a JSON string). Both read as
the same turns, so they train the same tokens; Alpaca's records with their system text and history; and the checks
every record's turns pass (content parts joined into text, an assistant turn, no empty answer learned). No
communication; any rank may call these."""

from __future__ import annotations

import json
import os

from ..core.errors import UsageError
from ..data.record_names import record_name

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# LLaMA-Factory's ShareGPT roles for a call and its result.
SHAREGPT_TOOL_ROLES = ("function_call", "observation")
# Tested with the templates these models ship (tests/test_tool_calls.py).
TEMPLATES_WITH_TOOLS = "Qwen 2.5 to 3.6, Llama 3.1 and 3.2, Gemma 4, gpt-oss, GLM-4.5, LFM2.5"
TEMPLATE_TOKENIZER = "use a tokenizer with a chat template (an instruct model's)"
NEEDS_TEMPLATE = f"{TEMPLATE_TOKENIZER}, without --no-chat_template"
# A conversation with a tool, a call and a result under names no data holds: what a template shows of each.
PROBE_TOOL, PROBE_CALL, PROBE_RESULT = "Tq7tool", "Zq9call", "Rz8result"


def without_nulls(value):
    """`value` with every None-valued key dropped, at any depth: the keys `datasets` adds to make records of one
    column share a type (a tool without a description gets "description": None), which a template would render as
    null or take for a key that is there."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def from_json(value, what: str, where: str):
    """`value` parsed when it is a JSON string (`what` it holds names it in the error), else as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as error:
        raise UsageError(f"{where}: {what} is a string that is not valid JSON ({error}); got {value[:80]!r}") from None


def as_json_turns(value, where: str):
    """A conversation given as JSON text (a CSV's cell, a column stored as a string) parsed into its turns; any other
    value as it is. Text that starts with "[" but is not JSON is a UsageError naming the record (`where`)."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        return from_json(value, "its conversation", where)
    return value


def json_turns(record: dict, columns: tuple[str, ...]) -> dict:
    """The `columns` of `record` that hold a conversation as JSON text (a CSV of preference pairs holds its turns
    so), each parsed into its turns. Text that does not parse into role/content or from/value turns stays text: a
    prompt may start with "[INST]", an answer may be a JSON array."""

    def turns(value):
        if not (isinstance(value, str) and value.lstrip().startswith("[")):
            return None
        try:
            parsed = json.loads(value)
        except ValueError:
            return None
        if not (isinstance(parsed, list) and parsed):
            return None
        return parsed if all(isinstance(turn, dict) and ("role" in turn or "from" in turn) for turn in parsed) else None

    return {column: parsed for column in columns if (parsed := turns(record.get(column))) is not None}


def record_tools(value, where: str) -> list[dict] | None:
    """A record's "tools" column (a list of function schemas, or a JSON string of one) in the shape templates
    render: each `{"type": "function", "function": {...}}` (a bare `{"name", "description", "parameters"}`,
    LLaMA-Factory's shape, is wrapped so). None when the record has none. Anything else is a UsageError that says
    the column is read as tools."""
    fix = "the 'tools' column is read as each record's function schemas; rename it if it holds something else"
    try:
        tools = without_nulls(from_json(value, "its tools", where))
    except UsageError as error:
        raise UsageError(f"{error}; {fix}") from None
    if not tools:
        return None

    def named(tool) -> bool:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        return isinstance(function, dict) and isinstance(function.get("name"), str)

    if not isinstance(tools, list) or not all(named(tool) for tool in tools):
        raise UsageError(f"{where}: its tools are not a list of named function schemas, got {str(tools)[:60]!r}; {fix}")
    return [tool if "function" in tool else {"type": "function", "function": tool} for tool in tools]


def tool_call(call, where: str) -> dict:
    """One tool call as templates render it: `{"type": "function", "function": {"name", "arguments"}}`, the
    arguments a JSON object (OpenAI gives them as a string, which most templates would quote again)."""
    call = without_nulls(call)
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise UsageError(f"{where}: a tool call must name its function ({{name, arguments}}); got {str(call)[:70]!r}")
    given = function.get("arguments") or {}  # "" or none: a call without arguments
    arguments = from_json(given, f"the arguments of its call to {function['name']!r}", where)
    if not isinstance(arguments, dict):
        raise UsageError(f"{where}: the arguments of its call to {function['name']!r} must be a JSON object")
    # Only the call's own keys: LLaMA-Factory's flat {"name", "arguments"} left beside would show the string again.
    named = {"id": call["id"]} if "id" in call else {}
    return {**named, "type": "function", "function": {**function, "arguments": arguments}}


def clean_turn(turn: dict, where: str) -> dict:
    """A role/content turn as templates take it: without the keys `datasets` filled with None; an assistant turn's
    tool calls parsed (`tool_call`), its missing content "" (the calls are its answer), no `tool_calls` key when there
    are none; a tool result given as a JSON object written as JSON text."""
    turn = {key: value for key, value in turn.items() if value is not None}
    calls = turn.pop("tool_calls", None)
    if calls:
        turn["tool_calls"] = [tool_call(call, where) for call in calls]
        turn.setdefault("content", "")
    if turn.get("role") == "tool" and isinstance(turn.get("content"), (dict, list)) and not is_parts(turn["content"]):
        turn["content"] = json.dumps(turn["content"], ensure_ascii=False)
    return turn


def is_parts(content) -> bool:
    """Whether `content` is a list of content parts ({"type": ...}), which `text_content` joins."""
    return isinstance(content, list) and all(isinstance(part, dict) and "type" in part for part in content)


def sharegpt_tool_turn(role: str, value, where: str) -> dict:
    """A LLaMA-Factory ShareGPT `function_call` turn (a JSON call, or a list of them) as an assistant turn with
    tool calls, an `observation` turn (a call's result) as a tool turn."""
    if role == "observation":
        return clean_turn({"role": "tool", "content": value}, where)
    calls = from_json(value, "its function call", where)
    return clean_turn({"role": "assistant", "tool_calls": calls if isinstance(calls, list) else [calls]}, where)


def uses_tools(messages: list[dict], tools: list[dict] | None) -> bool:
    """Whether a conversation has tools, tool calls or tool results."""
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def shown(value: str, text: str) -> bool:
    """Whether `text` shows `value` as it is, or quoted as JSON text (Llama 3.1 quotes every tool result)."""
    return value in text or json.dumps(value, ensure_ascii=False)[1:-1] in text


def tool_support(tokenizer, render) -> dict[str, bool]:
    """What the chat template shows of tools, calls and results ({"tool", "call to", "tool result"}: bool), found
    once per template (`chat.per_template`) from a conversation with names no data holds: a name that a record's
    own words hold would pass a check of that record. `render` is `chat.render`. A template that fails on the probe
    (one that wants ids or arguments of its own shape) is taken to show all three: a record it refuses is named then."""
    from jinja2.exceptions import TemplateError

    call = {"id": "a1b2c3d4e", "type": "function", "function": {"name": PROBE_CALL, "arguments": {"x": 1}}}
    talk = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    talk += [{"role": "tool", "tool_call_id": "a1b2c3d4e", "content": PROBE_RESULT}]
    talk += [{"role": "assistant", "content": "Ok"}]
    tools = [{"type": "function", "function": {"name": PROBE_TOOL, "parameters": {"type": "object"}}}]
    try:
        text = render(tokenizer, talk, tools=tools)
    except (TemplateError, TypeError):  # as chat.tokenize_conversation catches
        return {"tool": True, "call to": True, "tool result": True}
    return {"tool": PROBE_TOOL in text, "call to": PROBE_CALL in text, "tool result": shown(PROBE_RESULT, text)}


def check_tools_rendered(
    text: str, messages: list[dict], tools: list[dict] | None, tokenizer, where: str, support: dict[str, bool]
) -> None:
    """A UsageError naming the record unless its template shows tools, calls and results where the record has them
    (`support`, from `tool_support`), and the rendered conversation `text` shows each of its own: a template without
    tool support drops them, and the model would learn to answer without the tools it was given, or learn empty
    answers where it called one."""
    named = [("tool", tool["function"]["name"]) for tool in tools or []]
    named += [("call to", call["function"]["name"]) for m in messages for call in m.get("tool_calls", [])]
    named += [("tool result", m["content"].strip()) for m in messages if m["role"] == "tool"]
    missing = next(
        ((kind, name) for kind, name in named if not support[kind] or (name and not shown(name, text))), None
    )
    if missing:
        raise UsageError(
            f"{where}: the chat template of {tokenizer.name_or_path!r} leaves out its {missing[0]} "
            f"{missing[1][:60]!r}: it has no tool support, and the model would learn without it; fine-tune a model "
            f"whose template renders tools and tool calls ({TEMPLATES_WITH_TOOLS})"
        )


def tools_end(with_tools: str, without: str) -> int:
    """Where the tools' text ends in a conversation rendered `with_tools`, given the same conversation rendered
    `without` them: the end of the part that differs. 0 when they are the same."""
    if with_tools == without:
        return 0
    same_start = len(os.path.commonprefix([with_tools, without]))
    same_end = len(os.path.commonprefix([with_tools[same_start:][::-1], without[same_start:][::-1]]))
    return len(with_tools) - same_end


def is_turn_list(turns, role: str, content: str) -> bool:
    """Whether `turns` is a list of dicts, each with a `role` and a `content` key (by these names) that are set."""
    return isinstance(turns, list) and all(
        isinstance(turn, dict) and turn.get(role) is not None and turn.get(content) is not None for turn in turns
    )


def sharegpt_turns(turns, where: str, formats: str, fix: str) -> list[dict]:
    """ShareGPT turns ({"from": "human"|"gpt"|"system"|..., "value": ...}) as role/content turns.
    Anything else is a UsageError naming `where` (the record), the script's `formats` ("SFT") and
    the `fix`; a role not in SHAREGPT_ROLES or SHAREGPT_TOOL_ROLES is one too."""
    if not is_turn_list(turns, "from", "value"):
        raise UsageError(
            f"{where} fits none of the {formats} formats: its conversation is not a list of "
            f"{{'from': ..., 'value': ...}} turns (ShareGPT), got {str(turns)[:120]!r}; {fix}"
        )
    unknown = sorted({t["from"] for t in turns} - set(SHAREGPT_ROLES) - set(SHAREGPT_TOOL_ROLES))
    if unknown:
        raise UsageError(
            f"{where}: ShareGPT role {unknown[0]!r} is not one of {[*SHAREGPT_ROLES, *SHAREGPT_TOOL_ROLES]}; "
            "map it in your data, or convert the records to messages"
        )
    return [
        sharegpt_tool_turn(t["from"], t["value"], where)
        if t["from"] in SHAREGPT_TOOL_ROLES
        else {"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]}
        for t in turns
    ]


def alpaca_prompt(instruction: str, extra: str | None) -> str:
    """An Alpaca record's prompt: the instruction, then its input after a blank line when there is one."""
    return f"{instruction}\n\n{extra}" if extra else instruction


def alpaca_prompt_turns(record: dict, where: str) -> list[dict]:
    """An Alpaca record's prompt as turns, LLaMA-Factory's way: its `system` text, its `history` ([question,
    answer] pairs of text, oldest first; a CSV cell's JSON too), then the instruction (with its input) as the last
    user turn. SFT and DPO both read them; before, SFT dropped the system text and the history without a word."""
    turns = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    history = record.get("history") or []
    try:
        history = json.loads(history) if isinstance(history, str) else history
    except ValueError:
        pass  # refused below, as any history that is not pairs
    for pair in history if isinstance(history, list) else [history]:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(text, str) for text in pair)):
            raise UsageError(
                f"{where}: its history holds {str(pair)[:60]!r}; give it as [question, answer] pairs of text"
            )
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return [*turns, {"role": "user", "content": alpaca_prompt(record.get("instruction") or "", record.get("input"))}]


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
                        f"{record_name(split, record)}, turn {turn} ({message['role']}) holds a part of type "
                        f"{kind!r}: this script fine-tunes on text only, so it would be lost or learned as a "
                        "placeholder word; drop those parts or records, or use a vision-language fine-tuning script"
                    )
                texts.append(text)
            message = {**message, "content": PART_SEPARATOR.join(texts)}
        out.append(message)
    return out


ROLES = {"system", "developer", "user", "assistant", "tool", "function", "ipython"}  # the roles chat templates know


def check_messages(messages, record: int, split: str) -> None:
    """A UsageError naming the record unless `messages` is a list of role/content turns with an
    assistant turn."""
    if not is_turn_list(messages, "role", "content"):
        raise UsageError(
            f"{record_name(split, record)} fits none of the SFT formats: a conversation must be a list of "
            f"{{'role': ..., 'content': ...}} turns (an assistant's may hold 'tool_calls' instead of content; or "
            f"ShareGPT's {{'from': ..., 'value': ...}}), "
            f"got {str(messages)[:120]!r}; name the right column with --messages_column"
        )
    if not any(m["role"] == "assistant" for m in messages):
        other = sorted({m["role"] for m in messages} - ROLES, key=str)
        raise UsageError(
            f"{record_name(split, record)} has no assistant turn, so nothing to learn or to answer; "
            + (f"its roles {other} are not the chat roles: name them 'user' and 'assistant'" if other else
               "end each conversation with the assistant's answer")
        )  # fmt: skip


def check_answers_learned(messages: list[dict], loss_on: str, where: str) -> None:
    """A UsageError naming the turn where an answer that --loss_on learns (not one of "weight": 0) is empty text
    without tool calls: it would teach the model to answer with the end of its turn alone. `messages` as
    `text_content` gives them (content parts joined)."""
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("weight", 1) != 0]
    for i in answers[-1:] if loss_on == "last_assistant" else answers:
        content = messages[i].get("content")
        if not messages[i].get("tool_calls") and isinstance(content, str) and not content.strip():
            raise UsageError(f"{where}: its assistant turn {i} is empty; fill it or drop the record")
