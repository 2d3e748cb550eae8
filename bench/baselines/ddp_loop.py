"""Baseline: a hand-written PyTorch DDP loop, as in the classic DDP tutorials
(init_process_group + DistributedSampler + DistributedDataParallel). Launched with torchrun.

usage: torchrun --nproc_per_node 2 bench/baselines/ddp_loop.py --out OUT.json --epochs E --batch_size B --lr LR
           --max_length L [--seed S] [--max_train_samples N] [--max_eval_samples N]
"""

import json

import torch
import torch.distributed as dist
from common import (
    LABELS,
    PaddingCounter,
    baseline_arg_parser,
    demo_data,
    init_distributed,
    tutorial_ddp_training,
    tutorial_train_epoch,
)
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification

from ddp_utils.data.demo import demo_model_path


def main():
    args = baseline_arg_parser(__doc__).parse_args()
    rank, device = init_distributed(args.seed)

    tokenized, _, collate = demo_data(args.max_length, args.max_train_samples, args.max_eval_samples)
    model = AutoModelForSequenceClassification.from_pretrained(demo_model_path(), num_labels=len(LABELS))
    padding = PaddingCounter(collate)  # the training batches only; evaluation below uses the plain collator
    model, sampler, loader, optimizer, scheduler = tutorial_ddp_training(
        model, tokenized["train"], args.batch_size, padding, args.lr, args.epochs, device, seed=args.seed
    )

    train_time, accuracy = 0.0, None
    for epoch in range(args.epochs):
        train_time += tutorial_train_epoch(model, sampler, loader, optimizer, scheduler, device, epoch)
        if rank == 0:  # the tutorials' evaluation: rank 0 alone, over the whole eval set
            model.eval()
            correct = 0
            with torch.no_grad():
                for batch in DataLoader(tokenized["validation"], batch_size=32, collate_fn=collate):
                    batch = {k: v.to(device) for k, v in batch.items()}
                    correct += (model.module(**batch).logits.argmax(-1) == batch["labels"]).sum().item()
            accuracy = correct / len(tokenized["validation"])
            print(f"epoch {epoch}: eval_accuracy {accuracy:.4f}", flush=True)
        dist.barrier()

    counts = padding.totals()  # all ranks
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump(
                {
                    "train_samples": args.epochs * len(tokenized["train"]),
                    "train_time_s": train_time,
                    "eval_accuracy": accuracy,
                    "world_size": dist.get_world_size(),
                    **counts,
                },
                handle,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
