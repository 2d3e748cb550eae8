#!/usr/bin/env python
"""Preference tuning of a causal language model from chosen/rejected answer pairs, on one process
or many, with Accelerate: DPO (the default), IPO or SimPO, LoRA optional. The frozen reference is
never a second model in memory: with LoRA it is the same model with its adapters off; without, its
log-probs are computed once before training and cached with the prepared data. Evaluation gives
the reward accuracy and margin over every validation pair, before training too.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/train_dpo.py
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml scripts/train_dpo.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --train_file pairs.jsonl --lora_r 16

With no arguments it runs the offline demo: SmolLM2-135M-Instruct (LoRA) is asked the SFT demo's
question about the packaged drug reviews, with the right one-word answer as the chosen one and a
wrong one as the rejected one; its answers are scored by generation before and after. For your own
pairs, pass --train_file (and --validation_file), or edit `load_raw_datasets` in the DATA section. The
demo has settings of its own (`DEMO_DEFAULTS`); --help shows the defaults for your own model.
"""

import argparse
import math

import datasets
import torch
from accelerate.logging import get_logger

import ddp_utils
from ddp_utils import SAMPLE_WEIGHT, UsageError
from ddp_utils.data.demo import DEMO_QUESTION, DEMO_SYSTEM, demo_llm_gguf, load_demo_reviews  # the SFT demo's question
from ddp_utils.language_models.dpo import (
    LOSSES,
    PREFERENCE_SCORES,
    check_dpo_args,
    disable_dropout,
    evaluate_preferences,
    make_reference,
    pair_logps,
    preference_losses,
)
from ddp_utils.language_models.generation import GENERATION_SCORES, make_generation_dataloader, score_by_generation
from ddp_utils.language_models.pair_batches import PairCollator
from ddp_utils.language_models.pair_formats import detect_pair_format
from ddp_utils.language_models.pair_scoring import TWO_ROWS, choose_pair_layout
from ddp_utils.language_models.preference_data import tokenize_pairs

logger = get_logger(__name__)

# The demo (no --model_name_or_path): sizes chosen so `make train-dpo` runs in minutes on 2 CPU
# processes; bench/README.md has how they were chosen. The command line still wins.
DEMO_DEFAULTS = dict(
    lora_r=16,
    lora_dropout=0.0,
    learning_rate=1e-3,
    sft_weight=1.0,  # the model answers in sentences: DPO alone ranks the two words, the NLL term teaches the word
    num_train_epochs=1,
    per_device_train_batch_size=4,
    per_device_eval_batch_size=32,
    eval_max_new_tokens=8,
)


DPO_LEARNING_RATES = {"lora": 5e-5, "full": 1e-6}  # without --learning_rate (TRL's default: 1e-6)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=ddp_utils.HelpFormatter)  # with defaults
    # Model and data. Nothing given: SmolLM2-135M-Instruct and pairs made from the drug reviews.
    p.add_argument("--model_name_or_path", default=None, help="Hub model id or local directory (default: the demo LLM)")
    p.add_argument("--dataset_name", default=None, help="Hub dataset name")
    p.add_argument("--dataset_config_name", default=None, help="Hub dataset configuration")
    p.add_argument("--train_split", default=None, help="the Hub dataset's training split (default: train)")
    p.add_argument("--validation_split", default=None, help="its validation split (default: validation, else test)")
    p.add_argument("--train_file", default=None, help="preference pairs: .json(l) .csv .parquet, or a folder or glob")
    p.add_argument("--validation_file", default=None, help="local validation pairs (default: split off the training)")
    p.add_argument("--validation_split_percentage", type=int, default=5, help="%% held out without a validation split")
    p.add_argument(
        "--chat_template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="render plain prompt/answer strings as chat turns (default: if the tokenizer has a template)",
    )
    p.add_argument("--max_train_samples", type=int, default=None, help="use only the first N training pairs")
    p.add_argument("--max_eval_samples", type=int, default=None, help="use only the first N validation pairs")
    # The preference loss.
    p.add_argument("--loss_type", choices=LOSSES, default="sigmoid", help="sigmoid (DPO), ipo, or simpo (no reference)")
    p.add_argument(
        "--beta", type=float, default=None, help="how far from the reference the model may move (0.1; simpo 2)"
    )
    p.add_argument("--simpo_gamma", type=float, default=None, help="SimPO's target reward margin (0.5 x beta)")
    p.add_argument("--sft_weight", type=float, default=0.0, help="add this times the chosen answers' NLL (RPO)")
    p.add_argument(
        "--precompute_reference", action="store_true", help="with LoRA too: reference log-probs once, before training"
    )
    p.add_argument(
        "--disable_dropout",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="dropout off in the policy and its reference, as TRL does (--no-disable_dropout keeps it)",
    )
    # Evaluation.
    p.add_argument("--eval_max_new_tokens", type=int, default=0, help="answer each eval prompt, this long; 0: no")
    p.add_argument("--skip_zero_shot", action="store_true", help="do not evaluate the model before training")
    ddp_utils.add_causal_lm_args(p)  # GGUF, --block_size, LoRA, gradient checkpointing, torch.compile
    ddp_utils.add_training_args(p, lengths=True)  # batch sizes, learning rate, checkpoints, output, tracking
    p.set_defaults(output_dir="outputs/train_dpo", num_train_epochs=1)  # and --learning_rate: DPO_LEARNING_RATES
    args = p.parse_args(argv)
    demo = args.model_name_or_path is None
    if demo:  # the demo's own defaults; what the command line gives still wins
        if args.gguf_file:
            raise UsageError("--gguf_file names a file in --model_name_or_path: give that too")
        p.set_defaults(**DEMO_DEFAULTS)
        args = p.parse_args(argv)
        args.model_name_or_path, args.gguf_file = demo_llm_gguf()
    ddp_utils.check_training_args(args)
    if args.learning_rate is None:  # preference tuning moves far less than SFT
        args.learning_rate = DPO_LEARNING_RATES["lora" if args.lora_r else "full"]
    check_dpo_args(args)
    ddp_utils.check_causal_lm_args(args)
    ddp_utils.check_data_args(args, "train_file", "validation_file")
    if args.eval_max_new_tokens < 0:
        raise UsageError(f"--eval_max_new_tokens must be 0 (no generation) or more, got {args.eval_max_new_tokens}")
    at_epoch_end = GENERATION_SCORES if args.eval_max_new_tokens and not args.checkpointing_steps.isdigit() else ()
    ddp_utils.check_metric_for_best_model(args, PREFERENCE_SCORES + at_epoch_end, default="eval_loss")
    return args


