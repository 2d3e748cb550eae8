"""Output directory and files: only the main process writes, nothing is left half-written, and a
write that fails (no space, quota, file too large, permissions) is reported on every rank in one
line that names the directory, the cause, the newest complete checkpoint and the fix."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from accelerate import Accelerator

from .errors import UsageError
from .ranks import fail_together, from_main_process


def check_output_dir(output_dir: str, overwrite: bool, resuming: bool = False) -> None:
    """Refuse an output directory that already holds another run, before any work is done
    (a run that resumes from its checkpoints there is welcome). No communication: `start_run`
    calls it on every rank before any work, and each rank raises on its own. Writes nothing."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(f"--output_dir {output_dir!r} is a file; give a directory path")
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not (overwrite or resuming):
        raise UsageError(
            f"--output_dir {output_dir!r} already holds files from another run; "
            "pass --overwrite_output_dir to replace them, or choose another --output_dir"
        )


def prepare_output_dir(accelerator: Accelerator, output_dir: str, overwrite: bool, resuming: bool = False) -> None:
    """All ranks call this, once the inputs are validated (so bad input never leaves a directory
    behind): the main process checks the output directory again, empties it if `overwrite` and not
    `resuming`, and creates it; the other ranks wait for it and share its verdict (one broadcast).

    Only the main process looks at the directory here: another rank listing it while the main
    process deletes it could fail with FileNotFoundError.
    """

    def replace_on_main():
        check_output_dir(output_dir, overwrite, resuming)
        if overwrite and not resuming and os.path.isdir(output_dir):
            shutil.rmtree(output_dir)
        os.makedirs(output_dir, exist_ok=True)

    from_main_process(accelerator, replace_on_main)


def write_json(accelerator: Accelerator, path: str, data) -> None:
    """Write `data` as JSON, on the main process only, atomically (a complete file or none).
    Any rank may call it; the others do nothing."""
    _write_text_on_main(accelerator, path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_jsonl(accelerator: Accelerator, path: str, rows: list[dict]) -> None:
    """Write `rows` one JSON object per line, on the main process only, atomically. Any rank may
    call it; the others do nothing."""
    _write_text_on_main(accelerator, path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _write_text_on_main(accelerator: Accelerator, path: str, text: str) -> None:
    """Write `text` to `path` on the main process only, through a temporary file in the same
    directory and a rename, so readers see a complete file or none."""
    if not accelerator.is_main_process:
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as handle:
        handle.write(text)
    os.replace(handle.name, path)


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
    state_dict = accelerator.get_state_dict(model)
    error = None
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        try:
            write_pretrained(unwrapped, state_dict, output_dir, *processors, dtype=saved_dtype(unwrapped, dtype))
        except Exception as exc:  # reported on every rank by agree_on_write
            error = exc
    agree_on_write(accelerator, error, f"the model to {output_dir!r}", output_dir)  # instead of the last barrier


def saved_dtype(model, dtype: str = "auto"):
    """The torch dtype to save `model` in (None: as it is): `dtype`, or for "auto" the dtype of the
    checkpoint it was loaded from, as its config records it (`train_in_fp32` leaves the config
    alone). A LoRA adapter is saved as trained under "auto"."""
    import torch

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
    os.makedirs(output_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=output_dir)
    try:
        model.save_pretrained(staging, state_dict=state_dict, is_main_process=True)
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


def agree_on_write(accelerator: Accelerator, error: BaseException | None, what: str, output_dir: str) -> None:
    """All ranks call this after writing (one gather), each with the error its write raised, or
    None: if any rank failed, every rank raises `RunFailed` with one line that names `what` could
    not be written, the cause, the newest complete checkpoint in `output_dir` and the fix. Stands
    where a barrier would: the ranks that did not fail wait here, not in a collective the failed
    rank never reaches."""
    fail_together(accelerator, None if error is None else write_failure(error, what, output_dir))


def write_failure(error: BaseException, what: str, output_dir: str) -> str:
    """The one line for a write of `what` that raised `error`: the cause (the OS error, found in
    the exception's chain; torch's writer reports only "iostream error", so the free space and the
    file size limit are named then), the newest complete checkpoint and the fix."""
    import resource

    from .checkpoint_save import list_checkpoints

    cause, found = None, error
    while found is not None and cause is None:
        if isinstance(found, OSError) and found.errno:
            cause = f"[Errno {found.errno}] {found.strerror or os.strerror(found.errno)}"
        found = found.__cause__ or found.__context__
    if cause is None:  # torch's writer raises RuntimeError("unexpected pos ..."): name the likely limits first
        free = shutil.disk_usage(existing_parent(output_dir)).free
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        facts = [f"files are limited to {limit / 2**20:.1f} MiB (ulimit -f)"] if limit != resource.RLIM_INFINITY else []
        facts += [
            f"{free / 2**30:.1f} GiB free there",
            f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:120]}",
        ]
        cause = "; ".join(facts)
    newest = (list_checkpoints(output_dir) or [None])[-1]
    kept = f"the newest complete checkpoint is {newest!r}" if newest else "no complete checkpoint was saved yet"
    return (
        f"could not write {what} ({cause}); {kept}. Free space there (or raise the quota or file size limit), or give "
        "an --output_dir on a larger disk, then resume with --resume_from_checkpoint latest"
    )


def existing_parent(path: str) -> str:
    """`path`, or its nearest existing parent."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path
