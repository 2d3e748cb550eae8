"""scripts/train.py on 2 processes: N processes train the same model as one, evaluation
counts each example once, only the main process writes, the saved model reloads, the launch exits cleanly."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import AUDIT_HOOK_DIR, REPO, launch, load_script, put_in_hub_cache, refused_in_process, train_args

TRAIN = REPO / "scripts" / "train.py"

# The same training three ways: 60 examples (not a multiple of 8), 3 epochs, global batch 8.
LAYOUTS = {
    "one_process": (1, ["--per_device_train_batch_size", 8]),
    "two_processes": (2, ["--per_device_train_batch_size", 4]),
    # The accumulation derived from the global batch: 8 / (2 processes x 2 per device) = 2.
    "two_processes_accumulating": (2, ["--per_device_train_batch_size", 2, "--global_batch_size", 8]),
}


@pytest.fixture(scope="module")
def runs(tiny_model, tiny_data, tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    results = {}
    for name, (num_processes, extra) in LAYOUTS.items():
        output_dir = base / name
        audit = {
            "PYTHONPATH": os.pathsep.join([str(AUDIT_HOOK_DIR), str(REPO)]),
            "WRITE_AUDIT_TARGET": str(output_dir),
            "WRITE_AUDIT_LOG": str(base / f"{name}.writes"),
        }
        result = launch(
            TRAIN,
            *train_args(tiny_model, tiny_data, output_dir, "--num_train_epochs", 3, *extra),
            num_processes=num_processes,
            env=audit,
            real_launcher=name == "two_processes",  # its exit is checked: the warm launcher skips the module teardown
        )
        assert result.returncode == 0, result.output[-4000:]
        results[name] = {"dir": output_dir, "launch": result, "writes": base / f"{name}.writes"}
    return results


def weights(output_dir):
    return load_file(str(output_dir / "model.safetensors"))


def metrics(output_dir):
    return json.loads((output_dir / "metrics.json").read_text())


@pytest.mark.fast
def test_n_processes_train_the_same_model_as_one(runs, tiny_model):
    reference = weights(runs["one_process"]["dir"])
    initial = load_file(
        str(tiny_model / "model.safetensors")
    )  # the encoder before training, without the "bert." prefix
    changed = [k for k in initial if not np.allclose(initial[k], reference[f"bert.{k}"])]
    assert len(changed) > len(initial) // 2, "training barely changed the model: the comparison would prove nothing"
    for name in ("two_processes", "two_processes_accumulating"):
        other = weights(runs[name]["dir"])
        assert sorted(other) == sorted(reference)
        for key in reference:
            if key.endswith("attention.self.key.bias"):
                # Its exact gradient is zero (a constant added to every key score leaves the softmax
                # unchanged), so Adam turns rounding noise into steps: only check it stays noise.
                assert np.abs(other[key]).max() < 1e-4 and np.abs(reference[key]).max() < 1e-4, key
                continue
            np.testing.assert_allclose(other[key], reference[key], rtol=1e-4, atol=1e-5, err_msg=f"{name}: {key}")
        assert (
            metrics(runs[name]["dir"])["optimizer_steps"]
            == metrics(runs["one_process"]["dir"])["optimizer_steps"]
            == 24
        )


@pytest.mark.fast
def test_the_log_states_the_global_batch_and_what_changes_it(runs):
    plain, derived = runs["two_processes"]["launch"].output, runs["two_processes_accumulating"]["launch"].output
    assert (
        "global batch: 8 examples per optimizer step (2 process(es) x 4 per device x 1 accumulated); on another "
        in (plain)
        and "give --global_batch_size 8 to keep it" in plain
    )
    assert "(2 process(es) x 2 per device x 2 accumulated), set by --global_batch_size" in derived


@pytest.mark.fast
def test_the_global_batch_size_sets_the_accumulation_or_is_refused_in_one_line():
    from types import SimpleNamespace as Args

    from ddp_utils import UsageError
    from ddp_utils.lifecycle.args import accumulation_for

    def args(global_batch, per_device, accumulation=None):
        return Args(
            global_batch_size=global_batch,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
        )

    assert [accumulation_for(args(32, 4), world) for world in (1, 2, 8)] == [8, 4, 1]
    assert accumulation_for(args(None, 4, 3), 8) == 3 and accumulation_for(args(32, 4, 4), 2) == 4
    with pytest.raises(
        UsageError,
        match=r"^--global_batch_size 32 is not a multiple of 2 processes x "
        r"--per_device_train_batch_size 3; give --per_device_train_batch_size 4 or 8 or 16$",
    ):
        accumulation_for(args(32, 3), 2)
    with pytest.raises(UsageError, match="give a --global_batch_size that is a multiple of 3$"):
        accumulation_for(args(32, 4), 3)
    with pytest.raises(UsageError, match="accumulates 4 micro-batches, and --gradient_accumulation_steps says 2"):
        accumulation_for(args(32, 4, 2), 2)


@pytest.mark.fast
def test_every_training_example_counted_once_per_epoch(runs):
    for name, run in runs.items():
        # 60 examples x 3 epochs: the fillers that even out the shards are not counted.
        assert metrics(run["dir"])["train_samples_seen"] == 180, name


@pytest.mark.fast
def test_evaluation_counts_each_example_once_and_matches_one_process(runs):
    reference = metrics(runs["one_process"]["dir"])
    assert reference["eval_examples"] == 37
    for name in ("two_processes", "two_processes_accumulating"):
        scores = metrics(runs[name]["dir"])
        assert scores["eval_examples"] == 37, "37 is prime: duplicated padding would show up here"
        assert scores["eval_accuracy"] == pytest.approx(reference["eval_accuracy"], abs=1e-9)
        assert scores["eval_f1"] == pytest.approx(reference["eval_f1"], abs=1e-9)
        assert scores["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-4)
        assert scores["world_size"] == 2 and scores["distributed_type"] == "MULTI_CPU"


def test_only_the_main_process_writes(runs):
    for name, run in runs.items():
        rank0 = run["writes"].with_name(run["writes"].name + ".rank0")
        assert rank0.is_file() and rank0.read_text().strip(), f"{name}: the audit saw no write from rank 0"
        for other in run["writes"].parent.glob(run["writes"].name + ".rank*"):
            if other == rank0:
                continue
            # Other ranks write only their own RNG states, into a checkpoint's staging directory.
            outside = [line for line in other.read_text().splitlines() if "/.tmp-checkpoint-" not in line]
            assert outside == [], f"{name}: {other.name} wrote outside checkpoint staging: {outside[:5]}"
        files = sorted(os.listdir(run["dir"]))
        assert [f for f in files if not f.startswith("checkpoint-")] == [
            "README.md",  # the model card
            "config.json",
            "metrics.json",
            "model.safetensors",
            "report",
            "runs",
            "tokenizer.json",
            "tokenizer_config.json",
            "train_log.jsonl",
            "training_args.json",
        ]
        best = os.path.basename(json.loads((run["dir"] / "metrics.json").read_text())["best_checkpoint"])
        assert [f for f in files if f.startswith("checkpoint-")] == sorted({"checkpoint-16", "checkpoint-24", best}), (
            "epoch checkpoints, the newest 2 kept and the best by eval_accuracy"
        )


def test_overwrite_output_dir_is_replaced_by_the_main_process_alone(tmp_path):
    """--overwrite_output_dir: while the main process deletes the old run, another rank that looks
    at the directory itself can find it gone between `isdir` and `listdir` (FileNotFoundError).
    The race is widened by sleeps in the test double."""
    output_dir = tmp_path / "previous-run"
    (output_dir / "checkpoint-8").mkdir(parents=True)
    (output_dir / "metrics.json").write_text("{}")
    result = launch(REPO / "tests" / "launched" / "overwrite_race.py", output_dir, num_processes=2, timeout=120)
    assert result.returncode == 0, result.output[-3000:]
    assert "rank 0: output directory ready" in result.output and "rank 1: output directory ready" in result.output
    assert os.listdir(output_dir) == []


def test_a_hub_model_id_trains_the_same_model_as_its_local_copy(runs, tiny_model, tiny_data, tmp_path):
    """The Hub path of the scripts: the main process fetches the weights into the Hub cache
    (`fetch_weights`, inside the main-first section), then both ranks build the model from it. An
    offline Hub cache stands in for the Hub."""
    env = {"HF_HUB_CACHE": str(put_in_hub_cache(tmp_path / "hub", "tiny-org/tiny-bert", tiny_model))}
    output_dir = tmp_path / "from-hub"
    args = train_args(
        "tiny-org/tiny-bert", tiny_data, output_dir, "--num_train_epochs", 3, *LAYOUTS["two_processes"][1]
    )
    result = launch(TRAIN, *args, num_processes=2, env=env)
    assert result.returncode == 0, result.output[-4000:]
    reference = weights(runs["two_processes"]["dir"])
    for key, value in weights(output_dir).items():
        np.testing.assert_array_equal(value, reference[key], err_msg=key)


@pytest.mark.fast
def test_saved_model_reloads_with_from_pretrained_and_pipeline(runs, tiny_data):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    output_dir = runs["two_processes"]["dir"]
    assert not any(key.startswith("module.") for key in weights(output_dir)), "DDP wrapper leaked into the saved keys"
    assert not list(output_dir.glob("*.bin")), "weights must be safetensors only"

    model = AutoModelForSequenceClassification.from_pretrained(output_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert set(model.config.id2label.values()) == {"negative", "neutral", "positive"}
    assert model.config.label2id == {v: k for k, v in model.config.id2label.items()}

    texts = ["the movie was great", "this film is awful", "it was okay"]
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
    classifier = pipeline("text-classification", model=str(output_dir), device=-1)
    for text, row in zip(texts, logits):
        scores = {item["label"]: item["score"] for item in classifier(text, top_k=None, function_to_apply="none")}
        np.testing.assert_allclose(
            [scores[model.config.id2label[i]] for i in range(len(row))], row.numpy(), rtol=1e-5, atol=1e-5
        )


def test_launch_exits_cleanly_right_after_the_last_line(runs):
    real = {name: run for name, run in runs.items() if not run["launch"].warm}
    assert "two_processes" in real, "the exit of a run through `accelerate launch` is the one to check"
    for name, run in real.items():
        result = run["launch"]
        assert "saved to" in result.output
        assert result.exit_after_last_line < 5.0, (
            f"{name}: the launch took {result.exit_after_last_line:.1f}s to exit after its last line"
        )


def test_a_launch_configs_dynamo_backend_compiles_by_regions_and_the_model_saves(tiny_model, tiny_data, tmp_path):
    """train.py takes its compilation from the launch config (`dynamo_backend`), compiled by regions in place
    (`compile_by_regions`): under DDP Accelerate's own regional compilation copied the model and its DDP wrapper, and
    `unwrap_model` returned the copied DDP, which cannot `save_pretrained`. Dynamo's eager backend, 2 processes:
    every layer traced, none broken, and the saved model reloads with the trained weights."""
    from launching import CPU_CONFIG
    from transformers import AutoModelForSequenceClassification

    output_dir = tmp_path / "out"
    launcher = ["--config_file", str(CPU_CONFIG), "--num_processes", "2", "--dynamo_backend", "eager"]
    args = train_args(tiny_model, tiny_data, output_dir, "--num_train_epochs", 1, "--checkpointing_steps", "no")
    result = launch(TRAIN, *args, launcher_args=launcher, real_launcher=True)
    assert result.returncode == 0, result.output[-3000:]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["compiled_graphs"] > 0 and (metrics["graph_breaks"], metrics["frames_left_eager"]) == (0, 0)
    saved = load_file(str(output_dir / "model.safetensors"))
    assert not [name for name in saved if "_orig_mod" in name or name.startswith("module.")]
    initial = AutoModelForSequenceClassification.from_pretrained(tiny_model).state_dict()
    assert any(not np.array_equal(saved[name], initial[name].numpy()) for name in saved if "classifier" not in name)
    reloaded = AutoModelForSequenceClassification.from_pretrained(output_dir).state_dict()
    assert all(np.array_equal(saved[name], reloaded[name].numpy()) for name in saved)


# --- the families users bring (tests/test_families_classifiers.py sweeps 19 of them: FAMILY_SWEEP=1) -----------------


def logits_alone_and_padded(model, tokenizer, texts):
    """The model's logits for each text alone, and for the texts in one batch padded by `tokenizer`."""
    import torch

    with torch.no_grad():
        alone = torch.cat([model(**tokenizer([text], return_tensors="pt")).logits for text in texts])
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        assert (batch["attention_mask"] == 0).any(), "no padding: nothing checked"
        return alone.numpy(), model(**batch).logits.numpy()


