"""Preemption: SIGTERM / SIGUSR1 (what SLURM sends before a time limit or a preemption) turned into
a checkpoint after the optimizer step in flight, then exit code 75 on every rank, and
`preempted.json` for the job script that requeues the run (`slurm/train.sbatch`)."""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import torch
from accelerate import Accelerator

from ..core.errors import EXIT_PREEMPTED, PREEMPTION_SIGNALS, Preempted
from ..core.files import write_json
from ..core.ranks import fail_together

PREEMPTED_FILE = "preempted.json"  # in the output dir while a preempted run waits to be resumed


class PreemptionHandler:
    """Turns SIGTERM / SIGUSR1 (what SLURM sends before a time limit or preemption) into a flag
    that `requested` shares across ranks. All ranks create it, after the Accelerator: on an
    accelerator that is a collective (it makes the CPU process group the flag travels in)."""

    SIGNALS = PREEMPTION_SIGNALS

    def __init__(self, accelerator: Accelerator, timeout_s: int = 1800):
        self.accelerator = accelerator
        self.received: int | None = None
        # The flag goes through a gloo group on the CPU: through the device's own backend, reading
        # it every step would wait for the device to finish the step (a host sync per step).
        self.group = None
        if accelerator.num_processes > 1 and torch.distributed.is_initialized():
            on_cpu = torch.distributed.get_backend() == "gloo"
            self.group = (
                torch.distributed.group.WORLD
                if on_cpu
                else torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            )
        for signum in self.SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame):
        self.received = signum

    def requested(self) -> bool:
        """All ranks call this once per optimizer step: True on every rank if any rank received a
        signal (one scalar all-reduce on the CPU, no device sync), so they all stop after the same step."""
        flag = torch.tensor(1 if self.received is not None else 0, dtype=torch.int32)
        if self.group is not None:
            torch.distributed.all_reduce(flag, group=self.group)
        elif self.accelerator.num_processes > 1:  # processes without torch.distributed (XLA): through the device
            flag = self.accelerator.reduce(flag.to(self.accelerator.device), reduction="sum")
        return bool(flag.item())

    def stop(self, output_dir: str, checkpoint: str) -> None:
        """All ranks call this after the preemption checkpoint (one gather): the main process leaves
        `preempted.json` for the job script, and once it is written every rank raises `Preempted`
        (ddp_utils.run then exits with EXIT_PREEMPTED). No rank leaves before the marker is there:
        under `srun --kill-on-bad-exit` the first launcher to exit ends those of every other node.
        A marker that cannot be written is `RunFailed` on every rank (the job is not requeued)."""
        name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
        marker, problem = os.path.join(output_dir, PREEMPTED_FILE), None
        try:
            write_json(self.accelerator, marker, {"signal": name, "checkpoint": checkpoint})
        except Exception as exc:  # reported on every rank by fail_together
            problem = (
                f"stopped by {name} after saving {checkpoint}, but could not write {marker!r} ({exc}), so a job "
                "script will not requeue the run; resume it with --resume_from_checkpoint latest"
            )
        fail_together(self.accelerator, problem)
        raise Preempted(
            f"stopped by {name} after saving {checkpoint}; resume with --resume_from_checkpoint latest "
            f"(every process exits with {EXIT_PREEMPTED})"
        )


def clear_preempted_marker(accelerator: Accelerator, output_dir: str) -> None:
    """Remove a `preempted.json` left by an earlier attempt, on the main process, as a run starts
    (`start_run` calls it): the marker tells the job script that *this* attempt was preempted, so
    it must not outlive the attempt that wrote it (a requeued run that then fails for another
    reason, even while loading its data, would otherwise be requeued for ever). Any rank may call
    it; the others do nothing."""
    marker = os.path.join(output_dir, PREEMPTED_FILE)
    if accelerator.is_main_process and os.path.isfile(marker):
        os.remove(marker)
