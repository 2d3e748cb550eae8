"""In-process checks of ddp_utils pieces that need no second process."""

import json
import os
import re

import numpy as np
import pytest
import torch

import ddp_utils
from ddp_utils import SAMPLE_WEIGHT, UsageError
from ddp_utils.core.files import write_json
from ddp_utils.results.output import check_output_dir, resumes_in


@pytest.mark.fast
def test_the_training_rows_pad_to_whole_steps_with_weightless_fillers():
    import datasets

    from ddp_utils.data.dataloaders import StepAlignedSampler, _TrainingRows

    dataset = datasets.Dataset.from_dict({"x": list(range(37))})
    sampler = StepAlignedSampler(37, batch_size=4, num_processes=2, accumulation=1, seed=0)
    rows = _TrainingRows(dataset, 37, len(sampler))
    assert len(sampler) == len(rows) == 40
    assert [(row["x"], row[SAMPLE_WEIGHT]) for row in rows.__getitems__([36, 37, 38, 39])] == [
        (36, 1.0), (0, 0.0), (1, 0.0), (2, 0.0)
    ]  # fmt: skip
    assert sorted(sampler) == list(range(40))
    assert len(StepAlignedSampler(32, 4, 2, 1, seed=0)) == 32
    tagged = _TrainingRows(dataset, 37, 40, with_epoch=True).__getitems__([(3, 5), (3, 38)])
    assert [(row["x"], row[SAMPLE_WEIGHT], row["epoch"]) for row in tagged] == [(5, 1.0, 3), (1, 0.0, 3)]


@pytest.mark.fast
@pytest.mark.parametrize("seed", range(5))
def test_local_f1_and_accuracy_modules_match_scikit_learn(seed):
    from sklearn.metrics import accuracy_score, f1_score

    rng = np.random.default_rng(seed)
    predictions, references = rng.integers(0, 4, 200), rng.integers(0, 3, 200)
    f1 = ddp_utils.load_metric("f1")
    assert f1.compute(predictions=predictions, references=references)["f1"] == pytest.approx(
        f1_score(references, predictions, average="macro")
    )
    accuracy = ddp_utils.load_metric("accuracy").compute(predictions=predictions, references=references)["accuracy"]
    assert accuracy == pytest.approx(accuracy_score(references, predictions))


@pytest.mark.fast
def test_check_output_dir(tmp_path):
    check_output_dir(str(tmp_path / "new"), overwrite=False)
    check_output_dir(str(tmp_path), overwrite=False)  # exists but empty: fine
    (tmp_path / "model.safetensors").write_text("x")
    with pytest.raises(UsageError, match="--overwrite_output_dir"):
        check_output_dir(str(tmp_path), overwrite=False)
    check_output_dir(str(tmp_path), overwrite=True)
    with pytest.raises(UsageError, match="is a file"):
        check_output_dir(str(tmp_path / "model.safetensors"), overwrite=True)
    # A resume goes on with the run in the directory: from 'latest', or a checkpoint inside it (a relative path too)
    run, other = tmp_path / "run", tmp_path / "other" / "checkpoint-2"
    (run / "checkpoint-4").mkdir(parents=True)
    other.mkdir(parents=True)
    check_output_dir(str(run), overwrite=False, resume_from="latest")
    check_output_dir(str(run), overwrite=False, resume_from=str(run / "checkpoint-4"))
    check_output_dir(os.path.relpath(run), overwrite=False, resume_from=str(run / "checkpoint-4"))
    # A checkpoint of another directory starts another run: resumed into this one, its checkpoints past the step
    # would have been set aside as abandoned and its model replaced. A new directory, or an empty one, takes it.
    with pytest.raises(UsageError, match=r"lies outside it: to go on with the run in .*, resume with "
                                         r"--resume_from_checkpoint latest; to start a new run from that checkpoint, "
                                         r"give a new --output_dir"):  # fmt: skip
        check_output_dir(str(run), overwrite=False, resume_from=str(other))
    check_output_dir(str(tmp_path / "new"), overwrite=False, resume_from=str(other))
    check_output_dir(str(run), overwrite=True, resume_from=str(other))  # its files replaced
    # A checkpoint of the run linked to other storage is the run's: resumed, not refused, nor deleted by an overwrite
    (run / "checkpoint-6").symlink_to(other, target_is_directory=True)
    check_output_dir(str(run), overwrite=False, resume_from=str(run / "checkpoint-6") + "/")
    assert resumes_in(str(run), str(run / "checkpoint-6")) and not resumes_in(str(run), str(other))
    assert resumes_in(str(run), "latest") and not resumes_in(str(run), None)


