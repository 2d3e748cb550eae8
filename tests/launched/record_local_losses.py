"""Launched by the tests: runs scripts/train.py unchanged, but records what each rank's training
step saw (its local weighted loss sum and local number of examples per optimizer step) in
LOCAL_LOSS_LOG.rank<RANK>, so a test can check the logged loss against the ranks' own values.
It wraps `ddp_utils.global_mean_loss`, which the step calls once per micro-batch with the
micro-batch's per-example losses and weights; the tests that use it take one micro-batch per step.

usage: record_local_losses.py <train.py arguments>
"""

import json
import os
import runpy
import sys

import ddp_utils

original_global_mean_loss = ddp_utils.global_mean_loss
log_path = f"{os.environ['LOCAL_LOSS_LOG']}.rank{os.environ.get('RANK', '0')}"
steps_taken = []


def recording_global_mean_loss(per_example_loss, weights, step_weight, accelerator):
    steps_taken.append(1)
    with open(log_path, "a") as handle:
        handle.write(
            json.dumps(
                {
                    "step": len(steps_taken),
                    "loss_sum": float((per_example_loss.detach() * weights).sum()),
                    "examples": float(weights.sum()),
                }
            )
            + "\n"
        )
    return original_global_mean_loss(per_example_loss, weights, step_weight, accelerator)


ddp_utils.global_mean_loss = recording_global_mean_loss
script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "train.py")
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(script, run_name="__main__")
