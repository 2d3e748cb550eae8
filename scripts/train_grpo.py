#!/usr/bin/env python
"""Reinforcement learning from rewards (GRPO) for a causal language model, on one process or many, with
Accelerate: the model answers each prompt several times, plain Python functions score the answers, and each
answer is pushed up or down by how it did against its group. With LoRA the reference (--beta > 0) is the
same model with its adapters off. Evaluation answers the held-out prompts greedily, before and after.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/train_grpo.py
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml scripts/train_grpo.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --train_file prompts.jsonl --lora_r 16

With no arguments it runs the offline demo: SmolLM2-135M-Instruct (LoRA), with no SFT first, is asked the
SFT demo's question about the packaged drug reviews and rewarded for the right word and a short answer. For
your own prompts pass --train_file (records with a "prompt", and what your rewards read), and edit the
rewards in the DATA section. The demo has settings of its own (`DEMO_DEFAULTS`); --help shows the defaults for
your own model.
"""

import argparse
import dataclasses
import math

import datasets
import torch
from accelerate.logging import get_logger

import ddp_utils
from ddp_utils import UsageError
from ddp_utils.data.demo import DEMO_QUESTION, DEMO_SYSTEM, demo_llm_gguf, load_demo_reviews
from ddp_utils.language_models.causal_lm import model_context
from ddp_utils.language_models.generation import (
    answer_label,
    make_generation_dataloader,
    normalize_answer,
    score_by_generation,
)
from ddp_utils.language_models.group_scoring import completion_logps
from ddp_utils.language_models.grpo import (
    LOSS_TYPES,
    LOSS_WEIGHT,
    check_grpo_args,
    decode_completions,
    finish_rollouts,
    group_advantages,
    grpo_losses,
    reference_logps,
    sample_completions,
    score_completions,
    settle_grpo_metric,
)
from ddp_utils.language_models.grpo_data import PromptCollator, fit_prompts_in_block, held_out_answers, tokenize_prompts
from ddp_utils.language_models.grpo_log import GenerationClock, learning_signal, rollout_sums
from ddp_utils.language_models.pair_scoring import choose_pair_layout
from ddp_utils.language_models.static_decoding import StaticDecoding

logger = get_logger(__name__)