@pytest.mark.fast
def test_write_json_is_atomic_and_main_only(tmp_path):
    class Main:
        is_main_process = True

    class Other:
        is_main_process = False

    write_json(Other(), str(tmp_path / "a.json"), {"x": 1})
    assert not (tmp_path / "a.json").exists()
    write_json(Main(), str(tmp_path / "a.json"), {"x": 1})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}
    assert os.listdir(tmp_path) == ["a.json"], "no temporary file may be left behind"


@pytest.mark.fast
def test_demo_data_is_the_documented_subset():
    from ddp_utils.data.demo import load_demo_reviews

    data = load_demo_reviews()
    assert (len(data["train"]), len(data["validation"])) == (600, 379)
    labels = list(data["validation"]["label"])
    assert sorted(set(labels)) == ["negative", "neutral", "positive"]
    assert round(labels.count("positive") / len(labels), 3) == 0.654, "the majority-class baseline the README quotes"
    assert "&#039;" not in " ".join(data["train"]["text"]), "HTML entities are decoded"


@pytest.mark.fast
def test_save_model_of_a_compiled_model_reloads_its_trained_weights(tiny_lm, tmp_path):
    """--torch_compile: the compiled wrapper prefixes every key with "_orig_mod."; saved as is,
    from_pretrained would load none of them and silently start from random weights."""
    import torch
    from accelerate import Accelerator
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator(cpu=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm)
    with torch.no_grad():
        model.model.norm.weight.fill_(3.0)  # a change the reload must carry
    compiled = accelerator.prepare(torch.compile(model))  # compiling is lazy: nothing runs here
    ddp_utils.save_model(accelerator, compiled, str(tmp_path / "out"))
    assert not [key for key in load_file(str(tmp_path / "out" / "model.safetensors")) if "_orig_mod" in key]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for (name, expected), (_, actual) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(expected, actual), name


@pytest.mark.fast
@pytest.mark.parametrize("family", ["gemma3 (head registered last)", "xlm-roberta (head registered first)"])
def test_a_tied_weight_gathered_as_two_tensors_is_written_once_under_the_name_transformers_keeps(family, tmp_path):
    """FSDP gathers a tied LM head and the input embeddings as two tensors: both were written. Written under the
    name met first instead, XLM-R's file held only its head, and the model reloaded with random word embeddings."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    from ddp_utils.results.output import write_pretrained

    torch.manual_seed(0)
    if family.startswith("gemma3"):
        config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
        model, auto = transformers.Gemma3ForCausalLM(config), transformers.AutoModelForCausalLM
    else:
        config = transformers.XLMRobertaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, is_decoder=True)  # fmt: skip
        model, auto = transformers.XLMRobertaForCausalLM(config), transformers.AutoModelForCausalLM
    embeddings = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embeddings
    gathered = {name: value.clone() for name, value in model.state_dict().items()}  # as FSDP gathers: apart
    write_pretrained(model, gathered, str(tmp_path / "gathered"))
    model.save_pretrained(tmp_path / "itself")  # what DDP writes: the model's own state dict, its tied weights shared
    saved, expected = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("gathered", "itself"))
    assert sorted(saved) == sorted(expected) and len(saved) < len(gathered)
    reloaded = auto.from_pretrained(tmp_path / "gathered")
    assert torch.equal(reloaded.get_input_embeddings().weight, embeddings.detach())


@pytest.mark.fast
def test_step_aligned_sampler_spreads_the_last_step_over_ranks_and_micro_batches():
    from ddp_utils.data.dataloaders import StepAlignedSampler

    # 13 real examples, 3 fillers; steps of 2 ranks x 2 micro-batches x batch 2 = 8.
    sampler = StepAlignedSampler(13, batch_size=2, num_processes=2, accumulation=2, seed=1)
    order = list(sampler)
    assert sorted(order) == list(range(16))
    assert all(i < 13 for i in order[:8]), "full steps hold only real examples"
    last_step_batches = [order[8 + 2 * k : 10 + 2 * k] for k in range(4)]
    # The last step's 5 real examples dealt out over its 4 micro-batches (ranks 0, 1, 0, 1), not 2, 2, 1, 0.
    assert [sum(i < 13 for i in batch) for batch in last_step_batches] == [2, 1, 1, 1]
    sampler.set_epoch(1)
    assert list(sampler) != order, "a new order each epoch"
    sampler.set_epoch(0)
    assert list(sampler) == order, "the order depends on seed and epoch alone"


@pytest.mark.fast
def test_step_size_counts_real_rows_and_their_tokens_the_same_padded_or_packed():
    """Throughput counts real rows and non-padding tokens: fillers and padding are not work done,
    and packing the same examples must not change the tokens or the loss's weight."""
    import datasets
    from accelerate import Accelerator

    from ddp_utils.language_models.causal_lm import TARGET_TOKENS, CausalLMCollator
    from ddp_utils.language_models.token_blocks import packed_examples

    accelerator = Accelerator(cpu=True)
    lengths = (5, 9, 3, 7)
    rows = [
        {"input_ids": list(range(1, n + 1)), "labels": [-100, -100] + list(range(3, n + 1)), SAMPLE_WEIGHT: 1.0}
        for n in lengths
    ]
    filler = {**rows[0], SAMPLE_WEIGHT: 0.0}
    collate = CausalLMCollator(pad_token_id=0)

    def step_size(batches):
        size = ddp_utils.count_step(accelerator, batches, TARGET_TOKENS)
        return float(size.weight), float(size.examples), float(size.tokens)

    # Padded: two optimizer steps of one micro-batch each, a filler in the first.
    padded = [step_size([collate(rows[:2] + [filler])]), step_size([collate(rows[2:])])]
    assert [p[1] for p in padded] == [2, 2], "the filler row is not counted"
    assert sum(p[2] for p in padded) == sum(lengths), "padding is not counted"
    examples = datasets.Dataset.from_dict({key: [row[key] for row in rows] for key in ("input_ids", "labels")})
    packed_batch = collate(list(packed_examples(examples, block_size=12)))
    assert "attention_mask" not in packed_batch, (
        "packed rows are told apart by position_ids, so the tokens come from input_tokens"
    )
    weight, examples, tokens = step_size([packed_batch])
    assert (examples, tokens) == (2, sum(lengths)), (
        "2 packed rows (best fit: 9 + 3 and 7 + 5) holding the same 24 tokens"
    )
    assert weight == sum(p[0] for p in padded) == sum(n - 2 for n in lengths), "the same target tokens"


