"""Shared test fixtures: a tiny BERT built from a config, small synthetic data files, and a helper
that runs scripts through the real `accelerate launch` with 1 or 2 CPU processes (gloo)."""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CPU_CONFIG = REPO / "accelerate_configs" / "cpu_2proc.yaml"
AUDIT_HOOK_DIR = Path(__file__).resolve().parent / "audit"

WORDS = {
    "positive": "good great fine lovely superb".split(),
    "negative": "bad awful poor terrible dreadful".split(),
    "neutral": "okay average plain usual middling".split(),
}
FILLER = "the a movie film was is very not quite really it this".split()


@dataclass
class LaunchResult:
    returncode: int
    output: str
    seconds: float  # from start to exit of the whole launch
    exit_after_last_line: float  # seconds between the last line printed and the launch's exit
    lines: list = field(default_factory=list)
    warm: bool = False  # through tests/warm_launch.py: no launcher process, so no launcher's summary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env(extra: dict | None = None) -> dict:
    """The environment of a launched test run: offline, one thread per process, isolated caches."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    env.update(extra or {})
    return env


def launch(
    script,
    *args,
    num_processes=2,
    launcher_args=(),
    env=None,
    timeout=300,
    file_size_limit=None,
    real_launcher=False,
) -> LaunchResult:
    """Run `<script> <args>` on `num_processes` CPU processes and time its exit. With the default CPU config
    and the suite's environment, the processes are forked from the warm launcher (tests/warm_launch.py: the
    environment `accelerate launch` gives, without a fresh interpreter's imports); otherwise, or with
    `real_launcher`, through `accelerate launch` itself. `file_size_limit` (bytes): no process of the launch
    may write a larger file (ulimit -f)."""
    launcher_args = [*(launcher_args or ["--config_file", str(CPU_CONFIG), "--num_processes", str(num_processes)])]
    launcher_args += ["--main_process_port", str(free_port())]
    if not (real_launcher or file_size_limit or os.environ.get("TESTS_REAL_LAUNCHER")):
        warm, extra = warm_launcher(), warm_env(env)
        result = launch_warm(warm, script, args, launcher_args, extra, timeout) if warm and extra is not None else None
        if result is not None:
            return result
    command = [sys.executable, "-m", "accelerate.commands.launch", *launcher_args, str(script), *map(str, args)]
    start = time.monotonic()

    def limit_file_size():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=launch_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=limit_file_size if file_size_limit else None,
    )
    lines: list[tuple[float, str]] = []

    def read():
        for line in process.stdout:
            lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        reader.join(5)
        raise AssertionError(f"launch hung for {timeout}s:\n" + "".join(text for _, text in lines[-60:])) from None
    end = time.monotonic()
    reader.join(10)
    last_line_at = lines[-1][0] if lines else end
    return LaunchResult(process.returncode, "".join(t for _, t in lines), end - start, end - last_line_at, lines)


_WARM: dict = {}  # this pytest process's warm launcher: its server, socket and environment (started once)
# Variables that the audit hook (tests/audit) and the helpers in tests/launched read at run time, after the
# imports: a launch that adds only these, and the audit hook's PYTHONPATH, can run warm. Not SIGTERM_ON_WRITE:
# a preemption's exit code and signals are the launcher's.
RUNTIME_ENV = {
    "WRITE_AUDIT_TARGET",
    "WRITE_AUDIT_LOG",
    "CRASH_ON_WRITE",
    "SLOW_ON_WRITE",
    "STEP_LOG",
    "FINISH_LOG",
    "FP16_INIT_SCALE",
    "FP16_BACKOFF_FACTOR",
    "LOCAL_LOSS_LOG",
}
AUDIT_PYTHONPATH = os.pathsep.join([str(AUDIT_HOOK_DIR), str(REPO)])
# Set by an import, to a fixed default, the first time a test in the pytest process imports the library (torch's;
# scikit-learn's and joblib's, seen turning the warm launcher off for the rest of a worker's tests).
SET_BY_IMPORTS = {"TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"}


def comparable(env: dict) -> dict:
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


def warm_launcher() -> dict | None:
    """The warm launcher of this pytest process, started at its first use; None where the suite's
    environment has changed since (a variable read at import time would be stale in its processes)."""
    if not _WARM:
        import atexit
        import tempfile

        path = os.path.join(tempfile.mkdtemp(prefix="warm-launch-"), "socket")
        env = launch_env()
        server = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "warm_launch.py"), path], env=env, stdout=subprocess.PIPE, text=True
        )
        assert server.stdout.readline().strip() == "ready", "the warm launcher did not start"
        atexit.register(server.kill)
        _WARM.update(server=server, path=path, env=comparable(env))
    now = comparable(launch_env())
    drift = {name for name in set(now) | set(_WARM["env"]) if now.get(name) != _WARM["env"].get(name)}
    drift -= SET_BY_IMPORTS
    if drift and not _WARM.get("said"):
        _WARM["said"] = True
        print(f"warm launcher off from here: the environment changed ({', '.join(sorted(drift))})", file=sys.stderr)
    return None if drift else _WARM


def warm_env(env: dict | None) -> dict | None:
    """What a launch with `env` adds to the warm launcher's environment, or None where a fresh interpreter
    is needed: a variable other than RUNTIME_ENV's might be read at import time, before the fork. SET_BY_IMPORTS
    are passed on as they are now: a fresh launch inherits what this process's imports have set since."""
    extra = dict(env or {})
    hooks = extra.pop("PYTHONPATH", None)
    if hooks not in (None, AUDIT_PYTHONPATH) or set(extra) - RUNTIME_ENV:
        return None
    extra = {**{k: v for k, v in os.environ.items() if k in SET_BY_IMPORTS}, **extra}
    return {**extra, "PYTHONPATH": hooks} if hooks else extra


