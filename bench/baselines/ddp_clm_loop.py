"""Baseline: a hand-written PyTorch DDP loop for causal-LM training, as in the DDP tutorials and
most `*_no_trainer` scripts: DistributedSampler, DistributedDataParallel, the model's own
per-micro-batch mean loss, default AdamW, perplexity on rank 0. Launched with torchrun.

usage: torchrun --nproc_per_node 2 bench/baselines/ddp_clm_loop.py OUT.json EPOCHS BATCH LR BLOCK_SIZE
"""

import json
import math
import sys

import torch
import torch.distributed as dist
from common import demo_text_blocks, init_distributed, tutorial_ddp_training, tutorial_train_epoch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, default_data_collator

from ddp_utils.data.demo import bench_decoder_config_path


def main():
    out, epochs, batch_size, lr, block_size = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        float(sys.argv[4]),
        int(sys.argv[5]),
    )
    rank, device = init_distributed()

    blocks, _ = demo_text_blocks(block_size)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(bench_decoder_config_path()))
    model, sampler, loader, optimizer, scheduler = tutorial_ddp_training(
        model, blocks["train"], batch_size, default_data_collator, lr, epochs, device
    )

    train_time, perplexity = 0.0, None
    for epoch in range(epochs):
        train_time += tutorial_train_epoch(model, sampler, loader, optimizer, scheduler, device, epoch)
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
            json.dump(
                {
                    "train_tokens": epochs * len(blocks["train"]) * (block_size - 1),
                    "train_time_s": train_time,
                    "eval_perplexity": perplexity,
                },
                handle,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
