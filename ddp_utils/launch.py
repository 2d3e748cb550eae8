"""Starting a run (the Accelerator, with the launch guard), refusing mis-launched runs, and ending
a run cleanly.

Two launch mistakes fail *silently* with Accelerate on machines without GPUs, so every
script goes through `make_accelerator`, which builds the Accelerator and then runs the
launch guard:

* `accelerate launch --cpu --num_processes 2` (or a `distributed_type: MULTI_CPU` config)
  starts ONE process: Accelerate hands multi-CPU runs to `mpirun`, and without a hostfile
  it runs the script once.
* Under `torchrun` / `accelerate launch --multi_gpu` on a machine without GPUs,
  `Accelerator()` without `cpu=True` gives each process a world of its own: N independent
  runs writing the same files. `make_accelerator` passes `cpu=True` when no GPU is visible,
  which forms one gloo group, and the guard catches any remaining mismatch.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.logging import get_logger
from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration

from .checkpoint import clear_preempted_marker
from .errors import EXIT_PREEMPTED, EXIT_USAGE, Preempted, UsageError
from .io import check_output_dir
from .tracking import TENSORBOARD_DIR, hide_secret_args

logger = get_logger(__name__)

_CPU_LAUNCH_FIX = (
    "accelerate launch --config_file accelerate_configs/cpu_2proc.yaml <script> "
    "(or `make train`), which starts the processes through torchrun and trains on CPU with gloo"
)

# The Accelerators this process built, so that `run` can end their trackers when the run fails,
# and their process groups (see `_shutdown`).
_accelerators: list[Accelerator] = []
_process_groups: list = []


def _gpu_visible() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def make_accelerator(
    *,
    seed: int,
    gradient_accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
    ddp_timeout: int = 1800,
    **accelerator_kwargs,
) -> Accelerator:
    """All ranks call this: build the Accelerator every script uses (it forms the process group),
    then check the launch.

    - `cpu=True` when this process sees no GPU, so a torchrun-style launch on a CPU machine
      forms one gloo group instead of N separate worlds.
    - A data seed shared by all ranks: every rank draws the same shuffle (so the shards
      partition it; see `make_train_dataloader`), and each epoch reshuffles via `set_epoch`.
    - `ddp_timeout` seconds for collectives, so a rank stuck in one fails instead of waiting
      gloo's default 30 minutes.
    - The LR scheduler is not tied to the optimizer: by default Accelerate steps a prepared
      scheduler `num_processes` times per optimizer step. Scripts call `lr_scheduler.step()`
      once per optimizer step, so the schedule is in optimizer steps whatever the world size.
    - Under DeepSpeed, its config must agree with the script (`check_deepspeed_config`).
    """
    cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not _gpu_visible()
    accelerator = Accelerator(
        cpu=cpu,
        # Optimizer steps are always whole (see make_train_dataloader), so syncing at the end of the
        # dataloader is not needed, and would fire early when StepPlan reads a step's micro-batches ahead.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=gradient_accumulation_steps, sync_with_dataloader=False),
        # The data seed for make_train_dataloader's StepAlignedSampler (it reads it back from here).
        # On a GPU, batches are copied from pinned memory without waiting (no host sync per batch).
        dataloader_config=DataLoaderConfiguration(data_seed=seed, non_blocking=not cpu),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=ddp_timeout))],
        step_scheduler_with_optimizer=False,
        **accelerator_kwargs,
    )
    check_launch(accelerator)
    sharded = [name for name in ("FSDP", "DEEPSPEED") if os.environ.get(f"ACCELERATE_USE_{name}", "").lower() in ("1", "true")]
    if sharded and not _gpu_visible():
        # Measured with Accelerate 1.15: with cpu=True it quietly trains plain DDP (every rank a full
        # copy, the plugin ignored); without it, every process runs alone. Checked once the process
        # group exists, so that every rank reports it.
        raise UsageError(
            f"this launch config asks for {sharded[0]}, which Accelerate runs on GPUs only, and no GPU is visible; "
            "on this machine use accelerate_configs/cpu_2proc.yaml"
        )
    if accelerator.state.deepspeed_plugin is not None:
        check_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, gradient_accumulation_steps, max_grad_norm)
    _accelerators.append(accelerator)
    if torch.distributed.is_initialized():
        _process_groups.append(torch.distributed.distributed_c10d._get_default_group())
    return accelerator


def check_deepspeed_config(config: dict, gradient_accumulation_steps: int, max_grad_norm: float | None) -> None:
    """Refuse a DeepSpeed config that would silently override the script's options, and fill its
    "auto" values with them. Any rank may call it (each checks the same config).

    DeepSpeed accumulates and clips by its own config: a `gradient_accumulation_steps` there
    other than the script's changes the loss's normaliser, and its `gradient_clipping` replaces
    --max_grad_norm (Accelerate fills an "auto" one with 1.0, whatever the script says).
    """
    accumulation = config.get("gradient_accumulation_steps", "auto")
    if accumulation not in (gradient_accumulation_steps, "auto"):
        raise UsageError(
            f"the DeepSpeed config accumulates {accumulation} micro-batches per step, the script "
            f"{gradient_accumulation_steps}; set deepspeed_config.gradient_accumulation_steps to the script's "
            "--gradient_accumulation_steps"
        )
    if max_grad_norm is None:
        return
    clipping = config.get("gradient_clipping", "auto")
    if clipping in ("auto", None):
        config["gradient_clipping"] = max_grad_norm  # 0: DeepSpeed does not clip, as --max_grad_norm 0
    elif not math.isclose(float(clipping), max_grad_norm):
        raise UsageError(
            f"the DeepSpeed config clips gradients at {clipping}, the script at --max_grad_norm {max_grad_norm}, and "
            f"DeepSpeed's value would win; set deepspeed_config.gradient_clipping to {max_grad_norm} (or 'auto'), "
            f"or pass --max_grad_norm {clipping}"
        )


def start_run(args, **accelerator_options) -> Accelerator:
    """All ranks call this first: the Accelerator for a run (`make_accelerator`), with the trackers
    of --report_to (started later, by `TrainingLog`), logging set up (warnings and errors only on
    the other ranks), the same seed on every rank (identical initialisation), the output
    directory checked before any work is done, and a `preempted.json` of an earlier attempt removed.
    """
    import datasets
    import transformers

    hide_secret_args(args)  # --hub_token becomes HF_TOKEN; no secret stays in sys.argv
    accelerator = make_accelerator(
        seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps, max_grad_norm=args.max_grad_norm,
        ddp_timeout=args.ddp_timeout, log_with=args.trackers or None,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, TENSORBOARD_DIR)),
        **accelerator_options,
    )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not accelerator.is_main_process:
        for library in (datasets.utils.logging, transformers.utils.logging):
            library.set_verbosity_error()
            library.disable_progress_bar()
    logger.info(f"{accelerator.num_processes} process(es), {accelerator.distributed_type.value}, device {accelerator.device}")
    transformers.set_seed(args.seed)
    check_output_dir(args.output_dir, args.overwrite_output_dir, resuming=bool(args.resume_from_checkpoint))
    clear_preempted_marker(accelerator, args.output_dir)  # it describes an earlier attempt
    return accelerator


def _world_size_from_launcher() -> int | None:
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
    launched = _world_size_from_launcher()
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


def run(main, *args) -> None:
    """All ranks call this, from `__main__`: run a script's `main(*args)` and exit the process
    cleanly (after a last barrier when the run succeeded).

    A `UsageError` (bad input, bad launch) is printed as one line naming the rank, with exit
    code 2; `Preempted` exits with EXIT_PREEMPTED (75); any other exception prints its
    traceback and exits 1. Either way the trackers are ended first (their last events flushed,
    wandb and mlflow runs closed as failed or preempted), the launcher then stops the other ranks,
    and the process ends without the interpreter teardown that can hang in the gloo destructor.
    """
    rank = os.environ.get("RANK", "0")
    exit_code = 0
    try:
        main(*args)
    except UsageError as error:
        print(f"[rank {rank}] error: {error}", file=sys.stderr, flush=True)
        exit_code = EXIT_USAGE
        _meet_the_other_ranks()
    except Preempted as stop:
        print(f"[rank {rank}] preempted: {stop}", file=sys.stderr, flush=True)
        exit_code = EXIT_PREEMPTED
    except Exception:
        traceback.print_exc()
        print(f"[rank {rank}] failed, see the traceback above", file=sys.stderr, flush=True)
        exit_code = 1
    if exit_code:
        _end_trackers(exit_code)
    _shutdown(exit_code)


def _end_trackers(exit_code: int) -> None:
    """Flush and close the trackers of a run that stops early: `os._exit` skips the interpreter's
    exit hooks, so without this wandb and mlflow leave their run open (TensorBoard's writer kept
    up with every event here, but is closed too). Only the main process has trackers; the process group is left
    alone (its teardown can hang)."""
    for accelerator in _accelerators:
        for tracker in accelerator.trackers:
            try:
                if tracker.name == "wandb":  # wandb marks a run with a non-zero exit code as failed
                    tracker.run.finish(exit_code=exit_code)
                elif tracker.name == "mlflow":
                    import mlflow

                    mlflow.end_run(status="KILLED" if exit_code == EXIT_PREEMPTED else "FAILED")
                else:
                    tracker.finish()
            except Exception as error:  # a tracker that cannot close must not hide why the run stopped
                print(f"could not close the {tracker.name} tracker: {error}", file=sys.stderr, flush=True)


def _meet_the_other_ranks(timeout_s: int = 30) -> None:
    """Before a rank leaves over bad input, let the other ranks that fail the same check catch up
    and say so too: the launcher stops every rank once the first one exits, and a rank that was a
    little behind (still loading its data, say) would be killed before it could report the error.
    Each rank prints first, then waits here, at most `timeout_s`.

    - Before the ranks have met (a bad option, checked while parsing the arguments): wait until
      every rank has joined a process group.
    - After (a check made by each rank on its own, such as LoRA target modules the model does not
      have): count the failed ranks in the process group's key-value store, which is not a
      collective, so a rank still waiting in one is not disturbed; leave when all have arrived.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size < 2 or not os.environ.get("MASTER_ADDR"):
        return
    deadline = time.monotonic() + timeout_s
    if torch.distributed.is_initialized():
        store = torch.distributed.distributed_c10d._get_default_store()
        arrived = store.add("ddp_utils/ranks_refusing", 1)
        while arrived < torch.distributed.get_world_size() and time.monotonic() < deadline:
            time.sleep(0.1)
            arrived = store.add("ddp_utils/ranks_refusing", 0)
        return
    try:  # the ranks that fail the same check all arrive here; a rank that did not fail joins in make_accelerator
        torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    except Exception:  # a rank never came: leave anyway
        pass


def _shutdown(exit_code: int) -> None:
    """End the process without running the interpreter's final garbage collection.

    With torch 2.13 and gloo, a process group that is freed after `destroy_process_group`
    (it is still referenced by the DDP reducer, the Accelerator state, ...) can block for ever
    in the ProcessGroupGloo destructor, joining its worker threads. That happens at interpreter
    exit, and also when `main` returns and its DDP model is freed after `accelerator.end_training()`
    (seen once here with py-spy: `~Reducer` -> `~ProcessGroupGloo` -> `std::thread::join`).
    `make_accelerator` keeps a reference to the process group, so it is never freed before the
    process ends; everything this process had to write has been written and flushed by now, so
    we skip the teardown with `os._exit`.
    """
    if exit_code == 0 and torch.distributed.is_available() and torch.distributed.is_initialized():
        # A last barrier so no rank leaves while another still needs it.
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
