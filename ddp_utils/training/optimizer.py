"""The optimizer side of a run: fp32 trainable weights, AdamW with decay groups chosen by name, the
learning-rate schedule, and saying which optimizer really runs. Nothing here communicates."""

from __future__ import annotations

import json
import re

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from ..core.errors import UsageError

logger = get_logger(__name__)


def train_in_fp32(accelerator: Accelerator, model) -> None:
    """Cast the trainable parameters of `model` to fp32 before `accelerator.prepare`; frozen ones
    (a LoRA base model) keep the checkpoint's dtype. Any rank may call it; every rank does.

    transformers 5 loads a checkpoint in its own dtype: a bf16 Hub model arrives as bf16, and
    AdamW on bf16 weights rounds updates below half a unit in the last place (about 0.4% of the
    weight) to nothing, so a fine-tuning learning rate of 2e-5 barely moves them. Mixed precision
    still computes in bf16 through autocast. The model's config keeps the checkpoint's dtype, and
    `save_model` saves in it by default.

    Under DeepSpeed with bf16 or fp16 mixed precision nothing is cast: DeepSpeed keeps fp32 master
    weights itself. Without it, parameters ZeRO-3 has already partitioned cannot be cast here, so
    a low-precision checkpoint is refused with the fix.
    """
    cast = [
        (name, p)
        for name, p in model.named_parameters()
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32
    ]
    if not cast or (accelerator.state.deepspeed_plugin is not None and accelerator.mixed_precision in ("bf16", "fp16")):
        return
    if any(hasattr(p, "ds_id") for _, p in cast):
        raise UsageError(
            f"this checkpoint's weights are {cast[0][1].dtype} and DeepSpeed ZeRO-3 has partitioned them, so they "
            "would train in that dtype (updates rounded away); set mixed_precision: bf16 in the launch config "
            "(DeepSpeed then keeps fp32 master weights)"
        )
    logger.info(f"{len(cast)} trainable parameter tensors cast from {cast[0][1].dtype} to float32 for training")
    for _, parameter in cast:
        parameter.data = parameter.data.float()


def make_adamw(model, learning_rate: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over `weight_decay_groups`, with torch's fused kernel: one kernel for all parameters
    instead of a Python loop over them (measured here on all-MiniLM-L6-v2, CPU: 13.5 ms per step
    against 99.5 ms for the default). Same update rule; the fused kernel runs on CPU and GPU.
    Under DeepSpeed's optimizer offload, Accelerate replaces it by DeepSpeedCPUAdam: the scripts
    log which optimizer runs (`describe_optimizer`)."""
    return torch.optim.AdamW(weight_decay_groups(model, weight_decay), lr=learning_rate, fused=True)


def make_lr_scheduler(optimizer, args, max_train_steps: int):
    """The learning-rate schedule over `max_train_steps` optimizer steps, from
    `transformers.get_scheduler`: --lr_scheduler_type (linear decay to 0 by default, cosine,
    constant_with_warmup, ...) after a warm-up of --warmup_steps, or --warmup_ratio of the steps, with
    --lr_scheduler_kwargs (`schedule_settings`).
    Build it before `accelerator.prepare`; the scripts step it once per optimizer step (see
    `start.make_accelerator`)."""
    from transformers import get_scheduler

    warmup = args.warmup_steps if args.warmup_steps is not None else round(args.warmup_ratio * max_train_steps)
    given = getattr(args, "lr_scheduler_kwargs", {})
    if given and args.lr_scheduler_type in ("constant", "constant_with_warmup"):  # get_scheduler drops them unread
        raise UsageError(f"--lr_scheduler_type {args.lr_scheduler_type} takes no --lr_scheduler_kwargs, got {given}")
    try:
        return get_scheduler(
            args.lr_scheduler_type,
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=max_train_steps,
            scheduler_specific_kwargs=schedule_settings(args.lr_scheduler_type, given, max_train_steps),
        )
    except (TypeError, ValueError) as exc:  # a setting the schedule does not take, or a value it refuses
        raise UsageError(
            f"--lr_scheduler_type {args.lr_scheduler_type} with --lr_scheduler_kwargs {json.dumps(given)}: {exc}"
        ) from None


def schedule_settings(schedule: str, given: dict, max_train_steps: int) -> dict:
    """--lr_scheduler_kwargs, with what two schedules cannot start without where it does not say: transformers'
    `cosine_with_min_lr` needs a floor (a tenth of the peak, as open-r1's recipes set it), `warmup_stable_decay` a
    decay length (the last tenth of the steps); without them `get_scheduler` raised before the first step."""
    settings = dict(given)
    if schedule == "cosine_with_min_lr" and "min_lr" not in settings:
        settings.setdefault("min_lr_rate", 0.1)
    if schedule == "warmup_stable_decay":
        settings.setdefault("num_decay_steps", max(1, round(0.1 * max_train_steps)))
    return settings


def weight_decay_groups(model, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: weight decay on weight matrices and embeddings, none on biases and
    normalisation weights.

    Chosen by name, as `transformers.Trainer` does, not by shape: under DeepSpeed ZeRO-3 every
    parameter is a flat, empty 1-D tensor by the time the optimizer is built, and a shape rule would
    put all of them in the no-decay group.

    An empty group is left out (LoRA's adapters all take decay): DeepSpeed ZeRO-3 drops it from the
    optimizer it builds, and the learning-rate schedule, built on the groups given, then failed at
    its first step ("zip() argument 2 is longer than argument 1").
    """
    no_decay = set(no_decay_parameter_names(model))
    parameters = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for name, p in parameters if name not in no_decay], "weight_decay": weight_decay},
        {"params": [p for name, p in parameters if name in no_decay], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


# transformers.Trainer's name patterns for parameters without weight decay (on the lower-cased name).
_NO_DECAY_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def no_decay_parameter_names(model) -> list[str]:
    """The names of the parameters that take no weight decay: those `transformers.Trainer` exempts
    by name (biases, "layernorm", "rmsnorm", "norm", "*_norm"), and every parameter of a
    normalisation layer, whatever its name (a module whose class name holds "Norm": LayerNorm,
    RMSNorm, BatchNorm2d, GroupNorm, ...; HF's ResNet calls its BatchNorm "normalization")."""
    names = []
    for module_name, module in model.named_modules():
        is_norm_layer = "norm" in type(module).__name__.lower()
        for name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if is_norm_layer or _NO_DECAY_NAMES.search(full.lower()):
                names.append(full)
    return names


def describe_optimizer(optimizer) -> str:
    """The optimizer that really runs, through the wrappers around it: e.g. "AdamW (fused)", or
    under DeepSpeed "DeepSpeedZeroOptimizer > DeepSpeedCPUAdam". For a log line after `prepare`."""
    chain = []
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        name = type(optimizer).__name__
        if name not in ("AcceleratedOptimizer", "DeepSpeedOptimizerWrapper"):
            fused = getattr(optimizer, "defaults", {}).get("fused")
            chain.append(f"{name} (fused)" if fused else name)
        optimizer = getattr(optimizer, "optimizer", None)
    return " > ".join(chain)