@pytest.mark.fast
def test_report_to_and_secret_scrubbing(monkeypatch):
    from ddp_utils.core.redact import hide_secret_args, loggable_args
    from ddp_utils.training.training_log import parse_report_to

    assert parse_report_to("none") == [] and parse_report_to("") == []
    assert parse_report_to("tensorboard, tensorboard") == ["tensorboard"]
    assert "tensorboard" in parse_report_to("all")
    with pytest.raises(UsageError, match="'neptune' is not a tracker"):
        parse_report_to("tensorboard,neptune")

    import argparse
    import sys

    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-0123456789")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # named like "token" but not a credential
    # Unset for this test, and unset again after it: a delenv of an unset variable would not undo what
    # hide_secret_args sets below.
    monkeypatch.setenv("HF_TOKEN", "placeholder")
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(
        sys, "argv", ["train.py", "--hub_token=hf_abcdefgh123", "--run_name", "x-wandb-secret-0123456789"]
    )
    args = argparse.Namespace(
        hub_token="hf_abcdefgh123",
        run_name="x-wandb-secret-0123456789",
        sample_max_new_tokens=40,
        text_columns=["a", "b"],
        output_dir="out",
    )
    hide_secret_args(args)
    assert os.environ["HF_TOKEN"] == "hf_abcdefgh123", "--hub_token is the Hub credential of the run"
    assert sys.argv == ["train.py", "--hub_token=<redacted>", "--run_name", "x-<redacted>"]
    assert loggable_args(args) == {
        "hub_token": "<redacted>",
        "run_name": "x-<redacted>",
        "sample_max_new_tokens": 40,
        "text_columns": ["a", "b"],
        "output_dir": "out",
    }