def prepared(model_dir, data, tmp_path, *extra):
    """train.py's own parse_args and prepare_data: (tokenized, tokenizer, config)."""
    from accelerate import PartialState

    PartialState(cpu=True)
    script = load_script("train")
    argv = train_args(model_dir, data, tmp_path / "out", "--report_to", "none", *extra)
    return script.prepare_data(script.parse_args([str(a) for a in argv]))


def test_a_decoder_llm_without_a_pad_token_trains_and_its_classifier_reads_each_examples_last_token(
    tiny_lm, tiny_data, tmp_path
):
    """Llama's, Mistral's and GPT-2's tokenizers have no pad token: train.py stopped at the first batch ("Asking to
    pad but the tokenizer does not have a padding token"). It pads with EOS now, said once and saved with the
    model, and the config names it: the reloaded classifier reads each example's last real token, so an example
    inside a padded batch gets the logits it gets alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    output_dir = tmp_path / "llama"
    args = train_args(tiny_lm, tiny_data, output_dir, "--max_train_steps", 3, "--checkpointing_steps", "no")
    result = launch(TRAIN, *args, "--report_to", "none", num_processes=2)
    assert result.returncode == 0, result.output[-3000:]
    assert "the tokenizer has no pad token: padding with '</s>', and saved so" in result.output
    model = AutoModelForSequenceClassification.from_pretrained(output_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert (tokenizer.pad_token, model.config.pad_token_id, tokenizer.padding_side) == ("</s>", 2, "right")
    alone, padded = logits_alone_and_padded(model, tokenizer, ["great", "the film was very bad </s>", "a movie"])
    np.testing.assert_allclose(padded, alone, atol=1e-5)
    assert pipeline("text-classification", model=str(output_dir), device="cpu")("great")[0]["label"] in {
        "negative", "neutral", "positive"
    }  # fmt: skip


@pytest.mark.fast
def test_a_config_that_names_no_pad_token_gets_the_tokenizers(tiny_data, tmp_path):
    """Qwen's and Pythia's tokenizers pad, and their configs name no pad token: the classifier refused every batch
    of more than one example ("Cannot handle batch sizes > 1 if no padding token is defined")."""
    from classifier_families import save_family
    from transformers import AutoModelForSequenceClassification

    model_dir = save_family("qwen2", tmp_path / "qwen2")
    _, tokenizer, config = prepared(model_dir, tiny_data, tmp_path)
    assert config.pad_token_id == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, config=config).eval()
    alone, padded = logits_alone_and_padded(model, tokenizer, ["great", "the film was very bad"])
    np.testing.assert_allclose(padded, alone, atol=1e-5)


@pytest.mark.fast
def test_no_family_builds_a_kv_cache_in_training_or_evaluation(tiny_data, tmp_path):
    """Decoders' and BART's and T5's configs ask for a KV cache (use_cache): the classifier's every forward pass built
    one, holding each layer's keys and values to the pass's end, at the activations' peak, and under
    --gradient_checkpointing transformers warned that it turned it off. As train.py prepares them, none builds one."""
    import torch
    from classifier_families import FAMILIES, save_family
    from transformers import AutoConfig, AutoModelForSequenceClassification

    asked = []
    for family in FAMILIES:
        model_dir = save_family(family, tmp_path / family)
        asked += [family] if getattr(AutoConfig.from_pretrained(model_dir), "use_cache", False) else []
        _, tokenizer, config = prepared(model_dir, tiny_data, tmp_path / f"{family}-run")
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, config=config)
        batch = tokenizer(["great", "the film was very bad"], padding=True, return_tensors="pt")
        for training in (True, False):
            with torch.set_grad_enabled(training):
                output = model.train(training)(**batch)
            assert getattr(output, "past_key_values", None) is None, (family, training)
    assert {"llama", "qwen2", "gemma3_text", "gpt2", "bart", "t5"} <= set(asked), asked


@pytest.mark.fast
def test_a_tokenizer_that_pads_on_the_left_pads_on_the_right_where_positions_are_absolute(tiny_data, tmp_path):
    """A GPT-2 whose tokenizer was saved to pad on the left (for generation): its positions count from the batch's
    first column, so a left-padded example was read at other positions than alone, trained so and saved so. The
    classifier's tokenizer pads on the right, where every family reads an example as it reads it alone."""
    from classifier_families import save_family
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = save_family("gpt2", tmp_path / "gpt2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.save_pretrained(model_dir)
    _, tokenizer, config = prepared(model_dir, tiny_data, tmp_path)
    assert tokenizer.padding_side == "right"
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, config=config).eval()
    alone, padded = logits_alone_and_padded(model, tokenizer, ["great", "the film was very bad"])
    np.testing.assert_allclose(padded, alone, atol=1e-5)