# The demo (no --model_name_or_path): sizes chosen so `make train-grpo` runs in minutes on 2 CPU processes.
DEMO_DEFAULTS = dict(
    lora_r=16, lora_dropout=0.0, learning_rate=2e-4, per_device_train_batch_size=2, per_device_eval_batch_size=32
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=ddp_utils.HelpFormatter)  # with defaults
    # Model and data. Nothing given: SmolLM2-135M-Instruct and the drug reviews' question.
    p.add_argument("--model_name_or_path", default=None, help="Hub model id or local directory (default: the demo LLM)")
    p.add_argument("--dataset_name", default=None, help="Hub dataset name")
    p.add_argument("--dataset_config_name", default=None, help="Hub dataset configuration")
    p.add_argument("--train_split", default=None, help="the Hub dataset's training split (default: train)")
    p.add_argument("--validation_split", default=None, help="its validation split (default: validation, else test)")
    p.add_argument("--train_file", default=None, help="prompts: .json(l) .csv .parquet, or a folder or glob")
    p.add_argument("--validation_file", default=None, help="local held-out prompts (default: split off the training)")
    p.add_argument("--validation_split_percentage", type=int, default=5, help="%% held out without a validation split")
    p.add_argument("--max_train_samples", type=int, default=None, help="use only the first N training prompts")
    p.add_argument("--max_eval_samples", type=int, default=None, help="use only the first N held-out prompts")
    p.add_argument("--max_prompt_length", type=int, default=512, help="longer prompts are cut after BOS/system turn")
    # Sampling and the loss.
    p.add_argument("--num_generations", type=int, default=8, help="answers sampled per prompt (a group)")
    p.add_argument("--max_completion_length", type=int, default=64, help="tokens per sampled answer, at most")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling: the top tokens holding this mass")
    p.add_argument("--loss_type", choices=LOSS_TYPES, default="token", help="mean over tokens (DAPO) or answers")
    p.add_argument("--scale_rewards", action=argparse.BooleanOptionalAction, default=True, help="divide by group std")
    p.add_argument("--epsilon", type=float, default=0.2, help="the ratio's clip below: 1 - epsilon")
    p.add_argument("--epsilon_high", type=float, default=None, help="the ratio's clip above (default: --epsilon)")
    p.add_argument("--num_iterations", type=int, default=1, help="optimizer steps on each batch of samples")
    p.add_argument("--beta", type=float, default=0.0, help="weight of the KL to the reference (LoRA's adapters off)")
    p.add_argument("--compile_generation", action="store_true", help="sample in CUDA graphs: a static cache (GPU)")
    p.add_argument("--eval_max_new_tokens", type=int, default=8, help="greedy answer length at evaluation; 0: none")
    p.add_argument("--skip_zero_shot", action="store_true", help="do not evaluate the model before training")
    ddp_utils.add_causal_lm_args(p)  # GGUF, --block_size, LoRA, gradient checkpointing, torch.compile
    ddp_utils.add_training_args(p)  # batch sizes (prompts), learning rate, checkpoints, output, tracking
    p.set_defaults(output_dir="outputs/train_grpo", num_train_epochs=1, learning_rate=1e-5)
    args = p.parse_args(argv)
    if args.model_name_or_path is None:  # the demo's own defaults; what the command line gives still wins
        if args.gguf_file:
            raise UsageError("--gguf_file names a file in --model_name_or_path: give that too")
        p.set_defaults(**DEMO_DEFAULTS, num_generations=8, max_completion_length=8)
        args = p.parse_args(argv)
        args.model_name_or_path, args.gguf_file = demo_llm_gguf()
    args.epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    ddp_utils.check_training_args(args)
    check_grpo_args(args)
    ddp_utils.check_causal_lm_args(args)
    ddp_utils.check_data_args(args, "train_file", "validation_file")
    return args


# ==================================== DATA ====================================
# The one place to edit for your own task. `load_raw_datasets` returns a DatasetDict with a "train" split
# (and "validation" if you have one) holding a "prompt" column (a string, or chat turns as a list of
# {"role", "content"}) and whatever your rewards read; an "answer" column also gives the accuracy of the
# greedy answers at evaluation. Your own names, on what the --train_file branch below returns:
#   data = data.rename_columns({"question": "prompt", "solution": "answer"})
# A reward function takes the completions (strings) and their records, and returns one number per completion.
DEMO_REVIEW_WORDS = 50  # each review's last words, as in the DPO demo
DEMO_PROMPTS_PER_LABEL = 64  # 64 negative, 64 positive and the 54 neutral training reviews
LABELS = ["negative", "neutral", "positive"]


def load_raw_datasets(args):
    if args.train_file:
        files = {"train": args.train_file, **({"validation": args.validation_file} if args.validation_file else {})}
        return ddp_utils.read_data_files(files)
    if args.dataset_name:
        raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        return ddp_utils.named_splits(raw, args.train_split, args.validation_split)  # the Hub's own split names

    def as_prompt(review):  # offline demo: the SFT demo's question, its label the answer
        text = " ".join(review["text"].split()[-DEMO_REVIEW_WORDS:])
        prompt = [{"role": "system", "content": DEMO_SYSTEM}, {"role": "user", "content": f"{text}\n\n{DEMO_QUESTION}"}]
        return {"prompt": prompt, "answer": review["label"]}

    reviews, keep, seen = load_demo_reviews(), [], {}
    for i, label in enumerate(reviews["train"]["label"]):  # each label as often, as far as the data goes:
        seen[label] = seen.get(label, 0) + 1  # with 2/3 positive, "positive" to all earned 0.65 (bench/README.md)
        keep += [i] if seen[label] <= DEMO_PROMPTS_PER_LABEL else []
    reviews["train"] = reviews["train"].select(keep)
    return reviews.map(as_prompt, remove_columns=["label", "text"])


