"""The launch guard: fail at once, on every rank, when the launcher started a different number of
processes than the ones that joined this run.

Two launch mistakes fail *silently* with Accelerate on machines without GPUs:

* `accelerate launch --cpu --num_processes 2` (or a `distributed_type: MULTI_CPU` config)
  starts ONE process: Accelerate hands multi-CPU runs to `mpirun`, and without a hostfile
  it runs the script once.
* Under `torchrun` / `accelerate launch --multi_gpu` on a machine without GPUs,
  `Accelerator()` without `cpu=True` gives each process a world of its own: N independent
  runs writing the same files. `make_accelerator` passes `cpu=True` when no GPU is visible,
  which forms one gloo group, and this guard catches any remaining mismatch.

And one that fails late and unclearly: more processes on a machine than it has GPUs (2 on a workstation with one)
shared a GPU, and NCCL stopped the run at its first collective (`refuse_more_processes_than_gpus`).
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator

from ..core.errors import UsageError

_CPU_LAUNCH_FIX = (
    "accelerate launch --config_file accelerate_configs/cpu_2proc.yaml <script> "
    "(or `make train`), which starts the processes through torchrun and trains on CPU with gloo"
)


def world_size_from_launcher() -> int | None:
    """The number of processes the launcher says it started, or None if no launcher said."""
    for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return None


def _launch_args_start(cmdline: list[str]) -> int | None:
    """Where the arguments of `accelerate launch` begin in a command line, or None if it is not one.
    Covers `accelerate launch ...`, `accelerate-launch ...` and `python -m accelerate.commands.launch ...`."""
    for i, word in enumerate(cmdline):
        name = os.path.basename(word)
        if name == "accelerate" and cmdline[i + 1 : i + 2] == ["launch"]:
            return i + 2
        if name == "accelerate-launch" or (word == "accelerate.commands.launch" and i > 0 and cmdline[i - 1] == "-m"):
            return i + 1
    return None


def _processes_requested_by_parent_accelerate_launch() -> int | None:
    """If our parent is `accelerate launch` (the simple, single-process path), how many
    processes its command line or config file asked for; None if it is not."""
    try:
        import psutil

        parent_cmdline = psutil.Process(os.getppid()).cmdline()
    except Exception:  # no psutil, no permission, parent gone: nothing to check
        return None
    launch_args_at = _launch_args_start(parent_cmdline)
    if launch_args_at is None:
        return None
    from accelerate.commands.config import default_config_file, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    launch_args, _ = launch_command_parser().parse_known_args(parent_cmdline[launch_args_at:])
    if launch_args.num_processes is not None:
        return launch_args.num_processes
    # Accelerate's own rule: an explicit config file always counts, the default one not under --cpu.
    if launch_args.config_file:
        return load_config_from_file(launch_args.config_file).num_processes
    if os.path.isfile(default_config_file) and not launch_args.cpu:
        return load_config_from_file(default_config_file).num_processes
    return None


def check_launch(accelerator: Accelerator) -> None:
    """The launch guard: fail at once if the launcher started a different number of processes
    than the ones that joined this run. Every rank calls it (via `make_accelerator`) and every
    rank raises on its own, so no rank waits for the others."""
    launched = world_size_from_launcher()
    joined = accelerator.num_processes
    if launched is not None and launched != joined:
        raise UsageError(
            f"the launcher started {launched} processes but this one sees a world of {joined} "
            f"(distributed type {accelerator.distributed_type.value}): each process would train "
            "its own copy and they would overwrite each other's files. On a machine without GPUs, "
            "build the Accelerator with cpu=True or set ACCELERATE_USE_CPU=true (ddp_utils.make_accelerator "
            f"does this), and launch with {_CPU_LAUNCH_FIX}."
        )
    if launched is None and joined == 1:
        requested = _processes_requested_by_parent_accelerate_launch()
        if requested is not None and requested > 1:
            raise UsageError(
                f"`accelerate launch` was asked for {requested} processes but started only this one: "
                "Accelerate sends CPU runs (--cpu, or distributed_type MULTI_CPU) through mpirun and, "
                f"without --mpirun_hostfile, runs the script once. Launch with {_CPU_LAUNCH_FIX}."
            )
    slurm_tasks = int(os.environ.get("SLURM_NTASKS", "1") or 1)
    if launched is None and os.environ.get("SLURM_STEP_ID") is not None and slurm_tasks > 1:
        raise UsageError(
            f"srun started {slurm_tasks} tasks running the script directly, so each is a world of its own. "
            "Run one `accelerate launch` per node under srun (see accelerate_configs/) instead."
        )


def refuse_more_processes_than_gpus() -> None:
    """Before the Accelerator is built: refuse, on every rank of this machine, a launch of more processes on it than
    it has GPUs. Accelerate gives process i the GPU i modulo their number, so two processes shared a GPU, and NCCL
    stopped the run at its first collective ("Duplicate GPU detected"), after the data and the model were loaded, in a
    traceback. Left alone: a run on CPU processes (ACCELERATE_USE_CPU), a machine without CUDA, and a process shown
    one GPU of its own (CUDA_VISIBLE_DEVICES naming one device, as launchers that give each process its GPU set it).
    No communication."""
    from accelerate.utils import parse_flag_from_env

    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    own_gpu = len([d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]) == 1
    if parse_flag_from_env("ACCELERATE_USE_CPU") or processes <= 1 or own_gpu or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if processes > gpus:
        raise UsageError(
            f"this launch starts {processes} processes on this machine, which has {gpus} GPU(s): give one process per "
            f"GPU ({gpus} here; --num_processes counts every machine's; accelerate_configs/single_gpu.yaml for one "
            "GPU), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on CPU processes"
        )
