"""LoRA and QLoRA for scripts/train.py's classifiers (--lora_r, --load_in_4bit). What users rely on:

- on every family users bring (`classifier_families`: encoders, decoder LLMs, BART, T5), the adapters sit on the
  pretrained body and the head the task adds trains whole, with no adapter; every trainable weight gets a gradient;
  the saved adapter reloads with the model card's code (its labels saved beside it) and computes what was trained;
- 2 processes and 1 with accumulation train the same adapter and head (LoRA dropout on, as by default), a resumed
  run ends bit for bit as an uninterrupted one, and --merge_lora's model loads alone and computes the same;
- QLoRA keeps the head unquantized, trains (with gradient checkpointing), and merges into the unquantized weights.
--gradient_checkpointing itself: tests/test_gradient_checkpointing.py."""

import json
import logging
import shutil
import warnings

import numpy as np
import pytest
import torch
from classifier_families import FAMILIES, save_family
from safetensors.numpy import load_file

from conftest import REPO, launch, launch_sharded, load_script, make_tiny_causal_lm, make_tiny_model, train_args

TRAIN = REPO / "scripts" / "train.py"
NEW = {  # what each family's checkpoint (a masked, causal or seq2seq LM's) lacks of its *ForSequenceClassification
    "modernbert": ["classifier"], "deberta_v2": ["pooler", "classifier"],
    "distilbert": ["pre_classifier", "classifier"],
    "albert": ["albert.pooler", "classifier"], "bart": ["classification_head"], "t5": ["classification_head"],
    **dict.fromkeys(["roberta", "xlm_roberta", "electra", "mpnet"], ["classifier"]),
}  # fmt: skip
TEXTS = ["great", "the movie was very bad", "it is a really quite plain film this okay"]


def card_code(output_dir) -> str:
    card = (output_dir / "README.md").read_text()
    return card.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.fast
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_adapters_sit_on_the_body_the_head_trains_whole_and_the_card_reloads_it(family, tmp_path):
    """Found per family from its class (`base_model_prefix`), not from a list of head names: peft's own list
    (classifier, score) misses BART's and T5's classification_head and DeBERTa's pooler, which then stayed at their
    random start, or got adapters of their own on random weights."""
    from accelerate import Accelerator
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    import ddp_utils
    from ddp_utils.results.model_card import write_model_card
    from ddp_utils.results.output import write_pretrained

    Accelerator(cpu=True)
    source = save_family(family, tmp_path / family)
    labels = {"id2label": {0: "negative", 1: "neutral", 2: "positive"}, "problem_type": "single_label_classification"}
    config = AutoConfig.from_pretrained(source, **labels, label2id={"negative": 0, "neutral": 1, "positive": 2})
    model = ddp_utils.load_pretrained(AutoModelForSequenceClassification, str(source), config=config)
    if config.pad_token_id is None:  # as pad_for_classification sets it
        model.config.pad_token_id = config.eos_token_id
    args = load_script("train").parse_args(["--model_name_or_path", str(source), "--lora_r", "4"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ddp_utils.add_classifier_lora(model, args)
    # peft asks transformers for a deprecated name (`is_gradient_checkpointing`): a FutureWarning in every run's log
    assert not [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)]
    new = NEW.get(family, ["score"])  # the decoder LLMs' head
    trainable = [name.removeprefix("base_model.model.") for name, p in model.named_parameters() if p.requires_grad]
    whole = {name.split(".modules_to_save.")[0] for name in trainable if ".modules_to_save." in name}
    assert sorted(whole) == sorted(new) and any("lora_" in name for name in trainable)
    assert all(("lora_" in name) != (".modules_to_save." in name) for name in trainable)
    assert not [name for name in trainable if "lora_" in name and name.startswith(tuple(new))]
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    torch.manual_seed(0)
    with torch.no_grad():  # B starts at zero: a forward would not tell the adapter was loaded
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    model.train()
    torch.nn.functional.cross_entropy(model(**batch).logits, torch.tensor([0, 1, 2])).backward()
    assert not [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.eval()
    with torch.no_grad():
        trained = model(**batch).logits
    output_dir = tmp_path / "out"
    write_pretrained(model, model.state_dict(), str(output_dir), tokenizer)
    run_args = load_script("train").parse_args(["--model_name_or_path", str(source), "--lora_r", "4", "--output_dir",
                                                str(output_dir), "--report_to", "none"])  # fmt: skip
    write_model_card(run_args, {})
    assert "pipeline_tag: text-classification" in (output_dir / "README.md").read_text()
    code = card_code(output_dir).replace('"out"', repr(str(output_dir)))
    loaded = {}
    exec(code, loaded)  # the card's own lines
    with torch.no_grad():
        reloaded = loaded["model"].eval()(**batch).logits
    torch.testing.assert_close(reloaded, trained)
    assert loaded["model"].config.id2label[2] == "positive"


@pytest.mark.fast
def test_a_classifier_checkpoint_of_other_labels_trains_its_whole_head_and_reloads(tmp_path, caplog):
    """A RoBERTa classifier fine-tuned before on 2 labels, now on 3: only its out_proj is new (its dense was
    trained). peft trains any module named classifier whole, so naming out_proj alone nested a second copy inside
    the first, which got no gradient (the head never learned; DDP stops at such a weight). The head trains whole;
    the card's code loads it over the 2-label base."""
    from accelerate import Accelerator
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    import ddp_utils
    from ddp_utils.results.model_card import write_model_card
    from ddp_utils.results.output import write_pretrained

    Accelerator(cpu=True)
    source = save_family("roberta", tmp_path / "mlm")
    AutoModelForSequenceClassification.from_pretrained(source, num_labels=2).save_pretrained(tmp_path / "two")
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path / "two")
    config = AutoConfig.from_pretrained(tmp_path / "two", num_labels=3)
    model = ddp_utils.load_pretrained(AutoModelForSequenceClassification, str(tmp_path / "two"), config=config,
                                      ignore_mismatched_sizes=True)  # fmt: skip
    assert model.weights_not_in_checkpoint == ["classifier.out_proj.bias", "classifier.out_proj.weight"]
    args = load_script("train").parse_args(["--model_name_or_path", str(tmp_path / "two"), "--lora_r", "4",
                                            "--output_dir", str(tmp_path / "out"), "--report_to", "none"])  # fmt: skip
    with caplog.at_level(logging.INFO):
        model = ddp_utils.add_classifier_lora(model, args)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "two")
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    model.train()
    torch.nn.functional.cross_entropy(model(**batch).logits, torch.tensor([0, 1, 2])).backward()
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert not [name for name, p in trainable.items() if p.grad is None]
    assert any(".classifier.modules_to_save.default.out_proj." in name for name in trainable)
    assert "LoRA: classifier trains whole, with no adapter (it holds weights the checkpoint lacks)" in caplog.text
    model.eval()
    with torch.no_grad():
        trained = model(**batch).logits
    write_pretrained(model, model.state_dict(), str(tmp_path / "out"), tokenizer)
    write_model_card(args, {})
    loaded = {}
    exec(card_code(tmp_path / "out").replace('"out"', repr(str(tmp_path / "out"))), loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded["model"].eval()(**batch).logits, trained)


