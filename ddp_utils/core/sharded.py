"""Is the model's weights split over the ranks? The one test of it, for the places that must act
differently then: saving (the weights are gathered), generating (every rank steps together),
merging LoRA, the out-of-memory back-off. A leaf module: it imports nothing of ddp_utils."""

from __future__ import annotations

SHARDED_TYPES = ("FSDP", "DEEPSPEED")  # Accelerate's distributed types that split the weights over the ranks


def is_sharded(accelerator) -> bool:
    """True under FSDP or DeepSpeed (any ZeRO stage: at least the optimizer state is split, and
    `accelerator.get_state_dict` is a collective). No communication."""
    return accelerator.distributed_type.value in SHARDED_TYPES
