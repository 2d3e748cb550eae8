"""Launched by the tests: runs scripts/train.py unchanged, but rank 0 raises in the training step
of optimizer step FAIL_AT (1-based; one micro-batch per step), as a bug or an out-of-memory error
would, after the steps before it were logged. Each call of the TensorBoard tracker's `finish`
(which closes its writer) is recorded in FINISH_LOG, with the rank.

usage: fail_at_step.py FAIL_AT <train.py arguments>
"""

import os
import runpy
import sys

from accelerate.tracking import TensorBoardTracker

import ddp_utils

original_finish = TensorBoardTracker.finish


def recording_finish(self):
    with open(os.environ["FINISH_LOG"], "a") as handle:
        handle.write(f"tensorboard finished on rank {os.environ.get('RANK', '0')}\n")
    return original_finish(self)


TensorBoardTracker.finish = recording_finish

fail_at, calls = int(sys.argv[1]), []
original_global_mean_loss = ddp_utils.global_mean_loss


def failing_global_mean_loss(*args, **kwargs):
    calls.append(1)
    if len(calls) == fail_at and os.environ.get("RANK", "0") == "0":
        raise RuntimeError(f"injected failure in step {fail_at}")
    return original_global_mean_loss(*args, **kwargs)


ddp_utils.global_mean_loss = failing_global_mean_loss
script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "train.py")
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
