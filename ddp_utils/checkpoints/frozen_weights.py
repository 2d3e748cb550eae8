"""A LoRA run's checkpoints hold what it trains, not its frozen base. Each checkpoint held every weight, the
frozen base included: for an 8B model in bf16, 16 GB written (and hashed for the manifest) at every checkpoint,
where the adapter and its optimizer state are about 0.5 GB; DeepSpeed ZeRO-2 wrote the base twice (its module
state, and the frozen weights again for its own reader). The frozen weights are now left out and read again
from --model_name_or_path when the run resumes; a digest of them is saved with the checkpoint, so a resume on
other base weights is refused, not trained on silently.

Under DDP and on one process, Accelerate's save and load hooks leave them out of its model file; under
DeepSpeed, DeepSpeed's own `exclude_frozen_parameters`; under FSDP2, hooks on the model's own `state_dict` and
`load_state_dict`, active only while a checkpoint is written or read (Accelerate passes FSDP no option to leave
weights out from `save_state`, and the final save needs every weight). FSDP's checkpoints were written whole
before: for a 70B base in bf16, 140 GB at every checkpoint. A checkpoint saved whole still loads."""

from __future__ import annotations

import contextlib
import hashlib
import os

from accelerate.utils import DistributedType, gather_object
from accelerate.utils.constants import MODEL_NAME, SAFE_MODEL_NAME

FROZEN_DIGEST = "frozen_weights"  # the key of the digest in a checkpoint's trainer state
SAMPLED = 1024  # values read from each frozen tensor for the digest: evenly spaced, the first included
# True while a checkpoint is written or read (`leaving_out_frozen`): the FSDP hooks act only then. A module's flag,
# not a context variable, which a thread started inside would not see: a state dict built in a worker thread would
# then hold the base again, and its load fail on the missing frozen weights.
_in_a_checkpoint = False


def frozen_parameter_names(model) -> set[str]:
    """The names of `model`'s parameters that take no gradient, tied ones under each of their names."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def frozen_digest(model) -> str | None:
    """All ranks call this (under FSDP a gather): a digest of the frozen parameters, their names, dtypes and shapes,
    and SAMPLED evenly spaced values of each. Another base model (a base against its instruct version, a fine-tune
    of it) or another dtype differs in nearly every value; the same one read again gives the same digest, on any
    device. A sample, not every value: an edit of a few rows (a revision that fixes some token embeddings) can pass
    unseen. None when nothing is frozen. Reads about 300,000 values for an 8B model.

    Under FSDP each rank holds a shard of each weight and reads the sampled values that fall in it, put together
    with the other ranks' (one gather), so the digest is the same on any number of processes, and the same as one
    process's. Elsewhere no communication; under ZeRO-3, of this rank's partitions."""
    frozen = sorted(
        ((name.replace("_orig_mod.", "").removeprefix("module."), p)
         for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad),
        key=lambda named: named[0],
    )  # fmt: skip
    if not frozen:
        return None
    samples = [_sampled_values(p) for _, p in frozen]  # (first place, values) of what this rank holds
    if any(_is_dtensor(p) for _, p in frozen):  # the same on every rank: FSDP shards every weight
        held_by_rank = gather_object([samples])
        samples = [_put_together(parts) for parts in zip(*held_by_rank)]
    digest = hashlib.sha1()
    for (name, p), (_, values) in zip(frozen, samples):
        digest.update(f"{name} {p.dtype} {tuple(getattr(p, 'ds_shape', p.shape))}".encode())
        digest.update(values.tobytes())
    return digest.hexdigest()[:16]


def _is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _sampled_values(p):
    """All ranks call this for a weight sharded another way than by rows (`full_tensor`, a gather), each on its own
    shard: (k, values), the digest's sampled values of weight `p` that this rank holds, as float32, the first of them
    the k-th sampled. The samples are `flat[::step][:SAMPLED]` of the weight flattened; under FSDP this rank
    holds a block of rows (FSDP2 shards dim 0), the places from its first row's to its last's. No communication,
    except for a weight sharded another way, which is gathered whole (every rank does the same). Always a copy:
    `.numpy()` of a CPU weight's own storage fixes its size, and FSDP2 could no longer free a weight gathered whole
    (its root's, after a pass without gradients: DPO's precomputed reference with LoRA stopped at its first step)."""
    import torch

    whole = getattr(p, "ds_tensor", p).detach()  # ZeRO-3: this rank's partition, sampled as the whole
    step = max(1, whole.numel() // SAMPLED)
    if not _is_dtensor(whole):
        return 0, whole.reshape(-1)[::step][:SAMPLED].to("cpu", torch.float32, copy=True).numpy()
    [chunk] = whole.__create_chunk_list__()  # this rank's block: its offset and size in each dim
    if tuple(chunk.sizes[1:]) != tuple(whole.shape[1:]):  # not whole rows: not FSDP2's default sharding
        return 0, whole.full_tensor().reshape(-1)[::step][:SAMPLED].to("cpu", torch.float32, copy=True).numpy()
    local = whole.to_local().reshape(-1)
    start = chunk.offsets[0] * (whole.numel() // max(1, whole.shape[0]))  # its first value's place in the whole
    count = min(SAMPLED, -(-whole.numel() // step))  # how many places the whole has sampled
    first, end = -(-start // step), min(count, -(-(start + local.numel()) // step))
    values = local[first * step - start :: step][: max(0, end - first)]
    return first, values.to("cpu", torch.float32, copy=True).numpy()


def _put_together(parts):
    """One weight's sampled values from the (first place, values) of every rank, in order: (0, values)."""
    import numpy as np

    by_place = {}
    for first, values in parts:  # a replicated shard (HSDP) gives the same places twice
        by_place.update(zip(range(first, first + len(values)), values))
    return 0, np.array([by_place[place] for place in sorted(by_place)], dtype=np.float32)


