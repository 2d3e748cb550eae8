"""The chat templates of the families users fine-tune (tests/chat_templates.py: Llama 3.x instruct and
base, Qwen 2.5 instruct and base, Qwen3, Mistral v0.3, Gemma 2 and 3, Phi-3, ChatML), each on a tiny
model built offline. For every family, SFT and DPO's prompts alike:

- a one-answer conversation with a system turn trains only the answer and its end of turn, and keeps
  the system text (Mistral puts it in the last user turn only, Gemma 2 refuses it: folded in);
- generation stops at the end of turn (base models' EOS is another token), greedily, whatever the
  checkpoint's own sampling and penalties;
- exact match is right on a known answer (Qwen3's thinking block dropped first);
- a long prompt is cut in its middle: BOS and the system turn stay;
- the tokenizer is saved with the pad token it had, never pad = EOS.
"""

import datasets
import pytest
import torch
from accelerate import Accelerator
from chat_templates import FAMILIES, make_family_model, make_family_tokenizer

from ddp_utils.core.errors import UsageError
from ddp_utils.language_models.causal_lm import IGNORE_INDEX, load_tokenizer
from ddp_utils.language_models.chat import end_of_turn, tokenize_conversation
from ddp_utils.language_models.generation import (
    generate_answers,
    make_generation_dataloader,
    score_answers,
    stop_token_ids,
)

SYSTEM = "be brief"
ASKED = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what do you think of this film"}]
ANSWERED = ASKED + [{"role": "assistant", "content": "positive"}]


@pytest.fixture(autouse=True)
def accelerate_state():
    from accelerate import PartialState

    PartialState(cpu=True)  # ddp_utils logs through Accelerate's logger


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return {family: make_family_tokenizer(family, tmp_path_factory.mktemp(family)) for family in FAMILIES}


def targets(tokenizer, row) -> list[str]:
    return tokenizer.convert_ids_to_tokens([t for t in row.labels if t != IGNORE_INDEX])


def expected_targets(family: str, thinking: bool = True) -> list[str]:
    end = FAMILIES[family][4]
    answer = ["positive", end]
    if family == "qwen3" and thinking:
        answer = ["<think>", "</think>", *answer]  # the template's empty thinking block, learned with the answer
    if family == "phi3":
        answer.append("<|endoftext|>")  # Phi-3 ends the whole conversation with EOS
    return answer


@pytest.mark.fast
@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_answer_trains_only_the_answer_and_its_end_of_turn_with_the_system_kept(family, tokenizers):
    """Before, Mistral and Gemma 2 refused every record with a system turn (the demo's data has one)."""
    tokenizer = tokenizers[family]
    for loss_on in ("assistant", "last_assistant"):
        row = tokenize_conversation(tokenizer, ANSWERED, loss_on, block_size=128)
        assert targets(tokenizer, row) == expected_targets(family), (family, loss_on)
        assert "be brief" in tokenizer.decode(row.input_ids), "the system turn is in what the model sees"
    every = tokenize_conversation(tokenizer, ANSWERED, "all", block_size=128)
    assert "be brief" in tokenizer.decode(every.input_ids)  # before: Mistral rendered it without the system text


@pytest.mark.fast
def test_qwen3_without_thinking_and_with_several_turns(tokenizers):
    """--chat_template_kwargs '{"enable_thinking": false}' reaches the template: the answer alone is
    learned. Several turns: the template drops earlier answers' thinking once a later user turn
    follows; each answer is learned as the conversation shows it (before: refused)."""
    tokenizer = tokenizers["qwen3"]
    tokenizer.chat_template_kwargs = {"enable_thinking": False}
    try:
        row = tokenize_conversation(tokenizer, ANSWERED, "assistant", block_size=128)
        assert targets(tokenizer, row) == expected_targets("qwen3", thinking=False)
    finally:
        tokenizer.chat_template_kwargs = None
    talk = ANSWERED + [{"role": "user", "content": "was it good"}, {"role": "assistant", "content": "good"}]
    row = tokenize_conversation(tokenizer, talk, "assistant", block_size=128)
    assert targets(tokenizer, row) == ["positive", "<|im_end|>", "<think>", "</think>", "good", "<|im_end|>"]
    # Phi-3 ends the conversation with EOS: an earlier answer ends at its own <|end|>, not at that EOS.
    row = tokenize_conversation(tokenizers["phi3"], talk, "assistant", block_size=128)
    assert targets(tokenizers["phi3"], row) == ["positive", "<|end|>", "good", "<|end|>", "<|endoftext|>"]


