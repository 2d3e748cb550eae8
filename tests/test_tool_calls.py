"""Tool-calling conversations (function calling) in the shapes users bring, made here: OpenAI's chat JSONL (assistant
turns with `tool_calls` whose arguments are a JSON string, `tool` turns, a `tools` column that differs from record to
record) and LLaMA-Factory's ShareGPT shape (`function_call` and `observation` turns, `tools` as a JSON string). Both
train the same tokens with a template that renders tools (Qwen 2.5's layout, `chat_templates.QWEN25`): the calls and
the answers are learned, the tools and the results are not; a template without tool support, bad arguments, DPO
pairs with calls are refused in one line; a cut keeps the tools; GRPO prompts show them. The whole script runs on
such a file on 2 processes."""

import json
from types import SimpleNamespace

import pytest
from chat_templates import make_family_model, make_family_tokenizer

from conftest import REPO, launch
from ddp_utils import UsageError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SEARCH = {  # other parameters and no description: `datasets` gives records of one column one type
    "type": "function",
    "function": {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}},
}


def openai_record(city: str, tools=(WEATHER, SEARCH)) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"what is the weather in {city}"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"celsius": 12})},
            {"role": "assistant", "content": f"it is 12 degrees in {city}"},
        ],
        "tools": list(tools),
    }


def llama_factory_record(city: str, tools=(WEATHER, SEARCH)) -> dict:
    return {
        "conversations": [
            {"from": "human", "value": f"what is the weather in {city}"},
            {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": city}})},
            {"from": "observation", "value": json.dumps({"celsius": 12})},
            {"from": "gpt", "value": f"it is 12 degrees in {city}"},
        ],
        "system": "be brief",
        "tools": json.dumps([tool["function"] for tool in tools]),  # bare functions, as a string
    }


def plain_record(n: int) -> dict:
    return {"messages": [{"role": "user", "content": f"hello {n}"}, {"role": "assistant", "content": "hi"}]}


def options(**given):
    defaults = dict(
        messages_column="messages", prompt_column="prompt", completion_column="completion", chat_template=None
    )
    return SimpleNamespace(**{**defaults, "loss_on": "assistant", **given})


def read(tmp_path, records, name="train.jsonl"):
    """`records` as a JSONL file read by `datasets`, and its SFT format."""
    import datasets

    from ddp_utils.language_models.sft_formats import detect_format

    path = tmp_path / name
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    raw = datasets.load_dataset("json", data_files=str(path))
    return raw["train"], detect_format(raw, options())[0]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return make_family_tokenizer("qwen2.5", tmp_path_factory.mktemp("qwen2.5"))


@pytest.fixture(autouse=True)
def accelerate_state():
    from accelerate import PartialState

    PartialState(cpu=True)  # ddp_utils logs through Accelerate's logger


@pytest.mark.fast
def test_openai_and_llama_factory_tool_records_train_the_calls_and_answers_not_the_tools_or_results(tmp_path, qwen):
    from ddp_utils.language_models.chat import assistant_spans
    from ddp_utils.language_models.sft_data import tokenize_record

    openai, openai_fmt = read(tmp_path, [openai_record("paris"), plain_record(1), openai_record("oslo", [WEATHER])])
    assert openai_fmt.kind == "messages" and openai_fmt.tools == "tools"
    messages = openai_fmt.turns(openai[0], 0, "train")
    tools = openai_fmt.record_tools(openai[0], 0, "train")
    text, spans = assistant_spans(qwen, messages, "assistant", tools)
    assert [text[start:end] for start, end in spans] == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call><|im_end|>',
        "it is 12 degrees in paris<|im_end|>",
    ], "the call learned once, its arguments an object (not OpenAI's string quoted again), then the answer"
    shown = text[: spans[0][0]]
    assert '{"name": "search", "parameters":' in shown, "both tools shown, without the None keys datasets fills in"
    assert '"description": null' not in text and "<tool_response>" not in "".join(text[a:b] for a, b in spans)

    factory, factory_fmt = read(tmp_path, [llama_factory_record("paris"), llama_factory_record("oslo", [WEATHER])], "f")
    assert factory_fmt.kind == "sharegpt" and factory_fmt.tools == "tools"
    for n, same in ((0, 0), (1, 2)):  # its system column read as the first turn
        ours = tokenize_record(factory[n], factory_fmt, qwen, block_size=512, index=n)
        assert ours == tokenize_record(openai[same], openai_fmt, qwen, block_size=512, index=same), "the same tokens"
    plain, plain_fmt = read(tmp_path, [plain_record(1)], "plain.jsonl")
    assert plain_fmt.tools is None
    assert tokenize_record(openai[1], openai_fmt, qwen, 512) == tokenize_record(plain[0], plain_fmt, qwen, 512), (
        "a record without tools trains the same tokens in a file with a tools column"
    )
    system = {"from": "system", "value": "be brief"}
    with_system = dict(factory[0], conversations=[system, *factory[0]["conversations"]])
    turns = factory_fmt.turns(with_system, 0, "train")
    assert [turn["role"] for turn in turns].count("system") == 1, "its system column only where it has no system turn"
    call = factory_fmt.turns(factory[0], 0, "train")[2]["tool_calls"][0]
    assert call == {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "paris"}}}, (
        "only the call's own keys: LLaMA-Factory's flat name and arguments are not left beside it"
    )
    no_arguments = openai_record("paris")
    no_arguments["messages"][2]["tool_calls"][0]["function"]["arguments"] = ""  # a call without arguments
    raw, fmt = read(tmp_path, [no_arguments], "empty.jsonl")
    assert fmt.turns(raw[0], 0, "train")[2]["tool_calls"][0]["function"]["arguments"] == {}
    as_object = openai_record("paris")
    as_object["messages"][3]["content"] = {"celsius": 12}  # a tool result given as an object, not as its JSON text
    raw, fmt = read(tmp_path, [as_object], "object.jsonl")
    assert tokenize_record(raw[0], fmt, qwen, block_size=512) == tokenize_record(openai[0], openai_fmt, qwen, 512)


