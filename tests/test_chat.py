"""Conversations as training rows (ddp_utils.language_models.chat), checked token by token: the targets are exactly
the assistant's turns and their end-of-turn tokens, for chat templates without generation
markers; a template that re-renders history is refused; a record too long for the block loses
context from its start, never its answer."""

import pytest

from conftest import make_tiny_causal_lm
from ddp_utils import UsageError
from ddp_utils.language_models.causal_lm import IGNORE_INDEX
from ddp_utils.language_models.chat import fit_block, generation_prompt, tokenize_conversation
from ddp_utils.language_models.turns import as_messages

CHATML = (  # the layout of SmolLM2's and Qwen's templates, system turn included by default
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nbe brief<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FORGETFUL = (  # renders earlier answers differently once later turns follow, as reasoning templates do
    "{% for m in messages %}{{ m['role'] }}: "
    "{{ m['content'] if m['role'] != 'assistant' or loop.last else 'good' }} {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "the movie"},
    {"role": "assistant", "content": "w1 w2"},
    {"role": "user", "content": "was it good"},
    {"role": "assistant", "content": "w3"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        make_tiny_causal_lm(tmp_path_factory.mktemp("chat-llama"), chat_template=True)
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tokenizer


def tokens(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.fast
def test_the_targets_are_each_assistant_turn_and_its_end_marker(tokenizer):
    """conftest's template: '<s> user: ... assistant: ... </s> ...', no {% generation %} markers."""
    row = tokenize_conversation(tokenizer, CONVERSATION, "assistant", block_size=64)
    ignored = lambda text: [IGNORE_INDEX] * len(tokens(tokenizer, text))  # noqa: E731
    expected = (
        ignored("<s> user: the movie assistant:")
        + tokens(tokenizer, "w1 w2 </s>")
        + ignored("user: was it good assistant:")
        + tokens(tokenizer, "w3 </s>")
    )
    assert row.input_ids == tokens(
        tokenizer, "<s> user: the movie assistant: w1 w2 </s> user: was it good assistant: w3 </s>"
    )
    assert row.labels == expected and row.context_cut == 0
    last = tokenize_conversation(tokenizer, CONVERSATION, "last_assistant", block_size=64)
    assert [t for t in last.labels if t != IGNORE_INDEX] == tokens(tokenizer, "w3 </s>")
    every = tokenize_conversation(tokenizer, CONVERSATION, "all", block_size=64)
    assert every.labels == every.input_ids


@pytest.mark.fast
def test_chatml_targets_end_with_im_end_and_not_the_newline_after_it(tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    row = tokenize_conversation(tokenizer, CONVERSATION, "assistant", block_size=64)
    targets = [
        (tokenizer.convert_ids_to_tokens(t), label != IGNORE_INDEX) for t, label in zip(row.input_ids, row.labels)
    ]
    learned = [token for token, is_target in targets if is_target]
    assert learned == ["w1", "w2", "<|im_end|>", "w3", "<|im_end|>"]
    # The generation prompt is exactly the text before the last answer.
    prompt, reference = generation_prompt(tokenizer, CONVERSATION)
    assert reference == "w3" and prompt.endswith("was it good<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False).startswith(prompt + "w3<|im_end|>")


@pytest.mark.fast
def test_a_template_that_re_renders_history_is_refused_with_the_fix(tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = FORGETFUL
    with pytest.raises(
        UsageError, match="renders assistant turn 1 differently once later turns follow.*--loss_on last_assistant"
    ):
        tokenize_conversation(tokenizer, CONVERSATION, "assistant", block_size=64)
    row = tokenize_conversation(tokenizer, CONVERSATION, "last_assistant", block_size=64)
    assert [t for t in row.labels if t != IGNORE_INDEX] == tokens(tokenizer, "w3")


@pytest.mark.fast
def test_a_long_record_loses_context_after_bos_never_its_answer(tokenizer):
    """The cut keeps BOS (and a system turn: test_chat_templates.py), and the newest turns."""
    row = tokenize_conversation(tokenizer, CONVERSATION, "assistant", block_size=64)
    n, bos = len(row.input_ids), row.input_ids[:1]
    assert bos == [tokenizer.bos_token_id]
    first_answer = row.labels.index(tokens(tokenizer, "w1")[0])  # after '<s> user: the movie assistant:'
    # Context cut after BOS up to the token before the first answer (which predicts it): fits.
    fits = tokenize_conversation(tokenizer, CONVERSATION, "assistant", block_size=n - (first_answer - 2))
    assert fits.context_cut == first_answer - 2 and fits.input_ids == bos + row.input_ids[first_answer - 1 :]
    assert fits.labels == [IGNORE_INDEX] + row.labels[first_answer - 1 :]
    # One token more would cut into the first answer: it is not trained half, but left in as context and not
    # learned, and the newest answer, which fits whole, is kept with it (before, the whole record was dropped).
    kept = tokenize_conversation(tokenizer, CONVERSATION, "assistant", block_size=n - (first_answer - 1))
    assert kept.answers_dropped == 1 and kept.input_ids == bos + row.input_ids[first_answer:]
    assert [t for t in kept.labels if t != IGNORE_INDEX] == tokens(tokenizer, "w3 </s>")
    # Not even the last answer fits: dropped.
    last_answer = len(row.labels) - 1 - row.labels[::-1].index(tokens(tokenizer, "w3")[0])
    assert tokenize_conversation(tokenizer, CONVERSATION, "assistant", block_size=n - (last_answer - 1)) is None
    # Training on the last answer only, the first one is context and may go.
    last = tokenize_conversation(tokenizer, CONVERSATION, "last_assistant", block_size=n - first_answer - 1)
    assert last.context_cut == first_answer + 1 and last.input_ids == bos + row.input_ids[first_answer + 2 :]
    assert [t for t in last.labels if t != IGNORE_INDEX] == tokens(tokenizer, "w3 </s>")
    # The answer itself never gets cut: with fewer tokens than answer + one of context, dropped.
    assert fit_block([1, 2, 3, 4], [IGNORE_INDEX, IGNORE_INDEX, 3, 4], block_size=3) is not None
    assert fit_block([1, 2, 3, 4], [IGNORE_INDEX, IGNORE_INDEX, 3, 4], block_size=2) is None
    assert fit_block([1, 2, 3, 4], [1, 2, 3, 4], block_size=2, cut_targets=True).input_ids == [3, 4]


@pytest.mark.fast
def test_prompt_completion_records_become_turns():
    assert as_messages("hi", "there") == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"}]
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert as_messages(system, "there") == [*system, {"role": "assistant", "content": "there"}]
    assert as_messages("hi", [{"role": "assistant", "content": "there"}])[-1]["content"] == "there"


# --- the common SFT formats (ddp_utils.language_models.sft_data) ------------------------------------------------


def sft_options(**overrides):
    from types import SimpleNamespace

    from accelerate import PartialState

    PartialState(cpu=True)  # detect_format logs through Accelerate's logger
    options = dict(
        messages_column="messages",
        prompt_column="prompt",
        completion_column="completion",
        chat_template=False,
        loss_on="assistant",
    )
    return SimpleNamespace(**{**options, **overrides})


SHAREGPT = [
    {"from": "system", "value": "be brief"},
    {"from": "human", "value": "the movie"},
    {"from": "gpt", "value": "w1 w2"},
]


@pytest.mark.fast
def test_the_common_sft_formats_are_found_from_the_columns_and_read_as_the_same_turns(tokenizer):
    import datasets

    from ddp_utils.language_models.sft_data import tokenize_record
    from ddp_utils.language_models.sft_formats import detect_format

    def data(rows):
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})

    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the movie"},
        {"role": "assistant", "content": "w1 w2"},
    ]
    cases = {
        "messages": (data([{"messages": messages}]), "messages"),
        "sharegpt": (data([{"conversations": SHAREGPT}]), "sharegpt"),
        "sharegpt, named": (data([{"chats": SHAREGPT}]), "sharegpt"),
        "prompt/completion": (data([{"prompt": "the movie\n\nwhy", "completion": "w1 w2"}]), "prompt/completion"),
        "alpaca": (data([{"instruction": "the movie", "input": "why", "output": "w1 w2"}]), "alpaca"),
        "alpaca without input": (data([{"instruction": "the movie\n\nwhy", "output": "w1 w2"}]), "alpaca"),
    }
    rows = {}
    for name, (raw, kind) in cases.items():
        fmt, columns = detect_format(
            raw, sft_options(messages_column="chats" if name == "sharegpt, named" else "messages")
        )
        assert fmt.kind == kind, name
        assert set(columns) <= set(raw["train"].column_names), name
        rows[name] = tokenize_record(raw["train"][0], fmt, tokenizer, block_size=64)
    assert rows["sharegpt"] == rows["messages"] == rows["sharegpt, named"], "ShareGPT reads as the same turns"
    assert rows["alpaca"] == rows["prompt/completion"] == rows["alpaca without input"], "instruction, blank line, input"
    chat = detect_format(cases["alpaca"][0], sft_options(chat_template=True))[0]
    assert chat.turns(cases["alpaca"][0]["train"][0], 0, "train") == as_messages("the movie\n\nwhy", "w1 w2")


@pytest.mark.fast
def test_a_record_that_fits_no_format_is_named_with_the_formats_and_the_fix():
    import datasets

    from ddp_utils.language_models.sft_formats import detect_format

    with pytest.raises(
        UsageError, match=r"columns \['text', 'label'\] fit none of the SFT formats: messages .*ShareGPT"
    ):
        detect_format(
            datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a", "label": 1}])}), sft_options()
        )
    # The sets users bring most, each told the line that reads it (it was only "name ... with --prompt_column ...")
    fixes = {
        ("question", "answer"): "; name them: --prompt_column question --completion_column answer",  # GSM8K
        ("query", "response", "type"): "; name them: --prompt_column query --completion_column response",  # MetaMathQA
        ("instruction", "context", "response", "category"): "; read it as Alpaca's in the script's DATA section: "
        "data = data.rename_columns({'context': 'input', 'response': 'output'})",  # Dolly
    }
    for names, fix in fixes.items():
        data = datasets.DatasetDict({"train": datasets.Dataset.from_list([dict.fromkeys(names, "a")])})
        with pytest.raises(UsageError) as refused:
            detect_format(data, sft_options())
        assert str(refused.value).endswith(fix), refused.value
        if "rename_columns" in fix:  # the line, as a user pastes it, makes Alpaca records
            scope = {"data": data}
            exec(fix.split("DATA section: ")[1], {}, scope)
            assert detect_format(scope["data"], sft_options())[0].kind == "alpaca"
    raw = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"conversations": SHAREGPT}, {"conversations": [{"from": "human"}]}])}
    )
    fmt = detect_format(raw, sft_options())[0]
    with pytest.raises(
        UsageError, match=r"train record 1 fits none of the SFT formats: its conversation is not a list of"
    ):
        fmt.turns(raw["train"][1], 1, "train")
    bot = {"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}
    with pytest.raises(UsageError, match="train record 7: ShareGPT role 'bot' is not one of"):
        fmt.turns(bot, 7, "train")
