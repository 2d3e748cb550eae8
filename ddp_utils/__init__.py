"""The distributed chores the training scripts share. Each function's docstring says which ranks
call it; every one that takes part in a collective starts with "All ranks call this".

What the scripts use, by the order they use it in:

- start:   `start_run` (the Accelerator, with the launch guard), `run` (a clean exit), `UsageError`;
           `make_accelerator` alone for scripts without training options (check_env.py)
- options: `add_training_args`, `check_training_args`, `check_positive`
- data:    `load_on_main_first`, `read_data_files`, `check_splits`, `make_train_dataloader`, `padding_waste`,
           `longest_first`, `load_metric`
- model:   `load_model_config`, `fetch_weights`, `train_in_fp32`, `make_adamw`, `describe_optimizer`, `refuse_together`
- the run: `StepPlan` (steps, epochs, progress), `Checkpointer` (save, resume, preemption),
           `TrainingLog` (trackers, train_log.jsonl, progress bar), `prepare_output_dir`
- a step:  `count_step` (what the step holds on all ranks), `global_mean_loss` (the exact loss),
           `OOMBackoff` (--oom_backoff: the step again in smaller micro-batches after an out-of-memory error)
- eval:    `evaluate_classification` (classification), `gather_for_eval` (any task)
- the end: `save_model`, `write_results` (metrics.json, report/), `write_jsonl` (predictions)

Task helpers live in their own modules: `lm` (language models), `chat` (conversations and their
targets), `generation` (answers scored by generation), `gguf` (GGUF checkpoints), `vision`
(images), `demo` (the offline demos' models and data).
"""

from .args import add_training_args, check_positive, check_training_args
from .checkpoint import Checkpointer
from .classification import evaluate_classification, label_config, label_mapping
from .data import check_splits, read_data_files
from .errors import UsageError
from .exact_loss import count_step, global_mean_loss
from .io import fetch_weights, load_model_config, prepare_output_dir, save_model, write_jsonl
from .launch import make_accelerator, run, start_run
from .metrics import gather_for_eval, load_metric
from .oom_backoff import OOMBackoff
from .optim import describe_optimizer, make_adamw, train_in_fp32
from .plan import StepPlan
from .ranks import load_on_main_first, refuse_together
from .report import write_results
from .sharding import SAMPLE_WEIGHT, longest_first, make_train_dataloader, padding_waste
from .tracking import TrainingLog

__all__ = [
    "SAMPLE_WEIGHT",
    "Checkpointer",
    "OOMBackoff",
    "StepPlan",
    "TrainingLog",
    "UsageError",
    "add_training_args",
    "check_positive",
    "check_splits",
    "check_training_args",
    "count_step",
    "describe_optimizer",
    "evaluate_classification",
    "fetch_weights",
    "gather_for_eval",
    "global_mean_loss",
    "label_config",
    "label_mapping",
    "load_metric",
    "load_model_config",
    "load_on_main_first",
    "make_accelerator",
    "make_adamw",
    "longest_first",
    "make_train_dataloader",
    "padding_waste",
    "prepare_output_dir",
    "read_data_files",
    "refuse_together",
    "run",
    "save_model",
    "start_run",
    "train_in_fp32",
    "write_jsonl",
    "write_results",
]
