"""Bugs that only show on GPUs and sharded runs, shown on a CPU wherever the cause can be:

- fp16's loss scaler skips the steps whose gradients overflow, at the start of every fp16 run: the
  run goes on (only a long run of skipped steps stops it), and N processes still train as one;
- a bf16 checkpoint trains in fp32 weights (AdamW on bf16 weights rounds small updates away) and is
  saved back in bf16;
- under DeepSpeed ZeRO-3, building a model is a collective, so every rank builds it together;
- weight-decay groups, the model fingerprint and the packing check do not read shapes that ZeRO-3
  has already partitioned away;
- a DeepSpeed config that would silently override --max_grad_norm is refused, and the log names
  the optimizer that really runs.
"""

import json
import re
import shutil

import numpy as np
import pytest
import torch

import ddp_utils
from conftest import (
    CPU_CONFIG,
    REPO,
    launch,
    make_tiny_causal_lm,
    make_tiny_model,
    sft_args,
    train_args,
    write_examples,
)
from ddp_utils import UsageError

TRAIN = REPO / "scripts" / "train.py"
TRAIN_SFT = REPO / "scripts" / "train_sft.py"
TRAIN_IMAGE = REPO / "scripts" / "train_image.py"
COLLECTIVE_MODEL_INIT = REPO / "tests" / "launched" / "collective_model_init.py"
FP16_SCALER = REPO / "tests" / "launched" / "fp16_scaler.py"


# --- 0. fp16: the steps the loss scaler skips -----------------------------------------------------


@pytest.fixture(scope="module")
def fp16_runs(tiny_model, tmp_path_factory):
    """The GPU's fp16 on the CPU (`tests/launched/fp16_scaler.py`): autocast to float16 and torch's
    loss scaler, starting at 2**40 and divided by 32 after each overflow, so that the first 5 steps
    overflow and are skipped in both layouts (2**40 ... 2**20 overflow; 2**15, where it settles, is
    a quarter of the first scale that overflows here). 600 examples, a constant learning rate: 300
    steps on 2 processes (a checkpoint every 40), and the first 40 of them on 1 process."""
    base = tmp_path_factory.mktemp("fp16")
    data = {
        "train": write_examples(base / "train.csv", 600, seed=1),
        "validation": write_examples(base / "validation.csv", 37, seed=2),
    }
    scaler = {"FP16_INIT_SCALE": str(2.0**40), "FP16_BACKOFF_FACTOR": str(1 / 32)}
    common = ["--lr_scheduler_type", "constant", "--logging_steps", 10, "--report_to", "none"]
    layouts = {
        "two_processes": (
            2,
            [4, "--max_train_steps", 300, "--checkpointing_steps", 40, "--checkpoints_total_limit", 9],
        ),
        "one_process": (1, [8, "--max_train_steps", 40, "--checkpointing_steps", "no"]),
    }
    runs = {}
    for name, (processes, (per_device, *extra)) in layouts.items():
        output_dir = base / name
        fp16 = ["--config_file", CPU_CONFIG, "--num_processes", processes, "--mixed_precision", "fp16"]
        args = train_args(tiny_model, data, output_dir, "--per_device_train_batch_size", per_device, *common, *extra)
        result = launch(FP16_SCALER, "train", *args, launcher_args=[str(a) for a in fp16], env=scaler)
        assert result.returncode == 0, result.output[-3000:]
        runs[name] = output_dir
    return runs


def training_records(output_dir):
    return [r for r in map(json.loads, open(output_dir / "train_log.jsonl")) if "train/loss" in r]


def test_an_fp16_run_skips_the_steps_that_overflow_and_goes_on(fp16_runs):
    """Before, the first skipped step's infinite gradient norm stopped every fp16 run at step 1."""
    from safetensors.numpy import load_file

    output_dir = fp16_runs["two_processes"]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 300 and metrics["optimizer_steps_skipped"] == 5
    windows = training_records(output_dir)
    assert [r["train/skipped_steps"] for r in windows] == [5] + [0] * 29, "the 5 overflows are the first steps"
    assert {r["train/loss_scale"] for r in windows} == {2.0**15}
    assert all(np.isfinite(r["train/grad_norm"]) for r in windows), "the mean norm of the steps applied"
    weights = load_file(str(output_dir / "model.safetensors"))
    assert all(np.isfinite(w).all() for w in weights.values())
    assert metrics["eval_loss"] < 0.6, "it learned: the loss of 3 balanced classes starts at ln 3 = 1.10"


def test_in_fp16_two_processes_train_as_one(fp16_runs, tiny_model):
    """The same steps skipped, the same losses, and at step 40 the same weights but for fp16's
    rounding of batches of 8 against 2 x 4: 0.9% of how far training moved them, measured (in
    fp32 the same comparison gives 0.001%; a rank that skipped alone, or a step scaled twice, 100%)."""
    from safetensors.numpy import load_file

    one, two = fp16_runs["one_process"], fp16_runs["two_processes"]
    windows = [
        [(r["step"], r["train/skipped_steps"], r["train/loss"]) for r in training_records(d) if r["step"] <= 40]
        for d in (one, two)
    ]
    assert [w[:2] for w in windows[0]] == [w[:2] for w in windows[1]] == [(10, 5), (20, 0), (30, 0), (40, 0)]
    np.testing.assert_allclose([w[2] for w in windows[0]], [w[2] for w in windows[1]], rtol=1e-4)
    reference = load_file(str(one / "model.safetensors"))
    other = load_file(str(two / "checkpoint-40" / "model.safetensors"))
    initial = {f"bert.{k}": v for k, v in load_file(str(tiny_model / "model.safetensors")).items()}
    keys = [k for k in initial if not k.endswith("key.bias")]  # its exact gradient is zero: see test_train.py
    moved = sum(float(np.sum((reference[k] - initial[k]) ** 2)) for k in keys) ** 0.5
    apart = sum(float(np.sum((reference[k] - other[k]) ** 2)) for k in keys) ** 0.5
    assert apart < 0.03 * moved, f"{apart / moved:.2%} of the movement"


