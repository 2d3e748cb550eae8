"""Baseline: TRL's SFTTrainer with LoRA on the same model, chat data and hyper-parameters as
scripts/train_sft.py in bench/bench_sft.py. Launched with torchrun (2 real processes on CPU, gloo).

usage: torchrun --nproc_per_node 2 bench/baselines/trl_sft_run.py --out OUT.json --epochs E --batch_size B --lr LR
           --max_length L --model DIR --train_file TRAIN.jsonl --output_dir DIR [--trl_defaults] [--time_cap_s S]
           [--bf16] [--gradient_checkpointing] [--full] [--padding_free | --packing] [--prompt_completion]
           [--dataset_num_proc N] [--load_in_4bit]

Matched (the default): fp32, no gradient checkpointing, like ours on a CPU. --trl_defaults leaves
precision and gradient checkpointing to SFTConfig's own defaults (bf16=True, gradient_checkpointing=True),
what a user gets; --time_cap_s stops it after the first optimizer step that ends past that many seconds
of training, and the results say how many steps it finished.

On a GPU (bench/gpu_check/checklist.py), each of our runs is matched by TRL with its best settings for
the same case: --bf16, --gradient_checkpointing when ours uses it, --full for full fine-tuning, and
--padding_free (no padding: every batch flattened into one sequence) or --packing (best-fit decreasing
into rows of --max_length). --prompt_completion gives TRL each conversation as a conversational
prompt/completion pair (the last assistant turn is the completion), so that it learns the answer
only, as ours does. --load_in_4bit is QLoRA as ours' --load_in_4bit: the base loaded through TRL's own
`quantization_config` with the same BitsAndBytesConfig (NF4, double quantization, computing in bf16 with
--bf16, else fp32) on this process's device; TRL then keeps the adapters in bf16, its own QLoRA choice.
The results add the real input tokens and the target tokens of its batches and, on a GPU, the peak GPU
memory.
"""

import json
import time

import torch
import torch.distributed as dist
from accelerate import PartialState
from common import baseline_arg_parser, count_train_padding, peak_gpu_memory, reduce_over_ranks, trl_matched_settings
from datasets import load_dataset
from peft import LoraConfig
from transformers import BitsAndBytesConfig, TrainerCallback, set_seed
from trl import SFTConfig, SFTTrainer


class LoopClock(TrainerCallback):
    """Times the training loop alone (from on_train_begin, after the model is wrapped, to
    on_train_end) and, with a cap, ends training after the step that ends past it. The ranks agree
    on stopping (an all-reduce per step): one rank stopping alone would leave the other waiting in
    the next gradient all-reduce."""

    def __init__(self, cap_s: float | None):
        self.cap_s, self.start, self.seconds, self.capped = cap_s, None, None, False

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.cap_s is None:
            return
        [over] = reduce_over_ranks([float(time.perf_counter() - self.start > self.cap_s)], op=dist.ReduceOp.MAX)
        if over and state.global_step < state.max_steps:
            self.capped = control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self.start


def main():
    p = baseline_arg_parser(__doc__)
    p.add_argument("--model", required=True, help="a local model directory")
    p.add_argument("--train_file", required=True, help="JSONL of {'messages': [...]} records")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=float, default=16)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument(
        "--trl_defaults", action="store_true", help="SFTConfig's own bf16 and gradient checkpointing (both on)"
    )
    p.add_argument(
        "--time_cap_s", type=float, default=None, help="stop after the step that ends past this many seconds"
    )
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (ours: a bf16 launch config)")
    p.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations, as ours' flag")
    p.add_argument("--full", action="store_true", help="full fine-tuning: no LoRA")
    p.add_argument("--padding_free", action="store_true", help="each batch flattened into one sequence, no padding")
    p.add_argument("--packing", action="store_true", help="best-fit decreasing packing into rows of --max_length")
    p.add_argument(
        "--dataset_num_proc", type=int, default=None, help="processes that tokenize the data (SFTConfig's own)"
    )
    p.add_argument(
        "--prompt_completion",
        action="store_true",
        help="train on the last assistant turn only: each conversation as a prompt/completion pair",
    )
    p.add_argument("--load_in_4bit", action="store_true", help="QLoRA: the base in 4-bit NF4, as ours' flag")
    args = p.parse_args()
    if args.load_in_4bit and args.full:
        p.error("--load_in_4bit trains LoRA adapters on a 4-bit base: drop --full")

    set_seed(args.seed)  # the LoRA weights SFTTrainer initialises follow the seed, as ours do
    train = load_dataset("json", data_files=args.train_file, split="train")
    if args.prompt_completion:  # conversational prompt/completion: TRL's loss is then on the completion only
        train = train.map(
            lambda r: {"prompt": r["messages"][:-1], "completion": r["messages"][-1:]}, remove_columns=["messages"]
        )
    if args.trl_defaults:
        matched = {}
    else:  # ours: fp32 without checkpointing on a CPU; on a GPU, bf16 and checkpointing as the case asks
        matched = {"bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing}
    if args.padding_free or args.packing:
        matched["padding_free"] = True
        matched["packing"] = args.packing
    if args.padding_free and not args.packing:
        matched["max_length"] = None  # TRL refuses a max_length it would not enforce; the records are shorter
    quantization = None
    if args.load_in_4bit:  # ddp_utils/language_models/quantized.py's config, field for field
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        )
        # quantized on the device it trains on, as ours (TRL's default there: "auto" on a GPU, none on a CPU)
        matched["model_init_kwargs"] = {"device_map": {"": PartialState().device}}
    config = SFTConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        **trl_matched_settings(args),
        dataset_num_proc=args.dataset_num_proc,
        **{"max_length": args.max_length, **matched},
    )
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    clock = LoopClock(args.time_cap_s)
    peft_config = None if args.full else lora
    trainer = SFTTrainer(
        model=args.model,
        args=config,
        train_dataset=train,
        peft_config=peft_config,
        quantization_config=quantization,
        callbacks=[clock],
    )
    padding = count_train_padding(trainer)
    result = trainer.train()
    counts = padding.totals()  # all ranks
    state = trainer.state
    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    if trainer.is_world_process_zero():
        # Stopped early, every step it took was full; otherwise it trained every record once per epoch.
        samples = (
            state.global_step * args.batch_size * trainer.accelerator.num_processes
            if clock.capped
            else args.epochs * len(train)
        )
        with open(args.out, "w") as handle:
            json.dump(
                {
                    "train_samples": samples,
                    "train_time_s": clock.seconds,
                    "train_runtime": result.metrics["train_runtime"],
                    "optimizer_steps": state.global_step,
                    "planned_steps": state.max_steps,
                    "capped": clock.capped,
                    "bf16": config.bf16,
                    "gradient_checkpointing": config.gradient_checkpointing,
                    "world_size": trainer.accelerator.num_processes,
                    "train_loss": result.metrics.get("train_loss"),
                    "padding_free": getattr(trainer, "padding_free", False),
                    "packing": config.packing,
                    "lora": not args.full,
                    "load_in_4bit": bool(getattr(base, "is_loaded_in_4bit", False)),
                    "completion_only_loss": getattr(trainer, "completion_only_loss", None),
                    **peak_gpu_memory(),
                    **counts,
                },
                handle,
            )


if __name__ == "__main__":
    main()