def right_word(completions, records):  # 1 when the answer names the record's label, and no other
    return [float(answer_label(normalize_answer(c), LABELS) == r["answer"]) for c, r in zip(completions, records)]


def short_answer(completions, records):  # 1 for one word, less for each word more
    return [1.0 / max(len(c.split()), 1) for c in completions]


REWARDS = {right_word: 1.0, short_answer: 0.5}  # each function and its weight in the reward
# ==============================================================================


def prepare_data(args):
    """Load, check and tokenize the prompts; load the model's config and tokenizer (a GGUF file dequantized
    into its cached copy first). Runs on the main process first, then on the others."""
    raw = load_raw_datasets(args)
    limits = {"train": args.max_train_samples, "validation": args.max_eval_samples}
    raw = ddp_utils.check_splits(
        raw, {"prompt": "prompts"}, limits=limits, seed=args.seed, hold_out_percentage=args.validation_split_percentage
    )
    config, tokenizer, _ = ddp_utils.load_config_and_tokenizer(args)
    references = held_out_answers(raw["validation"], args)  # what greedy answers are scored against; None: not
    settle_grpo_metric(args, references)  # rank checkpoints by accuracy, exact match, or nothing to rank by
    fit_prompts_in_block(args, model_context(config, tokenizer), references is not None)  # prompt and answer fit
    chat = tokenizer.chat_template is not None
    processes = ddp_utils.preparation_processes(args, len(raw["train"]))  # the node's cores, for large data
    tokenized = tokenize_prompts(raw, tokenizer, args.max_prompt_length, chat, processes)
    if references is not None:  # scored against the greedy answers at evaluation
        tokenized["validation"] = tokenized["validation"].add_column("reference", references)
    return tokenized, tokenizer, config, raw


