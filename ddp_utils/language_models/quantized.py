"""QLoRA (--load_in_4bit): the base model's linear layers held in 4-bit NF4 by bitsandbytes, double-quantized, with
LoRA adapters training in fp32 on top, as the QLoRA paper and TRL, axolotl and torchtune do it. Each process holds
its own 4-bit copy on its own GPU (DDP, or one process); FSDP and DeepSpeed shard the weights instead and are refused
with it. The merged model (--merge_lora) is the adapter merged into the checkpoint's own weights, read again
unquantized on the main process: merged into the 4-bit weights, the update would be rounded to NF4's 16 levels."""

from __future__ import annotations

import importlib.util
import os

import torch
from accelerate.logging import get_logger
from accelerate.state import AcceleratorState, PartialState

from ..core.errors import UsageError
from ..results.output import unquantized_config
from .lora import wrap_in_peft

logger = get_logger(__name__)

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # else fp32, as the rest of the step


SHARDED = (
    "--load_in_4bit runs under DDP or one process: each GPU holds the 4-bit base whole, and {} shards weights "
    "instead; use a DDP launch config, or drop --load_in_4bit"
)


def check_4bit_args(args) -> None:
    """Refuse --load_in_4bit where it cannot work, while parsing, before any data is prepared: without LoRA,
    without bitsandbytes, under a launch config for FSDP or DeepSpeed (`four_bit_loading` checks the last again).
    Every rank calls it; no communication."""
    if not getattr(args, "load_in_4bit", False):
        return
    if not args.lora_r:
        raise UsageError("--load_in_4bit trains LoRA adapters on a 4-bit base (QLoRA): give --lora_r as well")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UsageError("--load_in_4bit needs bitsandbytes: pip install bitsandbytes")
    for variable, kind in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED")):
        if os.environ.get(variable, "").lower() in ("1", "true", "yes"):  # what `accelerate launch` sets
            raise UsageError(SHARDED.format(kind))


def four_bit_loading(args, kept: list[str] | None = None) -> dict:
    """The `from_pretrained` keyword arguments that load the base in 4-bit NF4 on this process's device, or {}
    without --load_in_4bit; `kept`: the layers left in the checkpoint's dtype (else transformers' choice, the output
    layer). Refused in one line, on every rank, under FSDP or DeepSpeed however they were set up (`check_4bit_args`
    refused the rest). Any rank may call it; every rank does, in `load_causal_lm`. No communication."""
    if not getattr(args, "load_in_4bit", False):
        return {}
    state = AcceleratorState()
    if state.distributed_type.value in ("FSDP", "DEEPSPEED"):
        raise UsageError(SHARDED.format(state.distributed_type.value))
    from transformers import BitsAndBytesConfig

    compute = COMPUTE_DTYPES.get(state.mixed_precision, torch.float32)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,  # the scales quantized too: about 0.4 bits a weight saved
        bnb_4bit_compute_dtype=compute,
        llm_int8_skip_modules=kept,  # bitsandbytes' name for the layers not quantized, 4-bit too
    )
    logger.info(f"QLoRA: the base model's linear layers in 4-bit NF4 (bitsandbytes), computing in {compute}")
    # quantized on the device it trains on: Accelerate refuses to move a 4-bit model afterwards
    return {"quantization_config": quantization, "device_map": {"": PartialState().device}}


def keep_4bit_backward_on_cpu(model) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes 0.50 repacks a 4-bit weight for inference at the first forward pass
    in eval mode (the zero-shot evaluation), for good; the training steps after it then ran a kernel without a
    backward pass, and the adapters below it learned from wrong gradients (measured: 0.10 off), silently. Kept off:
    the CPU then computes as a GPU does. Any rank may call it."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def is_4bit(model) -> bool:
    """Whether `model` (peft's or transformers', unwrapped) holds 4-bit weights."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "is_loaded_in_4bit", False))


def merged_unquantized(peft_model, model_name_or_path: str, trust_remote_code: bool = False):
    """A CPU copy of the checkpoint `peft_model` was quantized from, read again in its own dtype, with the trained
    adapter merged into those weights: a full model that loads without bitsandbytes. The main process calls it, at
    the end, with the checkpoint's size free in CPU memory. No communication."""
    import copy as copying

    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    base = peft_model.get_base_model()
    config = unquantized_config(base.config)
    adapter = peft_model.peft_config["default"]
    classifier = {"ignore_mismatched_sizes": True} if adapter.task_type == "SEQ_CLS" else {}  # a head of other labels
    unquantized = type(base).from_pretrained(
        model_name_or_path, config=config, device_map={"": "cpu"}, trust_remote_code=trust_remote_code, **classifier
    )
    copy = wrap_in_peft(unquantized, copying.deepcopy(adapter))
    trained = {key: value.detach().to("cpu") for key, value in get_peft_model_state_dict(peft_model).items()}
    result = set_peft_model_state_dict(copy, trained)
    missing = [key for key in getattr(result, "missing_keys", ()) if "lora_" in key]
    if getattr(result, "unexpected_keys", None) or missing:  # else a layer would be merged with its untrained adapter
        raise RuntimeError(
            f"the adapter's weights do not fit the unquantized model: {result.unexpected_keys[:3]} have no place "
            f"there, {missing[:3]} were not trained"
        )
    return copy.merge_and_unload()  # with the generation_config.json that from_pretrained read
