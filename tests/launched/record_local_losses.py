"""Launched by the tests: runs scripts/train.py unchanged, but records what each rank's
`ddp_utils.train_step` saw (its local loss sum and local number of examples per optimizer step)
in LOCAL_LOSS_LOG.rank<RANK>, so a test can check the logged loss against the ranks' own values.

usage: record_local_losses.py <train.py arguments>
"""

import json
import os
import runpy
import sys

import ddp_utils
from ddp_utils import SAMPLE_WEIGHT

original_train_step = ddp_utils.train_step
log_path = f"{os.environ['LOCAL_LOSS_LOG']}.rank{os.environ.get('RANK', '0')}"
steps_taken = []


def recording_train_step(accelerator, model, optimizer, micro_batches, step_size, loss_fn, max_grad_norm):
    local_examples = sum(float(batch[SAMPLE_WEIGHT].sum()) for batch in micro_batches)  # before the loss pops it
    step = original_train_step(accelerator, model, optimizer, micro_batches, step_size, loss_fn, max_grad_norm)
    steps_taken.append(1)
    with open(log_path, "a") as handle:
        handle.write(json.dumps({"step": len(steps_taken), "loss_sum": float(step.loss_sum), "examples": local_examples}) + "\n")
    return step


ddp_utils.train_step = recording_train_step
script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "train.py")
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(script, run_name="__main__")