@pytest.mark.fast
@pytest.mark.parametrize("family", list(FAMILIES))
def test_exact_match_is_right_on_a_known_answer(family, tokenizers):
    tokenizer = tokenizers[family]
    answer = tokenizer.decode(tokenizer.convert_tokens_to_ids(expected_targets(family)), skip_special_tokens=True)
    scores, _ = score_answers([answer, "negative"], ["positive", "positive"])
    assert scores["exact_match"] == 0.5, answer  # before: Qwen3's "<think> </think> positive" never matched


@pytest.mark.fast
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_long_prompt_is_cut_in_its_middle_keeping_bos_and_the_system_turn(family, tokenizers):
    tokenizer = tokenizers[family]
    long = [ASKED[0], {"role": "user", "content": " ".join(["good"] * 60) + " what do you think"}, ANSWERED[-1]]
    whole = tokenize_conversation(tokenizer, long, "assistant", block_size=512)
    row = tokenize_conversation(tokenizer, long, "assistant", block_size=len(whole.input_ids) - 30)
    assert row.context_cut == 30 and targets(tokenizer, row) == expected_targets(family)
    assert row.input_ids[0] == whole.input_ids[0], "BOS (where the template has one) stays"
    text = tokenizer.decode(row.input_ids)
    assert "be brief" in text and "what do you think" in text, "the system turn and the latest words stay"


# The templates that add a system turn of their own to a conversation without one (Qwen 2.5's text, Llama 3's dates).
OWN_SYSTEM = {"llama3", "llama3-base", "qwen2.5", "qwen2.5-base"}


@pytest.mark.fast
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_long_prompt_without_a_system_turn_keeps_the_one_the_template_adds(family, tokenizers):
    """Qwen 2.5 and Llama 3 add a system turn of their own where the conversation has none ("You are Qwen...", the
    dates). A cut took from the start and left its tail ("...a helpful assistant.<|im_end|>"); it keeps it whole now,
    in SFT, DPO (a string prompt rendered as a user turn too) and GRPO (`chat.head_length`). Other templates: as
    before, BOS where they have one."""
    from ddp_utils.language_models.chat import cut_prompt, head_length, render, template_head_end
    from ddp_utils.language_models.pair_formats import PairFormat
    from ddp_utils.language_models.preference_data import prompt_head

    tokenizer = tokenizers[family]
    question = " ".join(["good"] * 60) + " what do you think"
    long = [{"role": "user", "content": question}, {"role": "assistant", "content": "positive"}]
    whole = tokenize_conversation(tokenizer, long, "assistant", block_size=512)
    row = tokenize_conversation(tokenizer, long, "assistant", block_size=len(whole.input_ids) - 30)
    assert row.context_cut == 30 and targets(tokenizer, row) == expected_targets(family)
    asked = long[:1]
    text = render(tokenizer, asked, generation_prompt=True)
    head = head_length(tokenizer, asked, text)
    assert prompt_head(question, PairFormat("conversational", True), tokenizer) == head  # DPO's string prompt
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[:head] == row.input_ids[:head] == cut_prompt(tokenizer, asked, text, ids, None, 30)[:head]
    own = template_head_end(tokenizer, asked, text)  # where the template's own system text ends in `text`
    assert (own > 0) == (family in OWN_SYSTEM), text[:own]
    if own:  # its text and the end of its turn, whole
        assert "Today Date" in text[:own] or "You are Qwen" in text[:own]
        text_tokens = len(tokenizer(text[:own], add_special_tokens=False)["input_ids"])
        assert head > text_tokens and end_of_turn(tokenizer)[0] in ids[text_tokens:head]
    else:
        assert head == (tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id)


