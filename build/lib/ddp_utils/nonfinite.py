"""A run whose loss or gradient norm turns NaN or infinite stops, on every rank, with one line
that names the step and what to try, before anything with non-finite weights is saved.

The check costs no host sync of its own: each step's loss sum and gradient norm are tested on the
device (`NonFiniteWatch.note`), and the first bad step travels to the host with the log's values
once per logging window (`TrainingLog`), or when a checkpoint is about to be saved (`check_now`).
"""

from __future__ import annotations

import torch
from accelerate import Accelerator

from .errors import RunFailed


class NonFiniteWatch:
    """The first optimizer step whose loss sum (this rank's) or gradient norm was NaN or
    infinite, kept on the device. Built by `TrainingLog` on every rank."""

    def __init__(self, accelerator: Accelerator, args):
        self.accelerator, self.output_dir = accelerator, args.output_dir
        self.learning_rate, self.max_grad_norm = args.learning_rate, args.max_grad_norm
        self.first_bad = torch.zeros(2, dtype=torch.float32, device=accelerator.device)  # [loss, grad norm]; 0: none

    def note(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """Note optimizer step `step` (counted from 1) if its loss sum or gradient norm is not
        finite. Device operations only: no communication, no host sync."""
        bad = torch.stack(
            [
                ~torch.isfinite(loss_sum.detach().float()).reshape(()),
                ~torch.isfinite(grad_norm.float()).reshape(())
                if grad_norm is not None
                else torch.zeros((), dtype=torch.bool, device=loss_sum.device),
            ]
        )
        self.first_bad = torch.where((self.first_bad == 0) & bad, float(step), self.first_bad)

    def device_values(self) -> torch.Tensor:
        """[first step with a non-finite loss, first with a non-finite gradient norm] (0: none), on
        the device, for the log's one gather per window."""
        return self.first_bad

    def check(self, everyone: torch.Tensor) -> None:
        """Raise `RunFailed` on every rank if any rank saw a non-finite loss or gradient norm.
        `everyone`: the gathered `device_values` of all ranks, (world size, 2), on the host. Every
        rank calls it with the same values; no communication."""
        steps = [min((s for s in everyone[:, k].tolist() if s > 0), default=0) for k in range(2)]
        if not any(steps):
            return
        from .checkpoint import list_checkpoints

        first = int(min(s for s in steps if s > 0))
        what = " and ".join(name for name, s in zip(("the loss", "the gradient norm"), steps) if s == first)
        later = [name for name, s in zip(("the loss", "the gradient norm"), steps) if s > first]
        newest = (list_checkpoints(self.output_dir) or [None])[-1]
        saved = f"the newest checkpoint is {newest!r}" if newest else "no checkpoint was saved"
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

    def check_now(self) -> None:
        """All ranks call this (one gather): `check` with every rank's values, before a checkpoint
        or the model is saved."""
        self.check(self.accelerator.gather(self.first_bad[None]).cpu())
