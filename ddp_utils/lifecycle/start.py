"""Starting a run: `start_run`, the Accelerator every script uses (one process group on CPU or GPU,
the data seed, the collective timeout), checked by the launch guard (`launch_guard.check_launch`),
with logging, the seed and the output directory set up; `start_training`, the chores between
`accelerator.prepare` and the first step (output directory, checkpoints and resume, the log, the
out-of-memory back-off); and `is_sharded`, the one test of whether the model's weights are split
over the ranks (FSDP or DeepSpeed)."""

from __future__ import annotations

import logging
import math
import os
from datetime import timedelta

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.logging import get_logger
from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration, parse_flag_from_env

from ..checkpoints.checkpoint import Checkpointer
from ..checkpoints.preemption import clear_preempted_marker
from ..core.errors import UsageError
from ..core.redact import hide_secret_args
from ..core.sharded import SHARDED_TYPES
from ..results.output import check_output_dir, prepare_output_dir
from ..training.compilation import (
    compile_by_regions,
    configure_compile,
    dynamo_plugin,
    sharded_compile_warning,
)
from ..training.fsdp import fix_fsdp2_preparation
from ..training.oom_backoff import OOMBackoff
from ..training.optimizer import describe_optimizer
from ..training.training_log import TENSORBOARD_DIR, TrainingLog
from .args import accumulation_for
from .launch_guard import check_launch, refuse_more_processes_than_gpus, world_size_from_launcher

logger = get_logger(__name__)


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
    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not _gpu_visible()  # Accelerate's spellings: 1, true, yes, on
    refuse_more_processes_than_gpus()  # else two processes share a GPU, and NCCL stops at the first collective
    accelerator = Accelerator(
        cpu=cpu,
        # Optimizer steps are always whole (see make_train_dataloader), so syncing at the end of the
        # dataloader is not needed, and would fire early when StepPlan reads a step's micro-batches ahead.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=gradient_accumulation_steps, sync_with_dataloader=False
        ),
        # The data seed for make_train_dataloader's StepAlignedSampler (it reads it back from here).
        # On a GPU, batches are copied from pinned memory without waiting (no host sync per batch).
        dataloader_config=DataLoaderConfiguration(data_seed=seed, non_blocking=not cpu),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=ddp_timeout))],
        step_scheduler_with_optimizer=False,
        **accelerator_kwargs,
    )
    check_launch(accelerator)
    sharded = [name for name in SHARDED_TYPES if os.environ.get(f"ACCELERATE_USE_{name}", "").lower() in ("1", "true")]
    if sharded and accelerator.distributed_type.value != sharded[0]:
        # Measured with Accelerate 1.15: with cpu=True it quietly trains plain DDP (every rank a full
        # copy, the plugin ignored); without it, every process runs alone. So the test is what Accelerate
        # turned on, not what the config asked. Checked once the process group exists, so every rank reports it.
        raise UsageError(
            f"this launch config asks for {sharded[0]}, and Accelerate started {accelerator.distributed_type.value} "
            f"instead (it runs {sharded[0]} on GPUs only{', and no GPU is visible' if not _gpu_visible() else ''}); "
            "on a machine without GPUs use accelerate_configs/cpu_2proc.yaml"
        )
    fix_fsdp2_preparation(accelerator)  # under FSDP2: what Accelerate 1.15 gets wrong while sharding (fsdp.py)
    if accelerator.state.deepspeed_plugin is not None:
        check_deepspeed_config(
            accelerator.state.deepspeed_plugin.deepspeed_config, gradient_accumulation_steps, max_grad_norm
        )
    _accelerators.append(accelerator)
    if torch.distributed.is_initialized():
        _process_groups.append(torch.distributed.distributed_c10d._get_default_group())
    return accelerator


