"""Work the main process does once every rank has finished: `after_every_rank(job)` queues it, and
`process_exit.run` does it after the run's last barrier, while the other ranks have already exited.

For slow work at the end of a run that the other ranks need not wait for (the Hub upload): waiting
for it inside a collective would kill the job when the work outlasts --ddp_timeout. A leaf module:
it imports nothing of ddp_utils.
"""

from __future__ import annotations

from collections.abc import Callable

_jobs: list[tuple[str, Callable[[], str | None]]] = []


class Interrupted(Exception):
    """A SIGTERM or SIGUSR1 during the work after the run: raised inside the job, which reports it
    as its own failure (the upload that did not finish, and how to do it by hand)."""


def after_every_rank(what: str, job: Callable[[], str | None]) -> None:
    """Queue `job` (named `what` in the log) to run on this process after every rank has finished
    the script; it returns a line to log, or raises `RunFailed` with the one line that says why it
    failed. Call it on the main process only; no communication."""
    _jobs.append((what, job))


def queued_jobs() -> list[tuple[str, Callable[[], str | None]]]:
    """The queued jobs, in order, emptied from the queue."""
    jobs = list(_jobs)
    _jobs.clear()
    return jobs
