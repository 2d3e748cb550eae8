"""QLoRA (--load_in_4bit) on CPU processes: bitsandbytes' CPU backend holds the base model's linear layers in 4-bit
NF4 as on a GPU, so the whole path runs here (only its CUDA kernels and speed do not). What users rely on:

- 2 processes and 1 process with 2 micro-batches train the same adapter on the 4-bit base, and a run resumed from a
  checkpoint (the adapter only; the base is quantized again) ends bit for bit as the uninterrupted one;
- --merge_lora merges the adapter into the checkpoint's own weights, not into their 4-bit rounding: the merged model
  loads without bitsandbytes, computes what the unquantized base with the adapter computes and keeps the base's
  generation_config.json;
- DPO and GRPO train on a 4-bit base too;
- a setting that cannot work is refused in one line: without --lora_r, under FSDP or DeepSpeed, without
  bitsandbytes.

The tiny model is 64 wide: bitsandbytes' CPU kernels quantize in blocks of 64 along a layer's input."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from conftest import (
    REPO,
    assert_error_is_last,
    assert_generation_config_kept,
    dpo_args,
    launch,
    load_script,
    make_tiny_causal_lm,
    sft_args,
    with_instruct_generation_config,
)

pytest.importorskip("bitsandbytes", reason="requirements-dev.txt installs it")

TRAIN_SFT = REPO / "scripts" / "train_sft.py"
STEPS = ["--max_train_steps", 4, "--checkpointing_steps", 2, "--lora_r", 4, "--load_in_4bit",
         "--eval_max_new_tokens", 4, "--report_to", "none"]  # fmt: skip


@pytest.fixture(scope="module")
def wide_lm(tmp_path_factory):
    """The suite's tiny Llama (its tokenizer and chat template), 64 wide."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = make_tiny_causal_lm(tmp_path_factory.mktemp("wide-llama"), chat_template=True)
    config = LlamaConfig.from_pretrained(directory)
    config.update(dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def adapter(output_dir) -> dict:
    return load_file(str(output_dir / "adapter_model.safetensors"))


def test_an_evaluation_leaves_the_4bit_bases_backward_pass_as_it_was(wide_lm):
    """On a CPU with AVX512-BF16 (this machine's), bitsandbytes repacked each 4-bit weight for inference at the
    first forward pass in eval mode, for good: every training step after the zero-shot evaluation ran a kernel
    without a backward pass, and the adapters learned from wrong gradients (0.10 off), silently. A CPU without
    AVX512-BF16 never repacks: there this passes either way."""
    from accelerate import Accelerator

    import ddp_utils

    Accelerator(cpu=True)
    args = load_script("train_sft").parse_args(
        ["--model_name_or_path", str(wide_lm), "--lora_r", "4", "--load_in_4bit", "--lora_dropout", "0"]
    )
    config, tokenizer, _ = ddp_utils.load_config_and_tokenizer(args)
    tokens = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]])

    def gradients(evaluate_first: bool) -> dict:
        model = ddp_utils.load_causal_lm(args, config, tokenizer)
        torch.manual_seed(0)
        with torch.no_grad():  # B is zero at the start: the gradients below it would be zero too
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=0.1)
        if evaluate_first:
            model.eval()
            with torch.no_grad():
                model(input_ids=tokens)
        model.train()
        model(input_ids=tokens, labels=tokens).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}

    before, after = gradients(False), gradients(True)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_layer_whose_weight_the_model_reads_directly_stays_unquantized(wide_lm, tmp_path):
    """Mamba's fused kernels (Jamba's too, with mamba_ssm on a GPU) read dt_proj's weight instead of calling the
    layer: quantized, they would have read packed bytes. It stays in the checkpoint's dtype, with the output layer,
    and the rest is 4-bit; the model trains. Without such layers transformers keeps its own choice."""
    import bitsandbytes as bnb
    from accelerate import Accelerator
    from model_families import HYBRIDS, save_with_tokenizer

    import ddp_utils

    Accelerator(cpu=True)
    config_class, model_class, extra = HYBRIDS["jamba"]
    wide = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, mamba_dt_rank=8)
    jamba = save_with_tokenizer((config_class, model_class, {**extra, **wide}), wide_lm, tmp_path / "jamba")
    args = load_script("train_sft").parse_args(["--model_name_or_path", str(jamba), "--lora_r", "4", "--load_in_4bit"])
    config, tokenizer, _ = ddp_utils.load_config_and_tokenizer(args)
    model = ddp_utils.load_causal_lm(args, config, tokenizer).get_base_model()
    kinds = {name: type(module) for name, module in model.named_modules()}
    assert kinds["model.layers.0.mamba.dt_proj"] is torch.nn.Linear and kinds["lm_head"] is torch.nn.Linear
    assert kinds["model.layers.0.mamba.in_proj.base_layer"] is bnb.nn.Linear4bit
    tokens = torch.tensor([[1, 5, 6, 7, 8, 9]])
    model.train()
    model(input_ids=tokens, labels=tokens).loss.backward()