# ==================================== DATA ====================================
# The one place to edit for your own pairs: return a DatasetDict with a "train" split (and
# "validation" if you have one) with "prompt", "chosen" and "rejected" columns (strings, or
# conversations: a list of {"role", "content"} turns and the two answers as assistant turns), or
# "chosen" and "rejected" conversations that share their first turns, or LLaMA-Factory's shapes.
# Your own names, on what the --train_file branch below returns:
#   data = data.rename_columns({"question": "prompt", "good": "chosen", "bad": "rejected"})
DEMO_REVIEW_WORDS = 50  # each review's last words: the verdict is usually at the end (SFT's demo keeps 80)


def load_raw_datasets(args):
    if args.train_file:
        files = {"train": args.train_file, **({"validation": args.validation_file} if args.validation_file else {})}
        return ddp_utils.read_data_files(files)
    if args.dataset_name:
        raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        return ddp_utils.named_splits(raw, args.train_split, args.validation_split)  # the Hub's own split names

    def as_pair(review, index):  # offline demo: the right label chosen, a wrong one rejected
        text = " ".join(review["text"].split()[-DEMO_REVIEW_WORDS:])
        prompt = [{"role": "system", "content": DEMO_SYSTEM}, {"role": "user", "content": f"{text}\n\n{DEMO_QUESTION}"}]
        # The tempting mistake: "positive" (two reviews in three) for the others; else negative or neutral in turn.
        wrong = "positive" if review["label"] != "positive" else ("negative", "neutral")[index % 2]
        return {"prompt": prompt, "chosen": review["label"], "rejected": wrong}  # answers as strings: assistant turns

    return load_demo_reviews().map(as_pair, with_indices=True, remove_columns=["label", "text"])


# ==============================================================================


def prepare_data(args):
    """Load, check and tokenize the pairs; load the model's config and tokenizer (a GGUF file
    dequantized into its cached copy first). Runs on the main process first, then on the others."""
    raw = load_raw_datasets(args)
    fmt = detect_pair_format(raw, args.chat_template)  # TRL's shapes, implicit prompt, LLaMA-Factory's, ShareGPT
    limits = {"train": args.max_train_samples, "validation": args.max_eval_samples}
    needed = {"chosen": "the preferred answers", "rejected": "the answers not preferred"}
    raw = ddp_utils.check_splits(
        raw, needed, limits=limits, seed=args.seed, hold_out_percentage=args.validation_split_percentage
    )
    config, tokenizer, block_size = ddp_utils.load_config_and_tokenizer(args)
    processes = ddp_utils.preparation_processes(args, len(raw["train"]))  # the node's cores, for large data
    tokenized, report = tokenize_pairs(raw, fmt, tokenizer, block_size, args.eval_max_new_tokens, processes)
    return tokenized, tokenizer, config, {"block_size": block_size, **report}


