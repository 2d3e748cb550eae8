"""Baseline: transformers.Trainer on the same model, data and hyper-parameters. Launched with torchrun.

usage: torchrun --nproc_per_node 2 bench/baselines/trainer_run.py --out OUT.json --epochs E --batch_size B --lr LR
           --max_length L --output_dir DIR [--seed S] [--sampling random|group_by_length] [--bf16]
           [--max_train_samples N] ...
       python bench/baselines/trainer_run.py ...   # one process, no DDP (bench/gpu_check/checklist.py on one GPU)

--sampling group_by_length is what older transformers called `group_by_length=True`; in transformers 5
it is `train_sampling_strategy="group_by_length"` (LengthGroupedSampler).
"""

import json

import numpy as np
import torch
from common import LABELS, baseline_arg_parser, count_train_padding, demo_data, peak_gpu_memory
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments, set_seed

from ddp_utils.data.demo import demo_model_path


def accuracy(eval_prediction):
    logits, labels = eval_prediction
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def main():
    p = baseline_arg_parser(__doc__)
    p.add_argument("--output_dir", required=True)
    p.add_argument(
        "--sampling", choices=["random", "group_by_length"], default="random", help="train_sampling_strategy"
    )
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (ours: a bf16 launch config)")
    p.add_argument("--train_file", default=None, help="a CSV of text and label instead of the demo (bench_scale.py)")
    p.add_argument("--validation_file", default=None, help="its validation CSV")
    p.add_argument("--max_steps", type=int, default=-1, help="stop after this many optimizer steps (bench_scale.py)")
    args = p.parse_args()
    files = {"train": args.train_file, "validation": args.validation_file} if args.train_file else None
    tokenized, tokenizer, collate = demo_data(args.max_length, args.max_train_samples, args.max_eval_samples, files)
    set_seed(args.seed)  # before the model, as run_glue.py does: the new head's initialisation follows the seed
    model = AutoModelForSequenceClassification.from_pretrained(demo_model_path(), num_labels=len(LABELS))
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=32,
        learning_rate=args.lr,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        warmup_steps=0.1,  # a float: a ratio of the steps (transformers 5)
        weight_decay=0.01,
        max_grad_norm=1.0,
        train_sampling_strategy=args.sampling,
        eval_strategy="epoch",
        save_strategy="no",
        logging_strategy="epoch",
        report_to=[],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=True,
        bf16=args.bf16,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        data_collator=collate,
        compute_metrics=accuracy,
    )
    padding = count_train_padding(trainer)
    result = trainer.train()
    eval_time = sum(entry.get("eval_runtime", 0.0) for entry in trainer.state.log_history)
    final = [entry for entry in trainer.state.log_history if "eval_accuracy" in entry][-1]
    counts = padding.totals()  # all ranks
    if trainer.is_world_process_zero():
        with open(args.out, "w") as handle:
            json.dump(
                {
                    "train_samples": args.epochs * len(tokenized["train"]),
                    "train_time_s": result.metrics["train_runtime"] - eval_time,
                    "eval_accuracy": final["eval_accuracy"],
                    "world_size": trainer.accelerator.num_processes,
                    "mixed_precision": trainer.accelerator.mixed_precision,
                    **peak_gpu_memory(),
                    **counts,
                },
                handle,
            )


if __name__ == "__main__":
    main()
