"""Launched by the tests: runs scripts/train.py unchanged, but records which examples each
optimizer step trained on. Each training example gets an id (its row in the training data); each
rank appends {"step": <step just taken>, "ids": [its real examples in that step]} to
STEP_LOG.rank<RANK>, so a test can compare the steps of a resumed run with an uninterrupted one's
on any layout.

It wraps three things the script calls through `ddp_utils`: `make_train_dataloader` (adds the id
column and takes it out again when a batch is collated), `count_step` (reads the ids of the step's
micro-batches and drops them before the model sees them) and `StepPlan.advance` (writes the record).

usage: record_steps.py <train.py arguments>
"""

import json
import os
import runpy
import sys

import torch

import ddp_utils

ID = "recorded_example_id"
log_path = f"{os.environ['STEP_LOG']}.rank{os.environ.get('RANK', '0')}"
pending = []
original_make_train_dataloader, original_count_step = ddp_utils.make_train_dataloader, ddp_utils.count_step
original_advance = ddp_utils.StepPlan.advance


def make_train_dataloader(dataset, args, accelerator, collate_fn, **kwargs):
    def collate(rows):
        ids = [row.pop(ID) for row in rows]
        batch = collate_fn(rows)
        batch[ID] = torch.tensor(ids)
        return batch

    return original_make_train_dataloader(
        dataset.add_column(ID, list(range(len(dataset)))), args, accelerator, collate, **kwargs
    )


def count_step(accelerator, micro_batches, *args, **kwargs):
    for batch in micro_batches:
        ids = batch.pop(ID)
        pending.extend(ids[batch[ddp_utils.SAMPLE_WEIGHT].cpu() > 0].tolist())
    return original_count_step(accelerator, micro_batches, *args, **kwargs)


def advance(plan, size):
    original_advance(plan, size)
    with open(log_path, "a") as handle:
        handle.write(json.dumps({"step": plan.step, "ids": sorted(pending)}) + "\n")
    pending.clear()


ddp_utils.make_train_dataloader, ddp_utils.count_step, ddp_utils.StepPlan.advance = (
    make_train_dataloader,
    count_step,
    advance,
)
script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "train.py")
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(script, run_name="__main__")
