"""Ending a run's processes cleanly: bad input as one line on every rank (exit 2), a preemption as
exit 75, any other failure with its traceback (exit 1); trackers closed first, the work queued for
after the run done by the main process once every rank has finished, and no hang in the
interpreter's teardown. The one line is also the launcher's summary of the failure: torchrun shows
a failed process's error file (`TORCHELASTIC_ERROR_FILE`) as its "Root Cause", the last thing the
user reads, instead of "To enable traceback see ..." under 30 lines of the launcher's own stack."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch

from ..core.errors import EXIT_PREEMPTED, EXIT_USAGE, Preempted, RunFailed, UsageError
from ..results.after_the_run import Interrupted, queued_jobs
from .start import _accelerators


def run(main, *args) -> None:
    """All ranks call this, from `__main__`: run a script's `main(*args)` and exit the process
    cleanly (after a last barrier when the run succeeded).

    A `UsageError` (bad input, bad launch) is printed as one line naming the rank, with exit
    code 2; a `RunFailed` (a diverged loss, a failed save) as one line, with exit code 1;
    `Preempted` exits with EXIT_PREEMPTED (75); any other exception prints its traceback and
    exits 1. Either way the line goes to the launcher's error file too, the trackers are ended
    first (their last events flushed, wandb and mlflow runs closed as failed or preempted), the
    launcher then stops the other ranks, and the process ends without the interpreter teardown
    that can hang in the gloo destructor. After a run that succeeded, the main process does the
    work queued with `after_the_run.after_every_rank` (the Hub upload) once every rank has passed
    the last barrier, so no rank waits for it in a collective with a time limit.
    """
    rank = os.environ.get("RANK", "0")
    exit_code = 0
    try:
        main(*args)
    except UsageError as error:
        exit_code = _fail(f"[rank {rank}] error: {error}", EXIT_USAGE)
        _meet_the_other_ranks()
    except RunFailed as failure:  # every rank found it together: one line each, no traceback
        exit_code = _fail(f"[rank {rank}] error: {failure}", 1)
    except Preempted as stop:
        exit_code = _fail(f"[rank {rank}] preempted: {stop}", EXIT_PREEMPTED)
    except Exception:
        stack = traceback.format_exc()
        sys.stderr.write(stack)
        exit_code = _fail(f"[rank {rank}] failed, see the traceback above", 1, summary=stack)
    if exit_code:
        _end_trackers(exit_code)
    _shutdown(exit_code, rank)


def _fail(line: str, exit_code: int, summary: str | None = None) -> int:
    """Say `line` and leave it (or `summary`, a traceback) in the launcher's error file; return `exit_code`."""
    _say(line)
    _write_error_file(summary or line)
    return exit_code


def _write_error_file(text: str) -> None:
    """Write `text` where torch elastic's launcher reads a failed process's error
    (`TORCHELASTIC_ERROR_FILE`, set by torchrun and `accelerate launch` for every process), in the
    format of its own `record` decorator: the launcher's summary then ends with it as the root
    cause. Nothing without that variable (a plain `python` run)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    error = {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}
    try:
        with open(f"{path}.tmp", "w") as handle:
            json.dump({"message": error}, handle)
        os.replace(f"{path}.tmp", path)
    except OSError:  # the launcher then shows its own summary; the line was printed anyway
        pass


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


def _shutdown(exit_code: int, rank: str = "0") -> None:
    """End the process without running the interpreter's final garbage collection; after a run
    that succeeded, first a last barrier, then the work queued for after the run (`_do_queued_work`).

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
    if exit_code == 0:
        exit_code = _do_queued_work(rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _interrupt(signum, frame):
    raise Interrupted(f"stopped by {signal.Signals(signum).name}")


def _do_queued_work(rank: str) -> int:
    """Do the work queued for after the run (only the main process queues any), once every rank
    has passed the last barrier: the other ranks exit meanwhile, and the launcher waits for this
    one. A job that fails is one line here and in the launcher's summary, with exit code 1. A
    SIGTERM or SIGUSR1 now (a time limit, a preemption) interrupts the job, which then fails in
    that line: the run itself is saved, and no checkpoint is due."""
    jobs = queued_jobs()
    if jobs:
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, _interrupt)
    for what, job in jobs:
        _say(f"[rank {rank}] {what}, now that every process has finished")
        try:
            done = job()
        except RunFailed as failure:
            return _fail(f"[rank {rank}] error: {failure}", 1)
        except Exception:
            stack = traceback.format_exc()
            sys.stderr.write(stack)
            return _fail(f"[rank {rank}] failed while {what}, see the traceback above", 1, summary=stack)
        if done:
            _say(f"[rank {rank}] {done}")
    return 0