@pytest.mark.fast
def test_skipped_steps_are_watched_only_in_a_long_run():
    """Under torch's loss scaler an infinite gradient norm is a skipped step: 29 in a row pass, and
    the 30th stops the run in one line once the scale is below 1 (before, a high first scale is
    still coming down); a non-finite loss still stops it at once, also after a run of skips. Under
    DeepSpeed's fp16 the engine's own flag tells a skipped step (its norm is the last applied one's).
    Without a scaler an infinite gradient norm stops the run, as before."""
    from types import SimpleNamespace

    from ddp_utils.core.errors import RunFailed
    from ddp_utils.training.nonfinite import MAX_SKIPPED_IN_A_ROW, NonFiniteWatch

    def watch(scale=None, deepspeed=False):
        state = SimpleNamespace(deepspeed_plugin=object() if deepspeed else None)
        accelerator = SimpleNamespace(device=torch.device("cpu"), state=state, mixed_precision="fp16", scaler=None)
        accelerator.optimizer_step_was_skipped = False
        if scale is not None:
            accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        return NonFiniteWatch(
            accelerator, SimpleNamespace(output_dir="/nonexistent", learning_rate=1e-4, max_grad_norm=1.0)
        )

    def stops(w):
        try:
            w.check(w.device_values()[None])
        except RunFailed as failure:
            return str(failure)
        return None

    loss, inf, one = torch.tensor(2.0), torch.tensor(float("inf")), torch.tensor(1.0)
    low = watch(scale=2.0**-14)
    for step in range(1, MAX_SKIPPED_IN_A_ROW):
        assert low.note(step, loss, inf)
    assert stops(low) is None
    assert not low.note(MAX_SKIPPED_IN_A_ROW, loss, one), "an applied step ends the run of skips"
    for step in range(MAX_SKIPPED_IN_A_ROW + 1, 2 * MAX_SKIPPED_IN_A_ROW + 1):
        low.note(step, loss, inf)
    low.note(2 * MAX_SKIPPED_IN_A_ROW + 1, torch.tensor(float("nan")), inf)
    assert re.match(
        r"fp16's loss scaler had skipped 30 or more optimizer steps in a row by step 60 \(the loss became NaN or "
        r"infinite later\): .* down to a loss scale of 2\^-14, so the weights have not changed .* bf16",
        stops(low),
    ), stops(low)

    high = watch(scale=2.0**40)  # a first scale far too high: 30 skips in a row only bring it to 2**10
    for step in range(1, 2 * MAX_SKIPPED_IN_A_ROW):
        high.note(step, loss, inf)
    assert stops(high) is None

    nan = watch(scale=2.0**16)
    nan.note(1, torch.tensor(float("nan")), inf)
    assert stops(nan).startswith("the loss became NaN or infinite at optimizer step 1,")

    deepspeed = watch(deepspeed=True)
    deepspeed.accelerator.optimizer_step_was_skipped = True
    assert deepspeed.note(1, loss, one), "DeepSpeed's flag, though its norm is finite"
    deepspeed.accelerator.optimizer_step_was_skipped = False
    assert not deepspeed.note(2, loss, inf) and stops(deepspeed) is None, "its norm is not watched under fp16"

    plain = watch()
    plain.accelerator.mixed_precision = "no"
    assert not plain.note(1, loss, inf)
    assert stops(plain).startswith("the gradient norm became NaN or infinite at optimizer step 1,")


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
    from ddp_utils.results.output import saved_dtype

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

    from ddp_utils.checkpoints.checkpoint import model_fingerprint
    from ddp_utils.training.optimizer import no_decay_parameter_names

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
    adapters_only = torch.nn.Linear(4, 4, bias=False)  # LoRA's trainable weights all take decay
    assert len(decay_groups(adapters_only)) == 1, "an empty group: ZeRO-3 drops it, and the schedule's steps failed"


@pytest.mark.fast
def test_the_packing_check_does_not_run_a_forward_pass_on_partitioned_weights(tiny_lm):
    from transformers import AutoModelForCausalLM

    from ddp_utils.language_models.causal_lm import packing_is_masked

    model = AutoModelForCausalLM.from_pretrained(tiny_lm)
    assert packing_is_masked(model) is True
    assert packing_is_masked(partition_like_zero3(model)) is None, (
        "no weights here to check with: no answer, not a crash"
    )


@pytest.mark.fast
def test_partitioned_low_precision_weights_are_refused_unless_deepspeed_keeps_fp32_masters(tiny_lm):
    """ZeRO-3 partitions the weights before `train_in_fp32` sees them, so it cannot cast them; with
    bf16/fp16 mixed precision DeepSpeed keeps fp32 master weights itself, otherwise the run would
    train bf16 weights and is refused. (A stand-in for the Accelerator: a unit test of the rule.)"""
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
    from ddp_utils.lifecycle.start import check_deepspeed_config

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

    from ddp_utils.training.optimizer import describe_optimizer

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
