"""Baseline: a hand-written PyTorch DDP loop, as in the classic DDP tutorials
(init_process_group + DistributedSampler + DistributedDataParallel). Launched with torchrun.

usage: torchrun --nproc_per_node 2 bench/baselines/ddp_loop.py OUT.json EPOCHS BATCH LR MAX_LENGTH
"""

import json
import math
import sys
import time

import torch
import torch.distributed as dist
from common import init_distributed, LABELS, demo_data
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForSequenceClassification, get_linear_schedule_with_warmup

from ddp_utils import weight_decay_groups
from ddp_utils.demo import demo_model_path


def main():
    out, epochs, batch_size, lr, max_length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    rank, device = init_distributed()

    tokenized, _, collate = demo_data(max_length)
    model = AutoModelForSequenceClassification.from_pretrained(demo_model_path(), num_labels=len(LABELS)).to(device)
    model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = DistributedSampler(tokenized["train"], shuffle=True, seed=42)
    loader = DataLoader(tokenized["train"], batch_size=batch_size, sampler=sampler, collate_fn=collate)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.01), lr=lr)
    total_steps = epochs * len(loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(0.1 * total_steps), total_steps)

    train_time, accuracy = 0.0, None
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.perf_counter()
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        train_time += time.perf_counter() - start
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
