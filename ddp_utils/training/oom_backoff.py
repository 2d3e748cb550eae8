"""--oom_backoff: when a micro-batch runs out of GPU memory on any rank, every rank drops the
optimizer step in flight and takes it again in micro-batches half the size, twice as many: the
same examples, the same global batch and the same loss (`global_mean_loss` divides by the whole
step's weight, however many micro-batches hold it). The smaller micro-batch is kept for the rest
of the run.

The script's step stays as it is; it hands its micro-batch loop to the back-off in one line:

    loss_sum = backoff.run(forward_backward, micro_batches, step_size)

Without the option, `run` calls `forward_backward(micro_batches, step_size)` and nothing else.

Why the ranks cannot hang: with the option on, `forward_backward` runs under DDP's `no_sync`, so
its backward passes all-reduce nothing; and DDP's forward pass communicates only to broadcast
buffers after a synchronising backward pass, which never comes (the run's first forward pass
broadcasts them before any computation, on every rank). A rank that runs out of memory half-way
through a forward or backward pass therefore leaves no other rank waiting in a collective: its
`forward_backward` stops with the error, and every rank meets in one all-reduce of the ranks'
out-of-memory flags. If none ran out, the gradients are all-reduced (what DDP would have done in
the last backward pass) and the buffers broadcast from rank 0 (what DDP would do at the next
forward pass); if any did, every rank drops its gradients and calls `forward_backward` again. The
price: the gradient all-reduce no longer overlaps the backward pass, so the option is off by
default.
"""

from __future__ import annotations

import gc
import math

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..core.sharded import is_sharded

logger = get_logger(__name__)

BUCKET_BYTES = 25 * 2**20  # gradients all-reduced per flat bucket of about this size, as DDP's default bucket


def split_batch(batch: dict, rows: int) -> list[dict]:
    """`batch` cut into micro-batches of at most `rows` rows, in order: every tensor whose first
    dimension is the batch's number of rows is cut along it; anything else (a scalar, a
    non-tensor) goes to every part as it is. The parts are new dicts, so a training step that
    pops keys from them leaves `batch` whole. No communication."""
    tensors = [value for value in batch.values() if isinstance(value, torch.Tensor) and value.dim() > 0]
    if not tensors:
        return [dict(batch)]
    index = batch.get("index")
    if isinstance(index, torch.Tensor) and batch["input_ids"].shape[0] == 2 * len(index) > 0:
        return _split_pairs_in_two_rows(batch, rows)
    total = tensors[0].shape[0]
    parts = [dict() for _ in range(math.ceil(total / rows))]
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == total:
            for part, piece in zip(parts, value.split(rows)):
                part[key] = piece
        else:
            for part in parts:
                part[key] = value
    return parts


def _split_pairs_in_two_rows(batch: dict, pairs: int) -> list[dict]:
    """`split_batch` for DPO pairs scored as two rows each (`pair_scoring.TWO_ROWS`): rows p and
    B + p belong to pair p, so a part of pairs [s, e) takes both halves' rows [s, e)."""
    total = len(batch["index"])
    parts = []
    for start in range(0, total, pairs):
        end, part = min(start + pairs, total), {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 2 * total:
                part[key] = torch.cat([value[start:end], value[total + start : total + end]])
            elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == total:
                part[key] = value[start:end]
            else:
                part[key] = value
        parts.append(part)
    return parts


class OOMBackoff:
    """The out-of-memory back-off of --oom_backoff (see the module's docstring); with the option
    off, `run` calls the step's function once and does nothing else.

    Build it on every rank after `accelerator.prepare` (it needs the DDP-wrapped model) and before
    `prepare_output_dir`: it refuses FSDP, DeepSpeed and SyncBatchNorm, whose forward or backward
    passes communicate, before anything is written. No communication.
    """

    def __init__(self, accelerator: Accelerator, args, model, plan):
        self.accelerator, self.model, self.plan = accelerator, model, plan
        self.enabled = bool(getattr(args, "oom_backoff", False))
        self.per_device, self.accumulation = args.per_device_train_batch_size, accelerator.gradient_accumulation_steps
        self.micro_batch = self.per_device  # rows per micro-batch on each rank, halved by each back-off
        self.events: list[dict] = []
        if self.enabled:
            check_oom_backoff(accelerator, model)

    def run(self, forward_backward, micro_batches: list[dict], *args):
        """All ranks call this once per optimizer step (with --oom_backoff it all-reduces): returns
        `forward_backward(micro_batches, *args)`, the forward and backward passes over this rank's
        micro-batches of the step. With --oom_backoff, they run without DDP's gradient sync, in
        micro-batches of the current size; then every rank learns whether any ran out of memory
        (one all-reduce). If none did, the gradients are all-reduced and the step is ready for
        clipping and the optimizer; if one did, every rank drops its gradients, halves the
        micro-batch and runs the step again. At a micro-batch of 1 a `UsageError` says the model
        does not fit, on every rank."""
        if not self.enabled:
            return forward_backward(micro_batches, *args)
        while True:
            # A generator: each micro-batch is seeded (SeededMicroBatches) right before its parts run.
            parts = (part for batch in micro_batches for part in split_batch(batch, self.micro_batch))
            result, out_of_memory = None, False
            with self.accelerator.no_sync(self.model):
                try:
                    result = forward_backward(parts, *args)
                except torch.OutOfMemoryError:  # dropped with its traceback, which holds the activations
                    out_of_memory = True
            ranks = self._ranks_out_of_memory(out_of_memory)
            if not ranks:
                _reduce_gradients(self.model, self.accelerator.num_processes)
                _broadcast_buffers(self.model)
                self.accelerator.sync_gradients = True  # the gradient is complete: optimizer.step() and zero_grad() act
                return result
            result = None  # a dropped attempt's loss holds its graph: free it before the step is taken again
            _drop_gradients(self.model, self.accelerator.device)
            self._back_off(ranks, self.plan.step + 1)

    def _ranks_out_of_memory(self, out_of_memory: bool) -> list[int]:
        """The ranks that ran out of memory in this attempt (one all-reduce of the flags)."""
        accelerator = self.accelerator
        flags = torch.zeros(accelerator.num_processes, device=accelerator.device)
        flags[accelerator.process_index] = float(out_of_memory)
        if accelerator.num_processes > 1:
            torch.distributed.all_reduce(flags)
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]

    def _back_off(self, ranks: list[int], step: int) -> None:
        """Halve the micro-batch after an out-of-memory error on `ranks` in optimizer step `step`,
        or refuse to go on at one row. Every rank calls it with the same arguments."""
        where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ran out of memory in step {step}"
        if self.micro_batch == 1:
            raise UsageError(
                f"{where} with a micro-batch of 1 example per process: the model does not fit. Shard it "
                "(accelerate_configs/fsdp.yaml or deepspeed_zero3.yaml), use gradient checkpointing, "
                "shorter sequences or LoRA"
            )
        self.micro_batch = math.ceil(self.micro_batch / 2)
        accumulation = self.accumulation * math.ceil(self.per_device / self.micro_batch)
        self.events.append(
            {"step": step, "ranks": ranks, "micro_batch": self.micro_batch, "micro_batches_per_step": accumulation}
        )
        logger.warning(
            f"{where}: every rank dropped the step and takes it again in micro-batches of {self.micro_batch} "
            f"({accumulation} per step and process instead of {self.accumulation}), for the rest of the run; "
            "the global batch and the loss are unchanged"
        )

    def facts(self) -> dict:
        """What metrics.json records of the back-off (nothing without --oom_backoff). No communication."""
        if not self.enabled:
            return {}
        return {
            "oom_backoffs": self.events,
            "oom_backoff_micro_batch": self.micro_batch,
            "oom_backoff_micro_batches_per_step": self.accumulation * math.ceil(self.per_device / self.micro_batch),
        }


