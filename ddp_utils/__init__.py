"""The distributed chores the training scripts share. Each function's docstring says which ranks
call it; every one that takes part in a collective starts with "All ranks call this".

What the scripts use, in the order they use it, and the module that holds it:

- start:    `start_run` (the Accelerator, checked by the launch guard; start.py), `run` (a clean exit,
            one-line errors; process_exit.py), `UsageError` (errors.py)
- options:  `add_training_args`, `add_causal_lm_args`, `check_training_args`, `check_causal_lm_args`,
            `check_data_args`, `check_positive` (args.py), `check_metric_for_best_model` (evaluation.py)
- data:     `load_on_main_first` (ranks.py), `read_data_files`, `check_splits` (raw_data.py),
            `make_train_dataloader`, `make_eval_dataloader` (the training order; dataloaders.py),
            `load_metric` (evaluation.py)
- model:    `load_model_config`, `fetch_weights` (pretrained.py), `load_pretrained` (under FSDP only rank 0
            reads the weights; fsdp.py), `train_in_fp32`, `make_adamw`,
            `make_lr_scheduler` (optimizer.py); causal LMs: `load_config_and_tokenizer`,
            `load_causal_lm` (causal_lm.py), `check_merge_lora`, `save_with_merged` (lora.py)
- the run:  `StepPlan` (steps, epochs, progress; step_plan.py), `start_training` (output directory,
            `Checkpointer` with resume, `TrainingLog`, `OOMBackoff`; start.py)
- a step:   `count_step` (what the step holds on all ranks), `global_mean_loss` (the exact loss;
            exact_loss.py), `OOMBackoff.run` (--oom_backoff; oom_backoff.py)
- eval:     `evaluate_classification` (classification.py), `gather_for_eval` (any task; evaluation.py)
- the end:  `save_model` (output.py), `write_results` (metrics.json, report/; report.py)

Task helpers live in their own modules: `causal_lm` (language models), `lora`, `chat`
(conversations and their targets), `sft_data` (SFT records as training rows), `preference_data`
(preference pairs as training rows), `dpo` (preference losses, the reference), `generation`
(answers scored by generation), `gguf` (GGUF checkpoints), `vision` (images), `classification`,
`demo` (the offline demos' models and data). `is_sharded` (sharded.py) is the one test of
whether the weights are split over the ranks.
"""

from .checkpoints.checkpoint import Checkpointer
from .core.errors import UsageError
from .core.files import write_jsonl
from .core.ranks import load_on_main_first, refuse_together
from .core.sharded import is_sharded
from .data.classification import evaluate_classification, label_config, label_mapping
from .data.dataloaders import SAMPLE_WEIGHT, longest_first, make_eval_dataloader, make_train_dataloader
from .data.evaluation import check_metric_for_best_model, gather_for_eval, load_metric
from .data.raw_data import check_splits, preparation_processes, read_data_files
from .language_models.causal_lm import load_causal_lm, load_config_and_tokenizer
from .language_models.lora import check_merge_lora, save_with_merged
from .lifecycle.args import (
    add_causal_lm_args,
    add_training_args,
    check_causal_lm_args,
    check_data_args,
    check_positive,
    check_training_args,
)
from .lifecycle.process_exit import run
from .lifecycle.start import make_accelerator, start_run, start_training
from .results.output import prepare_output_dir, save_model
from .results.report import write_results
from .training.exact_loss import count_step, global_mean_loss
from .training.fsdp import load_pretrained
from .training.oom_backoff import OOMBackoff
from .training.optimizer import describe_optimizer, make_adamw, make_lr_scheduler, train_in_fp32
from .training.pretrained import fetch_weights, load_model_config
from .training.step_plan import StepPlan
from .training.training_log import TrainingLog

__all__ = [
    "SAMPLE_WEIGHT",
    "Checkpointer",
    "OOMBackoff",
    "StepPlan",
    "TrainingLog",
    "UsageError",
    "add_causal_lm_args",
    "add_training_args",
    "check_causal_lm_args",
    "check_data_args",
    "check_merge_lora",
    "check_metric_for_best_model",
    "check_positive",
    "check_splits",
    "check_training_args",
    "count_step",
    "describe_optimizer",
    "evaluate_classification",
    "fetch_weights",
    "load_pretrained",
    "gather_for_eval",
    "global_mean_loss",
    "is_sharded",
    "label_config",
    "label_mapping",
    "load_causal_lm",
    "load_config_and_tokenizer",
    "load_metric",
    "load_model_config",
    "load_on_main_first",
    "longest_first",
    "make_accelerator",
    "make_adamw",
    "make_eval_dataloader",
    "make_lr_scheduler",
    "make_train_dataloader",
    "prepare_output_dir",
    "preparation_processes",
    "read_data_files",
    "refuse_together",
    "run",
    "save_model",
    "save_with_merged",
    "start_run",
    "start_training",
    "train_in_fp32",
    "write_jsonl",
    "write_results",
]
