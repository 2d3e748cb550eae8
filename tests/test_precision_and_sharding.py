"""Bugs that only show on GPUs and sharded runs, shown on a CPU wherever the cause can be:

- a bf16 checkpoint trains in fp32 weights (AdamW on bf16 weights rounds small updates away) and is
  saved back in bf16;
- under DeepSpeed ZeRO-3, building a model is a collective, so every rank builds it together;
- weight-decay groups, the model fingerprint and the packing check do not read shapes that ZeRO-3
  has already partitioned away;
- a DeepSpeed config that would silently override --max_grad_norm is refused, and the log names
  the optimizer that really runs.
"""

import json
import shutil

import numpy as np
import pytest
import torch

import ddp_utils
from conftest import REPO, launch, make_tiny_causal_lm, make_tiny_model, sft_args, train_args
from ddp_utils import UsageError

TRAIN = REPO / "scripts" / "train.py"
TRAIN_SFT = REPO / "scripts" / "train_sft.py"
TRAIN_IMAGE = REPO / "scripts" / "train_image.py"
COLLECTIVE_MODEL_INIT = REPO / "tests" / "launched" / "collective_model_init.py"


# --- 1. bf16 checkpoints train in fp32 ------------------------------------------------------------


@pytest.fixture(scope="module")
def same_model_in_bf16_and_fp32(tmp_path_factory):
    """A tiny Llama whose weights are exactly representable in bf16, saved once in bf16 and once
    in fp32: the same starting point, two checkpoint dtypes."""
    from transformers import AutoModelForCausalLM

    base = tmp_path_factory.mktemp("dtypes")
    source = make_tiny_causal_lm(base / "source")
    model = AutoModelForCausalLM.from_pretrained(source).to(torch.bfloat16)
    directories = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        model.to(dtype).save_pretrained(base / name)
        for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / tokenizer_file, base / name / tokenizer_file)
        directories[name] = base / name
    return directories


