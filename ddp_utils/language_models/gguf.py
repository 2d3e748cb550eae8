"""GGUF checkpoints (llama.cpp's format) as a model source: dequantized once into plain
safetensors that `from_pretrained` loads like any model, kept in a cache the user can see."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from accelerate.logging import get_logger

from ..core.errors import UsageError

logger = get_logger(__name__)


def default_gguf_cache() -> str:
    """<HF_HOME>/dequantized-gguf (HF_HOME defaults to ~/.cache/huggingface)."""
    from huggingface_hub import constants

    return os.path.join(constants.HF_HOME, "dequantized-gguf")


def dequantized_gguf(model_name_or_path: str, gguf_file: str, cache_dir: str | None = None) -> str:
    """The directory of a plain copy of `gguf_file` (in a local directory or a Hub repo): fp32
    safetensors, config and tokenizer, made on the first call and reused after, keyed by the
    file's path, size and modification time. transformers dequantizes a GGUF model on every load
    (about 30 s for 135M parameters) and refuses to save it, so the scripts train and save this
    copy instead. Call it inside `load_on_main_first`: the main process converts, the others
    find the copy. No communication."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise UsageError("--gguf_file needs the gguf package: pip install -r requirements.txt") from None
    from transformers.utils.hub import cached_file

    try:
        path = cached_file(model_name_or_path, gguf_file)
    except OSError as exc:
        raise UsageError(
            f"GGUF file {gguf_file!r} not found in {model_name_or_path!r} ({str(exc).splitlines()[0][:160]})"
        ) from None
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.realpath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    cache_dir = cache_dir or default_gguf_cache()
    target = os.path.join(cache_dir, f"{os.path.splitext(os.path.basename(gguf_file))[0]}-{key}")
    if os.path.isfile(os.path.join(target, "config.json")):
        logger.info(f"GGUF {gguf_file}: using its dequantized copy in {target}")
        return target
    logger.info(f"GGUF {gguf_file}: dequantizing once into {target} (delete that directory to reclaim the space)")
    os.makedirs(cache_dir, exist_ok=True)
    staging = tempfile.mkdtemp(dir=cache_dir, prefix=".staging-")
    try:
        _write_plain_copy(model_name_or_path, gguf_file, staging)
        try:
            os.rename(staging, target)  # whole or not at all; another node may have been first
        except OSError:
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_plain_copy(model_name_or_path: str, gguf_file: str, directory: str) -> None:
    """A GGUF-loaded model refuses `save_pretrained` ("quantized with gguf and not serializable"):
    build the same architecture from its config without the quantization entry and move the
    dequantized weights into it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(model_name_or_path, gguf_file=gguf_file, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [name for name in missing if name not in _tied(plain)]:
        raise UsageError(
            f"the GGUF checkpoint's weights do not fit its architecture (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
    plain.save_pretrained(directory)
    AutoTokenizer.from_pretrained(model_name_or_path, gguf_file=gguf_file).save_pretrained(directory)


def _tied(model) -> set[str]:
    """Parameter names that are tied to another one (an output head sharing the embedding)."""
    keys = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    return set(keys) if not isinstance(keys, dict) else set(keys)
