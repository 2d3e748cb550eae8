"""Baseline: TRL's DPOTrainer with LoRA on the same model, pairs and hyper-parameters as
scripts/train_dpo.py in bench/bench_dpo.py. Launched with torchrun (2 real processes on CPU, gloo).

usage: torchrun --nproc_per_node 2 bench/baselines/trl_dpo_run.py --out OUT.json --epochs E --batch_size B --lr LR
           --max_length L --model DIR --train_file PAIRS.jsonl --output_dir DIR [--precompute_ref_log_probs] [--bf16]
           [--gradient_checkpointing] [--full]

Matched to ours: the sigmoid (DPO) loss with the same beta, LoRA on all linear layers, dropout off
(DPOConfig's disable_dropout, ours' --lora_dropout 0), the reference as the model with its adapters
turned off (TRL does so with a PEFT model and no ref_model), or with --precompute_ref_log_probs
computed once before training, as ours' --precompute_reference. fp32 and no gradient checkpointing
by default, as ours on a CPU. The results add the peak GPU memory on a GPU.
"""

import json

from common import baseline_arg_parser, peak_gpu_memory, trl_matched_settings
from datasets import load_dataset
from peft import LoraConfig
from transformers import set_seed
from trl import DPOConfig, DPOTrainer
from trl_sft_run import LoopClock


def main():
    p = baseline_arg_parser(__doc__)
    p.add_argument("--model", required=True, help="a local model directory")
    p.add_argument("--train_file", required=True, help="JSONL of {'prompt', 'chosen', 'rejected'} conversations")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=float, default=16)
    p.add_argument("--precompute_ref_log_probs", action="store_true", help="the reference's log-probs before training")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (ours: a bf16 launch config)")
    p.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations, as ours' flag")
    p.add_argument("--full", action="store_true", help="full fine-tuning: no LoRA (then a reference model copy)")
    args = p.parse_args()

    set_seed(args.seed)
    train = load_dataset("json", data_files=args.train_file, split="train")
    config = DPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        beta=args.beta,
        loss_type=["sigmoid"],
        max_length=args.max_length,
        precompute_ref_log_probs=args.precompute_ref_log_probs,
        bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing,
        **trl_matched_settings(args),
    )
    lora = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    clock = LoopClock(None)
    trainer = DPOTrainer(
        model=args.model, args=config, train_dataset=train, peft_config=None if args.full else lora, callbacks=[clock]
    )
    result = trainer.train()
    state = trainer.state
    if trainer.is_world_process_zero():
        with open(args.out, "w") as handle:
            json.dump(
                {
                    "train_pairs": args.epochs * len(train),
                    "train_time_s": clock.seconds,
                    "train_runtime": result.metrics["train_runtime"],
                    "optimizer_steps": state.global_step,
                    "world_size": trainer.accelerator.num_processes,
                    "train_loss": result.metrics.get("train_loss"),
                    "precompute_ref_log_probs": config.precompute_ref_log_probs,
                    "bf16": config.bf16,
                    "gradient_checkpointing": config.gradient_checkpointing,
                    "lora": not args.full,
                    **peak_gpu_memory(),
                },
                handle,
            )


if __name__ == "__main__":
    main()