def checkpoint_trainable_weights_only(accelerator, model) -> str | None:
    """All ranks call this, once, after `prepare` (under FSDP a gather, in `frozen_digest`): have
    `accelerator.save_state` leave `model`'s frozen parameters out of each checkpoint and
    `accelerator.load_state` load what it holds over the frozen weights already loaded, when some parameters
    are frozen (LoRA, --lora_last_layers): under DDP and on one process through Accelerate's hooks, under
    DeepSpeed and FSDP through `leaving_out_frozen` (and under FSDP hooks on `model`). Returns the frozen
    weights' digest, to be saved with each checkpoint and matched on resume (under ZeRO-3, of the main process's
    partitions: DeepSpeed resumes on as many processes only); None where checkpoints stay whole (nothing frozen,
    or FSDP1)."""
    if (
        accelerator.distributed_type == DistributedType.FSDP
        and getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) != 2
    ):
        return None  # FSDP1's state dicts are built under its own contexts: its checkpoints stay whole
    digest = frozen_digest(model)
    if digest is None:
        return None
    if accelerator.distributed_type == DistributedType.FSDP:
        _leave_out_of_state_dicts_in_a_checkpoint(model)
    elif accelerator.distributed_type != DistributedType.DEEPSPEED:
        accelerator.register_save_state_pre_hook(_leave_out_frozen)
        accelerator.register_load_state_pre_hook(_load_over_frozen)
    return digest


@contextlib.contextmanager
def leaving_out_frozen(accelerator, run_state: dict, loading: bool):
    """The context to call `accelerator.save_state` (or `load_state`, `loading`) in, giving the keyword
    arguments to call it with, in a run whose checkpoints leave the frozen weights out (its state, or the identity
    it expects, holds their digest): under DeepSpeed, its `save_checkpoint(exclude_frozen_parameters=True)` and a
    load that takes a module state without them (the digest is matched before); under FSDP, the model's hooks
    act within it; elsewhere none (Accelerate's hooks do it). No communication."""
    if FROZEN_DIGEST not in run_state:
        yield {}
        return
    kwargs = {}
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        kwargs = {"load_module_strict": False} if loading else {"exclude_frozen_parameters": True}
    global _in_a_checkpoint
    before, _in_a_checkpoint = _in_a_checkpoint, True
    try:
        yield kwargs
    finally:
        _in_a_checkpoint = before


def _leave_out_of_state_dicts_in_a_checkpoint(model) -> None:
    """Hooks on `model` (FSDP2) that, while a checkpoint is written or read (`leaving_out_frozen`), leave the
    frozen parameters out of its `state_dict` (Accelerate's FSDP2 save and load build theirs from it, sharded or
    whole, so the checkpoint holds, and the load reads, the trained weights only) and out of what
    `load_state_dict` reports missing (the frozen weights stay as loaded from --model_name_or_path). No
    communication."""
    frozen = frozen_parameter_names(model)

    def leave_out(module, state_dict, prefix, local_metadata):
        if _in_a_checkpoint:
            for name in frozen:
                state_dict.pop(prefix + name, None)

    def not_missing(module, incompatible_keys):
        if _in_a_checkpoint:
            incompatible_keys.missing_keys[:] = [key for key in incompatible_keys.missing_keys if key not in frozen]

    model.register_state_dict_post_hook(leave_out)
    model.register_load_state_dict_post_hook(not_missing)


def _leave_out_frozen(models, weights, output_dir) -> None:
    """Accelerate's hook before it writes the models' state dicts (`weights`, in place): without the frozen
    parameters, nor a 4-bit weight's quantization state (QLoRA: `<weight>.absmax`, ..., quantized again at the
    resume). Buffers stay (BatchNorm's statistics change in training). Each stays an OrderedDict, of which
    Accelerate drops a tied weight's second name before safetensors, which refuses shared tensors."""
    for index, (model, state_dict) in enumerate(zip(models, weights)):
        frozen = frozen_parameter_names(model)
        parts = tuple(f"{name}." for name in frozen)
        weights[index] = type(state_dict)(
            (key, value) for key, value in state_dict.items() if key not in frozen and not key.startswith(parts)
        )


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
