"""Launched by the tests: runs scripts/train.py unchanged, but on rank 0 the WHAT-th write fails
with "No space left on device", as on a full disk: WHAT is "checkpoint N" (the N-th
`accelerator.save_state`) or "model" (the final `save_pretrained`).

usage: fail_writes.py WHAT <train.py arguments>
"""

import errno
import os
import runpy
import sys

import accelerate

import ddp_utils.results.output

what = sys.argv[1]
rank = int(os.environ.get("RANK", "0"))
calls = []


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), args[-1] if args else "")


if what.startswith("checkpoint") and rank == 0:
    original_save_state, failing_call = accelerate.Accelerator.save_state, int(what.split()[1])

    def save_state(self, output_dir=None, *args, **kwargs):
        calls.append(output_dir)
        if len(calls) == failing_call:
            full_disk(output_dir)
        return original_save_state(self, output_dir, *args, **kwargs)

    accelerate.Accelerator.save_state = save_state
elif what == "model" and rank == 0:
    ddp_utils.results.output.write_pretrained = full_disk

script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "train.py")
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
