"""Watching a run: experiment trackers (`--report_to`), the records of each logging step and
evaluation (the trackers and `train_log.jsonl`), memory use, and keeping secrets out of all of them.

One run per job: the trackers start, log and write on the main process only (Accelerate's
trackers do nothing on the other ranks), and `train_log.jsonl` is written by the main process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import resource
import sys

import torch
from accelerate import Accelerator

from .launch import UsageError

# The trackers --report_to accepts, and the package each needs.
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}
TRAIN_LOG = "train_log.jsonl"
TENSORBOARD_DIR = "runs"  # <output_dir>/runs/<project>/: point `tensorboard --logdir` at it (or at outputs/)
REDACTED = "<redacted>"

# Option and environment variable names that hold credentials: hub_token, HF_TOKEN, WANDB_API_KEY,
# AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_PASSWORD, ... (not *_tokens: those are counts).
_SECRET_NAME = re.compile(r"(token|secret|password|passwd|api_?key|access_?key|credentials?)$", re.IGNORECASE)


def parse_report_to(value: str) -> list[str]:
    """The trackers named by --report_to (comma-separated; 'all': every supported one installed;
    'none'), or a UsageError naming a tracker that is unknown or whose package is missing.
    Every rank calls it while checking the arguments, so every rank refuses before any work starts.

    Accelerate itself skips a tracker whose package is missing with a debug message only: the run
    would train for hours and log nowhere.
    """
    names = [name.strip().lower() for name in value.split(",") if name.strip()]
    if names in ([], ["none"]):
        return []
    unknown = [name for name in names if name not in (*TRACKER_PACKAGES, "all")]
    if unknown:
        raise UsageError(f"--report_to {unknown[0]!r} is not a tracker this project supports; "
                         f"choose from {', '.join(TRACKER_PACKAGES)}, all or none")
    if "all" in names:
        return [name for name, package in TRACKER_PACKAGES.items() if importlib.util.find_spec(package)]
    for name in names:
        if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            raise UsageError(f"--report_to {name} needs the {TRACKER_PACKAGES[name]!r} package, which is not installed: "
                             f"pip install {TRACKER_PACKAGES[name]}, or log with --report_to tensorboard (or none)")
    return list(dict.fromkeys(names))


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


def hide_secret_args(args) -> None:
    """Make --hub_token the Hub credential of this process, and take it out of `sys.argv`, which
    wandb and mlflow record with the run. Every rank calls it, first thing."""
    if getattr(args, "hub_token", None):
        os.environ["HF_TOKEN"] = args.hub_token  # read by huggingface_hub on every Hub call
    secrets = secret_values(args)
    sys.argv[:] = scrub(sys.argv, secrets)


def tracker_config(args, facts: dict) -> dict:
    """Hyper-parameters for `init_trackers`: the options (secrets redacted) and the run's shape,
    as the plain values trackers accept (lists become comma-separated text)."""
    config = {**loggable_args(args), **facts}
    return {key: ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            for key, value in config.items() if value is None or isinstance(value, (bool, int, float, str, list, tuple))}


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    """This process's peak memory so far: host memory (peak resident set size) and, on a GPU, the
    peak of the tensors allocated on its device and of what the caching allocator reserved."""
    peaks = {"peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    if device.type == "cuda":
        peaks["peak_gpu_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        peaks["peak_gpu_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
    return peaks


class RunLog:
    """Where a run's records go: the trackers of --report_to through `accelerator.log`, and
    `train_log.jsonl` in the output directory, one JSON object per line, written by the main
    process. Every rank creates it and calls its methods (only the main process writes)."""

    def __init__(self, accelerator: Accelerator, output_dir: str):
        self.accelerator = accelerator
        self.path = os.path.join(output_dir, TRAIN_LOG)

    def start(self, project_name: str, run_name: str, config: dict, resumed_step: int = 0) -> None:
        """Start the trackers with the hyper-parameters; after a resume, drop the records of the
        steps after the checkpoint (the run takes them again), so each step is logged once."""
        if self.accelerator.is_main_process and os.path.isfile(self.path):
            kept = [line for line in self.records() if line["step"] <= resumed_step]
            with open(self.path, "w") as handle:
                handle.writelines(json.dumps(record) + "\n" for record in kept)
        init_kwargs = {"wandb": {"name": run_name}, "mlflow": {"run_name": run_name}, "trackio": {"name": run_name}}
        if resumed_step:  # TensorBoard hides the events a crashed run wrote after the checkpoint
            init_kwargs["tensorboard"] = {"purge_step": resumed_step + 1}
        if self.accelerator.log_with:
            self.accelerator.init_trackers(project_name, config=config, init_kwargs=init_kwargs)

    def log(self, record: dict, step: int) -> None:
        """Send `record` (name -> number) for optimizer step `step` to the trackers and append it,
        with the step, to train_log.jsonl. Every rank may call it; only the main process writes."""
        self.accelerator.log(record, step=step)
        if self.accelerator.is_main_process:
            with open(self.path, "a") as handle:
                handle.write(json.dumps({"step": step, **record}) + "\n")

    def records(self) -> list[dict]:
        """The records written so far (read by the main process, for the report)."""
        return read_train_log(os.path.dirname(self.path))


def read_train_log(output_dir: str) -> list[dict]:
    """The records of `output_dir/train_log.jsonl`, in order ([] if there is none)."""
    path = os.path.join(output_dir, TRAIN_LOG)
    if not os.path.isfile(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
