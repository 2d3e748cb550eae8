"""The text families users bring (`model_families.TEXT_FAMILIES`: MoEs with fused experts, MLA, attention sinks,
NoPE layers, linear attention and Mamba hybrids, learned positions, ALiBi, ...), each through the LLM scripts on 2
processes: SFT with LoRA (a checkpoint, --merge_lora) and full, DPO and GRPO under DDP; SFT with LoRA resumed from a
checkpoint under FSDP, bit for bit; GRPO under ZeRO-3. About 17 minutes here, so not in `make test`: `make
test-families` runs it (the first sweep found five faults, each now tested on its own in the suite: the MoE experts'
dropout, MiniMax's cache, ZeRO-3 with Mamba mixers and with peft's parameter wrappers)."""

import os
import shutil

import numpy as np
import pytest
from model_families import TEXT_FAMILIES, save_with_tokenizer
from safetensors.numpy import load_file

from conftest import REPO, dpo_args, launch, make_tiny_causal_lm, sft_args

pytestmark = pytest.mark.skipif(not os.environ.get("FAMILY_SWEEP"), reason="make test-families runs it (17 minutes)")

CONFIGS = REPO / "accelerate_configs"
HARNESS = {"fsdp": ("fsdp_on_cpu.py", "fsdp.yaml"), "zero3": ("deepspeed_on_cpu.py", "deepspeed_zero3.yaml")}
STEPS = ["--max_train_steps", 4, "--per_device_train_batch_size", 2, "--report_to", "none"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tiny_causal_lm(tmp_path_factory.mktemp("llama"), chat_template=True)


def family_model(family, tokenizer_dir, directory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config_class, model_class, extra = TEXT_FAMILIES[family]
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=None,
               max_position_embeddings=128)  # fmt: skip
    return save_with_tokenizer((config_class, model_class, {**ids, **extra}), tokenizer_dir, directory)


def run(script, *args, sharded=None, num_processes=2):
    if sharded is None:
        return launch(REPO / "scripts" / f"{script}.py", *args, num_processes=num_processes, timeout=600)
    harness, config = HARNESS[sharded]
    launcher = ["--config_file", str(CONFIGS / config), "--num_processes", "2", "--mixed_precision", "no"]
    return launch(REPO / "tests" / "launched" / harness, script, *args, launcher_args=launcher, timeout=600)


def ok(result):
    assert result.returncode == 0, result.output[-3000:]


@pytest.mark.parametrize("family", list(TEXT_FAMILIES))
def test_every_script_trains_the_family_under_ddp_fsdp_and_zero3(family, tokenizer_dir, sft_data, pairs, tmp_path):
    from test_grpo import grpo_args, write_prompts

    model = family_model(family, tokenizer_dir, tmp_path / family)
    lora = ["--lora_r", 4, *STEPS]
    ok(
        run(
            "train_sft",
            *sft_args(model, sft_data, tmp_path / "lora", *lora, "--checkpointing_steps", 2, "--merge_lora"),
        )
    )
    ok(run("train_sft", *sft_args(model, sft_data, tmp_path / "full", *STEPS)))
    ok(run("train_dpo", *dpo_args(model, pairs, tmp_path / "dpo", *lora)))
    prompts = write_prompts(tmp_path)
    ok(run("train_grpo", *grpo_args(model, prompts, tmp_path / "grpo", "--max_train_steps", 2)))

    whole, resumed = tmp_path / "fsdp", tmp_path / "fsdp-resumed"
    ok(run("train_sft", *sft_args(model, sft_data, whole, *lora, "--checkpointing_steps", 2), sharded="fsdp"))
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    args = sft_args(model, sft_data, resumed, *lora, "--checkpointing_steps", 2, "--resume_from_checkpoint", "latest")
    ok(run("train_sft", *args, sharded="fsdp"))
    ours, theirs = (load_file(str(d / "adapter_model.safetensors")) for d in (resumed, whole))
    assert [key for key in theirs if not np.array_equal(ours[key], theirs[key])] == [], "not bit for bit"

    ok(run("train_grpo", *grpo_args(model, prompts, tmp_path / "zero3", "--max_train_steps", 2), sharded="zero3"))
