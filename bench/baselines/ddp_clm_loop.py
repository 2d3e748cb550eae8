"""Baseline: a hand-written PyTorch DDP loop for causal-LM training, as in the DDP tutorials and
most `*_no_trainer` scripts: DistributedSampler, DistributedDataParallel, the model's own
per-micro-batch mean loss, default AdamW, perplexity on rank 0. Launched with torchrun.

usage: torchrun --nproc_per_node 2 bench/baselines/ddp_clm_loop.py OUT.json EPOCHS BATCH LR BLOCK_SIZE
"""

import json
import math
import sys
import time

import torch
import torch.distributed as dist
from common import init_distributed, demo_text_blocks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, default_data_collator, get_linear_schedule_with_warmup

from ddp_utils import weight_decay_groups
from ddp_utils.demo import demo_decoder_config_path


def main():
    out, epochs, batch_size, lr, block_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    rank, device = init_distributed()

    blocks, _ = demo_text_blocks(block_size)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(demo_decoder_config_path())).to(device)
    model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = DistributedSampler(blocks["train"], shuffle=True, seed=42)
    loader = DataLoader(blocks["train"], batch_size=batch_size, sampler=sampler, collate_fn=default_data_collator)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.01), lr=lr)
    total_steps = epochs * len(loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(0.1 * total_steps), total_steps)

    train_time, perplexity = 0.0, None
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
        if rank == 0:  # the usual evaluation: rank 0 alone, exp of the mean of batch mean losses
            model.eval()
            losses = []
            with torch.no_grad():
                for batch in DataLoader(blocks["validation"], batch_size=16, collate_fn=default_data_collator):
                    losses.append(model.module(**{k: v.to(device) for k, v in batch.items()}).loss.item())
            perplexity = math.exp(sum(losses) / len(losses))
            print(f"epoch {epoch}: eval_perplexity {perplexity:.2f}", flush=True)
        dist.barrier()

    if rank == 0:
        with open(out, "w") as handle:
            # Target tokens: every position of a block but the first predicts the next token.
            json.dump({"train_tokens": epochs * len(blocks["train"]) * (block_size - 1), "train_time_s": train_time,
                       "eval_perplexity": perplexity}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
