"""The output directory and the model saved in it: only the main process writes, nothing is left
half-written, and a write that fails is reported on every rank in one line (`write_failure.py`)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from ..checkpoints.write_failure import agree_on_write
from ..core.errors import UsageError
from ..core.ranks import from_main_process
from ..training.pretrained import shared_weights


def resumes_in(output_dir: str, resume_from: str | None) -> bool:
    """Whether --resume_from_checkpoint goes on with the run in `output_dir`: 'latest', or a checkpoint inside it. A
    checkpoint elsewhere starts another run from it, which must not write into a directory holding a run of its own:
    that run's checkpoints past the resumed step would be set aside as abandoned, its model replaced."""
    if not resume_from:
        return False
    if resume_from == "latest":
        return True
    # Where the checkpoint's name lies, not where it points: a checkpoint-<step> linked to scratch space is the run's
    where = os.path.normpath(os.path.abspath(resume_from))
    checkpoint = os.path.join(os.path.realpath(os.path.dirname(where)), os.path.basename(where))
    output_dir = os.path.realpath(output_dir)
    return os.path.commonpath([output_dir, checkpoint]) == output_dir


def check_output_dir(output_dir: str, overwrite: bool, resume_from: str | None = None) -> None:
    """Refuse an output directory that already holds another run, before any work is done
    (a run that resumes from its checkpoints there is welcome: `resumes_in`). No communication: `start_run`
    calls it on every rank before any work, and each rank raises on its own. Writes nothing."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(f"--output_dir {output_dir!r} is a file; give a directory path")
    if not os.path.isdir(output_dir) or not os.listdir(output_dir) or overwrite or resumes_in(output_dir, resume_from):
        return
    if resume_from:  # a checkpoint of another directory
        raise UsageError(
            f"--output_dir {output_dir!r} already holds files from another run, and --resume_from_checkpoint "
            f"{resume_from!r} lies outside it: to go on with the run in {output_dir!r}, resume with "
            "--resume_from_checkpoint latest; to start a new run from that checkpoint, give a new --output_dir (under "
            "SLURM, whose requeue resumes from latest, copy the checkpoint into it first and resume with latest)"
        )
    raise UsageError(
        f"--output_dir {output_dir!r} already holds files from another run; "
        "pass --overwrite_output_dir to replace them, or choose another --output_dir"
    )


def prepare_output_dir(accelerator: Accelerator, output_dir: str, overwrite: bool, resume_from: str | None = None):
    """All ranks call this, once the inputs are validated (so bad input never leaves a directory
    behind): the main process checks the output directory again, empties it if `overwrite` and the run does not go on
    from a checkpoint in it (`resumes_in`), and creates it; the other ranks wait for it and share its verdict (one
    broadcast).

    Only the main process looks at the directory here: another rank listing it while the main
    process deletes it could fail with FileNotFoundError.
    """

    def replace_on_main():
        check_output_dir(output_dir, overwrite, resume_from)
        if overwrite and not resumes_in(output_dir, resume_from) and os.path.isdir(output_dir):
            shutil.rmtree(output_dir)
        os.makedirs(output_dir, exist_ok=True)

    from_main_process(accelerator, replace_on_main)


def save_model(accelerator: Accelerator, model, output_dir: str, *processors, dtype: str = "auto") -> None:
    """All ranks call this: save the unwrapped model (safetensors, with its config) and its
    tokenizer / processors so that `from_pretrained(output_dir)` and `pipeline(..., model=output_dir)`
    load it. `dtype` ("auto", "float32", "bfloat16", "float16"): "auto" saves a model in the dtype
    of the checkpoint it was loaded from (its config's), whatever it was trained in, and a LoRA
    adapter as trained.

    `accelerator.get_state_dict` is a collective under FSDP and DeepSpeed ZeRO-3 (saving
    `model.state_dict()` there writes empty or partial weights); it gathers the full weights to
    CPU on the main process only. Only the main process writes.
    """
    accelerator.wait_for_everyone()
    saved = saved_dtype(accelerator.unwrap_model(model), dtype)
    if accelerator.distributed_type.value == "DEEPSPEED":  # the main process's: it decides which masters to gather,
        saved = broadcast_object_list([saved])[0]  # and save_pretrained rewrites the config's dtype there only
    state_dict = gathered_state_dict(accelerator, model, saved)
    error = None
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        try:
            write_pretrained(unwrapped, state_dict, output_dir, *processors, dtype=saved)
        except Exception as exc:  # reported on every rank by agree_on_write
            error = exc
    agree_on_write(accelerator, error, f"the model to {output_dir!r}", output_dir)  # instead of the last barrier


def gathered_state_dict(accelerator: Accelerator, model, saved_as=None) -> dict:
    """All ranks call this, with the same `saved_as`: the whole model's state dict on the main process
    (Accelerate's `get_state_dict`; a collective under FSDP and DeepSpeed), where DeepSpeed trained in bf16 or fp16
    with the trained weights taken from its fp32 master copy, unless they are to be saved in the dtype they have
    (`saved_as`, None: as they are): DeepSpeed's 16-bit weights are its masters rounded to that dtype, the same
    values, and the masters would cost the main process twice the model's 16-bit size in CPU memory (for a full
    70B model, 280 GB).

    DeepSpeed computes with a 16-bit copy of the model and keeps the fp32 weights in its optimizer; Accelerate
    gathers the 16-bit copy. A LoRA adapter, saved as trained, was then bf16's rounding of the weights that DDP and
    FSDP save (their parameters stay fp32 under autocast), and a full model saved in fp32 held bf16's values. Each
    trainable 16-bit parameter's fp32 weights are assembled by DeepSpeed (`safe_get_full_fp32_param`: an all-reduce
    under ZeRO-2 and ZeRO-3), one at a time, in the same order on every rank; frozen ones stay as gathered."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.distributed_type.value != "DEEPSPEED":
        return state_dict
    from deepspeed.utils import safe_get_full_fp32_param

    keys = {key.replace("_orig_mod.", ""): key for key in state_dict or ()}  # as compiled; ZeRO-3's other ranks: None
    masters = {}  # by parameter: a tied weight has several names and one master
    for name, param in accelerator.unwrap_model(model).named_parameters(remove_duplicate=False):
        if not param.requires_grad or param.dtype in (torch.float32, saved_as):
            continue  # the same on every rank: whether to join this parameter's collective
        if id(param) not in masters:
            master = safe_get_full_fp32_param(param)  # a new tensor, on every rank
            masters[id(param)] = master.detach().cpu() if master is not None and accelerator.is_main_process else None
        if masters[id(param)] is not None:
            state_dict[keys.get(name, name)] = masters[id(param)]
    return state_dict


