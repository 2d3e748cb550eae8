"""LoRA and QLoRA for train.py's text classifiers (--lora_r, --load_in_4bit), and LoRA for train_image.py's image
classifiers: adapters on the pretrained body, and the head the task adds (BERT's and ViT's classifier, Llama's score,
BART's and T5's classification_head, DeBERTa's pooler with its classifier) trained whole, with no adapter: it is new,
drawn at random, and a low-rank update of random weights would learn little. Under QLoRA the head stays unquantized. A
7B classifier does not fit one GPU with every weight training (AdamW: 16 bytes a weight); with LoRA it does, and under
QLoRA an 8B base takes about 6 GB instead of bf16's 16 (by count). Every rank calls these functions on its own
model."""

from __future__ import annotations

from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..training.activation_checkpointing import tracks_running_statistics
from ..training.pretrained import build_from_config, checkpoint_weight_names
from .lora import add_lora, linears_returning_several, linears_used_by_weight
from .quantized import four_bit_loading, is_4bit, keep_4bit_backward_on_cpu

logger = get_logger(__name__)

PEFT_HEADS = ("classifier", "score")  # what peft's sequence classification trains whole, whatever it is given


def classifier_head(model) -> list[str]:
    """The modules of a sequence classifier that train whole under LoRA: those whose weights its checkpoint did not
    hold (`fsdp.load_pretrained` records them: a new head, a pooler a masked LM's checkpoint lacks, a head of
    another shape), each named by its full path, the outermost whose weights are all new. Adapted instead, a random
    weight would stay random and frozen, and be missing from the saved adapter: the model reloaded from it computed
    something else. A module inside one that peft trains whole anyway (`PEFT_HEADS`) is named by that one: nested,
    peft's two copies left the inner one without a gradient. Without the record (a model not loaded by
    `load_pretrained`), the modules beside its pretrained body."""
    new = getattr(model, "weights_not_in_checkpoint", None)
    if new is None:
        return beside_body(model)
    new, found = set(new), []
    for name, module in model.named_modules():
        weights = [f"{name}.{key}" if name else key for key, _ in module.named_parameters()]
        if name and weights and set(weights) <= new:
            parts = name.split(".")
            peft_head = next((i for i, part in enumerate(parts) if part.endswith(PEFT_HEADS)), None)  # as peft matches
            found.append(".".join(parts[: peft_head + 1]) if peft_head is not None else name)
    return [name for name in dict.fromkeys(found) if not any(name.startswith(f"{outer}.") for outer in found)]


def beside_body(model) -> list[str]:
    """The modules a classifier holds beside its pretrained body (the child its class names `base_model_prefix`:
    bert, model, transformer, ...), those with weights: the head its task adds. A model whose body is not found is
    a UsageError: LoRA could not tell what is new from what is pretrained."""
    body = getattr(model, "base_model_prefix", "")
    children = dict(model.named_children())
    if body not in children:
        raise UsageError(
            f"{type(model).__name__} holds no body named {body!r} (its base_model_prefix) beside its head, so --lora_r "
            f"cannot tell the new head from the pretrained weights (its parts: {sorted(children)}); train it whole, "
            "without --lora_r"
        )
    return [name for name, module in children.items() if name != body and next(module.parameters(), None) is not None]


def classifier_4bit_loading(args, model_class, config) -> dict:
    """The `from_pretrained` keyword arguments that load a classifier's body in 4-bit NF4 (`four_bit_loading`),
    left unquantized: the modules beside the body, those whose weights the checkpoint lacks (a masked LM's missing
    pooler, which loading would leave as a 4-bit layer never quantized: the first forward failed), and the layers
    whose weight the model reads directly (`causal_lm.layers_read_directly`); {} without --load_in_4bit. Found on a
    skeleton built on the meta device and the checkpoint's weight names (`checkpoint_weight_names`): no weight read."""
    if not getattr(args, "load_in_4bit", False):
        return {}
    from accelerate import init_empty_weights
    from transformers.quantizers.base import get_keys_to_not_convert

    with init_empty_weights(include_buffers=False):
        skeleton = build_from_config(model_class, config, {"trust_remote_code": args.trust_remote_code})
    held = checkpoint_weight_names(args.model_name_or_path)
    if held is not None:
        body = f"{skeleton.base_model_prefix}."
        names = [name for name, _ in skeleton.named_parameters()]
        missing = [name for name in names if name not in held and name.removeprefix(body) not in held]
        # More than a few missing: the checkpoint names its weights otherwise (Gemma 3's language_model.model.* for
        # model.language_model.*, renamed at loading), not a body left out; kept whole, it would not be 4-bit.
        in_body = [name for name in names if name.startswith(body)]
        if len([name for name in missing if name.startswith(body)]) <= max(2, len(in_body) // 10):
            skeleton.weights_not_in_checkpoint = missing
    kept = {*beside_body(skeleton), *classifier_head(skeleton), *linears_used_by_weight(skeleton)}
    kept |= {*linears_returning_several(skeleton), *get_keys_to_not_convert(skeleton)}
    return four_bit_loading(args, sorted(kept))


def add_classifier_lora(model, args):
    """All ranks call this (under ZeRO-3 peft gathers the weights it copies for the modules trained whole): `model`
    (a text or image classifier) with LoRA adapters on its pretrained body and its new modules trained whole
    (`classifier_head`), or `model` as it is without --lora_r. Under QLoRA, the CPU's 4-bit kernels are kept to those
    with a backward pass. A model with BatchNorm is refused in one line (`refuse_batchnorm`)."""
    if not args.lora_r:
        return model
    whole = tuple(classifier_head(model))
    refuse_batchnorm(model, whole)
    if is_4bit(model):
        keep_4bit_backward_on_cpu(model)
    # peft's sequence classifier passes input_ids on; an image classifier is a plain PeftModel, its inputs as given
    task_type = None if getattr(model, "main_input_name", "") == "pixel_values" else "SEQ_CLS"
    model = add_lora(model, args, task_type=task_type, whole=whole)
    model.is_lora_classifier = True  # saved with the classifier's config beside the adapter (results.output)
    return model


def refuse_batchnorm(model, whole: tuple) -> None:
    """Refuse LoRA on a model with BatchNorm outside the modules trained whole (ResNet, EfficientNet, MobileNet,
    RegNet, LeViT, MobileViT): frozen, each one still moves its running statistics in training, and those are not in
    the adapter, so the base and the adapter reloaded would normalise with the checkpoint's statistics, not the ones
    the run evaluated with. No communication."""
    found = [
        name
        for name, module in model.named_modules()
        if tracks_running_statistics(module) and not any(name == w or name.startswith(f"{w}.") for w in whole)
    ]
    if found:
        raise UsageError(
            f"--lora_r: {type(model).__name__} has BatchNorm ({len(found)} layers, e.g. {found[0]}), whose running "
            "statistics move in training but are not saved in a LoRA adapter; train it whole, without --lora_r"
        )
