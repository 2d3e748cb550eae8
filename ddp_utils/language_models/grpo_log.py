"""What GRPO's log shows of each step beyond the loss: the share of the step spent generating, each reward's mean
and spread, the groups without signal, the completions' lengths; and, at the end, whether any group ever had a
signal. No communication: the `TrainingLog` gathers."""

from __future__ import annotations

import time

import numpy as np
import torch
from accelerate.logging import get_logger

from ..data.dataloaders import SAMPLE_WEIGHT

logger = get_logger(__name__)


class GenerationClock:
    """How much of each step's time went to generation, for the log: `new_step()`, then `with clock:` around
    generation, then `share()`. No communication."""

    def new_step(self) -> None:
        self.step_started, self.generating = time.perf_counter(), 0.0

    def __enter__(self):
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.generating += time.perf_counter() - self.started

    def share(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(seconds generating, seconds in the step so far): a mean for `TrainingLog.step`."""
        return torch.tensor(self.generating), torch.tensor(time.perf_counter() - self.step_started)


def rollout_sums(rollouts: list[dict], rewards: np.ndarray, total: np.ndarray, names: list[str], group: int, device):
    """(numerator, denominator) pairs for the log over this rank's rollouts of a step: each reward function's
    mean and spread, the share of groups whose rewards are all equal (no signal), completion lengths, and the
    share cut at the maximum. No communication."""
    weight = torch.cat([r[SAMPLE_WEIGHT] for r in rollouts]).double().cpu().numpy()
    lengths = torch.cat([r["completion_mask"].sum(dim=1) for r in rollouts]).double().cpu().numpy()
    cut = torch.cat([r["truncated"] for r in rollouts]).double().cpu().numpy()
    flat = total.reshape(-1, group)
    real_groups = weight.reshape(-1, group)[:, 0]
    sums = {
        "no_signal_groups": ((np.ptp(flat, axis=1) == 0) * real_groups).sum(),
        "completion_length": (lengths * weight).sum(),
        "cut_at_max_length": (cut * weight).sum(),
    }
    sums.update({f"reward/{name}": (rewards[:, j] * weight).sum() for j, name in enumerate(names)})
    counts = {"no_signal_groups": real_groups.sum()}
    out = {key: (torch.tensor(value), torch.tensor(counts.get(key, weight.sum()))) for key, value in sums.items()}
    for j, name in enumerate(names):  # the spread within groups, averaged over the groups
        spread = rewards[:, j].reshape(-1, group).std(axis=1)
        out[f"reward/{name}_std"] = (torch.tensor((spread * real_groups).sum()), torch.tensor(real_groups.sum()))
    return {key: (num.float().to(device), den.float().to(device)) for key, (num, den) in out.items()}


def learning_signal(log) -> dict:
    """For metrics.json once training is over: the share of this run's groups (since its start, or its resume: then
    `no_signal_from_step` says which) whose samples all got one reward, which give no gradient; where that is every
    group, a warning that the model learned nothing. Every rank calls it with the same `log` (a `TrainingLog`); no
    communication."""
    numerator, denominator = (float(value) for value in log.run_means.get("no_signal_groups", (0.0, 0.0)))
    if not denominator:
        return {}
    if numerator == denominator:
        since = f"since the resume at step {log.first_step}" if log.first_step else "sampled"
        unchanged = "these steps changed nothing" if log.first_step else "the saved model is the one it started from"
        logger.warning(
            f"no signal: in each of the {denominator:.0f} groups {since}, every answer got the same reward, so "
            f"{unchanged}; check that your rewards tell this model's answers apart (one it never earns, such as an "
            "exact answer it never gives, is the same for all), or raise --num_generations or --temperature"
        )
    resumed = {"no_signal_from_step": log.first_step} if log.first_step else {}
    return {"no_signal_groups": numerator / denominator, **resumed}
