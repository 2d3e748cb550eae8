"""The result pushed to the Hub (--push_to_hub): the repository it goes to, the names refused, and the
upload after the run, one commit that replaces the files of an earlier push of ours."""

from __future__ import annotations

import os

from ..core.errors import UsageError


def hub_repo_id(args) -> str:
    """The repository --push_to_hub uploads to: --hub_model_id, else the output directory's name
    (`check_hub_push` refuses the names that every run left at a default shares)."""
    return args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))


# The output directory names that the scripts and the Makefile give by default, and the docs in their examples: without
# --hub_model_id every run left at one would push to the same repository, each push replacing the last one's files.
SHARED_OUTPUT_NAMES = frozenset(
    """run train train_sft train_dpo train_grpo train_clm train_image demo demo_sft demo_dpo demo_grpo demo_clm
    demo_image sft dpo grpo wikitext reviews""".split()
)


def check_hub_push(args) -> None:
    """Refuse --push_to_hub where it cannot work, before any training: no --hub_model_id while the
    output directory has a name that other runs share, offline, or no Hub token. Every rank calls it
    while parsing (no communication, no network)."""
    from huggingface_hub import constants, get_token

    name = hub_repo_id(args)
    if not args.hub_model_id and name.lower().replace("-", "_") in SHARED_OUTPUT_NAMES:
        raise UsageError(
            f"--push_to_hub without --hub_model_id pushes to the repository named after --output_dir, {name!r}, a "
            "default name that other runs share, so each push would replace the last; give --hub_model_id "
            "your-name/a-name-for-this-model"
        )
    if constants.HF_HUB_OFFLINE:
        raise UsageError(
            "--push_to_hub needs the Hub, and HF_HUB_OFFLINE is set; unset it, or train without --push_to_hub and "
            f"upload later with `{upload_command(args)}`"
        )
    if not (args.hub_token or get_token()):
        raise UsageError("--push_to_hub needs a Hub token with write access: run `hf auth login`, or set HF_TOKEN")


# What is never uploaded: checkpoints (large, and resumable only here), staging directories, the preemption marker.
PUSH_IGNORE = ["checkpoint-*/**", ".tmp-*/**", ".staging-*/**", "preempted.json"]
# The validation data, prompt by prompt with its reference answer (train_sft.py's scoring by generation):
# uploaded only with --push_predictions, since the repository is public unless --hub_private_repo.
PREDICTIONS = "predictions*.jsonl"
# What a push keeps in the repository of the files it did not write: the Hub's own LFS rules.
KEPT_IN_REPO = {".gitattributes"}
# Every run of the scripts writes it: a repository without it holds another's files, which a push must not delete.
OUR_MARK = "training_args.json"


def push_ignore_patterns(args) -> list[str]:
    """What --push_to_hub leaves out of the upload: `PUSH_IGNORE`, and the predictions files
    unless --push_predictions."""
    return PUSH_IGNORE + ([] if getattr(args, "push_predictions", False) else [PREDICTIONS])


def upload_command(args) -> str:
    """The commands that push by hand what --push_to_hub would: the same repository, made private
    first with --hub_private_repo (`hf upload --private` leaves an existing repository public), the
    same files left out, and the repository's other files deleted (`--delete "*"`)."""
    repo_id = hub_repo_id(args)
    private = (
        f"hf repos create {repo_id} --private --exist-ok && hf repos settings {repo_id} --private && "
        if getattr(args, "hub_private_repo", False)
        else ""
    )
    excluded = "".join(f' --exclude "{pattern}"' for pattern in push_ignore_patterns(args))
    return f'{private}hf upload {repo_id} {args.output_dir}{excluded} --delete "*"'


class _Refused(Exception):
    """The push uploads nothing: the repository is public and the Hub did not make it private for
    --hub_private_repo, or it holds files no push of these scripts wrote, which the push would delete."""


