"""The two ways a run stops early on purpose, their exit codes, and the signals that ask for a stop.
A leaf module: everything in ddp_utils may import it, and it imports nothing of ddp_utils."""

import signal

# Exit code of a run stopped by bad input or a bad launch (argparse uses 2 as well).
EXIT_USAGE = 2
# Exit code of every training process after a preemption checkpoint (EX_TEMPFAIL: try again later).
# torchrun / accelerate launch report it per worker and exit 1 themselves; see preemption.PREEMPTED_FILE.
EXIT_PREEMPTED = 75
# What SLURM sends before a time limit or a preemption: the training process checkpoints and exits
# (preemption.PreemptionHandler); the data loader's workers ignore them.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class UsageError(Exception):
    """Bad input or a bad launch: reported as one clear line, without a stack trace."""


class RunFailed(Exception):
    """A fault the run cannot go past (a loss that turned NaN, a checkpoint that could not be
    written), found on every rank together: reported as one clear line on every rank, exit code 1,
    with nothing broken saved."""


class Preempted(Exception):
    """Raised on every rank once the preemption checkpoint is written; `run` exits with EXIT_PREEMPTED."""
