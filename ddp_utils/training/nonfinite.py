"""A run whose loss or gradient norm turns NaN or infinite stops, on every rank, with one line
that names the step and what to try, before anything with non-finite weights is saved.

fp16's loss scaler is the exception it must allow: it multiplies the loss by a large scale so that
small gradients survive in fp16, and a step whose gradients overflow at that scale is skipped (the
optimizer leaves the weights alone) while the scale is halved. That happens at the start of every
fp16 run and now and then after the scale has grown back. Such a step's gradient norm is infinite
and harmless, so it is not watched; only a run of `MAX_SKIPPED_IN_A_ROW` skipped steps means the
gradients overflow at every scale, the model has stopped learning, and the run stops.

The check costs no host sync of its own: each step's loss sum and gradient norm are tested on the
device (`NonFiniteWatch.note`), and the first bad step travels to the host with the log's values
once per logging window (`TrainingLog`), or when a checkpoint is about to be saved (`check_now`).
Whether the scaler skipped a step is read from the gradient norm, on the device too: the scaler
skips exactly the steps whose gradients hold an infinity or a NaN, which make the norm non-finite.
(Accelerate's `optimizer_step_was_skipped` cannot tell: with the fused AdamW the scaler always calls
the optimizer, whose kernel then leaves the weights alone.)
"""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator

from ..core.errors import RunFailed

# An fp16 run stops after this many skipped steps in a row, once its loss scale is below 1 too (the gradients then
# overflow fp16 unscaled: the run diverged). From torch's first scale of 2**16, 16 halvings reach 1, so a diverged
# run stops within 30 steps (and the next log record); a first scale set higher only takes longer to come down.
MAX_SKIPPED_IN_A_ROW = 30
WATCHED = ("the loss", "the gradient norm", "skipped steps")  # the first bad step of each, on the device