@pytest.mark.fast
def test_llama_3_1s_layout_tools_in_the_user_turn_results_quoted_one_call_a_turn(tmp_path):
    from ddp_utils.language_models.chat import assistant_spans, render
    from ddp_utils.language_models.sft_data import tokenize_record

    llama = make_family_tokenizer("llama3", tmp_path / "llama3")
    two_calls = openai_record("oslo")
    two_calls["messages"][2]["tool_calls"] *= 2
    raw, fmt = read(tmp_path, [openai_record("paris"), two_calls])
    messages, tools = fmt.turns(raw[0], 0, "train"), fmt.record_tools(raw[0], 0, "train")
    text, spans = assistant_spans(llama, messages, "assistant", tools)
    assert [text[start:end] for start, end in spans] == [
        '{"name": "get_weather", "parameters": {"city": "paris"}}<|eot_id|>',
        "it is 12 degrees in paris<|eot_id|>",
    ]
    assert '"{\\"celsius\\": 12}"' in text, "the result quoted as JSON text: shown, not refused as left out"
    whole = tokenize_record(raw[0], fmt, llama, block_size=4096)
    row = tokenize_record(raw[0], fmt, llama, block_size=len(whole.input_ids) - 3)
    tools_text = render(llama, messages, tools=tools).split("what is the weather")[0]
    kept = len(llama(tools_text, add_special_tokens=False)["input_ids"])
    assert row.context_cut == 3 and row.input_ids[:kept] == whole.input_ids[:kept], "the cut is after the tools"
    with pytest.raises(UsageError, match="train record 1: the chat template of .* refuses it: only one tool call"):
        tokenize_record(raw[1], fmt, llama, block_size=4096, index=1)
    every = assistant_spans(llama, messages, "all", tools)[1]
    assert every == [(0, len(text))], "--loss_on all takes the quoted result as shown"


