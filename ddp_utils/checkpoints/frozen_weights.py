"""A LoRA run's checkpoints hold what it trains, not its frozen base. Each checkpoint held every weight, the
frozen base included: for an 8B model in bf16, 16 GB written (and hashed for the manifest) at every checkpoint,
where the adapter and its optimizer state are about 0.5 GB; DeepSpeed ZeRO-2 wrote the base twice (its module
state, and the frozen weights again for its own reader). The frozen weights are now left out and read again
from --model_name_or_path when the run resumes; a digest of them is saved with the checkpoint, so a resume on
other base weights is refused, not trained on silently.

Under DDP and on one process, Accelerate's save and load hooks leave them out of its model file; under
DeepSpeed, DeepSpeed's own `exclude_frozen_parameters`. FSDP checkpoints stay whole: each rank writes its own
shard, and Accelerate passes FSDP no such option. A checkpoint saved whole (before this) still loads."""

from __future__ import annotations

import hashlib
import os

from accelerate.utils import DistributedType
from accelerate.utils.constants import MODEL_NAME, SAFE_MODEL_NAME

FROZEN_DIGEST = "frozen_weights"  # the key of the digest in a checkpoint's trainer state
SAMPLED = 1024  # values read from each frozen tensor for the digest: evenly spaced, the first included


def frozen_parameter_names(model) -> set[str]:
    """The names of `model`'s parameters that take no gradient, tied ones under each of their names."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def frozen_digest(model) -> str | None:
    """A digest of the frozen parameters: their names, dtypes and shapes, and SAMPLED evenly spaced values of
    each. Another base model (a base against its instruct version, a fine-tune of it) or another dtype differs
    in nearly every value; the same one read again gives the same digest, on any device. A sample, not every
    value: an edit of a few rows (a revision that fixes some token embeddings) can pass unseen. None when
    nothing is frozen. Reads about 300,000 values for an 8B model. No communication."""
    import torch

    frozen = sorted(
        ((name.replace("_orig_mod.", "").removeprefix("module."), p)
         for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad),
        key=lambda named: named[0],
    )  # fmt: skip
    if not frozen:
        return None
    digest = hashlib.sha1()
    for name, p in frozen:
        flat = getattr(p, "ds_tensor", p).detach().reshape(-1)  # ZeRO-3: this rank's partition
        sample = flat[:: max(1, flat.numel() // SAMPLED)][:SAMPLED].to("cpu", torch.float32)
        digest.update(f"{name} {p.dtype} {tuple(getattr(p, 'ds_shape', p.shape))}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def checkpoint_trainable_weights_only(accelerator, model) -> str | None:
    """Have `accelerator.save_state` leave `model`'s frozen parameters out of each checkpoint and
    `accelerator.load_state` load what it holds over the frozen weights already loaded, when some parameters
    are frozen (LoRA, --lora_last_layers), except under FSDP: under DDP and on one process through Accelerate's
    hooks, under DeepSpeed through `state_kwargs`. Returns the frozen weights' digest, to be saved with each
    checkpoint and matched on resume (under ZeRO-3, of the main process's partitions: DeepSpeed resumes on as
    many processes only); None where checkpoints stay whole. Call it on every rank, once, after `prepare`; no
    communication (each rank registers its own hooks)."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return None
    digest = frozen_digest(model)
    if digest is not None and accelerator.distributed_type != DistributedType.DEEPSPEED:
        accelerator.register_save_state_pre_hook(_leave_out_frozen)
        accelerator.register_load_state_pre_hook(_load_over_frozen)
    return digest


def state_kwargs(accelerator, run_state: dict, loading: bool) -> dict:
    """The keyword arguments for `accelerator.save_state` (or `load_state`, `loading`) in a run whose
    checkpoints leave the frozen weights out (its state, or the identity it expects, holds their digest):
    under DeepSpeed, its `save_checkpoint(exclude_frozen_parameters=True)` and a load that takes a module state
    without them (the digest is matched before); elsewhere none (the hooks do it). No communication."""
    if FROZEN_DIGEST not in run_state or accelerator.distributed_type != DistributedType.DEEPSPEED:
        return {}
    return {"load_module_strict": False} if loading else {"exclude_frozen_parameters": True}


def _leave_out_frozen(models, weights, output_dir) -> None:
    """Accelerate's hook before it writes the models' state dicts (`weights`, in place): without the frozen
    parameters. Buffers stay (BatchNorm's statistics change in training). Each stays an OrderedDict, of which
    Accelerate drops a tied weight's second name before safetensors, which refuses shared tensors."""
    for index, (model, state_dict) in enumerate(zip(models, weights)):
        frozen = frozen_parameter_names(model)
        weights[index] = type(state_dict)((key, value) for key, value in state_dict.items() if key not in frozen)


def _load_over_frozen(models, input_dir) -> None:
    """Accelerate's hook before it loads the models' files: loads each one here, where a file without the
    frozen parameters is complete, and takes the models off Accelerate's list (`models`, in place). A file
    that lacks a trained weight, or holds one this model has not, raises (the checkpoint's own)."""
    import torch
    from safetensors.torch import load_file

    for index, model in enumerate(models):
        ending = f"_{index}" if index else ""
        path = os.path.join(input_dir, f"{SAFE_MODEL_NAME}{ending}.safetensors")
        if os.path.exists(path):
            state_dict = load_file(path)
        else:
            path = os.path.join(input_dir, f"{MODEL_NAME}{ending}.bin")
            state_dict = torch.load(path, map_location="cpu", weights_only=True)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        named = dict(model.named_parameters(remove_duplicate=False))
        loaded = {id(named[key]) for key in state_dict if key in named}  # a tied weight is saved under one name
        absent = sorted(key for key in set(missing) - frozen_parameter_names(model) if id(named.get(key)) not in loaded)
        if absent or unexpected:
            raise ValueError(
                f"{os.path.basename(path)} does not fit this model: it lacks {absent[:3]} and holds {unexpected[:3]}"
            )
    models.clear()