@pytest.mark.fast
def test_check_splits_is_the_one_data_check_of_every_script():
    import datasets

    def data(**splits):
        return datasets.DatasetDict({name: datasets.Dataset.from_dict(columns) for name, columns in splits.items()})

    text = {"text": ["a", "  ", "b", "c", None], "label": [0, 1, 0, 1, 0]}
    with pytest.raises(UsageError, match=r"1 train records have an empty or missing 'text' \(first: record 4\)"):
        ddp_utils.check_splits(data(train=text, validation=text), {"text": "--text_column"}, "--train_file")
    clean = {"text": ["a", "  ", "b", "c"], "label": [0, 1, 0, 1]}
    with pytest.raises(UsageError, match=r"1 train records have an empty or missing 'text' \(first: record 1\)"):
        ddp_utils.check_splits(
            data(train=clean, validation=clean), {"text": "--text_column"}, "--train_file", blank="refuse"
        )
    kept = ddp_utils.check_splits(
        data(train=clean, validation=clean), {"text": "--text_column"}, "--train_file", blank="drop"
    )
    assert kept["train"]["text"] == ["a", "b", "c"], "blank lines of a .txt file are dropped"
    with pytest.raises(UsageError, match=r"\(first: record 4\)"):  # counted as given, before blank rows are dropped
        ddp_utils.check_splits(
            data(train={"text": ["", "", " ", "a", None]}, validation=clean),
            {"text": "--text_column"},
            "--train_file",
            blank="drop",
        )
    with pytest.raises(
        UsageError,
        match=r"has no column 'review'; its columns are \['text', 'label'\]. Name the right one with --text_column",
    ):
        ddp_utils.check_splits(data(train=clean, validation=clean), {"review": "--text_column"}, "--train_file")
    # No validation split: "test" if there is one, else a held-out part of train (if allowed), else an error.
    tested = ddp_utils.check_splits(
        data(train=clean, test={"text": ["z"], "label": [1]}), {"text": "--text_column"}, "--train_file"
    )
    assert tested["validation"]["text"] == ["z"]
    with pytest.raises(UsageError, match="the data has no 'validation' split .* give --train_file/--validation_file"):
        ddp_utils.check_splits(data(train=clean), {"text": "--text_column"}, "--train_file/--validation_file")
    many = {"text": [f"t{i}" for i in range(40)], "label": [i % 2 for i in range(40)]}
    held = ddp_utils.check_splits(
        data(train=many),
        {"text": "--text_column"},
        "--train_file",
        hold_out_percentage=10,
        seed=3,
        limits={"train": 30},
    )
    assert (len(held["train"]), len(held["validation"])) == (30, 4)
    assert not set(held["train"]["text"]) & set(held["validation"]["text"]), "held-out records are not trained on"
    with pytest.raises(UsageError, match="1 training record\\(s\\) are too few to hold out a validation split"):
        ddp_utils.check_splits(
            data(train={"text": ["a"], "label": [0]}), {"text": "--text_column"}, "--train_file", hold_out_percentage=5
        )


@pytest.mark.fast
@pytest.mark.parametrize(
    "labels, held_out",
    [
        (["pos"] * 60 + ["neg"] * 30 + ["rare"] * 10, {"pos": 9, "neg": 5, "rare": 1}),  # 15 of 100, by share
        ([f"intent{i % 6}" for i in range(18)] + ["once"] * 1, {f"intent{i}": 1 for i in range(3)}),  # a class of one
        ([i % 4 for i in range(12)], {0: 1, 1: 1}),  # ints; 2 rows held out of 4 classes
    ],
    ids=["by-share", "class-of-one", "more-classes-than-held-out"],
)
def test_a_held_out_split_keeps_each_class_in_training_and_its_share_in_validation(labels, held_out):
    """No --validation_file: the share held out is drawn class by class, in proportion, each class keeping at least
    one row in training. datasets' stratified split refused a class of one example and more classes than rows held
    out (raw tracebacks), and train.py's split was not stratified: a rare class could land in validation alone,
    refused as "validation labels never occur in the training data"."""
    import datasets

    train = datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(len(labels))], "label": labels})
    percentage = round(100 * sum(held_out.values()) / len(labels))
    splits = ddp_utils.check_splits(
        datasets.DatasetDict({"train": train}), {"text": "--text_column"}, hold_out_percentage=percentage, seed=1,
        stratify_by="label",
    )  # fmt: skip
    held, kept = (list(splits[split]["label"]) for split in ("validation", "train"))
    assert {label: held.count(label) for label in set(held)} == held_out
    assert set(kept) == set(labels), "a class left training"
    assert sorted([*splits["train"]["text"], *splits["validation"]["text"]]) == sorted(train["text"])
    again = ddp_utils.check_splits(
        datasets.DatasetDict({"train": train}), {"text": "--text_column"}, hold_out_percentage=percentage, seed=1,
        stratify_by="label",
    )  # fmt: skip
    assert list(again["validation"]["text"]) == list(splits["validation"]["text"]), "the same seed, another split"


