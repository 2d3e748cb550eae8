"""Loading a pretrained model under DeepSpeed ZeRO-3 when the checkpoint holds a weight of another shape
than the model (a classification head for another number of labels: ImageNet's 1,000 classes, a
sentiment model's 2). `loading_context` is a collective; nothing else here communicates.

Under ZeRO-3, transformers 5.23 builds the model already sharded (`zero.Init`) and loads the checkpoint
into the shards without applying `ignore_mismatched_sizes`: `from_pretrained` failed with "size
mismatch for classifier.1.weight" on one rank and "Fan in and fan out can not be computed" on another
(measured on 2 CPU processes, tests/launched/deepspeed_on_cpu.py). `zero3_init_flag: false` does not
avoid it: Accelerate 1.15 tells transformers about ZeRO-3 either way. So when the shapes differ,
`loading_context` has every rank build that model whole, as outside ZeRO-3 (the new head drawn
afresh), and DeepSpeed shards it in `accelerator.prepare`: each rank holds the whole model in CPU memory
while it loads, and DeepSpeed moves it to the GPU whole before sharding it. A classifier of a few billion
parameters affords that; a model that needs ZeRO-3 to fit one GPU at all does not."""

from __future__ import annotations

import contextlib
import json
import os
import zipfile

from accelerate.logging import get_logger

from ..core.ranks import from_main_process
from .pretrained import WEIGHT_FILES, build_from_config, fetch_weights

logger = get_logger(__name__)


def zero3_enabled() -> bool:
    """Whether transformers builds models sharded for DeepSpeed ZeRO-3 in this process."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


@contextlib.contextmanager
def built_whole():
    """Inside it, transformers builds and loads models whole, as without DeepSpeed; its ZeRO-3 setting (the
    object Accelerate gave it) is given back on the way out, an exception's way too."""
    from transformers.integrations import deepspeed as hf_deepspeed

    reference = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = reference


def weight_files(model_name_or_path: str) -> list[str]:
    """The checkpoint's weight files: a local directory's (its shards included), or a Hub model's in
    the local Hub cache (`fetch_weights`)."""
    directory = os.path.expanduser(model_name_or_path)
    if not os.path.isdir(directory):
        return fetch_weights(model_name_or_path)
    for single, index in WEIGHT_FILES:
        if os.path.isfile(os.path.join(directory, single)):
            return [os.path.join(directory, single)]
        if os.path.isfile(os.path.join(directory, index)):
            with open(os.path.join(directory, index)) as handle:
                shards = sorted(set(json.load(handle)["weight_map"].values()))
            return [os.path.join(directory, shard) for shard in shards]
    return []


def checkpoint_shapes(files: list[str]) -> dict[str, tuple[int, ...]]:
    """Each weight's shape, read from the files' headers (safetensors) or memory-mapped (.bin; a file
    from before torch 1.6, not a zip, is read whole): no weight is read otherwise."""
    import torch
    from safetensors import safe_open

    shapes = {}
    for path in files:
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt") as handle:
                shapes.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
        else:
            mmap = zipfile.is_zipfile(path)  # torch memory-maps only its zip format
            state = torch.load(path, map_location="meta" if mmap else "cpu", weights_only=True, mmap=mmap)
            shapes.update({key: tuple(value.shape) for key, value in state.items()})
    return shapes


def mismatched_weights(model_class, model_name_or_path: str, kwargs: dict) -> list[str]:
    """The names of the checkpoint's weights whose shape differs from the model's that `kwargs`
    (its config) builds, compared on the names both hold; the model is built on the meta device, leaving the
    random generator as it was. One process calls it; no communication."""
    from accelerate import init_empty_weights

    files = weight_files(model_name_or_path)
    config = kwargs.get("config")
    if not files or config is None:
        return []
    import torch

    # Some models draw their position embeddings with torch.randn even on the meta device (ViT, DINOv2, CLIP,
    # SigLIP, PVT): that advanced the main process's seed, and the new head was another draw than DDP's.
    with built_whole(), init_empty_weights(), torch.random.fork_rng(devices=[]):
        model = build_from_config(model_class, config, kwargs)
    wanted = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    saved = checkpoint_shapes(files)
    return sorted(name for name in saved.keys() & wanted.keys() if saved[name] != wanted[name])


def loading_context(model_class, model_name_or_path: str, kwargs: dict):
    """All ranks call this (one broadcast under ZeRO-3 when `ignore_mismatched_sizes` is asked; no
    communication otherwise): the context to run `model_class.from_pretrained(model_name_or_path,
    **kwargs)` in. Under ZeRO-3, when the checkpoint holds weights of other shapes, `built_whole`
    (logged, with the weights named); otherwise none. The main process decides and every rank
    follows, or raises its error: ranks that decided apart would wait in zero.Init's collectives."""
    if not (kwargs.get("ignore_mismatched_sizes") and zero3_enabled()):
        return contextlib.nullcontext()
    from accelerate.state import PartialState

    mismatched = from_main_process(PartialState(), mismatched_weights, model_class, model_name_or_path, kwargs)
    if not mismatched:
        return contextlib.nullcontext()
    logger.warning(
        f"the checkpoint's {', '.join(mismatched[:4])} have other shapes than this model's (a new head): under "
        "DeepSpeed ZeRO-3 transformers cannot replace them while building the model sharded, so every rank builds "
        "it whole and DeepSpeed shards it in prepare (each rank holds the whole model in CPU memory meanwhile, and "
        "DeepSpeed moves it to the GPU whole before sharding it)",
        main_process_only=True,
    )
    return built_whole()