def check_oom_backoff(accelerator: Accelerator, model) -> None:
    """Refuse --oom_backoff where a forward or backward pass communicates: FSDP and DeepSpeed
    (shards are gathered and reduced inside them) and SyncBatchNorm (an all-reduce per layer). A
    rank that ran out of memory half-way would leave the others waiting there. Warn where a
    smaller micro-batch changes the math: BatchNorm normalises over each micro-batch. Every rank
    calls it; no communication."""
    kind = accelerator.distributed_type.value
    if is_sharded(accelerator):
        raise UsageError(
            f"--oom_backoff works with DDP only, not {kind}: its forward and backward passes communicate, so "
            "a rank out of memory would leave the others waiting; drop --oom_backoff (a sharded model needs "
            "less memory per GPU already)"
        )
    if any(isinstance(module, torch.nn.SyncBatchNorm) for module in model.modules()):
        raise UsageError(
            "--oom_backoff cannot be used with --sync_batchnorm: SyncBatchNorm all-reduces in the forward pass, "
            "so a rank out of memory would leave the others waiting; drop one of them"
        )
    if any(isinstance(module, torch.nn.modules.batchnorm._BatchNorm) for module in model.modules()):
        logger.warning(
            "--oom_backoff with BatchNorm: after a back-off BatchNorm normalises over smaller micro-batches, "
            "which changes the model's function (the loss is otherwise the same)"
        )


def _reduce_gradients(model, world_size: int) -> None:
    """The mean of every trainable parameter's gradient over the ranks, in place: one all-reduce
    per bucket of same-dtype gradients (a missing one counts as zeros). What DDP does in a
    synchronising backward pass."""
    if world_size == 1:
        return
    buckets, size = {}, {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dtype = p.grad.dtype
        if size.get(dtype, BUCKET_BYTES) >= BUCKET_BYTES:
            buckets.setdefault(dtype, []).append([])
            size[dtype] = 0
        buckets[dtype][-1].append(p.grad)
        size[dtype] += p.grad.numel() * p.grad.element_size()
    for grads in (bucket for same_dtype in buckets.values() for bucket in same_dtype):
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat)
        flat /= world_size
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))


def _broadcast_buffers(model) -> None:
    """Rank 0's buffers (BatchNorm's running statistics, ...) on every rank, one broadcast per
    buffer, where DDP would broadcast them at the next forward pass (its `broadcast_buffers`)."""
    if not getattr(model, "broadcast_buffers", False):  # not DDP, or DDP told not to
        return
    for buffer in model.buffers():
        torch.distributed.broadcast(buffer, src=0)


def _drop_gradients(model, device: torch.device) -> None:
    """Free this rank's gradients of a dropped attempt, and the memory the failed one held."""
    for p in model.parameters():
        p.grad = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
