"""Conversation turns in the shapes users bring, as the role/content turns and tools that chat templates render:
ShareGPT's from/value turns, and tool calls (function calling) in OpenAI's chat JSONL (assistant turns with
`tool_calls`, whose arguments are a JSON string, `tool` turns with the results, a `tools` column of function schemas)
or LLaMA-Factory's ShareGPT shape (`function_call` and `observation` turns, `tools` as a JSON string). Both read as
the same turns, so they train the same tokens. No communication; any rank may call these."""

from __future__ import annotations

import json

from ..core.errors import UsageError

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# LLaMA-Factory's ShareGPT roles for a call and its result.
SHAREGPT_TOOL_ROLES = ("function_call", "observation")
TEMPLATES_WITH_TOOLS = "Qwen 2.5 and 3, Llama 3.1 and later, Mistral v0.3, Hermes"


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


def record_tools(value, where: str) -> list[dict] | None:
    """A record's tools (a list of function schemas, or a JSON string of one) in the shape templates render:
    each `{"type": "function", "function": {...}}` (a bare `{"name", "description", "parameters"}`, LLaMA-Factory's
    shape, is wrapped so). None when the record has none."""
    tools = without_nulls(from_json(value, "its tools", where))
    if not tools:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise UsageError(f"{where}: its tools must be a list of function schemas (objects); got {str(tools)[:80]!r}")
    return [tool if "function" in tool else {"type": "function", "function": tool} for tool in tools]


def tool_call(call, where: str) -> dict:
    """One tool call as templates render it: `{"type": "function", "function": {"name", "arguments"}}`, the
    arguments a JSON object (OpenAI gives them as a string, which most templates would quote again)."""
    call = without_nulls(call)
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise UsageError(f"{where}: a tool call must name its function ({{name, arguments}}); got {str(call)[:70]!r}")
    arguments = from_json(function.get("arguments", {}), f"the arguments of its call to {function['name']!r}", where)
    if not isinstance(arguments, dict):
        raise UsageError(f"{where}: the arguments of its call to {function['name']!r} must be a JSON object")
    return {**call, "type": "function", "function": {**function, "arguments": arguments}}


def tool_turn(turn: dict, where: str) -> dict:
    """A role/content turn without the keys `datasets` filled with None; an assistant turn's tool calls parsed
    (`tool_call`), its missing content "" (the calls are its answer), no `tool_calls` key when there are none; a tool
    result given as a JSON object written as JSON text."""
    turn = {key: value for key, value in turn.items() if value is not None}
    calls = turn.pop("tool_calls", None)
    if calls:
        turn["tool_calls"] = [tool_call(call, where) for call in calls]
        turn.setdefault("content", "")
    if turn.get("role") == "tool" and isinstance(turn.get("content"), (dict, list)) and not is_parts(turn["content"]):
        turn["content"] = json.dumps(turn["content"], ensure_ascii=False)
    return turn


def is_parts(content) -> bool:
    """Whether `content` is a list of content parts ({"type": ...}), which `chat.text_content` joins."""
    return isinstance(content, list) and all(isinstance(part, dict) and "type" in part for part in content)


def sharegpt_tool_turn(role: str, value, where: str) -> dict:
    """A LLaMA-Factory ShareGPT `function_call` turn (a JSON call, or a list of them) as an assistant turn with
    tool calls, an `observation` turn (a call's result) as a tool turn."""
    if role == "observation":
        return tool_turn({"role": "tool", "content": value}, where)
    calls = from_json(value, "its function call", where)
    return tool_turn({"role": "assistant", "tool_calls": calls if isinstance(calls, list) else [calls]}, where)


def uses_tools(messages: list[dict], tools: list[dict] | None) -> bool:
    """Whether a conversation has tools, tool calls or tool results."""
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def check_tools_rendered(text: str, messages: list[dict], tools: list[dict] | None, tokenizer, where: str) -> None:
    """A UsageError naming the record unless the rendered conversation `text` shows each of its tools, tool calls
    and tool results: a chat template without tool support drops them, and the model would learn to answer without
    the tools it was given, or learn empty answers where it called one."""
    shown = [("tool", tool["function"].get("name", "")) for tool in tools or []]
    shown += [("call to", call["function"]["name"]) for m in messages for call in m.get("tool_calls", [])]
    shown += [("tool result", m["content"].strip()) for m in messages if m["role"] == "tool"]
    # A result may be shown quoted as JSON text (Llama 3.1 quotes every result): its quotes escaped.
    seen = lambda name: name in text or json.dumps(name, ensure_ascii=False)[1:-1] in text  # noqa: E731
    missing = next(((kind, name) for kind, name in shown if name and not seen(name)), None)
    if missing:
        raise UsageError(
            f"{where}: the chat template of {tokenizer.name_or_path!r} leaves out its {missing[0]} "
            f"{missing[1][:60]!r}: it has no tool support, and the model would learn without it; fine-tune a model "
            f"whose template renders tools and tool calls ({TEMPLATES_WITH_TOOLS})"
        )


def tools_end(with_tools: str, without: str) -> int:
    """Where the tools' text ends in a conversation rendered `with_tools`, given the same conversation rendered
    `without` them: the end of the part that differs. A cut to fit the block keeps the text before it, so that the
    calls learned keep their tools. 0 when they are the same."""
    start = 0
    while start < min(len(with_tools), len(without)) and with_tools[start] == without[start]:
        start += 1
    same_end = 0
    while same_end < min(len(with_tools), len(without)) - start and with_tools[-1 - same_end] == without[-1 - same_end]:
        same_end += 1
    return len(with_tools) - same_end if start < len(with_tools) else 0


def sharegpt_turns(turns, where: str, formats: str, fix: str) -> list[dict]:
    """ShareGPT turns ({"from": "human"|"gpt"|"system"|..., "value": ...}) as role/content turns.
    Anything else is a UsageError naming `where` (the record), the script's `formats` ("SFT") and
    the `fix`; a role not in SHAREGPT_ROLES or SHAREGPT_TOOL_ROLES is one too."""

    def fits(turn):
        return isinstance(turn, dict) and turn.get("from") is not None and turn.get("value") is not None

    if not isinstance(turns, list) or not all(fits(turn) for turn in turns):
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
