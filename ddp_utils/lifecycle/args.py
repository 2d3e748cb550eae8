"""The command-line options every training script shares: training, checkpoints, output.

Each script declares its own model and data options at its top, calls `add_training_args`, then
sets its own defaults for the values that differ between tasks (`parser.set_defaults`).
"""

from __future__ import annotations

import argparse
import json
import re

from ..core.errors import UsageError
from ..training.training_log import parse_report_to
from .option_names import option_hint

# transformers.get_scheduler's schedules that run on the step count, where `optimizer.schedule_settings` fills what two
# of them need more (reduce_lr_on_plateau needs a metric). `constant` is transformers': it ignores the warm-up; it and
# constant_with_warmup take no --lr_scheduler_kwargs.
SCHEDULES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The scripts' --help: their docstring as written, and each option's default where it has one to show (not
    None, the script's choice after parsing, nor an off switch). A shared help's "(default: the script's)" words
    are for None: where a script's `set_defaults` gave a value (GRPO's learning rate), the value replaces them."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        shown = action.default is not None and action.default is not False and action.default != argparse.SUPPRESS
        words_for_none = re.sub(r" \(default: [^()]*\)$", "", text)
        if not shown or "%(default)" in text or "(default" in words_for_none:  # one named in words of its own
            return text
        return words_for_none + " (default: %(default)s)"


def add_training_args(parser: argparse.ArgumentParser, lengths: bool = False) -> None:
    """Add the shared options to `parser`. A script sets its own defaults after this call with
    `parser.set_defaults(...)` (a learning rate of None: the script picks one after parsing, e.g.
    for its offline demo and for a pretrained model). `lengths`: the examples are token sequences,
    so batches can be grouped by length. A bad option or value (`--epochs`, `--seed abc`) becomes
    a `UsageError`, so it is one line on every rank and the launcher's last line, as every other
    refusal: argparse's own exit skips both. An abbreviation is refused too, not read as the one option it
    begins: `--compile` (torchtune's and litgpt's name for compiling the model) ran train_grpo.py with
    --compile_generation (CUDA graphs for sampling) instead; the refusal names ours (`option_names`)."""
    parser.error = lambda message: _refuse_option(parser, message)
    parser.allow_abbrev = False  # read by argparse at parse time
    p = parser.add_argument_group("training")
    p.add_argument("--per_device_train_batch_size", type=int, default=8, help="examples per process per micro-batch")
    p.add_argument("--per_device_eval_batch_size", type=int, default=16, help="examples per process per eval batch")
    p.add_argument(
        "--gradient_accumulation_steps", type=int, default=None, help="micro-batches per optimizer step (default: 1)"
    )
    p.add_argument(
        "--global_batch_size",
        type=int,
        default=None,
        help="examples per optimizer step on all processes: sets the accumulation, so any cluster runs the same steps",
    )
    p.add_argument(
        "--learning_rate", type=float, default=None, help="peak AdamW learning rate (default: the script's, by method)"
    )
    p.add_argument("--weight_decay", type=float, default=0.01, help="AdamW weight decay (not on biases and norms)")
    p.add_argument(
        "--max_grad_norm", type=float, default=1.0, help="clip the global gradient norm to this (0: no clipping)"
    )
    p.add_argument("--num_train_epochs", type=int, default=3, help="passes over the training data")
    p.add_argument(
        "--max_train_steps", type=int, default=None, help="stop after this many optimizer steps (overrides epochs)"
    )
    p.add_argument(
        "--lr_scheduler_type",
        default="linear",
        help=f"learning-rate schedule after the warm-up: {', '.join(SCHEDULES)}",
    )
    p.add_argument(
        "--lr_scheduler_kwargs",
        default="{}",
        help="JSON of the schedule's own settings, e.g. '{\"min_lr_rate\": 0.1}' (see transformers' get_scheduler)",
    )
    p.add_argument(
        "--warmup_ratio", type=float, default=0.1, help="fraction of the steps that warm the learning rate up"
    )
    p.add_argument("--warmup_steps", type=int, default=None, help="warm-up steps (overrides --warmup_ratio)")
    if lengths:
        p.add_argument(
            "--group_by_length",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="batch examples of similar length together (less padding; the order is still drawn from the seed)",
        )
    p.add_argument(
        "--num_workers",
        type=int,
        default=0,
        help="processes per rank that prepare training batches (0: the training process)",
    )
    p.add_argument(
        "--preprocessing_num_workers",
        type=int,
        default=None,
        help="processes that tokenize the data, on each node's main process (default: one per 25,000 rows)",
    )
    p.add_argument("--seed", type=int, default=42, help="seed for initialisation, shuffling and dropout")
    p.add_argument("--logging_steps", type=int, default=10, help="show the loss every N optimizer steps")
    p.add_argument("--ddp_timeout", type=int, default=1800, help="seconds a collective may wait (data prep: a day)")
    p.add_argument(
        "--oom_backoff",
        action="store_true",
        help="after an out-of-memory error, take the step again in micro-batches half the size (same global batch "
        "and loss); DDP only, not train_grpo.py; the gradient all-reduce no longer overlaps the backward pass",
    )
    p = parser.add_argument_group(
        "checkpoints: resume exactly after a crash or preemption (SIGTERM/SIGUSR1 save one and exit 75)"
    )
    p.add_argument(
        "--checkpointing_steps", default="epoch", help="checkpoint every N optimizer steps, every 'epoch', or 'no'"
    )
    p.add_argument("--checkpoints_total_limit", type=int, default=2, help="keep the K newest checkpoints, and the best")
    p.add_argument(
        "--resume_from_checkpoint",
        default=None,
        help="a checkpoint-<step> dir, or 'latest' in output_dir (fresh if none)",
    )
    p = parser.add_argument_group("evaluation")
    p.add_argument(
        "--eval_steps", type=int, default=None, help="also evaluate every N optimizer steps (each epoch ends with one)"
    )
    p.add_argument(
        "--metric_for_best_model",
        default=None,
        help="the eval score that picks the best checkpoint, e.g. accuracy or eval_loss (default: the script's)",
    )
    p.add_argument(
        "--greater_is_better",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether a higher --metric_for_best_model is better (default: no for a loss or perplexity, else yes)",
    )
    p = parser.add_argument_group("output and tracking")
    p.add_argument(
        "--output_dir",
        default="outputs/run",
        help="where the model, tokenizer, metrics.json, train_log.jsonl and report/ go",
    )
    p.add_argument("--overwrite_output_dir", action="store_true", help="replace an output_dir that holds another run")
    p.add_argument(
        "--save_dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="dtype of the saved model; auto: the checkpoint's own (training is always in fp32 weights)",
    )
    p.add_argument(
        "--report_to",
        default="tensorboard",
        help="trackers, comma-separated: tensorboard, trackio, wandb, mlflow, all or none",
    )
    p.add_argument(
        "--project_name", default=None, help="tracker project / experiment name (default: the script's name)"
    )
    p.add_argument("--run_name", default=None, help="tracker run name (default: the output_dir's name)")
    p.add_argument(
        "--hub_token",
        default=None,
        help="Hub token for private models and data; prefer HF_TOKEN or `hf auth login` (the default): a token on the "
        "command line is readable by every user of the machine (ps, /proc), with a warning; never logged",
    )
    p.add_argument("--trust_remote_code", action="store_true", help="run a Hub model's own Python code (read it first)")
    p.add_argument("--push_to_hub", action="store_true", help="upload the output directory to the Hub at the end")
    p.add_argument(
        "--hub_model_id",
        default=None,
        help="the Hub repository to push to, whose files the push replaces (default: the output_dir's name, "
        "refused when it is a default that other runs share: run, train, demo, sft, ...)",
    )
    p.add_argument(
        "--hub_private_repo",
        action="store_true",
        help="make that repository private: created private, or made private before the upload if it is public",
    )
    p.add_argument(
        "--push_predictions",
        action="store_true",
        help="also upload predictions*.jsonl, which hold the validation prompts and answers (off: kept local)",
    )
    p.add_argument("--language", default=None, help="the data's language for the model card (ISO 639-1, e.g. en)")


