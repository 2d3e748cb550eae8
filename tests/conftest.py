"""Shared test fixtures: tiny models built from a config, small synthetic data files in the shapes users bring,
and the arguments of a tiny run. How a test launches a script on N processes is in launching.py."""

from __future__ import annotations

import csv
import json
import os
import random
from pathlib import Path

import pytest
from launching import (  # noqa: F401  (the tests import these from here)
    AUDIT_HOOK_DIR,
    CPU_CONFIG,
    REPO,
    LaunchResult,
    assert_error_is_last,
    assert_fails_cleanly,
    changed_since,
    environment_now,
    free_port,
    launch,
    launch_env,
    launch_sharded,
)

WORDS = {
    "positive": "good great fine lovely superb".split(),
    "negative": "bad awful poor terrible dreadful".split(),
    "neutral": "okay average plain usual middling".split(),
}
FILLER = "the a movie film was is very not quite really it this".split()


def refused_in_process(script: str, args, expected: str) -> None:
    """A script's own check of its input, run here without a launch: its `parse_args` and
    `prepare_data` (and for the causal-LM scripts the model's set-up, where LoRA is checked) raise a
    `UsageError` whose one line holds `expected`. Each test file keeps a few real 2-process
    launches of bad input, which show that the line reaches every rank fast with nothing written;
    the other cases need only the check itself, in a fraction of a launch's time."""
    from accelerate import PartialState

    from ddp_utils import UsageError

    PartialState(cpu=True)  # the scripts log through Accelerate's logger
    module = load_script(script)
    with pytest.raises(UsageError) as refused:
        args = module.parse_args([str(a) for a in args])
        data = module.prepare_data(args)
        if script in ("train_sft", "train_dpo", "train_grpo", "train_clm"):
            import ddp_utils

            ddp_utils.load_causal_lm(args, data[2], data[1])
    assert expected in str(refused.value), str(refused.value)


def make_tiny_model(directory: Path, dropout: float = 0.0, hidden_size: int = 32) -> Path:
    """A 2-layer BERT (hidden 32) with a word-level vocabulary, built from a config: no Hub."""
    from transformers import BertConfig, BertModel, BertTokenizer

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(
        {w for ws in WORDS.values() for w in ws} | set(FILLER)
    )
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(tokens)}, model_max_length=64)
    config = BertConfig(
        vocab_size=len(tokens),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        classifier_dropout=dropout,
    )
    import torch

    torch.manual_seed(0)
    BertModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def put_in_hub_cache(cache: Path, repo_id: str, model_dir: Path) -> Path:
    """Lay `model_dir`'s files out in `cache` as the Hub client stores a download of `repo_id`, so
    an offline run can load the model by its Hub id (HF_HUB_CACHE=cache, HF_HUB_OFFLINE=1)."""
    import shutil

    revision = "0" * 40
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return cache


