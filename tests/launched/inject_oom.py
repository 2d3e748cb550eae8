"""Launched by the tests: runs a training script unchanged, but one rank behaves as if its GPU
memory held at most MAX_ROWS rows per micro-batch: from its FROM_CALL-th micro-batch on (1-based,
counting every forward pass of the training step), a micro-batch of more rows raises
`torch.OutOfMemoryError` after its forward pass, before its backward pass, as a CUDA allocation
would. It wraps `ddp_utils.global_mean_loss`, which the step calls once per micro-batch with its
per-example (or per-token) losses.

usage: inject_oom.py SCRIPT RANK FROM_CALL MAX_ROWS <script arguments>
       (SCRIPT: train, train_sft, train_clm or train_image)
"""

import os
import runpy
import sys

import torch

import ddp_utils

script_name, oom_rank, from_call, max_rows = sys.argv[1], *map(int, sys.argv[2:5])
rank = int(os.environ.get("RANK", "0"))
original_global_mean_loss = ddp_utils.global_mean_loss
calls = []


def global_mean_loss(per_example_loss, *args, **kwargs):
    calls.append(1)
    rows = per_example_loss.shape[0]
    if rank == oom_rank and len(calls) >= from_call and rows > max_rows:
        print(f"injected: out of memory on rank {rank} in micro-batch {len(calls)} ({rows} rows)", flush=True)
        raise torch.OutOfMemoryError(f"injected: CUDA out of memory ({rows} rows, at most {max_rows} fit)")
    return original_global_mean_loss(per_example_loss, *args, **kwargs)


ddp_utils.global_mean_loss = global_mean_loss
script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", f"{script_name}.py")
sys.argv = [script, *sys.argv[5:]]
runpy.run_path(script, run_name="__main__")
