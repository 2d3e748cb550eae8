#!/usr/bin/env python
"""Check a launch config in seconds, before spending GPU hours: launch it like a training script.

    accelerate launch --config_file accelerate_configs/multi_node_ddp.yaml --machine_rank 0 \\
        --main_process_ip <first node> scripts/check_env.py

1. Every rank prints its rank, local rank, node, device and backend (in rank order).
2. The ranks all-reduce known values and check the result: a wrong world or a broken transport
   fails here, with the ranks that disagree named.
3. A short all-reduce bandwidth measurement: algorithm and bus bandwidth (GB/s) for a few sizes,
   as nccl-tests reports them, so a slow interconnect shows before training does.

Exit code 0 when every check passes, 1 otherwise.
"""

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist

import ddp_utils


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes_mib", default="1,16,64", help="comma-separated all-reduce sizes to time, in MiB")
    p.add_argument("--iterations", type=int, default=5, help="timed all-reduces per size (after 2 warm-up ones)")
    return p.parse_args()


def describe_ranks(accelerator):
    """One line per rank, gathered to the main process and printed in rank order."""
    from accelerate.utils import gather_object

    line = (
        f"rank {accelerator.process_index}/{accelerator.num_processes}  local rank {accelerator.local_process_index}  "
        f"node {socket.gethostname()} (machine rank {os.environ.get('GROUP_RANK', os.environ.get('NODE_RANK', '0'))})  "
        f"device {accelerator.device}  backend {dist.get_backend() if dist.is_initialized() else 'none'}  "
        f"{accelerator.distributed_type.value}, mixed precision {accelerator.mixed_precision}"
    )
    if accelerator.device.type == "cuda":
        line += f"  ({torch.cuda.get_device_name(accelerator.device)})"
    lines = gather_object([line])
    if accelerator.is_main_process:
        print("\n".join(lines), flush=True)


def check_all_reduce(accelerator) -> bool:
    """Each rank contributes rank + 1 in every element of a vector; the sum must be n(n+1)/2 everywhere."""
    n = accelerator.num_processes
    values = torch.full((1024,), float(accelerator.process_index + 1), device=accelerator.device)
    total = accelerator.reduce(values, reduction="sum")
    ok = bool(torch.all(total == n * (n + 1) / 2).item())
    verdicts = accelerator.gather(torch.tensor([1.0 if ok else 0.0], device=accelerator.device))
    bad = [rank for rank, verdict in enumerate(verdicts.tolist()) if verdict < 1.0]
    if accelerator.is_main_process:
        print(
            f"all-reduce correctness over {n} processes: " + ("OK" if not bad else f"FAILED on ranks {bad}"), flush=True
        )
    return not bad


def measure_bandwidth(accelerator, sizes_mib, iterations):
    """Time all-reduces of float32 buffers; bus bandwidth = size x 2(n-1)/n / time (nccl-tests' definition)."""
    n = accelerator.num_processes
    rows = []
    for size in sizes_mib:
        buffer = torch.ones(size * 2**20 // 4, device=accelerator.device)
        for _ in range(2):
            dist.all_reduce(buffer)
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(buffer)
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = torch.tensor((time.perf_counter() - start) / iterations, device=accelerator.device)
        seconds = accelerator.reduce(seconds, reduction="sum").item() / n  # the mean over ranks
        algorithm = size * 2**20 / seconds / 1e9
        rows.append((size, seconds * 1e3, algorithm, algorithm * 2 * (n - 1) / n))
    if accelerator.is_main_process:
        print("| size (MiB) | time (ms) | algorithm GB/s | bus GB/s |\n|---:|---:|---:|---:|", flush=True)
        for size, ms, algorithm, bus in rows:
            print(f"| {size} | {ms:.2f} | {algorithm:.2f} | {bus:.2f} |", flush=True)


def main():
    args = parse_args()
    sizes = [int(s) for s in args.sizes_mib.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or args.iterations < 1:
        raise ddp_utils.UsageError("--sizes_mib takes positive sizes, e.g. 1,16,64, and --iterations at least 1")
    accelerator = ddp_utils.make_accelerator(seed=0)  # with the launch guard: a mis-launch fails here
    describe_ranks(accelerator)
    ok = check_all_reduce(accelerator)
    if accelerator.num_processes > 1 and ok:
        measure_bandwidth(accelerator, sizes, args.iterations)
    accelerator.wait_for_everyone()
    if not ok:
        raise RuntimeError("the all-reduce gave wrong results: check the network between the failing ranks")
    if accelerator.is_main_process:
        print("check_env: all checks passed", flush=True)


if __name__ == "__main__":
    ddp_utils.run(main)
