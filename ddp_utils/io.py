"""Output directory and files: only the main process writes, and nothing is left half-written."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from accelerate import Accelerator

from .launch import UsageError


def check_output_dir(output_dir: str, overwrite: bool, resuming: bool = False) -> None:
    """Refuse an output directory that already holds another run, before any work is done
    (a run that resumes from its checkpoints there is welcome). All ranks call it (each raises
    on its own, nobody waits). Writes nothing."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(f"--output_dir {output_dir!r} is a file; give a directory path")
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not (overwrite or resuming):
        raise UsageError(
            f"--output_dir {output_dir!r} already holds files from another run; "
            "pass --overwrite_output_dir to replace them, or choose another --output_dir"
        )


def prepare_output_dir(accelerator: Accelerator, output_dir: str, overwrite: bool, resuming: bool = False) -> None:
    """Create the output directory (emptied first if `overwrite` and not `resuming`), on the main
    process only. All ranks call it, once the inputs are validated, so bad input never leaves a
    directory behind."""
    check_output_dir(output_dir, overwrite, resuming)
    if accelerator.is_main_process:
        if overwrite and not resuming and os.path.isdir(output_dir):
            shutil.rmtree(output_dir)
        os.makedirs(output_dir, exist_ok=True)
    accelerator.wait_for_everyone()


def write_json(accelerator: Accelerator, path: str, data) -> None:
    """Write `data` as JSON, on the main process only, atomically (a complete file or none).
    Any rank may call it; the others do nothing."""
    if not accelerator.is_main_process:
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(handle.name, path)


def save_model(accelerator: Accelerator, model, output_dir: str, *processors) -> None:
    """Save the unwrapped model (safetensors, with its config) and its tokenizer / processors so
    that `from_pretrained(output_dir)` and `pipeline(..., model=output_dir)` load it.

    All ranks must call it: `accelerator.get_state_dict` is a collective under FSDP and
    DeepSpeed ZeRO-3 (saving `model.state_dict()` there writes empty or partial weights); it
    gathers the full weights to CPU on the main process only. Only the main process writes.
    """
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        write_pretrained(accelerator.unwrap_model(model), state_dict, output_dir, *processors)
    accelerator.wait_for_everyone()


def write_pretrained(model, state_dict: dict, output_dir: str, *processors) -> None:
    """Write `model.save_pretrained` with the gathered full `state_dict`, and the processors, first
    into a staging directory inside `output_dir`, then moving each finished file into place, so
    a crash never leaves a half-written weights file. One process calls it (the main one)."""
    # A torch.compile'd model's state dict names every weight "_orig_mod.<name>"; saved as is,
    # from_pretrained would find none of them and silently start from random weights.
    state_dict = {key.replace("_orig_mod.", ""): value for key, value in state_dict.items()}
    os.makedirs(output_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=output_dir)
    try:
        model.save_pretrained(staging, state_dict=state_dict, is_main_process=True)
        for processor in processors:
            processor.save_pretrained(staging)
        for name in os.listdir(staging):
            target = os.path.join(output_dir, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            os.replace(os.path.join(staging, name), target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_model_config(model_name_or_path: str, **overrides):
    """`AutoConfig.from_pretrained(model_name_or_path, **overrides)`, or a `UsageError` that names
    the model when it is neither a local directory nor a reachable Hub model. Any rank may call it."""
    from transformers import AutoConfig

    path = model_name_or_path
    looks_local = os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(path)):
        raise UsageError(f"--model_name_or_path {path!r} is neither a local model directory nor a Hub model id; check the path")
    try:
        return AutoConfig.from_pretrained(path, **overrides)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"--model_name_or_path {path!r} is neither a local model directory nor a reachable Hub model ({reason}); "
            "give a directory with config.json or a Hub model id"
        ) from exc
