"""Watching a run: `TrainingLog` (the trackers of --report_to, `train_log.jsonl` and the progress
bar), memory use, and keeping secrets out of all of them.

One run per job: the trackers start, log and write on the main process only (Accelerate's
trackers do nothing on the other ranks), and `train_log.jsonl` is written by the main process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import sys

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from tqdm.auto import tqdm

from ..core.errors import UsageError
from ..core.redact import loggable_args
from .nonfinite import WATCHED, NonFiniteWatch

logger = get_logger(__name__)

# The trackers --report_to accepts, and the package each needs.
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}
TRAIN_LOG = "train_log.jsonl"
TENSORBOARD_DIR = "runs"  # <output_dir>/runs/<project>/: point `tensorboard --logdir` at it (or at outputs/)


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
        raise UsageError(
            f"--report_to {unknown[0]!r} is not a tracker this project supports; "
            f"choose from {', '.join(TRACKER_PACKAGES)}, all or none"
        )
    if "all" in names:
        return [name for name, package in TRACKER_PACKAGES.items() if importlib.util.find_spec(package)]
    for name in names:
        if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            raise UsageError(
                f"--report_to {name} needs the {TRACKER_PACKAGES[name]!r} package, which is not installed: "
                f"pip install {TRACKER_PACKAGES[name]}, or log with --report_to tensorboard (or none)"
            )
    return list(dict.fromkeys(names))


def tracker_config(args, facts: dict) -> dict:
    """Hyper-parameters for `init_trackers`: the options (secrets redacted) and the run's shape,
    as the plain values trackers accept (lists become comma-separated text)."""
    config = {**loggable_args(args), **facts}
    return {
        key: ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        for key, value in config.items()
        if value is None or isinstance(value, (bool, int, float, str, list, tuple))
    }


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    """This process's peak memory so far: host memory (peak resident set size) and, on a GPU, the
    peak of the tensors allocated on its device and of what the caching allocator reserved."""
    peaks = {"peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    if device.type == "cuda":
        peaks["peak_gpu_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        peaks["peak_gpu_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
    return peaks


class TrainingLog:
    """Shows and records the run as it trains: every --logging_steps optimizer steps (and at the
    last) the loss, learning rate, gradient norm, throughput and memory, and each evaluation's
    scores, to the trackers of --report_to, `train_log.jsonl` and the progress bar.

    A loss or gradient norm that turns NaN or infinite stops the run at the next record, on every
    rank (`NonFiniteWatch`, `finite`; the Checkpointer asks it too before saving); a step that
    fp16's loss scaler skipped is counted (`train/skipped_steps`), and only a long run of them stops it.

    Build it on every rank after `Checkpointer.resume` (it starts the trackers, and needs the step
    a resumed run starts from). Only the main process writes.
    """

    def __init__(self, accelerator: Accelerator, args, plan):
        self.accelerator, self.logging_steps = accelerator, args.logging_steps
        self.path = os.path.join(args.output_dir, TRAIN_LOG)
        self.finite = NonFiniteWatch(accelerator, args)
        self.last_evaluation: tuple[int, dict] | None = None  # (step, scores) of the newest evaluation
        self.run_means: dict[str, torch.Tensor] = {}  # name -> [numerator, denominator] over this run's records
        resumed_step = self.first_step = plan.step  # 0, or the step a resumed run starts from
        if accelerator.is_main_process and os.path.isfile(self.path):
            # After a resume, drop the records of the steps after the checkpoint: the run takes them again.
            kept = [record for record in read_train_log(args.output_dir) if record["step"] <= resumed_step]
            with open(self.path, "w") as handle:
                handle.writelines(json.dumps(record) + "\n" for record in kept)
        run_name = args.run_name or os.path.basename(os.path.abspath(args.output_dir))
        init_kwargs = {"wandb": {"name": run_name}, "mlflow": {"run_name": run_name}, "trackio": {"name": run_name}}
        if resumed_step:  # TensorBoard hides the events a crashed run wrote after the checkpoint
            init_kwargs["tensorboard"] = {"purge_step": resumed_step + 1}
        if accelerator.log_with:
            shape = {
                "world_size": accelerator.num_processes,
                "max_train_steps": plan.max_train_steps,
                "global_batch_size": plan.examples_per_step,
            }
            accelerator.init_trackers(
                args.project_name or script_name(), config=tracker_config(args, shape), init_kwargs=init_kwargs
            )
        self.bar = tqdm(
            total=plan.max_train_steps, initial=resumed_step, desc="train", disable=not accelerator.is_main_process
        )
        self._new_window(plan)

    def _new_window(self, plan) -> None:
        """Start collecting the steps of the next record."""
        self._window_start = dict(plan.progress)
        self._loss_sum = torch.zeros((), device=self.accelerator.device)
        self._grad_norm_sum = torch.zeros((), device=self.accelerator.device)
        self._grad_norms = torch.zeros((), device=self.accelerator.device)  # steps with a gradient norm, not skipped
        self._skipped = torch.zeros((), device=self.accelerator.device)  # steps fp16's loss scaler skipped
        self._learning_rate = None
        self._means: dict[str, torch.Tensor] = {}  # name -> [numerator, denominator] summed over the window

    def step(self, plan, loss_sum: torch.Tensor, grad_norm, learning_rate: float, means: dict | None = None) -> None:
        """All ranks call this after every optimizer step (after `plan.advance`), with this
        rank's weighted loss sum over its micro-batches, the gradient norm before clipping (None if
        DeepSpeed keeps it) and the learning rate the step used. Every --logging_steps steps and at
        the last step it writes a record, with one gather of every rank's loss and peak memory, and
        stops the run on every rank if a step's loss or gradient norm was not finite. Between records
        nothing leaves the device: one host sync per record. `means`, {name: (numerator, denominator)} of
        this rank's step (the same names every step and on every rank), are logged as train/<name>: the
        numerators over the window and all ranks, divided by the denominators; `run_means` adds them up over the
        run (since `first_step`: its start or resume), the same on every rank."""
        self._loss_sum += loss_sum.detach().float()
        for name, (numerator, denominator) in (means or {}).items():
            pair = torch.stack([torch.as_tensor(numerator), torch.as_tensor(denominator)]).float()
            self._means[name] = self._means.get(name, 0) + pair.to(self.accelerator.device)
        if grad_norm is not None:
            if hasattr(grad_norm, "full_tensor"):  # FSDP2's norm is a DTensor (all ranks call this: it may gather)
                grad_norm = grad_norm.full_tensor()
            grad_norm = torch.as_tensor(grad_norm, dtype=torch.float32, device=self.accelerator.device)
        skipped = self.finite.note(plan.step, loss_sum, grad_norm)  # by fp16's loss scaler: an overflow, not applied
        self._skipped += skipped
        if grad_norm is not None:  # the mean norm of the steps applied (a skipped one's is infinite)
            self._grad_norm_sum += torch.where(skipped, 0.0, grad_norm)
            self._grad_norms += ~skipped
        self._learning_rate = learning_rate
        self.bar.update(1)
        if plan.step % self.logging_steps == 0 or plan.done:
            self._write_window(plan)

    def _write_window(self, plan) -> None:
        """Log the steps since the last record: the loss over all their examples (or tokens) on
        all ranks, the mean gradient norm, the last learning rate, global throughput and the peak
        memory of the busiest rank. One gather, and one host sync (with the step counts, by `plan.read`)."""
        accelerator, start = self.accelerator, self._window_start
        memory = peak_memory_mb(accelerator.device)
        # Copied without waiting: a blocking copy to the device would wait for the steps queued before it.
        host_values = torch.tensor(list(memory.values()), dtype=torch.float32).to(accelerator.device, non_blocking=True)
        window = torch.stack([self._loss_sum.float(), self._grad_norm_sum, self._grad_norms.float(), self._skipped])
        means = torch.stack(list(self._means.values())).flatten() if self._means else window[:0]
        local = torch.cat([window.float(), host_values, means.float(), self.finite.first_bad])
        now, everyone = plan.read(accelerator.gather(local[None]))  # (world size, 4 + memory kinds + 3), on the host
        seconds = max(now["train_time_s"] - start["train_time_s"], 1e-9)
        weight, tokens = now["trained_weight"] - start["trained_weight"], now["tokens_seen"] - start["tokens_seen"]
        loss = everyone[:, 0].sum().item() / max(weight, 1.0)
        record = {"train/epoch": plan.fractional_epoch, "train/loss": loss, "train/learning_rate": self._learning_rate}
        norms, skipped = everyone[0, 2].item(), int(everyone[0, 3].item())  # the same on every rank
        if norms:
            record["train/grad_norm"] = everyone[0, 1].item() / norms
        if self.finite.scaled:  # fp16: the steps the loss scaler skipped (overflows, not applied), and its scale
            record["train/skipped_steps"] = skipped
            if accelerator.scaler is not None:
                record["train/loss_scale"] = accelerator.scaler.get_scale()
        record["train/samples_per_second"] = (now["samples_seen"] - start["samples_seen"]) / seconds
        if tokens:
            record["train/tokens_per_second"] = tokens / seconds
        for i, name in enumerate(memory, start=4):
            record[f"train/{name}"] = everyone[:, i].max().item()
        totals = everyone[:, 4 + len(memory) : 4 + len(memory) + 2 * len(self._means)].sum(dim=0)
        for i, name in enumerate(self._means):
            record[f"train/{name}"] = totals[2 * i].item() / max(totals[2 * i + 1].item(), 1e-12)
            self.run_means[name] = self.run_means.get(name, 0) + totals[2 * i : 2 * i + 2]  # the same on every rank
        self._write(record, plan.step)
        speed = f"{record['train/samples_per_second']:,.1f} samples/s"
        if tokens:
            speed += f", {record['train/tokens_per_second']:,.0f} tok/s"
        self.bar.set_postfix_str(f"loss {loss:.4f}, {speed}")
        self._new_window(plan)
        self.finite.check(everyone[:, -len(WATCHED) :])  # every rank raises together if a step was not finite

    def evaluation(self, plan, scores: dict, when: str | None = None) -> None:
        """After an evaluation: at an epoch's end (after `plan.end_epoch`), every --eval_steps
        steps, or before training (`when`: "zero-shot"). Logs its scores at the current step and
        epoch (fractional in mid-epoch) and keeps them as `last_evaluation` (step, scores), which
        the Checkpointer ranks checkpoints by. Every rank calls it with the same scores; no
        communication."""
        epoch = plan.fractional_epoch
        if when is None:  # epochs are counted from 0 in the log; an epoch's end: the next one's start
            when = f"epoch {int(epoch) - 1}" if epoch == int(epoch) else f"step {plan.step} (epoch {epoch:.2f})"
        logger.info(f"{when}: {describe(scores)}")
        record = {"epoch": epoch}
        record.update(
            {
                f"eval/{name.removeprefix('eval_')}": value
                for name, value in scores.items()
                if isinstance(value, (int, float))
            }
        )
        self._write(record, plan.step)
        self.last_evaluation = (plan.step, scores)

    def _write(self, record: dict, step: int) -> None:
        """Send `record` for optimizer step `step` to the trackers and append it, with the step, to
        train_log.jsonl (main process only)."""
        self.accelerator.log(record, step=step)
        if self.accelerator.is_main_process:
            with open(self.path, "a") as handle:
                handle.write(json.dumps({"step": step, **record}) + "\n")

    def close(self) -> None:
        """Close the progress bar, at the end of training."""
        self.bar.close()


def describe(values: dict) -> str:
    """`key value, ...` with floats to 4 significant digits, for log lines."""
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


def script_name() -> str:
    """The running script's name without .py (train, train_clm, ...): the default tracker project."""
    return os.path.splitext(os.path.basename(sys.argv[0]))[0] or "fine-tuning"


def read_train_log(output_dir: str) -> list[dict]:
    """The records of `output_dir/train_log.jsonl`, in order ([] if there is none)."""
    path = os.path.join(output_dir, TRAIN_LOG)
    if not os.path.isfile(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