@pytest.mark.fast
def test_limits_after_a_held_out_split_take_a_sample_of_every_class_not_the_files_first_rows():
    """A file sorted by class (an image folder pushed to the Hub, a CSV sorted by label): the held-out parts kept the
    file's order, and --max_train_samples 100 took 'neg' alone; and a ClassLabel naming classes that training
    lacks passed as several classes, and trained one."""
    import datasets

    from ddp_utils.data.classification import label_mapping

    train = datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(1000)], "label": ["neg"] * 500 + ["pos"] * 500})
    splits = ddp_utils.check_splits(
        datasets.DatasetDict({"train": train}), {"text": "--text_column"}, hold_out_percentage=10, seed=0,
        stratify_by="label", limits={"train": 100, "validation": 20},
    )  # fmt: skip
    assert [set(splits[split]["label"]) for split in ("train", "validation")] == [{"neg", "pos"}] * 2
    labels = datasets.ClassLabel(names=["cat", "dog", "fox"])
    one = datasets.Dataset.from_dict({"label": [0, 0]}, features=datasets.Features({"label": labels}))
    with pytest.raises(UsageError, match="the training data holds one class only \\('cat'\\)"):
        label_mapping(datasets.DatasetDict({"train": one, "validation": one}), "label")


@pytest.mark.fast
def test_validation_labels_numbered_otherwise_than_the_training_classlabel_are_renumbered_by_name():
    """Two splits each read with its own ClassLabel (a folder per split, a validation set lacking a class): train.py
    read the validation ids as training's, so its 'c' (id 1 of [a, c]) was scored as 'b'; class names beside a
    ClassLabel ended in a raw TypeError. Both scripts now number them by name; a class training lacks is refused."""
    import datasets

    from ddp_utils.data.classification import label_mapping, labels_numbered_as_training

    def split(labels, feature):
        return datasets.Dataset.from_dict({"label": labels}, features=datasets.Features({"label": feature}))

    names, text = datasets.ClassLabel(names=["a", "b", "c"]), datasets.Value("string")
    train = split([0, 1, 2, 0], names)
    cases = [
        (split([0, 1], datasets.ClassLabel(names=["a", "c"])), [0, 2]),
        (split(["c", " a"], text), [2, 0]),  # names, one with a space around it
        (split([2, 1], names), [2, 1]),  # one ClassLabel for both: as it was
        (split([2, 1], datasets.Value("int64")), [2, 1]),  # plain ids beside it: read as its ids
    ]
    for validation, ids_in_training in cases:
        data = labels_numbered_as_training(datasets.DatasetDict({"train": train, "validation": validation}), "label")
        assert label_mapping(data, "label")[0] == ["a", "b", "c"] and data["validation"]["label"][:] == ids_in_training
    fish = datasets.DatasetDict({"train": train, "validation": split([0, 1], datasets.ClassLabel(names=["a", "fish"]))})
    with pytest.raises(UsageError, match=re.escape("validation labels ['fish'] never occur in the training data")):
        labels_numbered_as_training(fish, "label")


@pytest.mark.fast
def test_fetch_weights_finds_single_and_sharded_hub_weights_and_skips_local_dirs(tiny_lm, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from conftest import put_in_hub_cache

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_lm).save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    put_in_hub_cache(tmp_path / "hub", "org/single", tiny_lm)
    put_in_hub_cache(tmp_path / "hub", "org/sharded", sharded)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))

    assert [os.path.basename(p) for p in ddp_utils.fetch_weights("org/single")] == ["model.safetensors"]
    shards = ddp_utils.fetch_weights("org/sharded")
    assert len(shards) > 1 and all(os.path.isfile(p) and "model-0" in os.path.basename(p) for p in shards)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(os.path.basename(p) for p in shards) == sorted(set(index["weight_map"].values()))
    assert ddp_utils.fetch_weights(str(tiny_lm)) == []