@pytest.mark.fast
def test_an_assistant_turn_of_weight_0_is_context_not_learned(tmp_path, qwen):
    """OpenAI's chat fine-tuning shape marks a turn not to learn with "weight": 0."""
    from ddp_utils.language_models.chat import assistant_spans
    from ddp_utils.language_models.sft_data import tokenize_record

    record = openai_record("paris")
    record["messages"][2]["weight"] = 0  # the call is context; the answer is learned
    raw, fmt = read(tmp_path, [record])
    messages, tools = fmt.turns(raw[0], 0, "train"), fmt.record_tools(raw[0], 0, "train")
    text, spans = assistant_spans(qwen, messages, "assistant", tools)
    assert [text[start:end] for start, end in spans] == ["it is 12 degrees in paris<|im_end|>"]
    record["messages"][4]["weight"] = 0
    raw, fmt = read(tmp_path, [record], "none.jsonl")
    with pytest.raises(UsageError, match="train record 0: every assistant turn has weight 0"):
        tokenize_record(raw[0], fmt, qwen, block_size=512)


# The templates these models ship, as TRL keeps them (trl/chat_templates/, from each model's Hub repository): found
# there where TRL is installed (`make bench` installs it; CI does not, and skips this).
SHIPPED = {
    "qwen2_5": "qwen2.5", "qwen3": "qwen2.5", "qwen3_instruct_2507": "qwen2.5", "qwen3_5_nothink": "qwen2.5",
    "qwen3_6": "qwen2.5", "llama3_1": "llama3", "llama3_2": "llama3", "gemma4": "qwen2.5", "gptoss": "qwen2.5",
    "glm4moe": "qwen2.5", "lfm2_2_5": "qwen2.5",
}  # fmt: skip


@pytest.mark.fast
@pytest.mark.parametrize("template", sorted(SHIPPED))
def test_the_templates_models_ship_learn_the_call_from_both_shapes(template, tmp_path):
    from ddp_utils.language_models.chat import assistant_spans
    from ddp_utils.language_models.sft_data import tokenize_record

    trl = pytest.importorskip("trl", reason="the shipped templates come with TRL (make bench installs it)")
    from pathlib import Path

    tokenizer = make_family_tokenizer(SHIPPED[template], tmp_path / "tokenizer")
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja").read_text()
    openai, openai_fmt = read(tmp_path, [openai_record("paris", [WEATHER])], "openai.jsonl")
    factory, factory_fmt = read(tmp_path, [llama_factory_record("paris", [WEATHER])], "factory.jsonl")
    row = tokenize_record(openai[0], openai_fmt, tokenizer, block_size=4096)
    assert row == tokenize_record(factory[0], factory_fmt, tokenizer, block_size=4096), "both shapes, the same tokens"
    messages, tools = openai_fmt.turns(openai[0], 0, "train"), openai_fmt.record_tools(openai[0], 0, "train")
    text, spans = assistant_spans(tokenizer, messages, "assistant", tools)
    learned = [text[start:end] for start, end in spans]
    assert len(learned) == 2 and "get_weather" in learned[0] and "paris" in learned[0], learned
    assert "12 degrees" in learned[1] and not any("celsius" in answer or "description" in answer for answer in learned)
    assert text.count("the weather in a city") == 1, "the tool shown once, in the prompt"


@pytest.mark.fast
def test_a_tool_call_answer_is_scored_against_the_call_the_template_writes(tmp_path, qwen):
    from ddp_utils.language_models.sft_data import generation_prompt_ids

    record = openai_record("paris")
    record["messages"] = record["messages"][:3]  # the conversation ends with the call
    raw, fmt = read(tmp_path, [record])
    ids, reference, cut = generation_prompt_ids(raw[0], fmt, qwen, max_prompt_tokens=512)
    assert reference == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'
    assert not cut and qwen.decode(ids).endswith("<|im_start|> assistant")


@pytest.mark.fast
def test_a_long_tool_conversation_is_cut_after_its_tools_never_through_them(tmp_path, qwen):
    from ddp_utils.language_models.chat import render
    from ddp_utils.language_models.sft_data import tokenize_record

    record = openai_record("paris")
    history = [{"role": "user", "content": "hello " * 40}, {"role": "assistant", "content": "hi"}]
    record["messages"][1:1] = history * 3
    raw, fmt = read(tmp_path, [record])
    whole = tokenize_record(raw[0], fmt, qwen, block_size=4096)
    row = tokenize_record(raw[0], fmt, qwen, block_size=len(whole.input_ids) - 60)
    assert row.context_cut == 60
    text = render(qwen, fmt.turns(raw[0], 0, "train"), tools=fmt.record_tools(raw[0], 0, "train"))
    tools_text = text[: text.index("</tool_call><|im_end|>") + len("</tool_call><|im_end|>")]
    kept = len(qwen(tools_text, add_special_tokens=False)["input_ids"])
    assert row.input_ids[:kept] == whole.input_ids[:kept], "the system turn and the tools stay whole"
    assert row.input_ids[-20:] == whole.input_ids[-20:] and row.labels[-20:] == whole.labels[-20:]
    assert tokenize_record(raw[0], fmt, qwen, block_size=kept) is None, "no room after the tools: dropped, counted"