def main():
    args = parse_args()
    accelerator = ddp_utils.start_run(args, dynamo_backend="inductor" if args.torch_compile else "no")

    tokenized, tokenizer, config, data_report = ddp_utils.load_on_main_first(accelerator, prepare_data, args)
    model = ddp_utils.load_causal_lm(args, config, tokenizer)  # every rank at once (a collective under ZeRO-3)
    if args.disable_dropout:  # the policy and its reference then compute the same function until the first update
        logger.info(f"dropout off in {disable_dropout(model)} places (--no-disable_dropout keeps it)")
    # All ranks: one row per pair (its prompt once) where that scores each answer as if alone; else two rows.
    layout = choose_pair_layout(accelerator, model, data_report["block_size"])
    ddp_utils.train_in_fp32(accelerator, model)  # AdamW on bf16 weights would lose small updates; LoRA's base stays
    multiple = ddp_utils.pad_multiple(accelerator)  # 8 under mixed precision: tensor cores like them
    collate = PairCollator(tokenizer.pad_token_id, pad_to_multiple_of=multiple, two_rows=layout == TWO_ROWS)
    train_dataloader = ddp_utils.make_train_dataloader(
        tokenized["train"], args, accelerator, collate, length_column="length"
    )
    eval_dataloader = ddp_utils.make_eval_dataloader(tokenized["validation"], args, collate, length_column="length")
    prompts = tokenized.get("generate")  # the eval prompts answered by generation, with the chosen answers
    if prompts is not None:
        generate_dataloader = make_generation_dataloader(prompts, args.per_device_eval_batch_size, tokenizer, config)

    optimizer = ddp_utils.make_adamw(model, args.learning_rate, args.weight_decay)  # trainable parameters only
    plan = ddp_utils.StepPlan(accelerator, args, train_dataloader, unit="pairs")  # steps, epochs, progress
    lr_scheduler = ddp_utils.make_lr_scheduler(optimizer, args, plan.max_train_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    if prompts is not None:
        generate_dataloader = accelerator.prepare(generate_dataloader)
    # All ranks, before a checkpoint is loaded: LoRA's adapters off, or log-probs computed once (cached).
    reference = make_reference(accelerator, args, model, tokenized, collate, eval_dataloader, config)
    checkpointer, log, backoff = ddp_utils.start_training(accelerator, args, model, optimizer, plan)  # all ranks

    def evaluate(name, generate=True):  # all ranks: every validation pair once; the answers by generation
        scores = evaluate_preferences(accelerator, model, eval_dataloader, reference, args)
        if prompts is None or not generate:
            return scores, None
        path = f"{args.output_dir}/{name}.jsonl"
        answers, confusion = score_by_generation(
            accelerator, model, generate_dataloader, tokenizer, prompts, args.eval_max_new_tokens, path
        )
        return {**scores, **answers}, confusion

    def forward_backward(micro_batches, step_size):  # this rank's share of one optimizer step
        loss_sum = torch.zeros((), device=accelerator.device)
        for batch in micro_batches:
            with accelerator.accumulate(model):  # DDP syncs the gradients on the last micro-batch only
                reference_logps = reference(model, batch)  # no gradient: adapters off, or looked up
                losses, _, _ = preference_losses(pair_logps(model, batch), reference_logps, args)  # one per pair
                weights = batch[SAMPLE_WEIGHT]  # 0.0 for a filler pair
                # The mean over the step's pairs on all ranks, not over this micro-batch.
                accelerator.backward(ddp_utils.global_mean_loss(losses, weights, step_size.weight, accelerator))
                loss_sum += (losses.detach() * weights).sum()
        return loss_sum

    # Calls marked "all ranks" are collectives: every rank makes them, in the same order. Never make
    # one under `if accelerator.is_main_process`, and never leave the loop on one rank alone.
    zero_shot = {}
    if not args.skip_zero_shot and plan.step == 0:  # the scores before training
        scores, _ = evaluate("predictions_zero_shot")  # all ranks
        log.evaluation(plan, scores, when="zero-shot")
        zero_shot = {key.replace("eval_", "zero_shot_", 1): value for key, value in scores.items()}
    scores, confusion = {}, None
    for epoch in plan.epochs():
        model.train()
        for micro_batches in plan.optimizer_steps(train_dataloader, epoch):
            step_size = ddp_utils.count_step(accelerator, micro_batches)  # all ranks: the step's pairs
            loss_sum = backoff.run(forward_backward, micro_batches, step_size)  # --oom_backoff: in halves after OOM
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)  # all ranks
            optimizer.step()
            optimizer.zero_grad()
            learning_rate = lr_scheduler.get_last_lr()[0]  # the rate this step used
            lr_scheduler.step()
            plan.advance(step_size)  # count the step; no communication
            log.step(plan, loss_sum, grad_norm, learning_rate)  # all ranks: every --logging_steps a record
            if plan.evaluation_due():  # every --eval_steps: the preference scores
                scores, confusion = evaluate("predictions", generate=False)  # all ranks
                log.evaluation(plan, scores)
            checkpointer.step(plan)  # all ranks: stops for a preemption signal, saves when due
            if plan.done:
                break
        scores, confusion = evaluate("predictions")  # all ranks
        plan.end_epoch()
        log.evaluation(plan, scores)
        checkpointer.epoch(plan)  # all ranks: saves when due
        if plan.done:
            break

    log.close()
    # The model (or with LoRA the adapter, and with --merge_lora also merged/) as safetensors, with the tokenizer.
    ddp_utils.save_with_merged(accelerator, model, args, tokenizer)  # all ranks
    facts = {**data_report, "reference": reference.kind or "none", "pair_layout": layout}
    facts.update(backoff.facts(), **checkpointer.facts())
    ddp_utils.write_results(accelerator, args, plan, {**scores, **zero_shot}, facts, confusion=confusion)  # all ranks
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