def _refuse_option(parser: argparse.ArgumentParser, message: str):
    raise UsageError(f"{message}{option_hint(parser, message)}; {parser.prog} --help lists the options")


def json_object(given, option: str, example: str) -> dict:
    """`given` (an option's JSON text, or the object it was read into already) as a dict; else a `UsageError`."""
    try:
        value = json.loads(given) if isinstance(given, str) else given
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise UsageError(f"{option} takes a JSON object, e.g. '{example}'; got {given!r}")
    return value


def check_schedule(args) -> None:
    """Refuse --lr_scheduler_kwargs that --lr_scheduler_type does not take, in one line, before the model loads: the
    schedule is built on a stand-in optimizer of 10 steps, as the run will build it (a value checked against the
    learning rate, such as polynomial's lr_end, is checked there again, once the rate is known). No communication."""
    import torch

    from ..training.optimizer import make_lr_scheduler

    stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate or 1.0)
    make_lr_scheduler(stand_in, args, max_train_steps=10)


def check_positive(args, *names: str) -> None:
    """Refuse a value below 1 for each named option that is set."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be at least 1, got {value}")


def check_training_args(args) -> None:
    """Refuse shared option values that cannot work, naming the option. Every rank calls it while
    parsing, before the ranks have met (no communication)."""
    check_positive(
        args,
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "global_batch_size",
        "num_train_epochs",
        "max_train_steps",
        "logging_steps",
        "ddp_timeout",
        "preprocessing_num_workers",
        "eval_steps",
    )
    if args.global_batch_size is None and args.gradient_accumulation_steps is None:
        args.gradient_accumulation_steps = 1  # else set by the world size, as the run starts (accumulation_for)
    steps = args.checkpointing_steps
    if steps not in ("epoch", "no") and not (steps.isdigit() and int(steps) > 0):
        raise UsageError(f"--checkpointing_steps takes a positive number, 'epoch' or 'no', got {steps!r}")
    if args.checkpoints_total_limit is not None and args.checkpoints_total_limit < 1:
        raise UsageError(f"--checkpoints_total_limit must be at least 1, got {args.checkpoints_total_limit}")
    if not 0.0 <= args.warmup_ratio < 1.0:
        raise UsageError(f"--warmup_ratio must be in [0, 1), got {args.warmup_ratio}")
    args.trackers = parse_report_to(args.report_to)
    if args.num_workers < 0:
        raise UsageError(
            f"--num_workers must be 0 (batches prepared in the training process) or more, got {args.num_workers}"
        )
    if args.max_grad_norm < 0:
        raise UsageError(f"--max_grad_norm must be 0 (no clipping) or positive, got {args.max_grad_norm}")
    if args.lr_scheduler_type not in SCHEDULES:
        raise UsageError(f"--lr_scheduler_type {args.lr_scheduler_type!r} is not one of {', '.join(SCHEDULES)}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        raise UsageError(f"--warmup_steps must be 0 or more, got {args.warmup_steps}")
    args.lr_scheduler_kwargs = json_object(args.lr_scheduler_kwargs, "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}')
    check_schedule(args)
    if args.eval_steps and steps.isdigit() and int(steps) % args.eval_steps:
        raise UsageError(
            f"--checkpointing_steps {steps} is not a multiple of --eval_steps {args.eval_steps}: every "
            "checkpoint needs an evaluation at its step to be ranked by --metric_for_best_model"
        )
    if args.push_to_hub:
        from ..results.hub import check_hub_push

        check_hub_push(args)


def accumulation_for(args, world_size: int) -> int:
    """The gradient accumulation steps of this run on `world_size` processes: with
    --global_batch_size, the one that makes that many examples per optimizer step with
    --per_device_train_batch_size, so the run takes the same steps on any number of processes; a
    size that does not divide is a `UsageError` naming the per-device batches that fit. Else
    --gradient_accumulation_steps. Every rank calls it as the run starts (no communication)."""
    wanted, per_device = args.global_batch_size, args.per_device_train_batch_size
    given = args.gradient_accumulation_steps
    if wanted is None:
        return given or 1
    processes = f"{world_size} process{'es' if world_size != 1 else ''}"
    if wanted % (world_size * per_device):
        fits = [batch for batch in range(1, wanted // world_size + 1) if wanted % (world_size * batch) == 0]
        fix = f"give --per_device_train_batch_size {' or '.join(map(str, fits[-3:]))}" if fits else ""
        raise UsageError(
            f"--global_batch_size {wanted} is not a multiple of {processes} x --per_device_train_batch_size "
            f"{per_device}; {fix or f'give a --global_batch_size that is a multiple of {world_size}'}"
        )
    accumulation = wanted // (world_size * per_device)
    if given not in (None, accumulation):
        raise UsageError(
            f"--global_batch_size {wanted} on {processes} with --per_device_train_batch_size {per_device} accumulates "
            f"{accumulation} micro-batches, and --gradient_accumulation_steps says {given}; give only one of the two"
        )
    return accumulation


def check_data_args(args, train: str, validation: str, both: bool = False) -> None:
    """Refuse a data source that cannot work: a Hub dataset and local files together, local
    validation data without training data (or, with `both`, one without the other), split names without a Hub
    dataset, a held-out percentage outside 1 to 99. `train` and `validation` name the options (train_file,
    train_dir, ...)."""
    given_train, given_validation = getattr(args, train), getattr(args, validation)
    if both and bool(given_train) != bool(given_validation):
        raise UsageError(f"give both --{train} and --{validation} (or neither)")
    if given_validation and not given_train:
        raise UsageError(f"--{validation} needs --{train}")
    if args.dataset_name and given_train:
        raise UsageError(f"give either --dataset_name or --{train}, not both")
    if not args.dataset_name and (getattr(args, "train_split", None) or getattr(args, "validation_split", None)):
        raise UsageError("--train_split and --validation_split name the splits of a --dataset_name; give one")
    percentage = getattr(args, "validation_split_percentage", None)
    if percentage is not None and not 0 < percentage < 100:
        raise UsageError(f"--validation_split_percentage must be between 1 and 99, got {percentage}")
    check_positive(args, "max_train_samples", "max_eval_samples")