@pytest.mark.fast
def test_lora_last_layers_takes_each_stacks_last_and_refuses_a_model_of_shared_layers(tmp_path):
    """BART adapts the last layer of its encoder and of its decoder; ALBERT, whose layers are one layer shared by
    its depth, was refused as "--lora_target_modules 'all-linear' does not fit", naming an option not given."""
    from accelerate import Accelerator
    from transformers import AutoModelForSequenceClassification

    import ddp_utils
    from ddp_utils import UsageError

    Accelerator(cpu=True)
    for family in ("bart", "albert"):
        source = save_family(family, tmp_path / family)
        model = ddp_utils.load_pretrained(AutoModelForSequenceClassification, str(source), num_labels=3)
        args = load_script("train").parse_args(["--model_name_or_path", str(source), "--lora_r", "4",
                                                "--lora_last_layers", "1"])  # fmt: skip
        if family == "albert":
            with pytest.raises(UsageError, match=r"^--lora_last_layers 1 with --lora_target_modules 'all-linear' "
                                                 r"adapts nothing in AlbertForSequenceClassification: .* shares one "
                                                 r"layer across its depth.*or drop --lora_last_layers$"):  # fmt: skip
                ddp_utils.add_classifier_lora(model, args)
            continue
        adapted = {
            name.split(".layers.")[0] + ".layers." + name.split(".layers.")[1].split(".")[0]
            for name, _ in ddp_utils.add_classifier_lora(model, args).named_parameters()
            if "lora_A" in name
        }
        assert adapted == {"base_model.model.model.encoder.layers.1", "base_model.model.model.decoder.layers.1"}


STEPS = ["--max_train_steps", 6, "--checkpointing_steps", 3, "--lora_r", 4, "--report_to", "none"]


def trained(output_dir) -> dict:
    return load_file(str(output_dir / "adapter_model.safetensors"))


