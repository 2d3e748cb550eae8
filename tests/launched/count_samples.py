"""Launched by the tests: which examples each rank draws, epoch by epoch, through the same
ddp_utils.make_train_dataloader + accelerator.prepare path that the training scripts use.

usage: count_samples.py OUT.json NUM_EXAMPLES PER_DEVICE_BATCH EPOCHS
"""

import json
import sys

import datasets
import torch
from accelerate.utils import gather_object

import ddp_utils
from ddp_utils import SAMPLE_WEIGHT


def collate(rows):
    return {key: torch.tensor([row[key] for row in rows]) for key in rows[0]}


def main():
    out, num_examples, batch_size, epochs = sys.argv[1], *map(int, sys.argv[2:5])
    accelerator = ddp_utils.make_accelerator(seed=7)
    dataset = datasets.Dataset.from_dict({"example_id": list(range(num_examples))})
    loader = ddp_utils.make_train_dataloader(dataset, batch_size=batch_size, accelerator=accelerator, collate_fn=collate)
    loader = accelerator.prepare(loader)
    epochs_seen = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        batches = [(batch["example_id"].tolist(), batch[SAMPLE_WEIGHT].tolist()) for batch in loader]
        epochs_seen.append(gather_object([batches]))  # one list of batches per rank
    if accelerator.is_main_process:
        with open(out, "w") as handle:
            json.dump({"world_size": accelerator.num_processes, "epochs": epochs_seen}, handle)
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
