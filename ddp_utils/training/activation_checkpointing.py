"""Activation checkpointing: each transformer layer's activations recomputed in the backward pass instead of kept,
by transformers' own per-layer checkpointing (non-reentrant), for `--gradient_checkpointing` and for a launch
config's `fsdp_activation_checkpointing: true` alike.

Accelerate 1.15's FSDP2 path would apply the config's option its own way: it wraps each layer in torch's
`checkpoint_wrapper` with `preserve_rng_state=False`. Measured on 2 CPU processes (tests/test_fsdp.py):

- the recomputation draws other dropout masks than the forward pass drew, so the gradients are not those of the
  loss: a BERT with dropout 0.1 ended 0.031 from the same run without checkpointing, which should change nothing;
- the wrapper renames every parameter of a wrapped layer (`_checkpoint_wrapped_module`): a LoRA run saved an empty
  adapter, and reported success.

`fix_fsdp2_preparation` therefore turns Accelerate's off and calls `checkpoint_for_fsdp` on the model instead: each
of transformers' layer blocks checkpointed (the decoder or encoder layers: the classes FSDP wraps by default),
dropout's random state kept for the recomputation, the names unchanged. No communication.
"""

from __future__ import annotations

import torch
from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..core.sharded import weight_count

logger = get_logger(__name__)


def checkpoint_activations(model, offload: bool = False) -> None:
    """Turn on transformers' activation checkpointing in `model` (a transformers model), non-reentrant, with the
    activations kept for the recomputation in host memory if `offload` and there is an accelerator to offload from.
    Raises ValueError where the model has none."""
    kwargs = {"use_reentrant": False}
    # Without an accelerator the activations are in host memory already, and transformers 5.23 would ask for pinned
    # memory, which a CPU-only torch refuses at the first forward pass.
    offload = offload and torch.accelerator.current_accelerator() is not None
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.2x's name; the old one warns
        offloading = {"offload": True} if offload else {}  # a remote-code model's own method may not take it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **offloading)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    checkpoint_innermost_only(model)
    drop_input_require_grads(model)  # now: a second enable (peft's) would orphan transformers' hook


def checkpoint_innermost_only(model) -> None:
    """Where checkpointed layers nest, recompute each weight once: both on, the outer layer's recomputation ran the
    inner ones' forward again inside their own backward (Swin's stage and its layers: 3 passes a step, not 2). An
    outer layer whose inner ones hold nearly all its weights (Swin's stage: all but its downsampling) stops
    checkpointing; one that holds much beside them (Zamba's hybrid layer: its shared attention beside its checkpointed
    mamba layer) stays checkpointed whole, and the inner ones stop. No communication."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for outer in [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]:
        inner = [m for m in outer.modules() if m is not outer and isinstance(m, GradientCheckpointingLayer)]
        if not inner or not outer.gradient_checkpointing:
            continue
        held = sum(weight_count(p) for layer in inner for p in layer.parameters())  # numel(): 0 under ZeRO-3
        if held >= 0.9 * sum(weight_count(p) for p in outer.parameters()):
            outer.gradient_checkpointing = False
        else:
            for layer in inner:
                layer.gradient_checkpointing = False


def checkpoint_if_asked(model, args) -> None:
    """--gradient_checkpointing: each of `model`'s layers (a transformers model) recomputes its activations in the
    backward pass instead of keeping them (`checkpoint_activations`), dropout's masks drawn again as in the forward
    pass. A model that transformers cannot checkpoint, or whose checkpointed layers hold BatchNorm
    (`refuse_uncheckpointable`), is refused in one line. Call it before adding LoRA. No communication."""
    if not getattr(args, "gradient_checkpointing", False):
        return
    refuse_uncheckpointable(model, "--gradient_checkpointing", "drop it, or lower --per_device_train_batch_size")
    checkpoint_activations(model)
    logger.info("gradient checkpointing: each layer's activations recomputed in the backward pass")


def checkpoint_for_fsdp(model, offload: bool = False) -> None:
    """Checkpoint `model`'s layers (a transformers model, or a peft model around one) where the launch config asks
    FSDP for activation checkpointing (with `offload`: `fsdp_activation_checkpointing_offload`), unless
    `--gradient_checkpointing` already did without offloading. A model that transformers cannot checkpoint is
    refused in one line."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    checkpointing = getattr(base, "is_activation_checkpointing", None)  # transformers 5.2x's name
    if checkpointing is None:
        checkpointing = getattr(base, "is_gradient_checkpointing", False)
    if checkpointing and not offload:
        return
    option = "the launch config's fsdp_activation_checkpointing"
    refuse_uncheckpointable(base, option, "set fsdp_activation_checkpointing: false in it")
    checkpoint_activations(base, offload=offload)
    logger.info(
        "FSDP2: fsdp_activation_checkpointing checkpoints each layer as --gradient_checkpointing does, with "
        "transformers' own checkpointing: Accelerate's wrapper would recompute with other dropout masks and "
        "rename the layers' weights",
        main_process_only=True,
    )


def tracks_running_statistics(module) -> bool:
    """Whether `module` is a BatchNorm (any: 1d to 3d, lazy, synchronised) that updates running statistics."""
    return isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats


def refuse_uncheckpointable(model, option: str, fix: str) -> None:
    """Refuse, in one line naming `option` and the `fix`, to checkpoint a model that transformers cannot checkpoint,
    or whose checkpointed layers (transformers' GradientCheckpointingLayer; the whole model where it has none) hold
    BatchNorm: recomputed in the backward pass, each one would update its running statistics a second time every
    step (MobileViT's: `num_batches_tracked` 2 a step, the running means moved twice), and the saved model would
    normalise with other statistics than training's. No communication."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    name = type(model).__name__
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UsageError(
            f"{option}: {name} cannot recompute its activations in transformers (it does not support gradient "
            f"checkpointing); {fix}"
        )
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)] or [model]
    if any(tracks_running_statistics(m) for layer in layers for m in layer.modules()):
        raise UsageError(
            f"{option}: {name}'s checkpointed layers hold BatchNorm, whose running statistics the recomputation "
            f"would update a second time every step; {fix}"
        )


def drop_input_require_grads(model) -> None:
    """Remove the hook that transformers and peft each put on the input embeddings to make their output require
    grad, where every checkpointed layer checkpoints non-reentrantly (as `checkpoint_activations` enables it): only
    reentrant checkpointing needs it. It computes the gradient of layer 0's input for nothing, carries the backward
    pass through every layer under --lora_last_layers, and breaks --torch_compile's graph at every call
    (`requires_grad_` on an intermediate). A model whose own code checkpoints otherwise (transformers' old format,
    remote code, which may call torch's checkpoint itself, reentrant by default) keeps it."""
    if any(type(m).__module__.startswith("transformers_modules") for m in model.modules()):  # --trust_remote_code
        return
    funcs = [
        getattr(m, "_gradient_checkpointing_func", None)
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False) is True
    ]
    if funcs and all(getattr(f, "keywords", {}).get("use_reentrant") is False for f in funcs):
        model.disable_input_require_grads()
