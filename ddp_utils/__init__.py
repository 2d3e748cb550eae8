"""The distributed chores the training scripts share, so that each script shows only its task.

What it promises every script, and where each promise is kept:
- rank-0 I/O: the main process alone reads the Hub or writes a file, atomically; the other ranks wait and share its
  verdict, a failure included (core/ranks.py, core/files.py, checkpoints/write_failure.py);
- gathered metrics: evaluation gathers each example exactly once over the ranks (data/evaluation.py);
- the exact loss: a step's loss is the mean over all its examples on all ranks (training/exact_loss.py);
- the saved model: the unwrapped model's full state dict, gathered under FSDP and DeepSpeed (from its fp32
  masters), reloadable (results/output.py);
- checkpoints: atomic, verified, resumed on any layout (checkpoints/);
- bad input and faults: one line on every rank, never a hang (core/errors.py, lifecycle/process_exit.py).
Each function's docstring says which ranks call it; one that takes part in a collective starts with
"All ranks call this".

Seven sub-packages, each importing only those listed below it (docs/design.md, "Package layout"):
  lifecycle/        a script's start and end: launch guard, options, the Accelerator, a clean exit
  language_models/  causal LMs: loading, chat, SFT and preference rows, DPO, generation, LoRA, GGUF
  results/          after training: the model saved, metrics.json, the report, the model card, the Hub push
  training/         the model made ready (weights, FSDP, optimizer), the step plan, the exact loss, the log
  checkpoints/      save, verify and resume; preemption; a failed write reported on every rank
  data/             data files read, the training order, gathering for evaluation, classification, images, demos
  core/             error types, rank-0 I/O, atomic files, whether weights are sharded, secrets kept out of logs

What the scripts call, one job a line, in the order a script uses it:
  start_run, make_accelerator       the Accelerator, checked by the launch guard (lifecycle/start.py)
  run, UsageError                   a clean exit; bad input as one line (lifecycle/process_exit.py, core/errors.py)
  HelpFormatter                     --help with each option's default (lifecycle/args.py)
  add_training_args, check_training_args, check_data_args, check_positive   the options the scripts share,
                                    checked (lifecycle/args.py)
  add_lora_args, add_gradient_checkpointing_arg, add_causal_lm_args, check_lora_options, check_causal_lm_args
                                    the model options: LoRA, QLoRA, checkpointing (lifecycle/model_args.py)
  load_on_main_first                the main process reads first, every rank shares its verdict (core/ranks.py)
  refuse_together                   a problem one rank found, refused on every rank (core/ranks.py)
  read_data_files                   local files read, each checked as read (data/data_files.py)
  check_splits                      one data check for all; named_splits, preparation_processes (data/raw_data.py)
  make_train_dataloader             the training order: whole steps, the same on any layout (data/dataloaders.py)
  make_eval_dataloader, longest_first, SAMPLE_WEIGHT   evaluation batches; a filler row weighs 0 (same)
  pad_multiple                      what batch lengths are padded to a multiple of: 8 under mixed precision (same)
  load_metric, gather_for_eval      metrics offline; each example gathered once (data/evaluation.py)
  check_metric_for_best_model       the score that ranks checkpoints (data/evaluation.py)
  load_model_config, fetch_weights  a model from the Hub or a directory (training/pretrained.py)
  load_pretrained                   under FSDP only rank 0 reads the weights (training/fsdp.py)
  make_adamw, make_lr_scheduler     the optimizer and its schedule (training/optimizer.py)
  train_in_fp32, describe_optimizer fp32 master weights under mixed precision; the log's line (same)
  load_config_and_tokenizer, load_causal_lm   a causal LM, LoRA, GGUF (language_models/causal_lm.py)
  classifier_4bit_loading, add_classifier_lora   a classifier's QLoRA and LoRA (language_models/classifier_lora.py)
  checkpoint_if_asked               --gradient_checkpointing: layers recompute their activations
                                    (training/activation_checkpointing.py)
  StepPlan                          steps, epochs and progress (training/step_plan.py)
  start_training                    output directory (prepare_output_dir), Checkpointer with resume, TrainingLog,
                                    OOMBackoff (lifecycle/start.py)
  is_sharded                        whether the weights are split over the ranks (core/sharded.py)
  count_step, global_mean_loss      what the step holds on all ranks; the exact loss (training/exact_loss.py)
  evaluate_classification           accuracy and F1; label_config, label_mapping, labels_numbered_as_training
                                    (data/classification.py)
  save_model, save_with_merged      the unwrapped model, and LoRA merged (results/output.py,
                                    language_models/lora_merge.py)
  write_results                     metrics.json, training_args.json, report/ (results/report.py)
  write_jsonl                       predictions, atomically, by the main process (core/files.py)
The task helpers a script imports by module (`from ddp_utils.language_models.chat import ...`) are named in its
sub-package's docstring.
"""

from .checkpoints.checkpoint import Checkpointer
from .core.errors import UsageError
from .core.files import write_jsonl
from .core.ranks import load_on_main_first, refuse_together
from .core.sharded import is_sharded
from .data.classification import evaluate_classification, label_config, label_mapping, labels_numbered_as_training
from .data.data_files import read_data_files
from .data.dataloaders import SAMPLE_WEIGHT, longest_first, make_eval_dataloader, make_train_dataloader, pad_multiple
from .data.evaluation import check_metric_for_best_model, gather_for_eval, load_metric
from .data.raw_data import check_splits, named_splits, preparation_processes
from .language_models.causal_lm import load_causal_lm, load_config_and_tokenizer
from .language_models.classifier_lora import add_classifier_lora, classifier_4bit_loading
from .language_models.lora_merge import save_with_merged
from .lifecycle.args import HelpFormatter, add_training_args, check_data_args, check_positive, check_training_args
from .lifecycle.model_args import (
    add_causal_lm_args,
    add_gradient_checkpointing_arg,
    add_lora_args,
    check_causal_lm_args,
    check_lora_options,
)
from .lifecycle.process_exit import run
from .lifecycle.start import make_accelerator, start_run, start_training
from .results.output import prepare_output_dir, save_model
from .results.report import write_results
from .training.activation_checkpointing import checkpoint_if_asked
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
    "HelpFormatter",
    "StepPlan",
    "TrainingLog",
    "UsageError",
    "add_causal_lm_args",
    "add_classifier_lora",
    "add_gradient_checkpointing_arg",
    "add_lora_args",
    "add_training_args",
    "check_causal_lm_args",
    "checkpoint_if_asked",
    "check_lora_options",
    "classifier_4bit_loading",
    "check_data_args",
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
    "labels_numbered_as_training",
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
    "pad_multiple",
    "prepare_output_dir",
    "preparation_processes",
    "named_splits",
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