def main():
    args = parse_args()
    accelerator = ddp_utils.start_run(args, dynamo_backend="inductor" if args.torch_compile else "no")

    tokenized, tokenizer, config, raw = ddp_utils.load_on_main_first(accelerator, prepare_data, args)
    model = ddp_utils.load_causal_lm(args, config, tokenizer)  # every rank at once (a collective under ZeRO-3)
    # All ranks: one row per prompt, its G completions after it, where that scores each as if alone; else a row each.
    block = (args.max_prompt_length + args.num_generations * args.max_completion_length) // 2 + 1
    layout = choose_pair_layout(accelerator, model, block)
    multiple = ddp_utils.pad_multiple(accelerator)  # 8 under mixed precision: tensor cores like them
    decoding = None  # --compile_generation: a static cache for the samples, checked here, before training
    if args.compile_generation:
        decoding = StaticDecoding(accelerator, model, args.max_prompt_length, args.max_completion_length)
    ddp_utils.train_in_fp32(accelerator, model)  # AdamW on bf16 weights would lose small updates; LoRA's base stays
    train_dataloader = ddp_utils.make_train_dataloader(
        tokenized["train"], args, accelerator, PromptCollator(tokenizer.pad_token_id), length_column="length"
    )
    generate_prompts = None
    if "reference" in tokenized["validation"].column_names:  # the held-out prompts' answers, to score greedy ones
        generate_prompts = tokenized["validation"]
        generate_dataloader = make_generation_dataloader(
            generate_prompts, args.per_device_eval_batch_size, tokenizer, config
        )
    optimizer = ddp_utils.make_adamw(model, args.learning_rate, args.weight_decay)  # trainable parameters only
    plan = ddp_utils.StepPlan(accelerator, args, train_dataloader, unit="prompts")  # steps, epochs, progress
    lr_scheduler = ddp_utils.make_lr_scheduler(optimizer, args, plan.max_train_steps * args.num_iterations)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    if generate_prompts is not None:
        generate_dataloader = accelerator.prepare(generate_dataloader)
    checkpointer, log, _ = ddp_utils.start_training(accelerator, args, model, optimizer, plan)  # all ranks
    names = [function.__name__ for function in REWARDS]
    clock = GenerationClock()

    def evaluate(name):  # all ranks: each held-out prompt answered once, greedily
        if generate_prompts is None:
            return {}, None
        path = f"{args.output_dir}/{name}.jsonl"
        return score_by_generation(
            accelerator, model, generate_dataloader, tokenizer, generate_prompts, args.eval_max_new_tokens, path
        )

    def generate_and_score(micro_batches):  # all ranks: this rank's samples of the step, their rewards
        with clock:  # each prompt's group on this rank, sampled by (seed, step, prompt, sample)
            rollouts = [
                sample_completions(accelerator, model, b, tokenizer, args, plan.step, decoding) for b in micro_batches
            ]
        records = [raw["train"][int(i)] for r in rollouts for i in r["index"]]
        values, rewards = score_completions(accelerator, REWARDS, decode_completions(tokenizer, rollouts), records)
        advantages = group_advantages(torch.tensor(rewards).float(), args.num_generations, args.scale_rewards)
        finish_rollouts(rollouts, advantages, args, layout, tokenizer.pad_token_id, multiple)  # loss weights
        sums = rollout_sums(rollouts, values, rewards, names, args.num_generations, accelerator.device)
        return rollouts, sums

    def forward_backward(rollouts, step_size, old, sums):  # this rank's share of one optimizer step
        loss_sum = torch.zeros((), device=accelerator.device)
        for k, rollout in enumerate(rollouts):
            with accelerator.accumulate(model):  # DDP syncs the gradients on the last micro-batch only
                logps = completion_logps(model, rollout, layout, args.temperature)
                if len(old) == k:  # the first pass over these samples: the policy they were sampled from
                    old.append(logps.detach())
                ref_logps = None
                if args.beta:  # the KL's reference: the same model with its adapters off
                    ref_logps = reference_logps(accelerator, model, rollout, layout, args.temperature)
                losses, weights, parts = grpo_losses(logps, old[k], ref_logps, rollout, args)
                # The mean over the step's completion tokens (or completions) on all ranks, not this micro-batch's.
                accelerator.backward(ddp_utils.global_mean_loss(losses, weights, step_size.weight, accelerator))
                loss_sum += (losses.detach() * weights).sum()
                for key, (num, den) in parts.items():
                    sums[key] = (sums.get(key, (0.0, 0.0))[0] + num.detach(), sums.get(key, (0.0, 0.0))[1] + den)
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
            clock.new_step()
            prompts = ddp_utils.count_step(accelerator, micro_batches)  # all ranks: the step's prompts
            rollouts, sums = generate_and_score(micro_batches)  # all ranks: generate, score, advantages
            step_size = ddp_utils.count_step(accelerator, rollouts, weight_key=LOSS_WEIGHT)  # all ranks
            old, loss_sum = [], 0.0  # --num_iterations: each pass's ratio is to the log-probs of the first
            for iteration in range(args.num_iterations):
                rollout_batches = micro_batches.with_batches(rollouts, iteration)  # dropout seeded per micro-batch
                loss_sum += forward_backward(rollout_batches, step_size, old, sums) / args.num_iterations
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)  # all ranks
                optimizer.step()
                optimizer.zero_grad()
                learning_rate = lr_scheduler.get_last_lr()[0]  # the rate this step used
                lr_scheduler.step()
            plan.advance(dataclasses.replace(prompts, tokens=step_size.tokens))  # count the step; no communication
            sums["generation_share"] = clock.share()
            loss_sum = loss_sum * prompts.weight / step_size.weight  # the log divides by the prompts
            log.step(plan, loss_sum, grad_norm, learning_rate, means=sums)  # all ranks: every --logging_steps a record
            if plan.evaluation_due():  # every --eval_steps: greedy answers to the held-out prompts
                scores, confusion = evaluate("predictions")  # all ranks
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
    facts = {"rewards": dict(zip(names, REWARDS.values())), "group_layout": layout, **learning_signal(log)}
    facts.update(checkpointer.facts())  # the best checkpoint
    ddp_utils.write_results(accelerator, args, plan, {**scores, **zero_shot}, facts, confusion=confusion)  # all ranks
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