def check_deepspeed_config(config: dict, gradient_accumulation_steps: int, max_grad_norm: float | None) -> None:
    """Refuse a DeepSpeed config that would silently override the script's options, and fill its
    "auto" values with them. Any rank may call it (each checks the same config).

    DeepSpeed accumulates and clips by its own config: a `gradient_accumulation_steps` there
    other than the script's changes the loss's normaliser, and its `gradient_clipping` replaces
    --max_grad_norm (Accelerate fills an "auto" one with 1.0, whatever the script says). A config file's own
    optimizer or scheduler (as in the DeepSpeed configs of Transformers' docs) cannot run with the script's.
    """
    own = [
        f'"{section}" ({config[section].get("type", "?") if isinstance(config[section], dict) else config[section]})'
        for section in ("optimizer", "scheduler")
        if section in config
    ]
    if own:  # Accelerate refused it inside `prepare`, after the model was built, naming a fix for other scripts
        raise UsageError(
            f"the DeepSpeed config file defines {' and '.join(own)}, and the script makes its own (AdamW and "
            "--lr_scheduler_type, set by its options); remove those sections from the file"
        )
    accumulation = config.get("gradient_accumulation_steps", "auto")
    if accumulation not in (gradient_accumulation_steps, "auto"):
        raise UsageError(
            f"the DeepSpeed config accumulates {accumulation} micro-batches per step, the script "
            f"{gradient_accumulation_steps}; set deepspeed_config.gradient_accumulation_steps to auto (the script's, "
            "as the shipped configs have it)"
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
    # What the launcher started (the launch guard checks it against the process group): --global_batch_size needs it.
    world_size = world_size_from_launcher() or 1
    # the scripts' --torch_compile, else the launch config's dynamo_backend: compiled by `start_training`, in place
    compiler = dynamo_plugin(accelerator_options.pop("dynamo_backend", None))
    args.dynamo_backend = compiler.backend.value.lower()
    args.gradient_accumulation_steps = accumulation_for(args, world_size)
    accelerator = make_accelerator(
        seed=args.seed,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_grad_norm=args.max_grad_norm,
        ddp_timeout=args.ddp_timeout,
        log_with=args.trackers or None,
        project_config=ProjectConfiguration(
            project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, TENSORBOARD_DIR)
        ),
        dynamo_plugin=dynamo_plugin("no"),  # not Accelerate's compilation: start_training's, in place, by regions
        **accelerator_options,
    )
    if compiler.backend.value != "NO":
        configure_compile()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not accelerator.is_main_process:
        for library in (datasets.utils.logging, transformers.utils.logging):
            library.set_verbosity_error()
            library.disable_progress_bar()
    logger.info(
        f"{accelerator.num_processes} process(es), {accelerator.distributed_type.value}, device {accelerator.device}"
    )
    logger.info(describe_global_batch(args, accelerator.num_processes))
    compile_warning = sharded_compile_warning(accelerator) if compiler.backend.value != "NO" else None
    if compile_warning:
        logger.warning(compile_warning)
    transformers.set_seed(args.seed)
    check_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
    clear_preempted_marker(accelerator, args.output_dir)  # it describes an earlier attempt
    return accelerator


def describe_global_batch(args, world_size: int) -> str:
    """The log line that says how many examples an optimizer step takes, and whether another
    number of processes would change it (it does, unless --global_batch_size fixes it)."""
    per_step = world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps
    line = (
        f"global batch: {per_step} examples per optimizer step ({world_size} process(es) x "
        f"{args.per_device_train_batch_size} per device x {args.gradient_accumulation_steps} accumulated)"
    )
    if args.global_batch_size:
        return line + ", set by --global_batch_size on any number of processes"
    return line + (
        "; on another number of processes it changes, and with it the run (scale the learning rate, or give "
        f"--global_batch_size {per_step} to keep it)"
    )


def start_training(accelerator: Accelerator, args, model, optimizer, plan):
    """All ranks call this once, after `accelerator.prepare` and before the first step: it logs
    the optimizer that really runs, compiles the model by regions where the run compiles, builds the
    out-of-memory back-off (which refuses --oom_backoff where it cannot work, before anything is
    written), creates the output directory, resumes from --resume_from_checkpoint (restoring `plan`'s
    progress) and starts the log and its trackers.
    Returns (Checkpointer, TrainingLog, OOMBackoff), the three the training loop calls."""
    logger.info(f"optimizer: {describe_optimizer(optimizer)}")
    backoff = OOMBackoff(accelerator, args, model, plan)  # --oom_backoff: smaller micro-batches after an OOM error
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)  # parameter names as in the checkpoint
    compile_by_regions(unwrapped, getattr(args, "dynamo_backend", "no"))  # --torch_compile: each layer, in place
    checkpointer = Checkpointer(accelerator, args, unwrapped, plan)  # saves when due or on SIGTERM
    prepare_output_dir(accelerator, args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
    checkpointer.resume(plan)  # from --resume_from_checkpoint, if given
    log = TrainingLog(accelerator, args, plan)  # trackers, train_log.jsonl, progress bar (after the resume)
    checkpointer.log = log  # no checkpoint of a run whose loss turned NaN; the best ranked by its evaluations
    return checkpointer, log, backoff
