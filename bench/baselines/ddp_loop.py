"""Baseline: a hand-written PyTorch DDP loop, as in the classic DDP tutorials
(init_process_group + DistributedSampler + DistributedDataParallel). Launched with torchrun.

usage: torchrun --nproc_per_node 2 bench/baselines/ddp_loop.py OUT.json EPOCHS BATCH LR MAX_LENGTH
"""

import json
import sys

import torch
import torch.distributed as dist
from common import LABELS, demo_data, init_distributed, tutorial_ddp_training, tutorial_train_epoch
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification

from ddp_utils.demo import demo_model_path


def main():
    out, epochs, batch_size, lr, max_length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    rank, device = init_distributed()

    tokenized, _, collate = demo_data(max_length)
    model = AutoModelForSequenceClassification.from_pretrained(demo_model_path(), num_labels=len(LABELS))
    model, sampler, loader, optimizer, scheduler = tutorial_ddp_training(model, tokenized["train"], batch_size, collate, lr, epochs, device)

    train_time, accuracy = 0.0, None
    for epoch in range(epochs):
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

    if rank == 0:
        with open(out, "w") as handle:
            json.dump({"train_samples": epochs * len(tokenized["train"]), "train_time_s": train_time, "eval_accuracy": accuracy}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
