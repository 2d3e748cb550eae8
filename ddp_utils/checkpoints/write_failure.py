"""A write that fails (no space, quota, file too large, permissions) on any rank, reported on every rank
in one line that names what could not be written, the cause, the newest complete checkpoint and the fix."""

from __future__ import annotations

import os
import shutil

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
    fail_together(accelerator, None if error is None else write_failure(error, what, output_dir))


def write_failure(error: BaseException, what: str, output_dir: str) -> str:
    """The one line for a write of `what` that raised `error`: the cause (the OS error, found in
    the exception's chain; torch's writer reports only "iostream error", so the free space and the
    file size limit are named then), the newest complete checkpoint and the fix."""
    import resource

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
    newest = (list_checkpoints(output_dir) or [None])[-1]
    kept = f"the newest complete checkpoint is {newest!r}" if newest else "no complete checkpoint was saved yet"
    return (
        f"could not write {what} ({cause}); {kept}. Free space there (or raise the quota or file size limit), or give "
        "an --output_dir on a larger disk, then resume with --resume_from_checkpoint latest"
    )