def launch_warm(warm: dict, script, args, launcher_args: list, env: dict, timeout: float) -> LaunchResult | None:
    """`launch` through the warm launcher: its processes write to a pipe read here; a hang kills them.
    None where `accelerate launch` would not use torchrun on one machine (--cpu, DeepSpeed, several nodes)."""
    from warm_launch import request

    start = time.monotonic()
    read_end, write_end = os.pipe()
    startup = AUDIT_HOOK_DIR / "sitecustomize.py" if env.get("PYTHONPATH") else None
    connection = request(warm["path"], script, list(args), launcher_args, env, startup, REPO, write_end)
    os.close(write_end)
    answer = json.loads(connection.recv(4096))
    if "real" in answer:
        connection.close(), os.close(read_end)
        return None
    group = answer["pid"]
    lines: list[tuple[float, str]] = []

    def read():
        with open(read_end, encoding="utf-8", errors="replace") as stream:
            for line in stream:
                lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    connection.settimeout(timeout)
    try:
        answer = connection.recv(4096)
    except TimeoutError:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reader.join(5)
        raise AssertionError(f"launch hung for {timeout}s:\n" + "".join(text for _, text in lines[-60:])) from None
    finally:
        connection.close()
    returncode = json.loads(answer)["returncode"] if answer else -signal.SIGKILL  # empty: its launcher was killed
    end = time.monotonic()
    reader.join(10)
    last_line_at = lines[-1][0] if lines else end
    return LaunchResult(returncode, "".join(t for _, t in lines), end - start, end - last_line_at, lines, warm=True)


def assert_fails_cleanly(result: LaunchResult, expected: str, output_dir: Path) -> None:
    """Bad input: a non-zero exit within 60 s, the error on every rank, no output directory."""
    assert result.returncode != 0
    assert result.seconds < 60
    for rank in (0, 1):
        assert f"[rank {rank}] error:" in result.output, (
            f"rank {rank} did not report the error:\n{result.output[-3000:]}"
        )
    assert expected in result.output, result.output[-3000:]
    assert not output_dir.exists(), "bad input must not leave an output directory behind"
    assert_error_is_last(result, expected)


def assert_error_is_last(result: LaunchResult, expected: str) -> None:
    """The launcher's summary ends with the error line as its root cause (read from the failed
    process's error file), so the line holding `expected` is the last one but the closing rule."""
    assert not result.warm, "the last line is the launcher's: launch this run with real_launcher=True"
    lines = result.output.rstrip().splitlines()
    last = max((i for i, text in enumerate(lines) if expected in text), default=-1)
    assert last >= 0 and len(lines) - 1 - last <= 1, "the error is not the last line:\n" + "\n".join(lines[last:])


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
    """A test that leaves a variable in os.environ hands it to every later launch of its worker (and turns the warm
    launcher off for them): fail it, by name. monkeypatch.setenv/delenv undo theirs; a delenv of an unset variable
    does not undo what the code under test sets after it. What launch_env sets itself cannot leak (datasets' map
    leaves TOKENIZERS_PARALLELISM=false)."""
    before = comparable(launch_env())
    yield
    after = comparable(launch_env())
    leaked = {name for name in set(before) | set(after) if before.get(name) != after.get(name)} - SET_BY_IMPORTS
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
