"""scripts/train.py on the families users bring to text classification and regression (`classifier_families`: 8
encoders, 9 decoder LLMs as *ForSequenceClassification, BART and T5), each tiny, from its config, with the kind of
tokenizer its checkpoints have. For each, on 2 processes: the loss goes down; 1 process with accumulation trains the
same model; the saved model reloads with AutoModelForSequenceClassification and the pipeline, and predicts the same
for an example alone and inside a padded batch; a regression and a multi-label task train and reload. Three under
FSDP2 and four under ZeRO-3 too. Not in `make test` (5 minutes here, idle): FAMILY_SWEEP=1 pytest
tests/test_families_classifiers.py."""

import json
import os

import numpy as np
import pytest
from classifier_families import FAMILIES, save_family
from safetensors.numpy import load_file

from conftest import REPO, launch, train_args, write_examples

pytestmark = pytest.mark.skipif(not os.environ.get("FAMILY_SWEEP"), reason="a sweep of 19 families (5 minutes)")

TRAIN = REPO / "scripts" / "train.py"
LAUNCHED, CONFIGS = REPO / "tests" / "launched", REPO / "accelerate_configs"
SHARDED = {  # sharded runs, on CPU processes: (harness, config)
    "fsdp": (LAUNCHED / "fsdp_on_cpu.py", CONFIGS / "fsdp.yaml"),
    "zero3": (LAUNCHED / "deepspeed_on_cpu.py", CONFIGS / "deepspeed_zero3.yaml"),
}
UNDER_FSDP = ["qwen2", "t5", "bart"]  # Qwen2 ties its (dropped) LM head; T5 and BART share their embeddings
# An 8B LLM as a classifier is where users take ZeRO-3: its new head is loaded sharded (zero3_loading.py)
UNDER_ZERO3 = ["llama", "qwen2", "deberta_v2", "t5"]
QUIET = ["--checkpointing_steps", "no", "--report_to", "none"]
TEXTS = ["great", "the movie was very bad", "it is a really quite plain film this okay", "not awful"]


def run(*args, num_processes=2, sharded=None):
    if sharded:
        harness, config = SHARDED[sharded]
        launcher = ["--config_file", config, "--num_processes", 2, "--mixed_precision", "no"]
        result = launch(harness, "train", *args, launcher_args=[str(a) for a in launcher], timeout=300)
    else:
        result = launch(TRAIN, *args, num_processes=num_processes, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    return result


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    from test_user_files import write_stsb, write_topics

    directory = tmp_path_factory.mktemp("tasks")
    eight = write_examples(directory / "eight.csv", 8, seed=1)  # one step an epoch: learned by heart in 12
    return {
        "classification": {"train": eight, "validation": eight},
        "regression": write_stsb(directory / "stsb.tsv", 40, seed=0),  # sentence pairs, a float score
        "multi_label": write_topics(directory / "topics.jsonl", 40, seed=0),  # lists of labels
    }


def eval_losses(output_dir) -> list:
    records = [json.loads(line) for line in (output_dir / "train_log.jsonl").read_text().splitlines()]
    return [record["eval/loss"] for record in records if "eval/loss" in record]


def assert_same_weights(ours, reference, atol):
    """`ours` is `reference` within `atol`: the float drift of sums taken in another order (FSDP's reduce-scatter),
    amplified by Adam where a gradient is zero by construction (a key's bias takes steps of rounding noise)."""
    a, b = load_file(str(ours / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert sorted(a) == sorted(b)
    worst = {key: float(np.abs(a[key].astype(np.float64) - b[key]).max()) for key in b}
    print(f"{ours.name} against {reference.name}: {max(worst.values()):.1e} at most")
    assert max(worst.values()) <= atol, sorted(worst.items(), key=lambda item: -item[1])[:3]


def assert_reloads_and_reads_the_right_token(output_dir, labels: int):
    """The saved classifier reloads with the Auto class and the pipeline, its tokenizer pads on the right, and an
    example inside a padded batch gets the logits it gets alone: a decoder reads its last real token, never a pad
    (nor an EOS that pads), BART and T5 their last EOS, an encoder masks the padding."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    model = AutoModelForSequenceClassification.from_pretrained(output_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert model.config.num_labels == labels and tokenizer.padding_side == "right"
    with torch.no_grad():
        alone = torch.cat([model(**tokenizer([text], return_tensors="pt")).logits for text in TEXTS])
        batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
        assert (batch["attention_mask"] == 0).any(), "no padding: nothing checked"
        np.testing.assert_allclose(model(**batch).logits.numpy(), alone.numpy(), atol=2e-5)
    classify = pipeline("text-classification", model=str(output_dir), device="cpu", top_k=None)
    assert {row["label"] for row in classify([TEXTS[1]])[0]} == set(model.config.id2label.values())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_train_py_trains_the_family_the_same_on_1_and_2_processes_and_it_reloads(family, task_data, tmp_path):
    model = save_family(family, tmp_path / family)
    data = task_data["classification"]
    epochs = ["--num_train_epochs", 12, "--learning_rate", 1e-2, *QUIET]
    two, one = tmp_path / "two", tmp_path / "one"
    result = run(*train_args(model, data, two, *epochs, "--per_device_train_batch_size", 4))
    assert "saved to" in result.output
    run(*train_args(model, data, one, *epochs, "--per_device_train_batch_size", 4, "--gradient_accumulation_steps", 2),
        num_processes=1)  # fmt: skip
    learned = eval_losses(two)  # on the 8 examples it trains on, after each step, without dropout
    assert len(learned) == 12 and learned[-1] < 0.9 * learned[0], f"not learned: {learned}"
    assert_same_weights(one, two, atol=1e-6)  # measured: 0.0 in every family (the same sums, the same dropout)
    assert_reloads_and_reads_the_right_token(two, labels=3)
    for layout, kind in (("fsdp", "FSDP"), ("zero3", "DEEPSPEED")):  # the same run, sharded
        if family not in {"fsdp": UNDER_FSDP, "zero3": UNDER_ZERO3}[layout]:
            continue
        sharded = tmp_path / layout
        run(*train_args(model, data, sharded, *epochs, "--per_device_train_batch_size", 4), sharded=layout)
        assert json.loads((sharded / "metrics.json").read_text())["distributed_type"] == kind
        assert_same_weights(sharded, two, atol=1e-4)  # measured: up to 2.2e-5 (T5 under FSDP2)
        assert_reloads_and_reads_the_right_token(sharded, labels=3)

    pairs = ["--text_column", "sentence1,sentence2", "--label_column", "score"]
    regression = tmp_path / "regression"
    run("--model_name_or_path", model, "--train_file", task_data["regression"], *pairs, "--max_length", 32,
        "--output_dir", regression, "--num_train_epochs", 1, "--per_device_train_batch_size", 4, *QUIET)  # fmt: skip
    scores = json.loads((regression / "metrics.json").read_text())
    assert np.isfinite(scores["eval_mse"]) and scores["eval_examples"] == 4
    assert_reloads_and_reads_the_right_token(regression, labels=1)

    multi = tmp_path / "multi"
    run("--model_name_or_path", model, "--train_file", task_data["multi_label"], "--label_column", "topics",
        "--max_length", 32, "--output_dir", multi, "--num_train_epochs", 1, "--per_device_train_batch_size", 4,
        *QUIET)  # fmt: skip
    scores = json.loads((multi / "metrics.json").read_text())
    assert 0 <= scores["eval_f1_micro"] <= 1 and scores["eval_examples"] == 4
    assert_reloads_and_reads_the_right_token(multi, labels=2)
