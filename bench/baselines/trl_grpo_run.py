"""Baseline: TRL's GRPOTrainer with LoRA on the same model, prompts, rewards and settings as
scripts/train_grpo.py in bench/bench_grpo.py. Launched with torchrun (2 real processes on CPU, gloo).

usage: torchrun --nproc_per_node 2 bench/baselines/trl_grpo_run.py --out OUT.json --epochs E --batch_size PROMPTS
           --lr LR --max_length COMPLETION_TOKENS --num_generations G --model DIR --train_file PROMPTS.jsonl
           --output_dir DIR [--bf16]

Matched to ours: G samples per prompt at temperature 1 (top-p 1, no top-k), at most --max_length new tokens
each, DAPO's token-level loss (TRL's default, ours' --loss_type token), rewards scaled by the group's
standard deviation, epsilon 0.2, beta 0 (no reference), one iteration per batch, LoRA on all linear
layers with dropout off, no gradient checkpointing (GRPOConfig turns it on by default; ours has it off),
and the same two rewards with the same weights (scripts/train_grpo.py's own functions, called through
TRL's signature). --batch_size counts prompts per process, as ours does:
TRL's per_device_train_batch_size counts completions, so it is given G times that.
"""

import json

from common import baseline_arg_parser, load_script, peak_gpu_memory, trl_matched_settings
from datasets import load_dataset
from peft import LoraConfig
from transformers import set_seed
from trl import GRPOConfig, GRPOTrainer
from trl_sft_run import LoopClock


def our_rewards():
    """scripts/train_grpo.py's REWARDS, each wrapped in TRL's signature: (completions, **columns) -> floats."""
    train_grpo = load_script("train_grpo")

    def wrap(function):
        def reward(completions, answer, **_):
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # chat: the answer's turn
            return function(texts, [{"answer": a} for a in answer])

        reward.__name__ = function.__name__
        return reward

    return [wrap(f) for f in train_grpo.REWARDS], list(train_grpo.REWARDS.values())


def main():
    p = baseline_arg_parser(__doc__)
    p.add_argument("--model", required=True, help="a local model directory")
    p.add_argument("--train_file", required=True, help="JSONL of {'prompt': [chat turns], 'answer': label}")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=float, default=16)
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (ours: a bf16 launch config)")
    args = p.parse_args()

    set_seed(args.seed)
    train = load_dataset("json", data_files=args.train_file, split="train")
    rewards, weights = our_rewards()
    config = GRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size * args.num_generations,  # completions, not prompts
        num_generations=args.num_generations,
        max_completion_length=args.max_length,
        temperature=1.0,
        top_p=1.0,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=0.2,
        beta=0.0,
        num_iterations=1,
        reward_weights=weights,
        gradient_checkpointing=False,  # GRPOConfig's default is True; ours (and this bench) computes without it
        bf16=args.bf16,
        **trl_matched_settings(args),
    )
    lora = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    clock = LoopClock(None)
    trainer = GRPOTrainer(
        model=args.model, reward_funcs=rewards, args=config, train_dataset=train, peft_config=lora, callbacks=[clock]
    )
    result = trainer.train()
    state = trainer.state
    if trainer.is_world_process_zero():
        prompts = state.global_step * args.batch_size * trainer.accelerator.num_processes
        with open(args.out, "w") as handle:
            json.dump(
                {
                    "train_prompts": prompts,
                    "train_time_s": clock.seconds,
                    "train_runtime": result.metrics["train_runtime"],
                    "optimizer_steps": state.global_step,
                    "world_size": trainer.accelerator.num_processes,
                    "train_loss": result.metrics.get("train_loss"),
                    "bf16": config.bf16,
                    **peak_gpu_memory(),
                },
                handle,
            )


if __name__ == "__main__":
    main()