@pytest.mark.fast
def test_xlnet_whose_head_reads_the_last_position_pads_on_the_left_and_has_no_length_limit(tiny_data, tmp_path):
    """XLNet's head reads position -1 whatever the mask (its tokenizer pads on the left for it): padded on the right,
    an example in a batch was read at a pad token (measured: logits 0.028 apart). Its config says -1 positions, which
    was taken for a limit: every --max_length was refused."""
    import torch
    from transformers import AutoModelForSequenceClassification, XLNetConfig, XLNetTokenizer

    from conftest import FILLER, WORDS

    words = sorted({w for ws in WORDS.values() for w in ws} | set(FILLER))
    specials = ["<unk>", "<s>", "</s>", "<cls>", "<sep>", "<pad>", "<mask>"]
    tokenizer = XLNetTokenizer(vocab=[(t, 0.0) for t in specials] + [("\u2581" + w, -1.0) for w in words])
    tokenizer.padding_side = "right"  # as a user may have saved it
    model_dir = tmp_path / "xlnet"
    tokenizer.save_pretrained(model_dir)
    torch.manual_seed(0)
    config = XLNetConfig(vocab_size=len(tokenizer), d_model=32, n_layer=2, n_head=2, d_inner=64, pad_token_id=5)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(model_dir)
    _, tokenizer, config = prepared(model_dir, tiny_data, tmp_path, "--max_length", 64)
    assert tokenizer.padding_side == "left"
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, config=config, ignore_mismatched_sizes=True)
    alone, padded = logits_alone_and_padded(model.eval(), tokenizer, ["great", "the film was very bad"])
    np.testing.assert_allclose(padded, alone, atol=1e-5)


