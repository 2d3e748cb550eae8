"""LoRA merged into the base weights: `save_with_merged` saves the adapter and, with --merge_lora, the merged model
(a collective, like `save_model`; under FSDP and DeepSpeed a CPU copy is merged on the main process), and
`merged_for_generation` merges the adapters for sampling where memory allows."""

from __future__ import annotations

import contextlib
import os

import torch
from accelerate.logging import get_logger

from ..checkpoints.write_failure import agree_on_write
from ..core.sharded import is_sharded
from ..results.output import gathered_state_dict, save_model, saved_dtype, write_pretrained
from ..training.zero3_loading import built_whole, zero3_enabled
from .lora import wrap_in_peft
from .multimodal import image_processors
from .quantized import is_4bit, merged_unquantized

logger = get_logger(__name__)


def save_with_merged(accelerator, model, args, tokenizer) -> None:
    """All ranks call this (`save_model` is a collective under FSDP and DeepSpeed): save the model
    to --output_dir, with LoRA as its adapter; with --merge_lora also the adapter merged into the
    base weights in `merged/`, a full model that loads as the checkpoint did, without peft. A model
    that also reads images is saved with the checkpoint's image processor. Unsharded, the merge
    changes the model in place: it computes the same afterwards, without LoRA layers. Under FSDP and
    DeepSpeed the main process merges a CPU copy built from the gathered weights (under ZeRO-3 with
    `zero3_save_16bit_model: true`, as our config has it)."""
    # A model that also reads images is saved with its image processor; only the main process writes.
    images = image_processors(accelerator.unwrap_model(model), args) if accelerator.is_main_process else ()
    processors = (*images, tokenizer)
    save_model(accelerator, model, args.output_dir, *processors, dtype=args.save_dtype)
    if not args.merge_lora:
        return
    merged_dir = os.path.join(args.output_dir, "merged")
    unwrapped = accelerator.unwrap_model(model)
    if is_4bit(unwrapped):  # QLoRA: merged into the checkpoint's weights, read again unquantized
        source, remote_code = args.model_name_or_path, args.trust_remote_code
        _write_merged_on_main(accelerator, lambda: merged_unquantized(unwrapped, source, remote_code), merged_dir,
                              processors, args)  # fmt: skip
        return
    if not is_sharded(accelerator):
        merged = unwrapped.merge_and_unload()
        save_model(accelerator, merged, merged_dir, *processors, dtype=args.save_dtype)
        return
    state_dict = gathered_state_dict(accelerator, model)  # all ranks: the whole model, on the main process
    _write_merged_on_main(accelerator, lambda: merged_copy(unwrapped, state_dict), merged_dir, processors, args)


def _write_merged_on_main(accelerator, build, merged_dir: str, processors: tuple, args) -> None:
    """All ranks call this (`agree_on_write`): the main process builds the merged model (`build()`, on its CPU)
    and writes it to `merged_dir`; a failure there is reported on every rank, in one line."""
    error = None
    if accelerator.is_main_process:
        try:
            merged = build()
            write_pretrained(
                merged, merged.state_dict(), merged_dir, *processors, dtype=saved_dtype(merged, args.save_dtype)
            )
        except Exception as exc:  # reported on every rank by agree_on_write
            error = exc
    agree_on_write(accelerator, error, f"the merged model to {merged_dir!r}", args.output_dir)


def merged_copy(peft_model, state_dict: dict):
    """A CPU copy of `peft_model` holding `state_dict` (its whole weights, gathered from the shards),
    with the adapter merged into the base weights: built with empty weights, then given those. One
    process calls it; no communication."""
    import copy as copying

    from accelerate import init_empty_weights

    base = peft_model.get_base_model()
    whole = built_whole() if zero3_enabled() else contextlib.nullcontext()  # not built in ZeRO-3's shards
    with whole, init_empty_weights(include_buffers=False):  # buffers computed as usual (rotary frequencies)
        copy = wrap_in_peft(type(base)._from_config(base.config), peft_model.peft_config["default"])
    copy.load_state_dict(state_dict, strict=True, assign=True)
    copy.get_base_model().tie_weights()  # assign=True unties shared weights; the config says which are tied
    merged = copy.merge_and_unload()
    if getattr(base, "generation_config", None) is not None:  # a classifier has none
        merged.generation_config = copying.deepcopy(base.generation_config)  # the checkpoint's, not config.json's
    return merged


MERGED_SHARE = 8  # the merged copies take at most 1/8 of the GPU's memory: else sampling stays unmerged


@contextlib.contextmanager
def merged_for_generation(accelerator, model):
    """`model` (unwrapped) generates with each LoRA layer merged: the layer runs one matmul, as the merged model
    does, instead of about six operators per call (on a GPU a small model's decoding is bound by launches: GRPO's
    generation dispatched 43% fewer, bench/README.md "GRPO's generation"). The merged weight is a new tensor swapped
    in for the base weight's data and swapped back out on exit, so the base weights end bit for bit as they were
    (peft's unmerge subtracts again, which rounds). Only where it computes the same: fp32 base weights (bf16 would
    round a young adapter's small update away), plain LoRA on a weight that is whole (not under FSDP or ZeRO-3) and
    not tied to another, with room for the copies on a GPU (`MERGED_SHARE`). No communication."""
    layers = mergeable_lora_layers(accelerator, model)
    swapped = []
    try:
        with torch.no_grad():
            for layer, adapter in layers:
                weight = layer.get_base_layer().weight
                original = weight.data
                weight.data = original + layer.get_delta_weight(adapter).to(original.dtype)
                layer.merged_adapters.append(adapter)  # peft's forward now calls the base layer alone
                swapped.append((layer, adapter, weight, original))
        yield
    finally:
        for _, _, weight, original in swapped:  # every weight back first, whatever peft's state became
            weight.data = original
        for layer, adapter, _, _ in swapped:
            if adapter in layer.merged_adapters:
                layer.merged_adapters.remove(adapter)


def mergeable_lora_layers(accelerator, model) -> list:
    """(layer, its adapter) for each of `model`'s LoRA linear layers that `merged_for_generation` can merge; none
    where the copies would not fit. No communication."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # no peft: no LoRA
        return []
    if accelerator.distributed_type.value == "FSDP" or zero3_enabled():
        return []
    names = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        names[id(parameter)] = names.get(id(parameter), 0) + 1
    layers = []
    for layer in model.modules():
        if not isinstance(layer, LoraLinear) or layer.merged or layer.disable_adapters:
            continue
        active = [adapter for adapter in layer.active_adapters if adapter in layer.lora_A]
        weight = getattr(layer.get_base_layer(), "weight", None)
        plain = len(active) == 1 and active[0] not in layer.lora_variant and not layer.lora_bias.get(active[0])
        frozen_fp32 = (
            isinstance(weight, torch.nn.Parameter) and weight.dtype == torch.float32 and not weight.requires_grad
        )
        if plain and frozen_fp32 and names[id(weight)] == 1:
            layers.append((layer, active[0]))
    size = sum(layer.get_base_layer().weight.nbytes for layer, _ in layers)
    device = accelerator.device
    if device.type == "cuda" and size > torch.cuda.get_device_properties(device).total_memory / MERGED_SHARE:
        return []
    return layers