def write_examples(
    path: Path, n: int, seed: int, labels=("positive", "negative", "neutral"), text_column="text", label_column="label"
):
    """n labelled sentences whose label is given by one of its words, varied in length."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = labels[i % len(labels)]
        words = rng.choices(FILLER, k=rng.randint(2, 12)) + [rng.choice(WORDS.get(label, FILLER))]
        rng.shuffle(words)
        rows.append({text_column: " ".join(words), label_column: label})
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[text_column, label_column])
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> dict:
    """60 training examples (not a multiple of 8) and 37 validation examples (a prime)."""
    directory = tmp_path_factory.mktemp("data")
    return {
        "train": write_examples(directory / "train.csv", 60, seed=1),
        "validation": write_examples(directory / "validation.csv", 37, seed=2),
    }


@pytest.fixture(scope="session", autouse=True)
def isolated_hf_home(tmp_path_factory):
    """Keep the datasets/evaluate caches of the launched runs out of the user's home. The dequantized copies
    of GGUF files are shared by the test processes of one run (pytest-xdist's workers): the demo LLM's takes
    30 s or more to make, and its writer is safe with several at once (a staging folder, then a rename)."""
    home = tmp_path_factory.mktemp("hf-home")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "dequantized-gguf"  # the run's folder, above each worker's
        shared.mkdir(exist_ok=True)
        (home / "dequantized-gguf").symlink_to(shared, target_is_directory=True)
    os.environ["HF_HOME"] = str(home)
    yield


@pytest.fixture(autouse=True)
def no_leaked_environment():
    """A test that leaves a variable in os.environ hands it to every later launch of its worker (and makes the next
    one restart the warm launcher's server): fail it, by name. monkeypatch.setenv/delenv undo theirs; a delenv of an
    unset variable does not undo what the code under test sets after it. What launch_env sets itself cannot leak
    (datasets' map leaves TOKENIZERS_PARALLELISM=false)."""
    before = environment_now()
    yield
    leaked = changed_since(before, environment_now())
    assert not leaked, f"the test changed os.environ and left it so: {sorted(leaked)} (use monkeypatch.setenv)"


def train_args(tiny_model, tiny_data, output_dir, *extra) -> list:
    return [
        "--model_name_or_path",
        tiny_model,
        "--train_file",
        tiny_data["train"],
        "--validation_file",
        tiny_data["validation"],
        "--max_length",
        32,
        "--output_dir",
        output_dir,
        "--learning_rate",
        5e-3,
        "--warmup_ratio",
        0.0,
        "--per_device_eval_batch_size",
        4,
        *extra,
    ]


# --- causal language models -------------------------------------------------------------------

LM_WORDS = [f"w{i}" for i in range(300)]  # a corpus of unique words: every token can be traced
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<s> ' if loop.first else '' }}{{ m['role'] }}: {{ m['content'] }}"
    "{{ ' </s> ' if m['role'] == 'assistant' else ' ' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def save_another_base(model_dir: Path, directory: Path) -> Path:
    """The causal LM of `model_dir` with one weight scaled by 1.01, saved with its tokenizer in `directory`: the same
    shapes and names, other values (a base against its instruct model), for a resume on another base."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(1.01)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(directory)
    return directory


# An instruct model's generation_config.json, which config.json does not hold: two EOS ids, sampling defaults.
INSTRUCT_GENERATION = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.9}


def with_instruct_generation_config(model_dir: Path, directory: Path) -> Path:
    """A copy of `model_dir` whose generation_config.json is INSTRUCT_GENERATION, as an instruct model ships one."""
    import shutil

    shutil.copytree(model_dir, directory)
    (directory / "generation_config.json").write_text(json.dumps(INSTRUCT_GENERATION))
    return directory


def assert_generation_config_kept(merged_dir: Path) -> None:
    """--merge_lora's model generates as its base was shipped to: INSTRUCT_GENERATION, not config.json's EOS."""
    saved = json.loads((merged_dir / "generation_config.json").read_text())
    assert {key: saved.get(key) for key in INSTRUCT_GENERATION} == INSTRUCT_GENERATION, saved


def make_tiny_causal_lm(directory: Path, chat_template: bool = False) -> Path:
    """A 2-layer Llama (hidden 32, context 64) with a whitespace word-level tokenizer that has BOS
    and EOS but no pad token (as Llama's own), built from a config: no Hub."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokens = (
        ["<unk>", "<s>", "</s>", "user:", "assistant:"]
        + sorted({w for ws in WORDS.values() for w in ws} | set(FILLER))
        + LM_WORDS
    )
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", model_max_length=64
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_alphabet() -> list[str]:
    """GPT-2's 256 printable stand-ins for the bytes: a byte-level BPE vocabulary with no merges."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + n) for n in range(len(others))]


def make_tiny_gguf(directory: Path):
    """A 2-layer Llama written as a GGUF file (llama.cpp's layout: q/k rows permuted for its rope)
    with the `gguf` package's writer, byte-level BPE tokenizer and a ChatML template inside.
    Returns (the file's path, the Llama it was written from)."""
    import gguf
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = _byte_level_alphabet() + ["\u0120t", "<|im_start|>", "<|im_end|>"]  # one merge ("Ġ t") and its result
    heads, kv_heads = 4, 2
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        bos_token_id=257,
        eos_token_id=258,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tiny.Q.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256), writer.add_embedding_length(64), writer.add_feed_forward_length(128)
    writer.add_block_count(2), writer.add_head_count(heads), writer.add_head_count_kv(kv_heads)
    (
        writer.add_layer_norm_rms_eps(config.rms_norm_eps),
        writer.add_rope_dimension_count(64 // heads),
        writer.add_vocab_size(len(tokens)),
    )
    writer.add_tokenizer_model("gpt2"), writer.add_tokenizer_pre("default"), writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3]), writer.add_token_merges(["\u0120 t"])
    writer.add_bos_token_id(257), writer.add_eos_token_id(258), writer.add_chat_template(CHATML_TEMPLATE)

    def permuted(weight, n):  # llama.cpp's q/k row order, which transformers undoes on load
        return weight.reshape(n, 2, weight.shape[0] // n // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)

    names = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
    for i in range(2):
        for hf, ours in (
            ("input_layernorm", "attn_norm"),
            ("self_attn.q_proj", "attn_q"),
            ("self_attn.k_proj", "attn_k"),
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("post_attention_layernorm", "ffn_norm"),
            ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
        ):
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{ours}"
    state = model.state_dict()
    for hf, ours in names.items():
        weight = state[hf].numpy()
        if ours.endswith("attn_q"):
            weight = permuted(weight, heads)
        elif ours.endswith("attn_k"):
            weight = permuted(weight, kv_heads)
        writer.add_tensor(f"{ours}.weight", np.ascontiguousarray(weight, dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path, model


def write_sft_records(path: Path, n: int, seed: int) -> Path:
    """n prompt/response records with very uneven response lengths (1 to 30 words): averaging
    per-micro-batch means would weight the short responses' tokens far more than the long ones'."""
    import json

    rng = random.Random(seed)
    with open(path, "w") as handle:
        for i in range(n):
            prompt = " ".join(rng.choices(FILLER, k=rng.randint(2, 8)))
            response = " ".join(rng.choices(LM_WORDS[:50], k=1 if i % 3 == 0 else rng.randint(10, 30)))
            handle.write(json.dumps({"prompt": prompt, "completion": response}) + "\n")
    return path


def write_text_corpus(path: Path, words=LM_WORDS, seed: int = 0) -> Path:
    """Lines of 1 to 25 words of `words`, each word exactly once in the file."""
    rng = random.Random(seed)
    words, lines = list(words), []
    while words:
        k = rng.randint(1, 25)
        lines.append(" ".join(words[:k]))
        words = words[k:]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory) -> Path:
    return make_tiny_causal_lm(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory) -> dict:
    """24 training records and 7 validation records (7: not a multiple of processes x eval batch)."""
    directory = tmp_path_factory.mktemp("sft")
    return {
        "train": write_sft_records(directory / "train.jsonl", 24, seed=1),
        "validation": write_sft_records(directory / "validation.jsonl", 7, seed=2),
    }


def sft_args(model, data, output_dir, *extra) -> list:
    """The arguments of a short scripts/train_sft.py run on the tiny Llama and `sft_data`."""
    return [
        "--model_name_or_path",
        model,
        "--train_file",
        data["train"],
        "--validation_file",
        data["validation"],
        "--block_size",
        48,
        "--output_dir",
        output_dir,
        "--learning_rate",
        1e-2,
        "--warmup_ratio",
        0.0,
        "--per_device_eval_batch_size",
        2,
        "--checkpointing_steps",
        "no",
        "--eval_max_new_tokens",
        8,
        *extra,
    ]


def load_script(name: str):
    """Import scripts/<name>.py as a module, to test its functions directly."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_pairs(path, n, seed):
    """n prompt/chosen/rejected string pairs with uneven answer lengths (1 to 12 words): the chosen
    answers drawn from the first 20 words, the rejected from the next 20."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(n):
            prompt = " ".join(rng.choices(FILLER, k=rng.randint(2, 8)))
            chosen = " ".join(rng.choices(LM_WORDS[:20], k=rng.randint(1, 12)))
            rejected = " ".join(rng.choices(LM_WORDS[20:40], k=rng.randint(1, 12)))
            handle.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return path


@pytest.fixture(scope="session")
def pairs(tmp_path_factory):
    """24 training pairs and 7 validation pairs (7: not a multiple of processes x eval batch)."""
    directory = tmp_path_factory.mktemp("pairs")
    return {
        "train": write_pairs(directory / "train.jsonl", 24, 1),
        "validation": write_pairs(directory / "v.jsonl", 7, 2),
    }


def dpo_args(model, data, output_dir, *extra):
    return [
        "--model_name_or_path", model, "--train_file", data["train"], "--validation_file", data["validation"],
        "--block_size", 48, "--output_dir", output_dir, "--learning_rate", 1e-2, "--warmup_ratio", 0.0,
        "--per_device_eval_batch_size", 2, "--checkpointing_steps", "no", "--report_to", "none", *extra,
    ]  # fmt: skip