@pytest.mark.fast
def test_a_t5_whose_tokenizer_gives_no_length_limit_prepares(tiny_data, tmp_path):
    """T5 v1.1's and mT5's tokenizers give no model_max_length, and T5 has relative positions only: the limit was
    read from max_position_embeddings, which T5's config lacks (AttributeError)."""
    from classifier_families import save_family

    model_dir = save_family("t5", tmp_path / "t5")
    tokenized, _, config = prepared(model_dir, tiny_data, tmp_path, "--max_length", 512)
    assert config.pad_token_id == 0 and len(tokenized["train"]) == 60


@pytest.mark.fast
@pytest.mark.parametrize("family, limit", [("roberta", 64), ("xlm_roberta", 64), ("mpnet", 64), ("bart", 64)])
def test_a_tokenizer_without_a_limit_gets_the_positions_a_text_can_take(family, limit, tmp_path):
    """RoBERTa's family numbers positions from its pad token's id + 1: of the tiny RoBERTa's 66 position embeddings
    (514 in the real one), 64 are a text's. A tokenizer saved without a limit took the config's count as the limit,
    and an input that long indexed past the table (on a GPU, a device-side assert). BART's table is larger than its
    config says, and keeps the config's count."""
    import torch
    from classifier_families import save_family
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from ddp_utils.data.text_classifiers import max_input_length

    source = save_family(family, tmp_path / family)
    tokenizer, config = AutoTokenizer.from_pretrained(source), AutoConfig.from_pretrained(source, num_labels=3)
    tokenizer.model_max_length = int(1e30)  # as a tokenizer saved without one says
    assert max_input_length(tokenizer, config) == limit
    model = AutoModelForSequenceClassification.from_pretrained(source, config=config).eval()
    text = " ".join(["great"] * (3 * limit))
    with torch.no_grad():
        model(**tokenizer(text, truncation=True, max_length=limit, return_tensors="pt"))
        if config.max_position_embeddings > limit:  # the config's count: past the table
            with pytest.raises((IndexError, RuntimeError)):  # "index 66 is out of bounds"
                model(**tokenizer(text, truncation=True, max_length=config.max_position_embeddings,
                                  return_tensors="pt"))  # fmt: skip