@pytest.mark.fast
def test_length_grouped_order_loses_nothing_and_forms_the_same_global_steps_on_any_layout():
    """Grouping by length changes which examples share a micro-batch, never the promise: each epoch
    every example once, each global step the same examples whatever the layout, drawn from (seed,
    epoch) alone; and far less padding than a random order."""
    from ddp_utils.data.dataloaders import StepAlignedSampler

    lengths = [int(x) for x in np.random.default_rng(0).integers(5, 200, size=203)]
    step = 8  # examples per optimizer step
    layouts = [(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 4, 2)]  # (batch, processes, accumulation)

    def order(batch, processes, accumulation, epoch, grouped=True):
        sampler = StepAlignedSampler(
            len(lengths), batch, processes, accumulation, seed=3, lengths=lengths if grouped else None
        )
        sampler.set_epoch(epoch)
        return list(sampler)

    def steps(o):  # the examples of each optimizer step
        return [sorted(o[s : s + step]) for s in range(0, len(o), step)]

    for epoch in (0, 1):
        orders = [order(*layout, epoch) for layout in layouts]
        for o in orders:
            assert sorted(i for i in o if i < len(lengths)) == list(range(len(lengths))), "every example exactly once"
            assert steps(o) == steps(orders[0]), "the global steps do not depend on the layout"
    assert order(8, 1, 1, 0) != order(8, 1, 1, 1), "a new order each epoch"
    assert order(8, 1, 1, 0) == order(8, 1, 1, 0), "drawn from (seed, epoch) alone"

    def padded(o, batch=4):
        rows = [[lengths[i] for i in o[s : s + batch] if i < len(lengths)] for s in range(0, len(o), batch)]
        return sum(max(r) * len(r) - sum(r) for r in rows if r) / sum(lengths)

    assert padded(order(4, 2, 1, 0)) < 0.1 < 0.3 < padded(order(4, 2, 1, 0, grouped=False))
    # Each sorted step is dealt round-robin: the micro-batches (so the ranks) get the same mix of lengths.
    o, batch = order(2, 2, 2, 0), 2
    for start in range(0, len(lengths) - len(lengths) % step, step):
        micro = [[lengths[i] for i in o[start + m * batch : start + (m + 1) * batch]] for m in range(step // batch)]
        spread = max(max(m) for m in micro) - min(min(m) for m in micro)
        assert max(map(sum, micro)) - min(map(sum, micro)) <= spread, micro
    group = 16 * step  # the sampler's default group of 16 steps

    def step_of_longest(o):  # which step of the first group holds that group's longest example
        return max(range(group), key=lambda k: lengths[o[k]]) // step

    assert len({step_of_longest(order(8, 1, 1, e)) for e in range(8)}) > 1, "the longest step is not always first"


@pytest.mark.fast
def test_best_fit_packing_fills_rows_and_keeps_every_example_whole():
    """Every example lands whole in exactly one row of at most block_size tokens, and the rows are
    nearly full (first fit in the data's order left far more room)."""
    import datasets

    from ddp_utils.language_models.token_blocks import packed_examples

    rng = np.random.default_rng(0)
    examples = [list(range(100 * i, 100 * i + int(n))) for i, n in enumerate(rng.integers(3, 60, size=300))]
    packed = packed_examples(datasets.Dataset.from_dict({"input_ids": examples, "labels": examples}), 64)[:]
    assert all(len(row) <= 64 for row in packed["input_ids"])
    pieces = []
    for ids, positions in zip(packed["input_ids"], packed["position_ids"]):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
        pieces += [ids[a:b] for a, b in zip(starts, starts[1:])]
    assert sorted(pieces) == sorted(examples), "each example once, whole"
    room = sum(64 - len(row) for row in packed["input_ids"]) / (64 * len(packed["input_ids"]))
    lower_bound_rows = -(-sum(map(len, examples)) // 64)
    assert room < 0.05 and len(packed["input_ids"]) <= 1.05 * lower_bound_rows, (
        room,
        len(packed["input_ids"]),
        lower_bound_rows,
    )


class OnDevice(torch.Tensor):
    """A CPU tensor that stands for one on a GPU: it records every call that would copy it to the
    host and so wait for the device (item, tolist, float, bool, cpu, ...). What those calls return
    is an ordinary tensor: it is on the host."""

    host_syncs: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"):
            cls.host_syncs.append(name)
            with torch._C.DisableTorchFunctionSubclass():
                result = func(*args, **(kwargs or {}))
                return result.as_subclass(torch.Tensor) if isinstance(result, torch.Tensor) else result
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.fast
def test_the_training_path_syncs_with_the_device_once_per_logging_window(tmp_path):
    """Between two records of the log, what the scripts call around each optimizer step (count_step,
    global_mean_loss, StepPlan.advance, TrainingLog.step, Checkpointer.step) copies nothing to the
    host, so a GPU never waits for the CPU to read a number; each record costs exactly one host sync.
    One process: the preemption flag of several goes through a gloo group on the CPU, by construction."""
    import argparse
    import signal

    import datasets
    from accelerate import Accelerator

    from ddp_utils.checkpoints.preemption import PreemptionHandler
    from ddp_utils.training.training_log import read_train_log

    parser = argparse.ArgumentParser()
    ddp_utils.add_training_args(parser)
    parser.set_defaults(learning_rate=1e-3, per_device_eval_batch_size=8, num_train_epochs=1, output_dir=str(tmp_path))
    args = parser.parse_args(
        ["--logging_steps", "10", "--max_train_steps", "25", "--checkpointing_steps", "no", "--report_to", "none"]
    )
    ddp_utils.check_training_args(args)
    accelerator = Accelerator(cpu=True)
    rows = datasets.Dataset.from_dict({"length": [3 + i % 5 for i in range(200)]})

    def collate(batch):
        width = max(row["length"] for row in batch)
        return {
            "attention_mask": torch.tensor([[1] * row["length"] + [0] * (width - row["length"]) for row in batch]),
            SAMPLE_WEIGHT: torch.tensor([row[SAMPLE_WEIGHT] for row in batch]),
        }

    train_dataloader = ddp_utils.make_train_dataloader(rows, args, accelerator, collate)
    handlers = {signum: signal.getsignal(signum) for signum in PreemptionHandler.SIGNALS}
    try:
        plan = ddp_utils.StepPlan(accelerator, args, train_dataloader)
        checkpointer = ddp_utils.Checkpointer(accelerator, args, torch.nn.Linear(2, 2), plan)
        log = ddp_utils.TrainingLog(accelerator, args, plan)
        syncs_per_step = []
        for micro_batches in plan.optimizer_steps(accelerator.prepare(train_dataloader), epoch=0):
            OnDevice.host_syncs.clear()
            micro_batches = [
                {key: value.as_subclass(OnDevice) for key, value in batch.items()} for batch in micro_batches
            ]
            step_size = ddp_utils.count_step(accelerator, micro_batches)
            weights = micro_batches[0][SAMPLE_WEIGHT]
            losses = torch.rand(len(weights)).as_subclass(OnDevice)
            ddp_utils.global_mean_loss(losses, weights, step_size.weight, accelerator)
            plan.advance(step_size)
            log.step(plan, (losses * weights).sum(), torch.tensor(0.5).as_subclass(OnDevice), 1e-3)
            checkpointer.step(plan)
            syncs_per_step.append(len(OnDevice.host_syncs))
            if plan.done:
                break
        log.close()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert syncs_per_step == [1 if step in (10, 20, 25) else 0 for step in range(1, 26)], syncs_per_step
    records = [record for record in read_train_log(str(tmp_path)) if "train/loss" in record]
    assert [record["step"] for record in records] == [10, 20, 25]
    assert all(record["train/grad_norm"] == pytest.approx(0.5) for record in records), "the norms read in the same sync"
    assert plan.progress["samples_seen"] == 200 and plan.progress["tokens_seen"] == sum(3 + i % 5 for i in range(200))


@pytest.mark.fast
def test_a_manifest_finds_a_file_cut_short_changed_or_missing_and_each_rank_hashes_what_it_wrote(tmp_path):
    """The files Accelerate writes on each rank carry the rank in their names (DDP's RNG states,
    FSDP's shards, DeepSpeed's partitions): each rank hashes those it wrote, the main process the
    rest. At a resume the ranks split the bytes to checksum evenly."""
    from accelerate import PartialState

    from ddp_utils.checkpoints.manifest import (
        checkpoint_files,
        checkpoint_problem,
        hash_and_flush,
        share_of,
        write_manifest,
        written_by,
    )

    names = {  # None: the main process's (or, scaler.pt, every rank's, the same bytes)
        "model.safetensors": None,
        "optimizer.bin": None,
        "scaler.pt": None,
        "random_states_0.pkl": 0,
        "random_states_3.pkl": 3,
        "pytorch_model_fsdp_0/__2_0.distcp": 2,
        "pytorch_model_fsdp_0/.metadata": None,
        "optimizer_0/__1_0.distcp": 1,
        "pytorch_model_fsdp_rank2.bin": 2,  # FSDP's local state dict
        "pytorch_model/zero_pp_rank_3_mp_rank_00_model_states.pt": 3,
        "pytorch_model/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt": 1,
        "random_states_9.pkl": 1,  # written by rank 9 of a larger world: resumed on 4, rank 9 % 4 checks it
    }
    assert {name: written_by(name, 4) for name in names} == names
    PartialState(cpu=True)  # a file no rank hashed is said in the log

    checkpoint = tmp_path / "checkpoint-1"
    sizes = {"model.safetensors": 2048, "optimizer.bin": 4096, "random_states_0.pkl": 256, "random_states_1.pkl": 256}
    checkpoint.mkdir()
    for name, size in sizes.items():
        (checkpoint / name).write_bytes(bytes(range(256)) * (size // 256))
    files = checkpoint_files(checkpoint)
    entries = {}
    for rank in (0, 1):
        entries.update(hash_and_flush(str(checkpoint), [f for f in files if (written_by(f, 2) or 0) == rank]))
    write_manifest(str(checkpoint), entries)
    assert checkpoint_problem(str(checkpoint)) is None
    shares = [share_of(entries, rank, 2) for rank in (0, 1)]
    assert [sorted(share) for share in shares] == [
        ["optimizer.bin", "random_states_0.pkl"],
        ["model.safetensors", "random_states_1.pkl"],
    ], "a rank's own files to it, then the largest file to the rank with the fewest bytes so far"
    optimizer = checkpoint / "optimizer.bin"
    original = optimizer.read_bytes()
    optimizer.write_bytes(original[:-100])
    assert checkpoint_problem(str(checkpoint)) == "optimizer.bin holds 3,996 bytes, 4,096 were written"
    optimizer.write_bytes(original[:1000] + bytes([original[1000] ^ 1]) + original[1001:])
    assert (
        checkpoint_problem(str(checkpoint)) == "optimizer.bin has changed since it was written (its checksum differs)"
    )
    optimizer.unlink()
    assert checkpoint_problem(str(checkpoint)) == "optimizer.bin is missing"
    (checkpoint / "stray.bin").write_bytes(b"x")  # a name no rank claims: the main process hashes it too
    (checkpoint / "optimizer.bin").write_bytes(original)
    write_manifest(str(checkpoint), entries)
    assert checkpoint_problem(str(checkpoint)) is None and "stray.bin" in (checkpoint / "manifest.json").read_text()
    (checkpoint / "manifest.json").write_text('{"files": {"optimizer.bin": {"bytes": 4096, "xxh3_12": "0"}}}')
    assert checkpoint_problem(str(checkpoint)) == "its manifest.json cannot be read (KeyError)"


@pytest.mark.fast
def test_the_model_card_loads_with_the_models_own_code_and_tags_an_adapter_that_reads_images(tmp_path):
    """A run that needed --trust_remote_code saves a model whose loading needs it too: the card's code passes it
    (without it a user's copy of the card's code failed). An adapter of an image-and-text model saved with its
    base's image processor (Gemma 3 from 4B) is tagged as one, as the merged model is; without the processor, or
    of a causal LM that reads images only through adapters of its own (Phi-4-multimodal), as text generation."""
    from types import SimpleNamespace

    from ddp_utils.results.model_card import write_model_card

    output_dir = tmp_path / "adapter"
    output_dir.mkdir()
    (output_dir / "adapter_config.json").write_text("{}")
    args = SimpleNamespace(output_dir=str(output_dir), model_name_or_path=str(tmp_path / "base"), hub_model_id=None,
                           language=None, trust_remote_code=True, lora_r=4)  # fmt: skip
    write_model_card(args, {})
    card = (output_dir / "README.md").read_text()
    assert "pipeline_tag: text-generation" in card
    assert 'AutoPeftModelForCausalLM.from_pretrained("adapter", trust_remote_code=True)' in card
    assert 'AutoTokenizer.from_pretrained("adapter", trust_remote_code=True)' in card

    (output_dir / "processor_config.json").write_text("{}")
    args.trust_remote_code = False
    for architecture, task in (("Gemma3ForConditionalGeneration", "image-text-to-text"),
                               ("Phi4MultimodalForCausalLM", "text-generation")):  # fmt: skip
        (tmp_path / "base").mkdir(exist_ok=True)
        (tmp_path / "base" / "config.json").write_text(
            json.dumps({"model_type": "gemma3", "architectures": [architecture]})
        )
        write_model_card(args, {})
        card = (output_dir / "README.md").read_text()
        assert f"pipeline_tag: {task}" in card and "trust_remote_code" not in card, architecture
