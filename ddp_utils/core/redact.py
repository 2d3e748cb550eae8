"""Keeping credentials out of everything a run records: the trackers' hyper-parameters,
training_args.json, the report and `sys.argv` (which wandb and mlflow record). Nothing here
communicates."""

from __future__ import annotations

import logging
import os
import re
import sys

REDACTED = "<redacted>"

logger = logging.getLogger(__name__)


# Option and environment variable names that hold credentials: hub_token, HF_TOKEN, WANDB_API_KEY,
# AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_PASSWORD, ... (not *_tokens: those are counts).
_SECRET_NAME = re.compile(r"(token|secret|password|passwd|api_?key|access_?key|credentials?)$", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def secret_values(args=None) -> set[str]:
    """The credentials this process knows: set environment variables named like one (8 characters
    or more, so that a flag such as "1" is not taken for one) and the values of secret options."""
    values = {value for name, value in os.environ.items() if is_secret_name(name) and len(value) >= 8}
    if args is not None:
        values |= {str(value) for name, value in vars(args).items() if is_secret_name(name) and value}
    return values


def scrub(data, secrets: set[str]):
    """`data` (dicts, lists and strings, nested) with every secret value replaced by <redacted>,
    and every non-empty value under a secret-looking key too."""
    if isinstance(data, dict):
        return {key: REDACTED if is_secret_name(str(key)) and data[key] else scrub(data[key], secrets) for key in data}
    if isinstance(data, (list, tuple)):
        return [scrub(item, secrets) for item in data]
    if isinstance(data, str):
        for secret in sorted(secrets, key=len, reverse=True):
            data = data.replace(secret, REDACTED)
    return data


def loggable_args(args) -> dict:
    """The run's options with secrets redacted, as a JSON-serialisable dict. Any rank may call it."""
    return scrub({key: value for key, value in vars(args).items() if not key.startswith("_")}, secret_values(args))


HUB_TOKEN_WARNING = (
    "--hub_token puts the token on the command line, which every user of this machine can read while the job runs "
    "(ps, /proc/<pid>/cmdline, of the launcher and of every process) and which your shell history keeps; "
    "set HF_TOKEN in the environment or run `hf auth login` instead"
)


def hide_secret_args(args) -> None:
    """Make --hub_token the Hub credential of this process, and take it out of `sys.argv`, which
    wandb and mlflow record with the run; warn, once per job (rank 0), that the command line shows it
    to other users anyway. Every rank calls it, first thing."""
    if getattr(args, "hub_token", None):
        os.environ["HF_TOKEN"] = args.hub_token  # read by huggingface_hub on every Hub call
        # sys.argv can be scrubbed, /proc/<pid>/cmdline cannot: only a token outside the command line stays private.
        if os.environ.get("RANK", "0") == "0":
            logger.warning(HUB_TOKEN_WARNING)
    secrets = secret_values(args)
    sys.argv[:] = scrub(sys.argv, secrets)