def saved_dtype(model, dtype: str = "auto"):
    """The torch dtype to save `model` in (None: as it is): `dtype`, or for "auto" the dtype of the
    checkpoint it was loaded from, as its config records it (`train_in_fp32` leaves the config
    alone). A LoRA adapter is saved as trained under "auto"."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if hasattr(model, "peft_config"):
        return None
    recorded = getattr(getattr(model, "config", None), "dtype", None)
    if isinstance(recorded, str):
        recorded = getattr(torch, recorded, None)
    return recorded if isinstance(recorded, torch.dtype) and recorded.is_floating_point else None


def save_processor(processor, directory: str) -> None:
    """`processor.save_pretrained(directory)`, a tokenizer with the pad token it was loaded with: one
    that had none got EOS for padding here (`causal_lm.load_tokenizer`), and saved so, a user's later
    collator that masks padding by token id would mask every EOS and stop learning to end answers."""
    if not getattr(processor, "borrowed_pad_token", False):
        processor.save_pretrained(directory)
        return
    pad = processor.pad_token
    processor.pad_token = None
    try:
        processor.save_pretrained(directory)
    finally:
        processor.pad_token = pad


def write_pretrained(model, state_dict: dict, output_dir: str, *processors, dtype=None) -> None:
    """Write `model.save_pretrained` with the gathered full `state_dict` (its floating-point
    tensors cast to `dtype`, if given), and the processors, first into a staging directory inside
    `output_dir`, then moving each finished file into place, so a crash never leaves a
    half-written weights file. One process calls it (the main one)."""
    # A torch.compile'd model's state dict names every weight "_orig_mod.<name>"; saved as is,
    # from_pretrained would find none of them and silently start from random weights.
    state_dict = {key.replace("_orig_mod.", ""): value for key, value in state_dict.items()}
    if dtype is not None:
        state_dict = {key: value.to(dtype) if value.is_floating_point() else value for key, value in state_dict.items()}
    # The names of a weight that layers share (an LM head tied to the input embeddings) hold one tensor, as in the
    # model's own state dict, so that `save_pretrained` writes it once, under the name it keeps (for XLM-R the
    # embeddings', registered second): gathered from FSDP's shards they were two tensors, and both were written.
    for name, first in shared_weights(model).items():
        name, first = name.replace("_orig_mod.", ""), first.replace("_orig_mod.", "")
        if name in state_dict and first in state_dict:
            state_dict[name] = state_dict[first]
    os.makedirs(output_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=output_dir)
    try:
        model.save_pretrained(staging, state_dict=state_dict, is_main_process=True)
        if is_classifier_adapter(model):
            _save_classifier_config(model.get_base_model(), staging)
        if dtype is not None:
            _record_dtype(staging, dtype)
        for processor in processors:
            save_processor(processor, staging)
        for name in os.listdir(staging):
            target = os.path.join(output_dir, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            os.replace(os.path.join(staging, name), target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def is_classifier_adapter(model) -> bool:
    """Whether `model` is a text or image classifier with LoRA, as `add_classifier_lora` marks it (not by its class's
    name: a remote-code image classifier may be named otherwise)."""
    return bool(getattr(model, "is_lora_classifier", False))


def _save_classifier_config(classifier, directory: str) -> None:
    """Beside a classifier's LoRA adapter, the classifier's config.json: its labels and problem type, which the base
    model's config lacks, and without which its head is built with another number of outputs than the adapter's
    (the model card loads the base with it). Unquantized: the adapter does not need a 4-bit base."""
    config = unquantized_config(classifier.config)
    config.architectures = [type(classifier).__name__]  # as save_pretrained writes it: the card's task comes from it
    config.save_pretrained(directory)


def unquantized_config(config):
    """A copy of a 4-bit model's `config` that names no quantization: what its unquantized weights load with."""
    import copy

    config = copy.deepcopy(config)
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    return config


def _record_dtype(directory: str, dtype) -> None:
    """Make config.json name the dtype the weights were saved in: `save_pretrained` writes the
    model's own (fp32 after training), and `from_pretrained` would then load bf16 weights as fp32."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):  # a LoRA adapter: adapter_config.json, no dtype field
        return
    with open(path) as handle:
        config = json.load(handle)
    config["dtype"] = str(dtype).removeprefix("torch.")
    with open(path, "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
        handle.write("\n")
