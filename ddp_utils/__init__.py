"""The distributed chores every training script shares. Each function's docstring says which ranks call it.

- launch:  `make_accelerator` (with the launch guard), `run` (clean exit), `UsageError`
- data:    `load_on_main_first`, `read_data_files`, `make_train_dataloader`, `optimizer_step_batches`, `global_mean_loss`,
           `make_adamw`, `weight_decay_groups`
- metrics: `load_metric` (local evaluate modules), `gather_for_eval`
- io:      `check_output_dir`, `prepare_output_dir`, `write_json`, `save_model`
- demo:    the offline demo model and data shipped by PyPI packages
"""

from .data import (
    SAMPLE_WEIGHT,
    global_mean_loss,
    load_on_main_first,
    make_adamw,
    make_train_dataloader,
    optimizer_step_batches,
    pad_to_even_shards,
    read_data_files,
    weight_decay_groups,
)
from .io import check_output_dir, prepare_output_dir, save_model, write_json
from . import demo
from .launch import EXIT_USAGE, UsageError, check_launch, make_accelerator, run
from .metrics import gather_for_eval, load_metric

__all__ = [
    "EXIT_USAGE",
    "SAMPLE_WEIGHT",
    "UsageError",
    "check_launch",
    "check_output_dir",
    "gather_for_eval",
    "global_mean_loss",
    "load_metric",
    "load_on_main_first",
    "make_accelerator",
    "make_adamw",
    "make_train_dataloader",
    "optimizer_step_batches",
    "pad_to_even_shards",
    "prepare_output_dir",
    "read_data_files",
    "run",
    "save_model",
    "weight_decay_groups",
    "write_json",
]
