"""A pretrained model from the Hub or a local directory: its config (with a clear error for a bad path
or id), and its weights fetched once into the Hub cache before every rank builds the model. Nothing
here communicates."""

from __future__ import annotations

import os

from ..core.errors import UsageError

# A checkpoint's weights, as from_pretrained looks for them: one file, or an index of shards; safetensors first.
WEIGHT_FILES = (
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)


def fetch_weights(model_name_or_path: str) -> list[str]:
    """Put a Hub model's weights in the local Hub cache, as `from_pretrained` looks for them
    (model.safetensors, or its sharded index and shards, else the same for pytorch_model.bin), and
    return their local paths; a local directory is left alone ([]). Call it inside
    `load_on_main_first`: the main process downloads, a failure is reported on every rank, and the
    ranks that then build the model together read the cache instead of all downloading at once.
    No communication."""
    if os.path.isdir(os.path.expanduser(model_name_or_path)):
        return []
    from transformers.utils.hub import cached_file, get_checkpoint_shard_files

    for single, index in WEIGHT_FILES:
        path = cached_file(model_name_or_path, single, _raise_exceptions_for_missing_entries=False)
        if path:
            return [path]
        index_file = cached_file(model_name_or_path, index, _raise_exceptions_for_missing_entries=False)
        if index_file:
            return list(get_checkpoint_shard_files(model_name_or_path, index_file)[0])
    return []  # no weights file by these names: from_pretrained will say what it misses


def checkpoint_weight_names(model_name_or_path: str) -> set[str] | None:
    """The names of the weights a checkpoint holds, read from its safetensors headers or index alone (no weight
    read): a local directory's, or a Hub model's from the cache `fetch_weights` filled. None where it has none to
    read so (pytorch_model.bin). No communication."""
    import json

    from safetensors import safe_open

    directory = os.path.expanduser(model_name_or_path)
    if os.path.isdir(directory):
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as handle:
                return set(json.load(handle)["weight_map"])
        files = [os.path.join(directory, "model.safetensors")]
    else:
        files = fetch_weights(model_name_or_path)
    if not files or not all(name.endswith(".safetensors") and os.path.isfile(name) for name in files):
        return None
    names = set()
    for name in files:
        with safe_open(name, "np") as handle:
            names.update(handle.keys())
    return names