def test_lora_trains_the_same_classifier_on_any_layout_resumes_bit_for_bit_and_merges(tiny_model, tiny_data, tmp_path):
    """The tiny BERT with LoRA's default dropout: 2 processes and 1 process, each accumulating micro-batches of 2 to
    the global batch of 8 (dropout's masks are drawn per micro-batch: docs/design.md), train the same adapter and
    head; a run resumed from its step-3 checkpoint ends bit for bit as the uninterrupted one; the merged model loads
    as a plain classifier (pipeline) and computes what the base with the adapter computes."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, pipeline

    two, one = tmp_path / "two", tmp_path / "one"
    run = launch(TRAIN, *train_args(tiny_model, tiny_data, two, *STEPS, "--per_device_train_batch_size", 2,
                                    "--global_batch_size", 8, "--merge_lora"))  # fmt: skip
    assert run.returncode == 0, run.output[-3000:]
    assert "LoRA: classifier trains whole, with no adapter (it holds weights the checkpoint lacks)" in run.output
    assert "is_gradient_checkpointing" not in run.output  # peft's FutureWarning, at the merge's copy too
    args = train_args(tiny_model, tiny_data, one, *STEPS, "--per_device_train_batch_size", 2, "--global_batch_size", 8)
    assert launch(TRAIN, *args, num_processes=1).returncode == 0
    ours, theirs = trained(one), trained(two)
    assert sorted(ours) == sorted(theirs) and any("classifier" in key for key in ours)
    start = {key: value for key, value in ours.items() if "lora_B" in key}  # B starts at 0: it must have moved
    assert all(np.abs(value).max() > 0 for value in start.values())
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, atol=1e-6, err_msg=key)

    resumed = tmp_path / "resumed"
    shutil.copytree(two / "checkpoint-3", resumed / "checkpoint-3")
    args = train_args(tiny_model, tiny_data, resumed, *STEPS, "--per_device_train_batch_size", 2,
                      "--global_batch_size", 8, "--resume_from_checkpoint", "latest")  # fmt: skip
    run = launch(TRAIN, *args)
    assert run.returncode == 0 and "resumed from" in run.output, run.output[-3000:]
    assert [key for key, value in trained(resumed).items() if not np.array_equal(value, theirs[key])] == []

    tokenizer = AutoTokenizer.from_pretrained(two)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model, config=AutoConfig.from_pretrained(two))
    expected = PeftModel.from_pretrained(base, two).eval()
    merged = AutoModelForSequenceClassification.from_pretrained(two / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, expected(**batch).logits, rtol=1e-5, atol=1e-5)
    assert pipeline("text-classification", model=str(two / "merged"), device="cpu")("great")[0]["label"] in {
        "negative", "neutral", "positive"
    }  # fmt: skip
    assert json.loads((two / "config.json").read_text())["id2label"]["2"] == "positive"  # beside the adapter


def test_qlora_keeps_the_head_unquantized_trains_and_merges_into_the_unquantized_weights(tiny_data, tmp_path):
    """A decoder LLM as a classifier, its body in 4-bit NF4 (bitsandbytes' CPU backend, 64 wide: its blocks of 64),
    on 2 processes with gradient checkpointing: the new head stays a plain linear layer that trains whole (4-bit, it
    would be random packed bytes with no gradient); --merge_lora merges into the checkpoint's own weights, and the
    merged classifier loads without bitsandbytes and computes what the unquantized base with the adapter computes."""
    pytest.importorskip("bitsandbytes", reason="requirements-dev.txt installs it")
    import bitsandbytes as bnb
    from accelerate import Accelerator
    from model_families import save_multimodal
    from peft import PeftModel
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        BertConfig,
        BertForMaskedLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    import ddp_utils
    from ddp_utils.core.sharded import weight_count

    source = make_tiny_causal_lm(tmp_path / "wide")
    config = LlamaConfig.from_pretrained(source)
    config.update(dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(source)

    Accelerator(cpu=True)
    args = load_script("train").parse_args(["--model_name_or_path", str(source), "--lora_r", "4", "--load_in_4bit"])
    labelled = AutoConfig.from_pretrained(source, num_labels=3, pad_token_id=2)
    model = ddp_utils.load_pretrained(AutoModelForSequenceClassification, str(source), config=labelled,
                                      **ddp_utils.classifier_4bit_loading(args, AutoModelForSequenceClassification,
                                                                          labelled))  # fmt: skip
    kinds = {name: type(module) for name, module in model.named_modules()}
    assert kinds["score"] is torch.nn.Linear and kinds["model.layers.0.self_attn.q_proj"] is bnb.nn.Linear4bit
    query = model.get_submodule("model.layers.0.self_attn.q_proj")  # the log's count: its weights, not its bytes
    assert weight_count(query.weight) == query.in_features * query.out_features == 2 * query.weight.numel()

    # A masked LM's checkpoint has no pooler: loaded as a 4-bit layer, it was never quantized, and the first forward
    # failed in bitsandbytes. It stays unquantized, and trains whole with the head.
    make_tiny_model(tmp_path / "bert", hidden_size=64)
    BertForMaskedLM(BertConfig.from_pretrained(tmp_path / "bert")).save_pretrained(tmp_path / "bert")
    args = load_script("train").parse_args(["--model_name_or_path", str(tmp_path / "bert"), "--lora_r", "4",
                                            "--load_in_4bit"])  # fmt: skip
    labelled = AutoConfig.from_pretrained(tmp_path / "bert", num_labels=3)
    loading = ddp_utils.classifier_4bit_loading(args, AutoModelForSequenceClassification, labelled)
    model = ddp_utils.load_pretrained(AutoModelForSequenceClassification, str(tmp_path / "bert"), config=labelled,
                                      **loading)  # fmt: skip
    assert type(model.bert.pooler.dense) is torch.nn.Linear
    assert type(model.bert.encoder.layer[0].attention.self.query) is bnb.nn.Linear4bit
    model = ddp_utils.add_classifier_lora(model, args)
    model.train()
    tokens = torch.tensor([[2, 5, 6, 7, 3]])
    # Gemma 3's checkpoints name the text model language_model.model.*, renamed at loading: that is no missing
    # body, and it is quantized (kept whole by that reading, a 27B would have loaded in bf16).
    gemma = save_multimodal("gemma3", source, tmp_path / "gemma3")
    args = load_script("train").parse_args(["--model_name_or_path", str(gemma), "--lora_r", "4", "--load_in_4bit"])
    gemma_config = AutoConfig.from_pretrained(gemma, num_labels=3)
    kept = ddp_utils.classifier_4bit_loading(args, AutoModelForSequenceClassification, gemma_config)
    assert not [name for name in kept["quantization_config"].llm_int8_skip_modules if "language_model" in name]
    torch.nn.functional.cross_entropy(model(input_ids=tokens).logits, torch.tensor([1])).backward()
    assert not [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]

    output_dir = tmp_path / "out"
    # with --gradient_checkpointing, as a QLoRA run of a model too large for its memory has it
    run = launch(TRAIN, *train_args(source, tiny_data, output_dir, *STEPS, "--load_in_4bit", "--merge_lora",
                                    "--gradient_checkpointing"))  # fmt: skip
    assert run.returncode == 0, run.output[-3000:]
    assert "LoRA: score trains whole" in run.output and "QLoRA: the base model's linear layers in 4-bit" in run.output
    assert "each layer's activations recomputed in the backward pass" in run.output
    # A classifier keeps no KV cache (its decoder's config asked for one): transformers has none to turn off
    assert "use_cache=True` is incompatible" not in run.output
    assert "is_gradient_checkpointing" not in run.output  # peft's FutureWarning, at the unquantized merge too
    assert json.loads((output_dir / "merged" / "config.json").read_text())["use_cache"] is False
    assert "quantization_config" not in json.loads((output_dir / "merged" / "config.json").read_text())
    assert "quantization_config" not in json.loads((output_dir / "config.json").read_text())
    merged = AutoModelForSequenceClassification.from_pretrained(output_dir / "merged").eval()
    base = AutoModelForSequenceClassification.from_pretrained(source, config=AutoConfig.from_pretrained(output_dir))
    expected = PeftModel.from_pretrained(base, output_dir).eval()
    tokens = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, expected(tokens).logits, rtol=1e-5, atol=1e-5)


def assert_same_lora(ours, theirs) -> None:
    """The same adapter and head, and the same merged model, in two runs' output directories."""
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        mine, reference = load_file(str(ours / name)), load_file(str(theirs / name))
        assert sorted(mine) == sorted(reference)
        for key in reference:
            np.testing.assert_allclose(mine[key], reference[key], rtol=1e-5, atol=1e-6, err_msg=f"{name}: {key}")


@pytest.mark.parametrize("sharded", ["fsdp", "zero3"])
def test_lora_trains_the_classifier_under_fsdp2_and_zero3_as_ddp_does(sharded, tiny_data, tmp_path):
    """On 2 CPU processes under Accelerate's FSDP2 path (rank 0 alone reads the weights and tells the others which
    ones the checkpoint lacked) and under DeepSpeed ZeRO-3 (the model built in shards): the same adapter and head
    as DDP's, dropout on, and the same merged model."""
    model = make_tiny_model(tmp_path / "bert", dropout=0.1)
    args = ["--max_train_steps", 4, "--lora_r", 4, "--report_to", "none", "--checkpointing_steps", "no"]
    args += ["--per_device_train_batch_size", 4, "--merge_lora"]
    ddp, other = tmp_path / "ddp", tmp_path / sharded
    assert launch(TRAIN, *train_args(model, tiny_data, ddp, *args)).returncode == 0
    launch_sharded(sharded, "train", *train_args(model, tiny_data, other, *args))
    assert_same_lora(other, ddp)