class NonFiniteWatch:
    """The first optimizer step whose loss sum (this rank's) or gradient norm was NaN or
    infinite, and the step that ended a run of `MAX_SKIPPED_IN_A_ROW` steps the fp16 loss scaler
    skipped, kept on the device. Built by `TrainingLog` on every rank."""

    def __init__(self, accelerator: Accelerator, args):
        self.accelerator, self.output_dir = accelerator, args.output_dir
        self.learning_rate, self.max_grad_norm = args.learning_rate, args.max_grad_norm
        # fp16 with a loss scaler: torch's (`accelerator.scaler`), or DeepSpeed's inside its engine.
        self.deepspeed_fp16 = accelerator.state.deepspeed_plugin is not None and accelerator.mixed_precision == "fp16"
        self.scaler = getattr(accelerator, "scaler", None)
        self.scaled = self.scaler is not None or self.deepspeed_fp16
        device = accelerator.device
        self.first_bad = torch.zeros(len(WATCHED), dtype=torch.float32, device=device)  # 0: none
        self.skipped_in_a_row = torch.zeros((), dtype=torch.float32, device=device)

    def note(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """Note optimizer step `step` (counted from 1) if its loss sum or gradient norm is not
        finite. Under a loss scaler a skipped step (the scaler found an overflow, left the weights
        alone and lowered its scale) is not a fault, and its gradient norm is not watched: it is
        counted, and MAX_SKIPPED_IN_A_ROW of them in a row with a loss scale below 1 are one.
        Returns whether the step was skipped, a device bool.

        Torch's scaler skips exactly the steps whose gradients hold an infinity or a NaN, which make
        the norm non-finite: read on the device, no host sync. DeepSpeed's engine keeps the last
        applied step's norm on a skipped step, so there the skip is its own host flag (DeepSpeed
        synced to decide it). No communication."""
        device = self.first_bad.device
        no = torch.zeros((), dtype=torch.bool, device=device)
        norm_bad = no if grad_norm is None else ~torch.isfinite(grad_norm.float()).reshape(())
        if self.deepspeed_fp16:
            skipped = torch.tensor(bool(self.accelerator.optimizer_step_was_skipped), device=device)
        else:
            skipped = norm_bad if self.scaler is not None else no
        self.skipped_in_a_row = (self.skipped_in_a_row + 1) * skipped
        too_many = self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW
        if self.scaler is not None:  # and the gradients overflow unscaled; the scale stays on the device
            scale = self.scaler._get_scale_async()  # None before its first use: the first scale, no sync
            too_many = too_many & (scale < 1 if scale is not None else self.scaler.get_scale() < 1)
        bad = torch.stack(
            [~torch.isfinite(loss_sum.detach().float()).reshape(()), no if self.scaled else norm_bad, too_many]
        )
        self.first_bad = torch.where((self.first_bad == 0) & bad, float(step), self.first_bad)
        return skipped

    def device_values(self) -> torch.Tensor:
        """The first step of each of `WATCHED` (0: none), on the device, for the log's one gather per window."""
        return self.first_bad

    def check(self, everyone: torch.Tensor) -> None:
        """Raise `RunFailed` on every rank if any rank saw a non-finite loss or gradient norm, or
        a run of skipped steps. `everyone`: the gathered `device_values` of all ranks, (world size,
        len(WATCHED)), on the host. Every rank calls it with the same values; no communication."""
        steps = [min((s for s in everyone[:, k].tolist() if s > 0), default=0) for k in range(len(WATCHED))]
        if not any(steps):
            return
        from ..checkpoints.manifest import list_checkpoints

        first = int(min(s for s in steps if s > 0))
        newest = (list_checkpoints(self.output_dir) or [None])[-1]
        saved = f"the newest checkpoint is {newest!r}" if newest else "no checkpoint was saved"
        later = [name for name, s in zip(WATCHED[:2], steps) if s > first or (s and steps[2] == first)]
        if steps[2] == first:
            raise RunFailed(self._skipped_too_often(first, saved, later))
        what = " and ".join(name for name, s in zip(WATCHED[:2], steps) if s == first)
        clip = (
            f"a lower --max_grad_norm (it was {self.max_grad_norm:g})"
            if self.max_grad_norm
            else "--max_grad_norm 1.0 (clipping was off)"
        )
        raise RunFailed(
            f"{what} became NaN or infinite at optimizer step {first}"
            + (f" ({' and '.join(later)} later)" if later else "")
            + f", so the run stopped before saving anything from that step; {saved}. Try a lower --learning_rate "
            f"(it was {self.learning_rate:g}), a longer warm-up (--warmup_ratio), {clip}, bf16 instead of fp16, "
            "or look for a broken example in that step's data; then resume with --resume_from_checkpoint latest"
        )

    def _skipped_too_often(self, step: int, saved: str, later: list[str]) -> str:
        """The line for a run of MAX_SKIPPED_IN_A_ROW skipped steps that ended at `step` (and what
        turned non-finite at a later step)."""
        scaler = self.scaler
        scale = f", down to a loss scale of 2^{math.log2(scaler.get_scale()):.0f}" if scaler is not None else ""
        also = f" ({' and '.join(later)} became NaN or infinite later)" if later else ""
        return (
            f"fp16's loss scaler had skipped {MAX_SKIPPED_IN_A_ROW} or more optimizer steps in a row by step {step}"
            f"{also}: their gradients overflowed fp16 at every scale it tried{scale}, so the weights have not changed "
            f"in those steps and the run is diverging or beyond fp16's range; {saved}. Train in "
            f"bf16 (mixed_precision: bf16) if the GPU has it, or with a lower --learning_rate (it was "
            f"{self.learning_rate:g}) or a longer warm-up (--warmup_ratio); then resume with "
            "--resume_from_checkpoint latest"
        )

    def check_now(self) -> None:
        """All ranks call this (one gather): `check` with every rank's values, before a checkpoint
        or the model is saved."""
        self.check(self.accelerator.gather(self.first_bad[None]).cpu())