def commit_operations(args, remote_files) -> list:
    """The one commit of a push: every file of the output directory that the push uploads
    (`push_ignore_patterns` left out), and the deletion of every other file in the repository
    (`remote_files`) but .gitattributes, so nothing of an earlier push stays next to this run's
    files (a full model next to a new LoRA adapter, another run's predictions). No communication."""
    from pathlib import Path

    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    folder = Path(args.output_dir)
    local = sorted(path.relative_to(folder).as_posix() for path in folder.glob("**/*") if path.is_file())
    uploaded = list(filter_repo_objects(local, ignore_patterns=push_ignore_patterns(args) + DEFAULT_IGNORE_PATTERNS))
    stale = sorted(set(remote_files) - set(uploaded) - KEPT_IN_REPO)
    return [CommitOperationDelete(path_in_repo=path) for path in stale] + [
        CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(folder / path)) for path in uploaded
    ]


def push_to_hub(args) -> str:
    """Upload the output directory of a run with --push_to_hub: create the repository
    (--hub_model_id, private with --hub_private_repo) if needed, make an existing public one private
    with --hub_private_repo before anything is uploaded (or fail, uploading nothing), and replace
    its files in one commit (`commit_operations`): the model, tokenizer, model card, metrics.json,
    training_args.json (secrets redacted), report/ and the TensorBoard events; never the
    checkpoints, and the predictions (validation prompts and answers) only with --push_predictions;
    the files of an earlier push deleted, .gitattributes kept. The token comes from HF_TOKEN
    (--hub_token becomes it) or `hf auth login`; it is never written to a file. Returns the line
    that says where it went, or raises `RunFailed` with one line that says the run is saved and how
    to push it by hand.

    The main process calls it alone, after every rank has finished (`report.write_results` queues
    it with `after_the_run.after_every_rank`): an upload can outlast --ddp_timeout, and no rank
    waits for it in a collective. No communication."""
    from huggingface_hub import CommitOperationDelete, HfApi

    from ..core.errors import RunFailed

    repo_id = hub_repo_id(args)
    try:
        api = HfApi()
        # private=None, not False: a new repository without --hub_private_repo takes its namespace's default.
        repo = api.create_repo(repo_id, private=True if args.hub_private_repo else None, exist_ok=True)
        info = api.repo_info(repo.repo_id)
        if args.hub_private_repo and not info.private:  # create_repo leaves an existing repository as it is
            try:
                api.update_repo_settings(repo.repo_id, private=True)
                info = api.repo_info(repo.repo_id)
                problem = None if info.private else "the Hub answered, but it is still public"
            except Exception as exc:
                problem = f"{type(exc).__name__}: {_first_line(exc)}"
            if problem:
                raise _Refused(
                    f"it is public and --hub_private_repo could not make it private ({problem}): nothing uploaded"
                )
        # The files as of `info.sha`, and the commit made on top of it only: a push in between fails it (412).
        remote = api.list_repo_files(repo.repo_id, revision=info.sha)
        if set(remote) - KEPT_IN_REPO - {"README.md"} and OUR_MARK not in remote:
            raise _Refused(
                f"it holds files that no run of these scripts pushed (no {OUR_MARK}), which this push would delete: "
                "nothing uploaded; give a new --hub_model_id"
            )
        operations = commit_operations(args, remote)
        api.create_commit(
            repo.repo_id,
            operations=operations,
            commit_message="Upload the fine-tuned model, its card and its report",
            parent_commit=info.sha,
        )
    except Exception as exc:
        reason = str(exc) if isinstance(exc, _Refused) else f"{type(exc).__name__}: {_first_line(exc)}"
        raise RunFailed(
            f"the run is saved in {args.output_dir!r}, but the push to the Hub repository {repo_id!r} failed "
            f"({reason}); push it later with `{upload_command(args)}`"
        ) from None
    deleted = [op.path_in_repo for op in operations if isinstance(op, CommitOperationDelete)]
    if not deleted:
        return f"pushed {args.output_dir} to {repo}"
    names = ", ".join(deleted[:5]) + (f" and {len(deleted) - 5} more" if len(deleted) > 5 else "")
    return f"pushed {args.output_dir} to {repo}, deleting the {len(deleted)} file(s) of an earlier push: {names}"


def _first_line(exc: BaseException) -> str:
    """The error's first line, with the Hub's own reason when that is further down (a 412's "A commit has happened
    since", a 403's missing right)."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    hub_says = (getattr(exc, "server_message", None) or "").strip().splitlines()
    if hub_says and hub_says[0] not in line:
        line = f"{line}: {hub_says[0]}"
    return line[:300]
