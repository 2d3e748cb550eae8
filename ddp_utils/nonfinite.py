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

from .errors import RunFailed

# Skipped steps in a row that stop an fp16 run. From torch's first scale of 2**16, 16 halvings reach a scale of 1,
# where the gradients overflow fp16 unscaled; 30 leave room for a scale that had grown to 2**30 (a model whose
# gradients are tiny), and still stop a diverged run within 30 steps instead of letting it skip every step after.
MAX_SKIPPED_IN_A_ROW = 30
WATCHED = ("the loss", "the gradient norm", "skipped steps")  # the first bad step of each, on the device


class NonFiniteWatch:
    """The first optimizer step whose loss sum (this rank's) or gradient norm was NaN or
    infinite, and the step that ended a run of `MAX_SKIPPED_IN_A_ROW` steps the fp16 loss scaler
    skipped, kept on the device. Built by `TrainingLog` on every rank."""

    def __init__(self, accelerator: Accelerator, args):
        self.accelerator, self.output_dir = accelerator, args.output_dir
        self.learning_rate, self.max_grad_norm = args.learning_rate, args.max_grad_norm
        # fp16 with a loss scaler (torch's, or DeepSpeed's): a step whose gradients overflow is skipped, not applied.
        deepspeed_fp16 = accelerator.state.deepspeed_plugin is not None and accelerator.mixed_precision == "fp16"
        self.scaled = getattr(accelerator, "scaler", None) is not None or deepspeed_fp16
        device = accelerator.device
        self.first_bad = torch.zeros(len(WATCHED), dtype=torch.float32, device=device)  # 0: none
        self.skipped_in_a_row = torch.zeros((), dtype=torch.float32, device=device)

    def note(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """Note optimizer step `step` (counted from 1) if its loss sum or gradient norm is not
        finite. Under a loss scaler a non-finite gradient norm is a skipped step (the scaler found
        the overflow, left the weights alone and lowered its scale): not a fault, but counted, and
        MAX_SKIPPED_IN_A_ROW of them in a row are one. Returns whether the step was skipped, a
        device bool. Device operations only: no communication, no host sync (the scaler's own
        decision is on the device too, with a fused optimizer)."""
        device = self.first_bad.device
        no = torch.zeros((), dtype=torch.bool, device=device)
        norm_bad = no if grad_norm is None else ~torch.isfinite(grad_norm.float()).reshape(())
        skipped = norm_bad if self.scaled else no
        self.skipped_in_a_row = (self.skipped_in_a_row + 1) * skipped
        bad = torch.stack(
            [
                ~torch.isfinite(loss_sum.detach().float()).reshape(()),
                no if self.scaled else norm_bad,
                self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW,
            ]
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
        from .checkpoint_save import list_checkpoints

        first = int(min(s for s in steps if s > 0))
        newest = (list_checkpoints(self.output_dir) or [None])[-1]
        saved = f"the newest checkpoint is {newest!r}" if newest else "no checkpoint was saved"
        if steps[2] == first and not any(steps[:2]):
            raise RunFailed(self._skipped_too_often(first, saved))
        what = " and ".join(name for name, s in zip(WATCHED[:2], steps) if s == first)
        later = [name for name, s in zip(WATCHED[:2], steps) if s > first]
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

    def _skipped_too_often(self, step: int, saved: str) -> str:
        """The line for a run of MAX_SKIPPED_IN_A_ROW skipped steps that ended at `step`."""
        scaler = getattr(self.accelerator, "scaler", None)
        scale = f", down to a loss scale of 2^{math.log2(scaler.get_scale()):.0f}" if scaler is not None else ""
        return (
            f"fp16's loss scaler skipped {MAX_SKIPPED_IN_A_ROW} optimizer steps in a row, the last at step {step}: "
            f"their gradients overflowed fp16 at every scale it tried{scale}, so the weights have not changed since "
            f"step {step - MAX_SKIPPED_IN_A_ROW} and the run is diverging or beyond fp16's range; {saved}. Train in "
            f"bf16 (mixed_precision: bf16) if the GPU has it, or with a lower --learning_rate (it was "
            f"{self.learning_rate:g}) or a longer warm-up (--warmup_ratio); then resume with "
            "--resume_from_checkpoint latest"
        )

    def check_now(self) -> None:
        """All ranks call this (one gather): `check` with every rank's values, before a checkpoint
        or the model is saved."""
        self.check(self.accelerator.gather(self.first_bad[None]).cpu())
