"""Launched by the tests: which examples each rank draws, epoch by epoch, through the same
ddp_utils.make_train_dataloader / StepPlan.optimizer_steps / count_step path as the training
scripts. With RESUME_EPOCH and RESUME_STEPS it also records that epoch as a run resumed after
RESUME_STEPS optimizer steps sees it.

usage: count_samples.py OUT.json NUM_EXAMPLES PER_DEVICE_BATCH EPOCHS [ACCUMULATION RESUME_EPOCH RESUME_STEPS]
"""

import argparse
import json
import sys

import datasets
import torch
from accelerate.utils import gather_object

import ddp_utils
from ddp_utils import SAMPLE_WEIGHT
from ddp_utils.lifecycle.start import make_accelerator


def collate(rows):
    return {key: torch.tensor([row[key] for row in rows]) for key in rows[0]}


def epoch_batches(accelerator, plan, loader, epoch, steps_done=0):
    """This rank's (ids, weights) per micro-batch, in order, as the training loop sees them."""
    plan.progress["step_in_epoch"] = steps_done
    seen = []
    for micro_batches in plan.optimizer_steps(loader, epoch):
        ddp_utils.count_step(accelerator, micro_batches)  # as the scripts do: every rank, every step
        seen += [(b["example_id"].tolist(), b[SAMPLE_WEIGHT].tolist()) for b in micro_batches]
    return seen


def main():
    out, num_examples, batch_size, epochs = sys.argv[1], *map(int, sys.argv[2:5])
    accumulation, resume_epoch, resume_steps = map(int, sys.argv[5:8]) if len(sys.argv) > 5 else (1, None, None)
    accelerator = make_accelerator(seed=7, gradient_accumulation_steps=accumulation)
    dataset = datasets.Dataset.from_dict({"example_id": list(range(num_examples))})
    options = argparse.Namespace(
        max_train_steps=None, num_train_epochs=epochs, per_device_train_batch_size=batch_size, num_workers=0
    )
    loader = ddp_utils.make_train_dataloader(dataset, options, accelerator, collate)
    plan = ddp_utils.StepPlan(accelerator, options, loader)
    loader = accelerator.prepare(loader)
    record = {
        "world_size": accelerator.num_processes,
        "epochs": [gather_object([epoch_batches(accelerator, plan, loader, e)]) for e in range(epochs)],
    }
    if resume_epoch is not None:
        record["resumed"] = gather_object([epoch_batches(accelerator, plan, loader, resume_epoch, resume_steps)])
    if accelerator.is_main_process:
        with open(out, "w") as handle:
            json.dump(record, handle)
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
