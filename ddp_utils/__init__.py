"""The distributed chores every training script shares. Each function's docstring says which ranks call it.

- launch:  `make_accelerator` (with the launch guard), `run` (clean exit), `UsageError`, `Preempted`
- args:    `add_training_args`, `check_training_args`, `check_positive` (the options every script shares)
- loop:    `start_run`, `train_step` (one exact optimizer step), `TrainingRun` (progress, logging,
           checkpoints, preemption, resume, the report), `describe`
- tracking: `parse_report_to` (--report_to), `RunLog` (trackers + train_log.jsonl), `read_train_log`,
           `peak_memory_mb`, secrets kept out of logs (`loggable_args`, `scrub`)
- classification: `label_mapping`, `label_config`, `classification_loss`, `evaluate_classification` (scores + confusion matrix)
- report:  `write_report` (plots + summary in report/), `confusion_matrix`, `plot_runs`
- checkpoint: atomic `save_checkpoint`, `load_checkpoint`, `resolve_resume_path`, `PreemptionHandler`
- data:    `load_on_main_first`, `read_data_files`, `check_splits`, `make_train_dataloader`, `epoch_dataloader`,
           `optimizer_step_batches` (-> `StepSize`), `global_mean_loss`,
           `make_adamw`, `weight_decay_groups`
- metrics: `load_metric` (local evaluate modules), `gather_for_eval`
- io:      `check_output_dir`, `prepare_output_dir`, `write_json`, `save_model`, `write_pretrained`, `load_model_config`
- demo:    the offline demo model and data shipped by PyPI packages
"""

from .data import (
    INPUT_TOKENS,
    SAMPLE_WEIGHT,
    StepSize,
    check_splits,
    epoch_dataloader,
    global_mean_loss,
    load_on_main_first,
    make_adamw,
    make_train_dataloader,
    optimizer_step_batches,
    pad_to_even_shards,
    read_data_files,
    weight_decay_groups,
)
from .io import check_output_dir, load_model_config, prepare_output_dir, save_model, write_json, write_pretrained
from .args import add_training_args, check_positive, check_training_args
from .loop import StepStats, TrainingRun, describe, start_run, train_step
from .classification import classification_loss, evaluate_classification, label_config, label_mapping
from .report import confusion_matrix, plot_runs, write_report
from .tracking import RunLog, loggable_args, parse_report_to, peak_memory_mb, read_train_log, scrub
from . import demo
from .checkpoint import (
    PREEMPTED_FILE,
    PreemptionHandler,
    clear_preempted_marker,
    list_checkpoints,
    load_checkpoint,
    model_fingerprint,
    resolve_resume_path,
    save_checkpoint,
)
from .launch import EXIT_PREEMPTED, EXIT_USAGE, Preempted, UsageError, check_launch, make_accelerator, run
from .metrics import gather_for_eval, load_metric

__all__ = [
    "INPUT_TOKENS",
    "RunLog",
    "StepSize",
    "StepStats",
    "TrainingRun",
    "check_splits",
    "classification_loss",
    "confusion_matrix",
    "evaluate_classification",
    "label_config",
    "label_mapping",
    "loggable_args",
    "parse_report_to",
    "peak_memory_mb",
    "plot_runs",
    "read_train_log",
    "scrub",
    "write_report",
    "add_training_args",
    "check_positive",
    "check_training_args",
    "describe",
    "load_model_config",
    "start_run",
    "train_step",
    "EXIT_PREEMPTED",
    "EXIT_USAGE",
    "PREEMPTED_FILE",
    "Preempted",
    "PreemptionHandler",
    "SAMPLE_WEIGHT",
    "UsageError",
    "check_launch",
    "check_output_dir",
    "clear_preempted_marker",
    "epoch_dataloader",
    "gather_for_eval",
    "global_mean_loss",
    "list_checkpoints",
    "load_checkpoint",
    "load_metric",
    "load_on_main_first",
    "make_accelerator",
    "make_adamw",
    "make_train_dataloader",
    "model_fingerprint",
    "optimizer_step_batches",
    "pad_to_even_shards",
    "prepare_output_dir",
    "read_data_files",
    "resolve_resume_path",
    "run",
    "save_checkpoint",
    "save_model",
    "weight_decay_groups",
    "write_json",
    "write_pretrained",
]
