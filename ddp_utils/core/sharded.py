"""Is the model's weights split over the ranks? The one test of it, for the places that must act
differently then: saving (the weights are gathered), generating (every rank steps together),
merging LoRA, the out-of-memory back-off; and how many weights a parameter holds, split or packed.
A leaf module: it imports nothing of ddp_utils."""

from __future__ import annotations

SHARDED_TYPES = ("FSDP", "DEEPSPEED")  # Accelerate's distributed types that split the weights over the ranks


def is_sharded(accelerator) -> bool:
    """True under FSDP or DeepSpeed (any ZeRO stage: at least the optimizer state is split, and
    `accelerator.get_state_dict` is a collective). No communication."""
    return accelerator.distributed_type.value in SHARDED_TYPES


def weight_count(parameter) -> int:
    """How many weights `parameter` holds: under ZeRO-3 its whole count, not this rank's partition; in 4-bit its
    count unpacked, not its bytes (half of it: a QLoRA base read as half its size)."""
    quantized = getattr(parameter, "quant_state", None)
    if quantized is not None:
        return quantized.shape.numel()
    return getattr(parameter, "ds_numel", parameter.numel())