# The layout of Mistral v0.3's tool template: the tools just before the LAST user turn, no generation prompt.
TOOLS_LATE = (
    "{%- set ns = namespace(last=0) %}{%- for m in messages %}"
    "{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'user' %}{%- if tools and loop.index0 == ns.last %}[AVAILABLE_TOOLS] {{ tools | tojson }} "
    "[/AVAILABLE_TOOLS]{%- endif %}[INST] {{ m.content }} [/INST]"
    "{%- elif m.tool_calls is defined %}"
    " [TOOL_CALLS] {{ m.tool_calls | map(attribute='function') | list | tojson }}</s>"
    "{%- elif m.role == 'tool' %} [TOOL_RESULTS] {{ m.content }} [/TOOL_RESULTS]"
    "{%- else %} {{ m.content }}</s>{%- endif %}{%- endfor %}"
)


@pytest.mark.fast
def test_tools_shown_late_are_not_kept_by_a_cut_that_would_then_take_the_newest_question(tmp_path):
    """Mistral's layout: a cut keeps BOS and takes the oldest turns, as without tools, not everything up to them."""
    from dataclasses import replace

    from ddp_utils.language_models.sft_data import tokenize_record

    mistral = make_family_tokenizer("mistral-v0.3", tmp_path / "mistral")
    mistral.chat_template = TOOLS_LATE
    record = openai_record("paris")
    old_turns = [{"role": "user", "content": "hello " * 40}, {"role": "assistant", "content": "hi"}]
    record["messages"] = old_turns + record["messages"][1:]  # no system turn: this template has none
    raw, fmt = read(tmp_path, [record])
    fmt = replace(fmt, loss_on="last_assistant")  # its earlier answers render otherwise once the tools move
    whole = tokenize_record(raw[0], fmt, mistral, block_size=4096)
    row = tokenize_record(raw[0], fmt, mistral, block_size=len(whole.input_ids) - 30)
    assert row.input_ids[0] == mistral.bos_token_id and row.input_ids[1:] == whole.input_ids[31:], (
        "the oldest turn's words went; the tools, the question and the call stay"
    )


@pytest.mark.fast
def test_a_template_without_tool_support_and_bad_arguments_are_refused_naming_the_record(tmp_path, qwen):
    from ddp_utils.language_models.sft_data import tokenize_record

    chatml = make_family_tokenizer("chatml", tmp_path / "chatml")
    raw, fmt = read(tmp_path, [plain_record(0), openai_record("paris")])
    assert tokenize_record(raw[0], fmt, chatml, block_size=512) is not None, "records without tools still train"
    with pytest.raises(UsageError, match=r"train record 1: the chat template of .* leaves out its tool 'get_weather'"):
        tokenize_record(raw[1], fmt, chatml, block_size=512, index=1)
    without_tools = openai_record("paris")
    del without_tools["tools"]
    without_tools["messages"][1]["content"] = "use get_weather for paris"  # the name in the question's own words
    raw, fmt = read(tmp_path, [without_tools], "no-tools.jsonl")
    with pytest.raises(UsageError, match="leaves out its call to 'get_weather': it has no tool support"):
        tokenize_record(raw[0], fmt, chatml, block_size=512)
    strict = make_family_tokenizer("chatml", tmp_path / "strict")
    strict.chat_template = (  # as Gemma's and Mistral's raise on a role they do not take
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('Conversation roles must alternate') }}"
        "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    raw, fmt = read(tmp_path, [plain_record(0), without_tools], "strict.jsonl")
    with pytest.raises(UsageError, match="train record 1: the chat template of .* refuses it: Conversation roles must"):
        tokenize_record(raw[1], fmt, strict, block_size=512, index=1)
    calculator = {"prompt": "what is 2 + 2", "completion": "4", "tools": "calculator"}  # a column of another meaning
    raw, fmt = read(tmp_path, [calculator], "calculator.jsonl")
    with pytest.raises(UsageError, match="train record 0: its tools is a string .*; the 'tools' column is read as"):
        tokenize_record(raw[0], fmt, qwen, block_size=512)
    bad = openai_record("paris")
    bad["messages"][2]["tool_calls"][0]["function"]["arguments"] = "{'city': 'paris'}"  # Python, not JSON
    raw, fmt = read(tmp_path, [bad], "bad.jsonl")
    with pytest.raises(UsageError, match="train record 0: the arguments of its call to 'get_weather' is a string"):
        tokenize_record(raw[0], fmt, qwen, block_size=512)