def keep_used_weight_conversions(model):
    """Keep only the weight renamings and conversions that loading `model` applied, so that
    `save_pretrained` reverts only those, and return `model`. Any rank may call it; no communication.

    transformers 5 renames some checkpoint keys while loading, and reverts the renamings it applied when
    saving. Under DeepSpeed ZeRO-3 (transformers 5.23's `_load_state_dict_into_zero3_model`) it kept every
    renaming it knows, its legacy ones included, as applied: a BERT fine-tuned there was saved with
    `LayerNorm.gamma` and `LayerNorm.beta` for `weight` and `bias`, names that transformers reads back and
    other readers of the file do not. Elsewhere transformers keeps only those applied: this changes nothing."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [c for c in conversions if getattr(c, "was_used", lambda: True)()]
    return model


def build_from_config(model_class, config, kwargs: dict):
    """`model_class` built from `config` alone, with the building options of `from_pretrained`'s `kwargs`
    (attention implementation, dtype, trust_remote_code): an Auto class through `from_config`, a model class
    through `_from_config`. Weights are drawn afresh (inside `init_empty_weights`, left empty). No communication."""
    building = {key: kwargs[key] for key in ("attn_implementation", "dtype", "torch_dtype") if key in kwargs}
    if hasattr(model_class, "from_config"):  # an Auto class
        return model_class.from_config(config, trust_remote_code=kwargs.get("trust_remote_code", False), **building)
    return model_class._from_config(config, **building)  # a model class itself


def load_model_config(model_name_or_path: str, trust_remote_code: bool = False, **overrides):
    """`AutoConfig.from_pretrained(model_name_or_path, **overrides)`, or a `UsageError` that names
    the model when it is neither a local directory nor a reachable Hub model, or when it holds
    code of its own to run and --trust_remote_code was not given. Any rank may call it."""
    from transformers import AutoConfig

    path = model_name_or_path
    looks_local = os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(path)):
        raise UsageError(
            f"--model_name_or_path {path!r} is neither a local model directory nor a Hub model id; check the path"
        )
    not_a_model = lora_adapter_problem(path) or training_checkpoint_problem(path)
    if not_a_model:
        raise UsageError(not_a_model)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **overrides)
    except (OSError, ValueError) as exc:
        if "trust_remote_code" in str(exc):
            raise UsageError(
                f"--model_name_or_path {path!r} holds Python code of its own that transformers must run to load it; "
                "read that code, then pass --trust_remote_code"
            ) from None
        if not looks_local and _hub_adapter(path, exc):
            raise UsageError(
                f"--model_name_or_path {path!r} is a LoRA adapter (adapter_config.json), not a whole model; merge it "
                "into its base model with peft's merge_and_unload(), save that, and give its directory"
            ) from None
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"--model_name_or_path {path!r} is neither a local model directory nor a reachable Hub model ({reason}); "
            "give a directory with config.json or a Hub model id"
        ) from exc


def lora_adapter_problem(path: str) -> str | None:
    """The one-line refusal of a local directory that holds a LoRA adapter and no model weights (a
    LoRA run's --output_dir: the SFT step before DPO or GRPO), or None. transformers reads its
    adapter_config.json as a model's config and says the directory has no model type."""
    local = os.path.expanduser(path)

    def has(*parts) -> bool:
        return os.path.isfile(os.path.join(local, *parts))

    if not has("adapter_config.json") or any(has(name) for pair in WEIGHT_FILES for name in pair):
        return None
    if has("merged", "config.json"):
        fix = f"give {os.path.join(path, 'merged')!r}, the merged model its run wrote beside it"
    else:
        fix = (
            "give a whole model: a run with --merge_lora writes one in <output_dir>/merged, or merge the adapter "
            "into its base with peft's merge_and_unload() and save that"
        )
    return f"--model_name_or_path {path!r} holds a LoRA adapter (adapter_config.json), not a whole model; {fix}"


def training_checkpoint_problem(path: str) -> str | None:
    """The one-line refusal of a local directory that holds a training checkpoint of these scripts
    (trainer_state.json, Accelerate's layout, no config.json), or None. `transformers.Trainer`'s
    checkpoints are models too; ours hold what a resume needs, and the way to a model is a resume
    that takes no step."""
    import json

    from ..checkpoints.manifest import STATE_FILE

    local = os.path.expanduser(path)
    if not os.path.isfile(os.path.join(local, STATE_FILE)) or os.path.isfile(os.path.join(local, "config.json")):
        return None
    try:
        with open(os.path.join(local, STATE_FILE)) as handle:
            step = json.load(handle)["step"]
    except (OSError, ValueError, KeyError, TypeError):
        step = "<its step>"
    return (
        f"--model_name_or_path {path!r} is a training checkpoint ({STATE_FILE}), not a model; to save the model it "
        f"holds, run the script that wrote it, with its options, and --resume_from_checkpoint {path} "
        f"--max_train_steps {step} --output_dir <a new directory>: it takes no step and saves the model"
    )


def _hub_adapter(repo_id: str, error: Exception) -> bool:
    """Whether Hub model `repo_id`, whose config `error` kept from loading, holds a LoRA adapter's
    adapter_config.json: in the Hub cache, else on the Hub where it answered that the repo has no config.json
    (never a second wait for a Hub that cannot be reached)."""
    from transformers.utils.hub import cached_file

    for local_only in (True, False):
        if local_only or "config.json" in str(error):
            try:
                found = cached_file(
                    repo_id,
                    "adapter_config.json",
                    local_files_only=local_only,
                    _raise_exceptions_for_missing_entries=False,
                )
            except Exception:  # not a repo, or not reachable: the caller's own message stands
                found = None
            if found:
                return True
    return False


def causal_lm_class(config):
    """The Auto class that loads `config`'s model whole, with its LM head: of AutoModelForCausalLM and
    AutoModelForImageTextToText, the one that maps `config` to the class its checkpoint names (Gemma 3 and 4: causal
    LM; Llama 4 and Qwen 3.5, also mapped to a text-only causal LM that would drop their vision tower: image-and-
    text), else the one that maps it at all (Mistral 3, Qwen-VL: image-and-text only), else AutoModelForCausalLM
    (remote code; or its error, which names the model type)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    autos = (AutoModelForCausalLM, AutoModelForImageTextToText)
    remote = getattr(config, "auto_map", None) or {}
    named = (getattr(config, "architectures", None) or [None])[0]
    mapped = {auto: auto._model_mapping[type(config)] for auto in autos if type(config) in auto._model_mapping}
    for auto in autos:
        if auto.__name__ in remote or getattr(mapped.get(auto), "__name__", None) == named:
            return auto
    return next(iter(mapped), AutoModelForCausalLM)


def shared_weights(model) -> dict[str, str]:
    """{name: the first name of the same parameter} for each parameter that layers share (a tied LM head)."""
    first, shared = {}, {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(parameter), name) != name:
            shared[name] = first[id(parameter)]
    return shared
