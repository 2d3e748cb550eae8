"""The exact loss of an optimizer step: its gradient is the mean over all the step's real examples
(or target tokens), on every rank and in every micro-batch, so N processes or gradient
accumulation train the same model as one big batch.

Two pieces, both called in the scripts' training step: `count_step` (one all-reduce, before the
first backward pass) and `global_mean_loss` (the normaliser, no communication).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate import Accelerator

from ..data.dataloaders import SAMPLE_WEIGHT

INPUT_TOKENS = "input_tokens"  # per weighted row: its non-padding tokens, where the attention_mask does not tell


@dataclass
class StepSize:
    """What one optimizer step holds on all ranks together (float tensors on the device)."""

    weight: torch.Tensor  # the loss's denominator: real examples, or target tokens
    examples: torch.Tensor  # real rows (fillers not counted)
    tokens: torch.Tensor  # their non-padding input tokens (0 for inputs that are not tokens)


def _local_step_size(micro_batches: list[dict], weight_key: str) -> torch.Tensor:
    """[weight, examples, tokens] of this rank's micro-batches."""
    totals = []
    for batch in micro_batches:
        row_weight = batch[weight_key]
        real = row_weight > 0
        if INPUT_TOKENS in batch:  # first: a pair's row has a 4D mask (pair_batches.PairCollator), not tokens
            tokens = batch[INPUT_TOKENS][real].sum()
        elif "attention_mask" in batch:
            tokens = batch["attention_mask"][real].sum()
        else:
            tokens = torch.zeros((), device=row_weight.device)
        totals.append(torch.stack([row_weight.sum().float(), real.sum().float(), tokens.float()]))
    return torch.stack(totals).sum(dim=0)


def count_step(accelerator: Accelerator, micro_batches: list[dict], weight_key: str = SAMPLE_WEIGHT) -> StepSize:
    """All ranks call this once per optimizer step, before its first backward pass, with this
    rank's micro-batches of the step: what the step holds on all ranks together (one all-reduce).

    Knowing the step's total weight (real examples, or target tokens) before the first backward
    pass is what makes the loss exact: `global_mean_loss` divides by it, so the step's gradient is
    the mean over all its real examples, however they are split over ranks and micro-batches.
    """
    weight, examples, tokens = accelerator.reduce(_local_step_size(micro_batches, weight_key), reduction="sum")
    return StepSize(weight, examples, tokens)


def global_mean_loss(
    per_example_loss: torch.Tensor, weights: torch.Tensor, step_weight: torch.Tensor, accelerator: Accelerator
) -> torch.Tensor:
    """The loss to pass to `accelerator.backward` for one micro-batch: this rank's share of the
    mean loss over the optimizer step's real examples (or target tokens). Call it on each
    micro-batch with its per-example (or per-token) losses and weights and the step's total weight
    (`count_step(...).weight`); no communication.

    Why not the model's own mean loss: that is a mean per micro-batch, and averaging those over
    micro-batches and ranks weighs an example in a small (or short) micro-batch more than one in a
    full one, so N processes or accumulation would train another model than one big batch.
    Accelerate divides each micro-batch's loss by the accumulation steps and DDP averages the
    gradients over the ranks: both are undone here, so the summed gradient is exactly
    sum(weight * loss) / step_weight. Filler examples (weight 0.0) contribute nothing, and a rank
    whose micro-batch holds only fillers still takes part in the gradient all-reduce.
    """
    scale = accelerator.num_processes * accelerator.gradient_accumulation_steps
    return (per_example_loss * weights.to(per_example_loss.dtype)).sum() * scale / step_weight.clamp(min=1.0)