def test_qlora_trains_the_same_adapter_on_any_layout_resumes_bit_for_bit_and_merges_unquantized(
    wide_lm, sft_data, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    two, one = tmp_path / "two", tmp_path / "one"
    instruct = with_instruct_generation_config(wide_lm, tmp_path / "instruct")  # merged/ keeps its generation_config
    run = launch(TRAIN_SFT, *sft_args(instruct, sft_data, two, *STEPS, "--per_device_train_batch_size", 2,
                                      "--merge_lora"))  # fmt: skip
    assert run.returncode == 0, run.output[-3000:]
    assert "QLoRA: the base model's linear layers in 4-bit NF4 (bitsandbytes)" in run.output
    args = sft_args(
        instruct, sft_data, one, *STEPS, "--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2
    )
    assert launch(TRAIN_SFT, *args, num_processes=1).returncode == 0
    ours, theirs = adapter(one), adapter(two)
    assert sorted(ours) == sorted(theirs) and len(ours) == 2 * 7 * 2  # 2 layers' 7 linear layers, A and B
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, atol=1e-6, err_msg=key)
    metrics = json.loads((two / "metrics.json").read_text())
    assert np.isfinite(metrics["eval_loss"]) and metrics["eval_examples"] == 7
    card = (two / "README.md").read_text()
    assert "- qlora" in card and "| `load_in_4bit` | True |" in card  # the card says the base was 4-bit

    resumed = tmp_path / "resumed"
    shutil.copytree(two / "checkpoint-2", resumed / "checkpoint-2")
    args = sft_args(instruct, sft_data, resumed, *STEPS, "--per_device_train_batch_size", 2, "--resume_from_checkpoint",
                    "latest")  # fmt: skip
    run = launch(TRAIN_SFT, *args)
    assert run.returncode == 0 and "resumed from" in run.output, run.output[-3000:]
    assert [key for key, value in adapter(resumed).items() if not np.array_equal(value, theirs[key])] == []
    unquantized = tmp_path / "unquantized"  # the same checkpoint resumed without --load_in_4bit: the flag is named
    shutil.copytree(two / "checkpoint-2", unquantized / "checkpoint-2")
    args = [arg for arg in args if arg != "--load_in_4bit"]
    run = launch(TRAIN_SFT, *[unquantized if arg == resumed else arg for arg in args])
    assert run.returncode != 0 and "load_in_4bit: checkpoint True, this run False" in run.output, run.output[-3000:]

    # The merged model: the checkpoint's fp32 weights plus the adapter, loaded without a quantization config.
    assert "quantization_config" not in json.loads((two / "merged" / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(two / "merged").eval()
    expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(wide_lm), two).merge_and_unload().eval()
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    assert_generation_config_kept(two / "merged")
    tokens = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, expected(tokens).logits, rtol=1e-5, atol=1e-5)


def test_dpo_and_grpo_train_on_a_4bit_base(wide_lm, pairs, tmp_path):
    from test_grpo import grpo_args, write_prompts

    quantized = ["--lora_r", 4, "--load_in_4bit"]
    run = launch(REPO / "scripts" / "train_dpo.py", *dpo_args(wide_lm, pairs, tmp_path / "dpo", *quantized,
                                                              "--max_train_steps", 2))  # fmt: skip
    assert run.returncode == 0 and "QLoRA" in run.output, run.output[-3000:]
    args = grpo_args(wide_lm, write_prompts(tmp_path), tmp_path / "grpo", *quantized, "--max_train_steps", 2)
    run = launch(REPO / "scripts" / "train_grpo.py", *args)
    assert run.returncode == 0 and "QLoRA" in run.output, run.output[-3000:]
    for name in ("dpo", "grpo"):
        assert all(np.isfinite(value).all() for value in adapter(tmp_path / name).values()), name


def test_load_in_4bit_is_refused_in_one_line_where_it_cannot_work(wide_lm, sft_data, tmp_path, monkeypatch):
    """Without --lora_r (4-bit weights cannot train), under FSDP (each rank would hold the base whole: it shards
    weights instead), and without bitsandbytes installed."""
    import importlib.util

    from ddp_utils import UsageError

    with pytest.raises(
        UsageError, match=r"--load_in_4bit trains LoRA adapters on a 4-bit base \(QLoRA\): give --lora_r"
    ):
        load_script("train_sft").parse_args(["--model_name_or_path", str(wide_lm), "--load_in_4bit"])

    config = REPO / "accelerate_configs" / "fsdp.yaml"
    launcher = [str(a) for a in ("--config_file", config, "--num_processes", 2, "--mixed_precision", "no")]
    args = sft_args(wide_lm, sft_data, tmp_path / "fsdp", *STEPS)
    run = launch(
        REPO / "tests" / "launched" / "fsdp_on_cpu.py", "train_sft", *args, launcher_args=launcher, real_launcher=True
    )
    assert run.returncode != 0 and all(f"[rank {rank}] error: --load_in_4bit" in run.output for rank in (0, 1))
    assert_error_is_last(run, "--load_in_4bit runs under DDP or one process: each GPU holds the 4-bit base whole")

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # as `accelerate launch` sets it for a ZeRO config
    with pytest.raises(UsageError, match="each GPU holds the 4-bit base whole, and DEEPSPEED shards weights instead"):
        load_script("train_sft").parse_args(["--model_name_or_path", str(wide_lm), "--lora_r", "4", "--load_in_4bit"])
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(UsageError, match="--load_in_4bit needs bitsandbytes: pip install bitsandbytes"):
        load_script("train_sft").parse_args(["--model_name_or_path", str(wide_lm), "--lora_r", "4", "--load_in_4bit"])