@pytest.mark.fast
def test_dpo_pairs_with_tool_calls_are_refused_and_grpo_prompts_show_their_tools(tmp_path, qwen):
    import datasets

    from ddp_utils.language_models.chat import render
    from ddp_utils.language_models.grpo_data import tokenize_prompts
    from ddp_utils.language_models.pair_formats import PairFormat

    record = openai_record("paris")
    pair = {"prompt": record["messages"][:2], "chosen": record["messages"][2:3], "rejected": record["messages"][4:]}
    with pytest.raises(UsageError, match="train record 3 holds tool calls or results: .*train_sft.py learns calls"):
        PairFormat("conversational", None).pair(pair, 3, "train")
    prompts = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"prompt": "what is the weather in paris", "tools": [WEATHER]}])}
    )
    ids = tokenize_prompts(prompts, qwen, 512, use_chat_template=True)["train"][0]["input_ids"]
    asked = render(qwen, [{"role": "user", "content": "what is the weather in paris"}], True, tools=[WEATHER])
    assert ids == qwen(asked, add_special_tokens=False)["input_ids"] and "get_weather" in asked
    chatml = make_family_tokenizer("chatml", tmp_path / "chatml")
    with pytest.raises(UsageError, match="record 0: the chat template of .* leaves out its tool 'get_weather'"):
        tokenize_prompts(prompts, chatml, 512, use_chat_template=True)
    two_calls = openai_record("paris")["messages"][1:4]  # a prompt that holds calls already, two at once
    two_calls[1]["tool_calls"] *= 2
    llama = make_family_tokenizer("llama3", tmp_path / "llama3")
    prompts = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": two_calls, "tools": [WEATHER]}])})
    with pytest.raises(UsageError, match="record 0: the chat template of .* refuses it: only one tool call at a time"):
        tokenize_prompts(prompts, llama, 512, use_chat_template=True)


def test_train_sft_learns_a_tool_calling_file_on_two_processes(tmp_path):
    """The script end to end on an OpenAI tool-calling file: it trains, scores the calls by generation, and saves."""
    model = make_family_model("qwen2.5", tmp_path / "qwen")
    calls = [openai_record(city) for city in ("paris", "oslo", "lima", "rome") * 2]
    for record in calls[4:]:
        record["messages"] = record["messages"][:3]  # these end with the call: scored against it
    records = calls + [plain_record(n) for n in range(8)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    common = ["--per_device_train_batch_size", 4, "--max_train_steps", 3, "--eval_max_new_tokens", 24]
    common += ["--block_size", 256, "--skip_zero_shot", "--report_to", "none", "--output_dir", tmp_path / "out"]
    common += ["--train_file", data, "--validation_file", data]
    result = launch(REPO / "scripts" / "train_sft.py", "--model_name_or_path", model, *common)
    assert result.returncode == 0, result.output[-3000:]
    assert "SFT data format: messages (columns messages, tools)" in result.output
    predictions = [json.loads(line) for line in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    references = sorted(p["reference"] for p in predictions)
    assert len(references) == len(records)
    assert sum(r.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": ') for r in references) == 4
    assert sum(r.startswith("it is 12 degrees in") for r in references) == 4
    assert (tmp_path / "out" / "model.safetensors").exists()