def test_a_bf16_checkpoint_trains_like_the_fp32_one_and_is_saved_in_bf16(
    same_model_in_bf16_and_fp32, sft_data, tmp_path
):
    """Full fine-tuning at the usual learning rate of 2e-5, 2 processes, 12 optimizer steps.
    Measured before the fix: the bf16 run moved 21% of the weights (the fp32 run 43%), and agreed
    with the fp32 run cast to bf16 on 62% of them; its small updates were rounded away."""
    from safetensors.torch import load_file

    saved, outputs = {}, {}
    for name, model_dir in same_model_in_bf16_and_fp32.items():
        output_dir = tmp_path / name
        result = launch(
            TRAIN_SFT,
            *sft_args(
                model_dir,
                sft_data,
                output_dir,
                "--learning_rate",
                2e-5,
                "--num_train_epochs",
                2,
                "--per_device_train_batch_size",
                2,
                "--report_to",
                "none",
            ),
            num_processes=2,
        )
        assert result.returncode == 0, result.output[-4000:]
        saved[name], outputs[name] = load_file(str(output_dir / "model.safetensors")), result.output
        # Saved in the checkpoint's own dtype, and config.json says so (from_pretrained reads it).
        assert (
            json.loads((output_dir / "config.json").read_text())["dtype"]
            == {"bf16": "bfloat16", "fp32": "float32"}[name]
        )
        assert {tensor.dtype for tensor in saved[name].values()} == {
            {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
        }
    assert "trainable parameter tensors cast from torch.bfloat16 to float32" in outputs["bf16"]
    assert "cast from" not in outputs["fp32"]

    initial = load_file(str(same_model_in_bf16_and_fp32["bf16"] / "model.safetensors"))
    fp32_as_bf16 = {key: value.to(torch.bfloat16) for key, value in saved["fp32"].items()}
    changed = {
        name: np.mean([(weights[key].to(torch.bfloat16) != initial[key]).float().mean().item() for key in initial])
        for name, weights in (("bf16", saved["bf16"]), ("fp32", fp32_as_bf16))
    }
    assert changed["bf16"] > 0.3 and changed["fp32"] > 0.3, f"both runs must move most weights: {changed}"
    agree = np.mean([(saved["bf16"][key] == fp32_as_bf16[key]).float().mean().item() for key in initial])
    assert agree > 0.999, (
        f"the bf16 run must equal the fp32 run up to the final cast; they agree on {agree:.1%} of the weights"
    )


@pytest.mark.fast
def test_lora_keeps_the_frozen_base_in_the_checkpoint_dtype_and_trains_the_adapter_in_fp32(tmp_path):
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    source = make_tiny_causal_lm(tmp_path / "m")
    AutoModelForCausalLM.from_pretrained(source).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert model.dtype == torch.bfloat16, "transformers 5 loads a bf16 checkpoint as bf16 when no dtype is given"
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    ddp_utils.train_in_fp32(Accelerator(cpu=True), model)
    trainable = {name: p.dtype for name, p in model.named_parameters() if p.requires_grad}
    frozen = {name: p.dtype for name, p in model.named_parameters() if not p.requires_grad}
    assert trainable and set(trainable.values()) == {torch.float32}
    assert frozen and set(frozen.values()) == {torch.bfloat16}, "the frozen base is not copied to fp32"
    from ddp_utils.output import saved_dtype

    assert saved_dtype(model) is None, "a LoRA adapter is saved as trained"
    assert saved_dtype(model.merge_and_unload()) == torch.bfloat16, "a merged model in the checkpoint's dtype"
    assert saved_dtype(model, "float16") == torch.float16


# --- 2. ZeRO-3: building a model is a collective --------------------------------------------------


@pytest.mark.parametrize("script", ["train", "train_sft", "train_image"])
def test_every_rank_builds_the_model_at_the_same_time(script, tiny_model, tiny_data, tiny_lm, sft_data, tmp_path):
    """Under ZeRO-3 (zero3_init_flag) transformers builds models inside deepspeed.zero.Init, whose
    broadcasts are collectives. Built inside load_on_main_first, the main process would build alone
    while the other ranks wait in a broadcast: a deadlock until the timeout. The test double makes
    model building an all-reduce; the scripts must build on every rank at once."""
    output_dir = tmp_path / "out"
    common = ["--max_train_steps", 2, "--checkpointing_steps", "no", "--report_to", "none", "--ddp_timeout", 30]
    if script == "train":
        args = train_args(tiny_model, tiny_data, output_dir, *common)
    elif script == "train_sft":
        args = sft_args(tiny_lm, sft_data, output_dir, "--packing", *common)
    else:  # the offline demo: a ResNet built from its config, on scikit-learn's digits
        args = ["--output_dir", output_dir, "--max_train_samples", 64, "--max_eval_samples", 32, *common]
    result = launch(COLLECTIVE_MODEL_INIT, REPO / "scripts" / f"{script}.py", *args, num_processes=2, timeout=120)
    assert result.returncode == 0, result.output[-4000:]
    assert json.loads((output_dir / "metrics.json").read_text())["optimizer_steps"] == 2
    assert "optimizer: AdamW (fused)" in result.output, "the log names the optimizer that runs"


# --- 3. what ZeRO-3 partitioning hides: shapes ---------------------------------------------------


def partition_like_zero3(model):
    """What a model looks like once deepspeed.zero.Init has partitioned it: every parameter an
    empty 1-D tensor, its full shape in `ds_shape`, an id in `ds_id`."""
    for i, parameter in enumerate(model.parameters()):
        parameter.ds_shape, parameter.ds_id = parameter.shape, i
        parameter.data = torch.empty(0, dtype=parameter.dtype)
    return model


def decay_groups(model):
    return [[id(p) for p in group["params"]] for group in ddp_utils.make_adamw(model, 1e-3, 0.01).param_groups]


@pytest.mark.fast
def test_weight_decay_groups_and_fingerprint_do_not_depend_on_shapes(tmp_path):
    """Under ZeRO-3 a shape rule (ndim < 2: no decay) would exempt every weight from decay."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        ResNetConfig,
        ResNetForImageClassification,
    )

    from ddp_utils.checkpoint import model_fingerprint
    from ddp_utils.optimizer import no_decay_parameter_names

    models = {
        "llama": lambda: AutoModelForCausalLM.from_pretrained(make_tiny_causal_lm(tmp_path / "llama")),
        "bert": lambda: AutoModelForSequenceClassification.from_pretrained(
            make_tiny_model(tmp_path / "bert"), num_labels=3
        ),
        "resnet": lambda: ResNetForImageClassification(
            ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])
        ),
    }
    for name, build in models.items():
        model = build()
        by_shape = {n for n, p in model.named_parameters() if p.ndim < 2}
        assert set(no_decay_parameter_names(model)) == by_shape, f"{name}: biases and norm weights, and nothing else"
        groups, fingerprint = decay_groups(model), model_fingerprint(model)
        assert groups[0] and groups[1]
        partitioned = partition_like_zero3(model)
        assert decay_groups(partitioned) == groups, (
            f"{name}: the groups must not change once the weights are partitioned"
        )
        assert model_fingerprint(partitioned) == fingerprint, f"{name}: the fingerprint reads the full shapes"
    resnet = models["resnet"]()
    assert any(".normalization." in n for n in no_decay_parameter_names(resnet)), (
        "HF's ResNet names its BatchNorm 'normalization'"
    )


@pytest.mark.fast
def test_the_packing_check_does_not_run_a_forward_pass_on_partitioned_weights(tiny_lm):
    from transformers import AutoModelForCausalLM

    from ddp_utils.causal_lm import packing_is_masked

    model = AutoModelForCausalLM.from_pretrained(tiny_lm)
    assert packing_is_masked(model) is True
    assert packing_is_masked(partition_like_zero3(model)) is None, (
        "no weights here to check with: no answer, not a crash"
    )


@pytest.mark.fast
def test_partitioned_low_precision_weights_are_refused_unless_deepspeed_keeps_fp32_masters(tiny_lm):
    """ZeRO-3 partitions the weights before `train_in_fp32` sees them, so it cannot cast them; with
    bf16/fp16 mixed precision DeepSpeed keeps fp32 master weights itself, otherwise the run would
    train bf16 weights and is refused. (A stand-in for the Accelerator: DeepSpeed is not installed.)"""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    def accelerator(deepspeed, mixed_precision):
        return SimpleNamespace(
            state=SimpleNamespace(deepspeed_plugin=object() if deepspeed else None), mixed_precision=mixed_precision
        )

    model = partition_like_zero3(AutoModelForCausalLM.from_pretrained(tiny_lm, dtype=torch.bfloat16))
    ddp_utils.train_in_fp32(accelerator(deepspeed=True, mixed_precision="bf16"), model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}, "DeepSpeed's own fp32 masters: nothing to cast"
    for mixed_precision in ("no", "bf16"):
        deepspeed = (
            mixed_precision == "no"
        )  # DeepSpeed without mixed precision, or partitioned weights without DeepSpeed
        with pytest.raises(UsageError, match="partitioned them.*set mixed_precision: bf16"):
            ddp_utils.train_in_fp32(accelerator(deepspeed, mixed_precision), model)


# --- 4. DeepSpeed options that would override the script in silence ------------------------------


def deepspeed_config(**options):
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(zero_stage=2, **options).deepspeed_config  # builds without the deepspeed package


@pytest.mark.fast
def test_deepspeed_gradient_clipping_must_agree_with_max_grad_norm():
    from ddp_utils.start import check_deepspeed_config

    config = deepspeed_config(gradient_clipping=1.0, gradient_accumulation_steps=1)
    check_deepspeed_config(config, gradient_accumulation_steps=1, max_grad_norm=1.0)
    with pytest.raises(
        UsageError,
        match=r"clips gradients at 1.0, the script at --max_grad_norm 0.5.*"
        r"set deepspeed_config.gradient_clipping to 0.5",
    ):
        check_deepspeed_config(config, gradient_accumulation_steps=1, max_grad_norm=0.5)
    # "auto": Accelerate would fill in 1.0 whatever the script says; the script's value goes in first.
    for max_grad_norm in (0.5, 0.0):
        config = deepspeed_config()
        assert config["gradient_clipping"] == "auto"
        check_deepspeed_config(config, gradient_accumulation_steps=1, max_grad_norm=max_grad_norm)
        assert config["gradient_clipping"] == max_grad_norm
    with pytest.raises(UsageError, match="accumulates 4 micro-batches per step, the script 1"):
        check_deepspeed_config(
            deepspeed_config(gradient_accumulation_steps=4), gradient_accumulation_steps=1, max_grad_norm=1.0
        )


@pytest.mark.fast
def test_describe_optimizer_names_the_optimizer_that_really_runs():
    """Under DeepSpeed's optimizer offload, Accelerate swaps our fused AdamW for DeepSpeedCPUAdam;
    the scripts log what runs after `prepare` (a real run logs "optimizer: AdamW (fused)", checked
    in test_every_rank_builds_the_model_at_the_same_time)."""
    from accelerate import Accelerator

    from ddp_utils.optimizer import describe_optimizer

    class DeepSpeedCPUAdam:
        defaults = {"lr": 1e-4}

    class DeepSpeedZeroOptimizer:  # what DeepSpeed's engine holds: its ZeRO optimizer around the base one
        optimizer = DeepSpeedCPUAdam()

    class DeepSpeedOptimizerWrapper:  # Accelerate's wrapper around the engine's optimizer
        optimizer = DeepSpeedZeroOptimizer()

    assert describe_optimizer(DeepSpeedOptimizerWrapper()) == "DeepSpeedZeroOptimizer > DeepSpeedCPUAdam"
    model = torch.nn.Linear(2, 2)
    prepared = Accelerator(cpu=True).prepare(ddp_utils.make_adamw(model, 1e-3, 0.0))
    assert describe_optimizer(prepared) == "AdamW (fused)"