def hooked(model, prompt_length, plan):
    """Make the model's greedy choice for answer token k be plan[k] (the last one thereafter), each
    only a little above the rest, so that a repetition penalty would change it."""

    def force(module, args, kwargs, output):
        cache = kwargs.get("past_key_values")
        seen = cache.get_seq_length() if cache is not None else kwargs["input_ids"].shape[1]  # this pass's included
        generated = seen - prompt_length
        if generated >= 0:  # not the shared prefix's own pass
            logits = torch.zeros_like(output.logits)
            logits[..., plan[min(generated, len(plan) - 1)]] = 0.5
            output.logits = logits
        return output

    model.register_forward_hook(force, with_kwargs=True)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generation_stops_at_the_end_of_turn_greedily(family, tmp_path):
    """Base models' EOS is not their template's end of turn: answers ran to --eval_max_new_tokens
    ("positive user ..."). And the checkpoint's repetition penalty was applied to "greedy" answers."""
    from transformers import AutoModelForCausalLM

    directory = make_family_model(family, tmp_path)
    tokenizer = load_tokenizer(str(directory))
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    model.generation_config.repetition_penalty = 10.0  # as a checkpoint may ship it (Qwen2.5-Instruct: 1.05)
    end, _ = end_of_turn(tokenizer)
    assert end in stop_token_ids(tokenizer, model.generation_config)
    good, positive = tokenizer.convert_tokens_to_ids(["good", "positive"])
    accelerator = Accelerator(cpu=True)
    prompt = tokenizer.apply_chat_template(ASKED[1:], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    hooked(model, len(ids), [positive, good, good, end, good])
    prompts = datasets.Dataset.from_dict({"index": [0], "input_ids": [ids], "reference": ["positive good good"]})
    loader = accelerator.prepare(make_generation_dataloader(prompts, 1, tokenizer, model.config))
    answers = generate_answers(accelerator, accelerator.prepare(model), loader, tokenizer, max_new_tokens=8)
    assert answers == ["positive good good"], "stopped at the end of turn, the repeated word not penalised"


@pytest.mark.fast
def test_the_saved_tokenizer_keeps_the_pad_token_it_had(tmp_path):
    """pad = EOS is set for our own padding (masked by position); saved, a user's collator that masks
    padding by id would mask every EOS and stop learning to end answers."""
    from transformers import AutoTokenizer

    from ddp_utils.results.output import save_processor

    make_family_tokenizer("llama3-base", tmp_path / "source")
    tokenizer = load_tokenizer(str(tmp_path / "source"))
    assert tokenizer.pad_token == tokenizer.eos_token  # in memory, for padding
    save_processor(tokenizer, str(tmp_path / "saved"))
    assert AutoTokenizer.from_pretrained(tmp_path / "saved").pad_token is None
    assert tokenizer.pad_token == tokenizer.eos_token


@pytest.mark.fast
@pytest.mark.parametrize("family", list(FAMILIES))
def test_dpo_prompts_keep_the_system_turn_and_answers_end_with_the_end_of_turn(family, tokenizers):
    from ddp_utils.language_models.pair_formats import PairFormat
    from ddp_utils.language_models.preference_data import tokenize_pair

    tokenizer = tokenizers[family]
    pair = (ASKED, [{"role": "assistant", "content": "positive"}], [{"role": "assistant", "content": "negative"}])
    prompt, chosen, rejected, _ = tokenize_pair(pair, PairFormat("conversational", True), tokenizer)
    assert "be brief" in tokenizer.decode(prompt)
    assert tokenizer.convert_ids_to_tokens(chosen) == expected_targets(family)
    assert tokenizer.convert_ids_to_tokens(rejected) == [
        "negative" if t == "positive" else t for t in expected_targets(family)
    ]


@pytest.mark.fast
def test_loss_on_all_is_refused_when_the_template_leaves_a_turn_out(tokenizers):
    tokenizer = tokenizers["chatml"].__class__.from_pretrained(tokenizers["chatml"].name_or_path)
    tokenizer.chat_template = FAMILIES["chatml"][0].replace("{% for m in messages %}", "{% for m in messages[-2:] %}")
    talk = ANSWERED[1:] + [{"role": "user", "content": "was it good"}, {"role": "assistant", "content": "good"}]
    with pytest.raises(UsageError, match="leaves out of the conversation a user turn's text"):
        tokenize_conversation(tokenizer, talk, "all", block_size=128)


@pytest.mark.fast
def test_greedy_generation_leaves_a_lora_models_own_generation_config_as_it_was(tmp_path):
    """peft's generate copies the wrapper's config onto the base model: emptied there, --merge_lora's
    merged/ shipped a generation_config without its EOS ids."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ddp_utils.language_models.generation import only_this_config

    directory = make_family_model("llama3", tmp_path)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(directory), LoraConfig(r=2, target_modules="all-linear")
    )
    model.get_base_model().generation_config.eos_token_id = [3, 4]
    with only_this_config(model):
        model.generate(input_ids=torch.tensor([[1, 2]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert model.get_base_model().generation_config.eos_token_id == [3, 4]
    assert model.merge_and_unload().generation_config.eos_token_id == [3, 4]
