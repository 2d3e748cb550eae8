"""Ending a run's processes cleanly: bad input as one line on every rank (exit 2), a preemption as
exit 75, any other failure with its traceback (exit 1); trackers closed first, and no hang in the
interpreter's teardown."""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta

import torch

from .errors import EXIT_PREEMPTED, EXIT_USAGE, Preempted, RunFailed, UsageError
from .start import _accelerators


def run(main, *args) -> None:
    """All ranks call this, from `__main__`: run a script's `main(*args)` and exit the process
    cleanly (after a last barrier when the run succeeded).

    A `UsageError` (bad input, bad launch) is printed as one line naming the rank, with exit
    code 2; a `RunFailed` (a diverged loss, a failed save) as one line, with exit code 1;
    `Preempted` exits with EXIT_PREEMPTED (75); any other exception prints its traceback and
    exits 1. Either way the trackers are ended first (their last events flushed,
    wandb and mlflow runs closed as failed or preempted), the launcher then stops the other ranks,
    and the process ends without the interpreter teardown that can hang in the gloo destructor.
    """
    rank = os.environ.get("RANK", "0")
    exit_code = 0
    try:
        main(*args)
    except UsageError as error:
        _say(f"[rank {rank}] error: {error}")
        exit_code = EXIT_USAGE
        _meet_the_other_ranks()
    except RunFailed as failure:  # every rank found it together: one line each, no traceback
        _say(f"[rank {rank}] error: {failure}")
        exit_code = 1
    except Preempted as stop:
        _say(f"[rank {rank}] preempted: {stop}")
        exit_code = EXIT_PREEMPTED
    except Exception:
        traceback.print_exc()
        _say(f"[rank {rank}] failed, see the traceback above")
        exit_code = 1
    if exit_code:
        _end_trackers(exit_code)
    _shutdown(exit_code)


def _say(line: str) -> None:
    """Write one whole line to stderr in one write: `print` writes the text and the newline apart,
    and the launcher's shared pipe then interleaved two ranks' lines (seen in a test)."""
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor (captured)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


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
                _say(f"could not close the {tracker.name} tracker: {error}")


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