@pytest.mark.fast
def test_a_text_holding_an_encoder_decoders_eos_is_refused_naming_it(tiny_data, tmp_path):
    """BART's and T5's heads read each example's last EOS and need as many in every example: a review holding
    HTML's <s>...</s> stopped the run at the first batch that mixed it with others, in a traceback."""
    from classifier_families import save_family

    train = tmp_path / "train.csv"
    rows = tiny_data["train"].read_text().splitlines()
    train.write_text("\n".join([*rows, "the film was <s>bad</s> really,negative"]) + "\n")
    data = {"train": train, "validation": tiny_data["validation"]}
    refused_in_process(
        "train",
        train_args(save_family("bart", tmp_path / "bart"), data, tmp_path / "out"),
        "1 example(s) of the train data hold 2 EOS tokens '</s>' where most hold 1, as '<s>the film was "
        "<s>bad</s> really</s>'; this model's head reads each example's last one, and needs as many in each: they "
        "hold '</s>' in their text; remove it in the DATA section",
    )


@pytest.mark.fast
def test_a_pad_token_outside_the_models_vocabulary_is_refused_with_the_fix(tiny_lm, tiny_data, tmp_path):
    """A pad token added to the tokenizer without resizing the model's embeddings: an IndexError at the first batch."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path / "added-pad"
    AutoModelForCausalLM.from_pretrained(tiny_lm).save_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm)
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    tokenizer.save_pretrained(model_dir)
    vocabulary = AutoConfig.from_pretrained(tiny_lm).vocab_size
    refused_in_process(
        "train",
        train_args(model_dir, tiny_data, tmp_path / "out"),
        f"the tokenizer's pad token '[PAD]' has id {vocabulary}, outside the model's vocabulary of {vocabulary}; "
        "pad with a token the model has (tokenizer.pad_token = tokenizer.eos_token), or resize",
    )


def test_t5_trains_under_fsdp2_what_ddp_trains(tiny_data, tmp_path):
    """Transformers 5 gives T5's and BART's encoder and decoder embedding modules of their own, tied to `shared` by
    the weight; under FSDP2 torch refused the weight in `prepare` ("shared with a parameter already managed by another
    FSDP group"). One module serves all three now (`fsdp._one_module_for_the_input_embeddings`); BART: the sweep."""
    from classifier_families import save_family

    model_dir = save_family("t5", tmp_path / "t5")
    args = ["--max_train_steps", 3, "--checkpointing_steps", "no", "--report_to", "none"]
    ddp = launch(TRAIN, *train_args(model_dir, tiny_data, tmp_path / "ddp", *args), num_processes=2)
    assert ddp.returncode == 0, ddp.output[-3000:]
    launcher = ["--config_file", REPO / "accelerate_configs" / "fsdp.yaml", "--num_processes", 2]
    harness = REPO / "tests" / "launched" / "fsdp_on_cpu.py"
    sharded = launch(
        harness, "train", *train_args(model_dir, tiny_data, tmp_path / "fsdp", *args),
        launcher_args=[str(a) for a in [*launcher, "--mixed_precision", "no"]],
    )  # fmt: skip
    assert sharded.returncode == 0, sharded.output[-3000:]
    ours, theirs = weights(tmp_path / "fsdp"), weights(tmp_path / "ddp")
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], atol=1e-5, err_msg=key)
