"""A write that fails (no space, quota, file too large, permissions) on any rank, reported on every rank
in one line that names what could not be written, the cause, the newest complete checkpoint and the fix.
A fault met while writing that is no fault of the disk (a bug, a model that cannot be merged) is named as
such, its traceback printed by the rank that met it: no disk advice for it."""

from __future__ import annotations

import os
import shutil
import sys
import traceback

from accelerate import Accelerator

from ..core.files import existing_parent
from ..core.ranks import fail_together
from .manifest import list_checkpoints


def agree_on_write(accelerator: Accelerator, error: BaseException | None, what: str, output_dir: str) -> None:
    """All ranks call this after writing (one gather), each with the error its write raised, or
    None: if any rank failed, every rank raises `RunFailed` with one line that names `what` could
    not be written, the cause, the newest complete checkpoint in `output_dir` and the fix. Stands
    where a barrier would: the ranks that did not fail wait here, not in a collective the failed
    rank never reaches."""
    if error is not None and not is_write_fault(error):
        traceback.print_exception(error, file=sys.stderr)  # one line cannot say where a bug arose
    fail_together(accelerator, None if error is None else write_failure(error, what, output_dir))


# Writers that name the OS's fault in words only: torch's ("iostream error", "unexpected pos", "file write failed",
# "open file failed with strerror: Permission denied"), safetensors' ("IoError(Os { code: 28, ... })").
WRITERS_WORDS = ("iostream error", "unexpected pos", "write failed", "open file failed", "cannot be opened", "strerror",
                 "ioerror", "no space", "quota", "too large", "permission denied", "read-only file system")  # fmt: skip


def is_write_fault(error: BaseException) -> bool:
    """Did the write itself fail (the disk, its quota, a file size limit, permissions): an OS error in the
    exception's chain, or the words of a writer that does not raise one (torch's "iostream error" and
    "unexpected pos", safetensors' IoError)? No communication."""
    found = error
    while found is not None:
        if isinstance(found, OSError) and found.errno:
            return True
        if any(word in str(found).lower() for word in WRITERS_WORDS):
            return True
        found = found.__cause__ or found.__context__
    return False


def write_failure(error: BaseException, what: str, output_dir: str) -> str:
    """The one line for a write of `what` that raised `error`: the cause (the OS error, found in
    the exception's chain; torch's writer reports only "iostream error", so the free space and the
    file size limit are named then), the newest complete checkpoint and the fix; for a fault that is
    not the write's (`is_write_fault`), the error, named as no disk fault. No communication."""
    import resource

    newest = (list_checkpoints(output_dir) or [None])[-1]
    kept = f"the newest complete checkpoint is {newest!r}" if newest else "no complete checkpoint was saved yet"
    if not is_write_fault(error):
        message = (str(error).splitlines() or [""])[0][:200]
        return (
            f"could not write {what}: {type(error).__name__}: {message} (not a disk fault: the traceback above "
            f"shows where it arose); {kept}. Fix the cause, then resume with --resume_from_checkpoint latest"
        )
    cause, found = None, error
    while found is not None and cause is None:
        if isinstance(found, OSError) and found.errno:
            cause = f"[Errno {found.errno}] {found.strerror or os.strerror(found.errno)}"
        found = found.__cause__ or found.__context__
    if cause is None:  # torch's writer raises RuntimeError("unexpected pos ..."): name the likely limits first
        free = shutil.disk_usage(existing_parent(output_dir)).free
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        facts = [f"files are limited to {limit / 2**20:.1f} MiB (ulimit -f)"] if limit != resource.RLIM_INFINITY else []
        facts += [
            f"{free / 2**30:.1f} GiB free there",
            f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:120]}",
        ]
        cause = "; ".join(facts)
    return (
        f"could not write {what} ({cause}); {kept}. Free space there (or raise the quota or file size limit), or give "
        "an --output_dir on a larger disk, then resume with --resume_from_checkpoint latest"
    )
