"""Models from the Hub or a local directory: the config (with a clear error for a bad path or id),
and the weights fetched once into the Hub cache before every rank builds the model. Nothing here
communicates."""

from __future__ import annotations

import os

from .errors import UsageError


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

    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        path = cached_file(model_name_or_path, single, _raise_exceptions_for_missing_entries=False)
        if path:
            return [path]
        index_file = cached_file(model_name_or_path, index, _raise_exceptions_for_missing_entries=False)
        if index_file:
            return list(get_checkpoint_shard_files(model_name_or_path, index_file)[0])
    return []  # no weights file by these names: from_pretrained will say what it misses


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
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **overrides)
    except (OSError, ValueError) as exc:
        if "trust_remote_code" in str(exc):
            raise UsageError(
                f"--model_name_or_path {path!r} holds Python code of its own that transformers must run to load it; "
                "read that code, then pass --trust_remote_code"
            ) from None
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"--model_name_or_path {path!r} is neither a local model directory nor a reachable Hub model ({reason}); "
            "give a directory with config.json or a Hub model id"
        ) from exc


def hub_repo_id(args) -> str:
    """The repository --push_to_hub uploads to: --hub_model_id, else the output directory's name."""
    return args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))


def check_hub_push(args) -> None:
    """Refuse --push_to_hub where it cannot work, before any training: offline, or no Hub token.
    Every rank calls it while parsing (no communication, no network)."""
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise UsageError(
            "--push_to_hub needs the Hub, and HF_HUB_OFFLINE is set; unset it, or train without --push_to_hub and "
            f"upload later with `{upload_command(args)}`"
        )
    if not (args.hub_token or get_token()):
        raise UsageError(
            "--push_to_hub needs a Hub token with write access: run `hf auth login`, set HF_TOKEN, or give --hub_token"
        )


# What is never uploaded: checkpoints (large, and resumable only here), staging directories, the preemption marker.
PUSH_IGNORE = ["checkpoint-*/**", ".tmp-*/**", ".staging-*/**", "preempted.json"]
# The validation data, prompt by prompt with its reference answer (train_sft.py's scoring by generation):
# uploaded only with --push_predictions, since the repository is public unless --hub_private_repo.
PREDICTIONS = "predictions*.jsonl"


def push_ignore_patterns(args) -> list[str]:
    """What --push_to_hub leaves out of the upload: `PUSH_IGNORE`, and the predictions files
    unless --push_predictions."""
    return PUSH_IGNORE + ([] if getattr(args, "push_predictions", False) else [PREDICTIONS])


def upload_command(args) -> str:
    """The `hf upload` command that uploads what --push_to_hub would (the same repository and
    privacy, the same files left out), for a push done by hand."""
    private = " --private" if getattr(args, "hub_private_repo", False) else ""
    excluded = "".join(f' --exclude "{pattern}"' for pattern in push_ignore_patterns(args))
    return f"hf upload {hub_repo_id(args)} {args.output_dir}{private}{excluded}"


def push_to_hub(args) -> str:
    """Upload the output directory of a run with --push_to_hub: create the repository
    (--hub_model_id, private with --hub_private_repo) if needed and upload the model, tokenizer,
    model card, metrics.json, training_args.json (secrets redacted), report/ and the TensorBoard
    events; never the checkpoints, and the predictions (validation prompts and answers) only with
    --push_predictions. The token comes from HF_TOKEN (--hub_token becomes it) or `hf auth login`;
    it is never written to a file. Returns the line that says where it went, or raises `RunFailed`
    with one line that says the run is saved and how to push it by hand.

    The main process calls it alone, after every rank has finished (`report.write_results` queues
    it with `after_the_run.after_every_rank`): an upload can outlast --ddp_timeout, and no rank
    waits for it in a collective. No communication."""
    from huggingface_hub import HfApi

    from .errors import RunFailed

    repo_id = hub_repo_id(args)
    try:
        api = HfApi()
        repo = api.create_repo(repo_id, private=args.hub_private_repo, exist_ok=True)
        api.upload_folder(
            repo_id=repo.repo_id,
            folder_path=args.output_dir,
            ignore_patterns=push_ignore_patterns(args),
            commit_message="Upload the fine-tuned model, its card and its report",
        )
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise RunFailed(
            f"the run is saved in {args.output_dir!r}, but the push to the Hub repository {repo_id!r} failed "
            f"({type(exc).__name__}: {reason}); push it later with `{upload_command(args)}`"
        ) from None
    return f"pushed {args.output_dir} to {repo}"
