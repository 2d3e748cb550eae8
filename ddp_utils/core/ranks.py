"""Making the ranks agree: work done on the main process first or alone, and errors that every
rank raises together instead of leaving the others waiting in a collective until the timeout.

Every function here is a collective: all ranks call it, at the same point of the script.
"""

from __future__ import annotations

from datetime import timedelta

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from .errors import RunFailed, UsageError


def _on_main_process(accelerator: Accelerator, work, *args, long_wait: bool = False, **kwargs):
    """All ranks call this: `work(*args, **kwargs)` on the main process (None elsewhere); if it raised, every
    rank raises (one broadcast). With `long_wait` (data preparation) the others wait up to `DATA_WAIT` for it."""
    result, error = None, None
    if accelerator.is_main_process:
        try:
            result = work(*args, **kwargs)
        except Exception as exc:  # reported to every rank by _share_outcome
            error = exc
    _share_outcome(accelerator, error, long_wait)
    return result


DATA_WAIT = timedelta(days=1)  # how long ranks wait for another's data preparation: not --ddp_timeout
_waiting = []  # the gloo group they wait in, made by the first wait


def _wait_for_the_others(accelerator: Accelerator) -> None:
    """All ranks call this: a barrier in a gloo group whose timeout is `DATA_WAIT`. A rank that finished its part
    waits here for the ones still preparing data, in `load_on_main_first` only (every other wait stays bound by
    --ddp_timeout, so that a rank stuck elsewhere still ends the job). The first preparation of a large set (every
    image of an ImageNet folder decoded, a corpus tokenized) can take longer than --ddp_timeout, which ended the
    waiting ranks with the backend's own timeout (gloo's "Timed out waiting ... for recv", or NCCL's watchdog). A
    rank that fails is reported at once, as before; one that dies ends the job through the launcher."""
    import torch.distributed as dist

    if accelerator.num_processes == 1 or not dist.is_initialized():
        return
    if not _waiting:
        _waiting.append(dist.new_group(backend="gloo", timeout=DATA_WAIT))
    dist.barrier(group=_waiting[0])


def _share_outcome(accelerator: Accelerator, error: BaseException | None, long_wait: bool = False) -> None:
    """All ranks call this: tell every rank whether the main process failed, and raise its error on every rank."""
    if accelerator.num_processes > 1:
        if long_wait:  # the main process's data preparation may take longer than a collective's timeout
            _wait_for_the_others(accelerator)
        # [is a UsageError, message] from the main process; [False, None] when it succeeded.
        report = [isinstance(error, UsageError), None if error is None else str(error) or type(error).__name__]
        broadcast_object_list(report)
        is_usage, message = report
        if not accelerator.is_main_process and message is not None:
            raise UsageError(message) if is_usage else RuntimeError(f"the main process failed: {message}")
    if error is not None:
        raise error


def load_on_main_first(accelerator: Accelerator, load, *args, **kwargs):
    """All ranks call this: `load(*args, **kwargs)` runs on the main process first, then on the
    main process of every other node (local rank 0), then on the remaining ranks, and each rank
    gets its own result.

    This is `accelerator.main_process_first()` (the main process downloads and fills the caches,
    the others then read them) made safe and node-aware:
    - if `load` raises on the main process, the other ranks are told and raise the same error at
      once (one broadcast), instead of waiting at the barrier until the distributed timeout; so
      for a failure on another node's main process (one gather);
    - each node prepares its data once: with node-local caches (no shared file system) its local
      main process fills the node's cache and its other ranks read it; with a shared one, the
      other nodes' main processes read what the main process wrote. Not once per rank;
    - each of the three turns ends with every rank told of any rank's error (a broadcast, then two gathers), and
      the ranks not loading wait for those that are up to `DATA_WAIT`, not --ddp_timeout.
    `load` must not itself call a collective (it runs on a few ranks at a time): build models
    outside it, on every rank together.
    """
    result = _on_main_process(accelerator, load, *args, long_wait=True, **kwargs)
    if accelerator.num_processes == 1:
        return result
    turns = (
        accelerator.is_local_main_process and not accelerator.is_main_process,  # each other node's main process
        not accelerator.is_local_main_process,  # then the other ranks, from their node's cache
    )
    for mine in turns:  # the ranks not loading wait for those that are, up to DATA_WAIT
        error = None
        if mine:
            try:
                result = load(*args, **kwargs)
            except Exception as exc:  # reported to every rank below
                error = exc
        _share_errors(accelerator, error)
    return result


def _share_errors(accelerator: Accelerator, error: BaseException | None) -> None:
    """All ranks call this: every rank raises the first error any rank had, or none (one gather)."""
    _wait_for_the_others(accelerator)  # the ranks loading data may take longer than a collective's timeout
    reports = gather_object(
        [None if error is None else (isinstance(error, UsageError), str(error) or type(error).__name__)]
    )
    failed = [report for report in reports if report is not None]
    if error is not None:
        raise error
    if failed:
        is_usage, message = failed[0]
        raise UsageError(message) if is_usage else RuntimeError(f"another rank failed: {message}")


def from_main_process(accelerator: Accelerator, compute, *args, **kwargs):
    """All ranks call this: `compute(*args, **kwargs)` runs on the main process only, and every
    rank gets its result (one broadcast), or raises its error. For decisions that must be the same
    on every rank even where the ranks see different things (the newest checkpoint on a file
    system with per-node caches, an output directory another rank is deleting)."""
    result = _on_main_process(accelerator, compute, *args, **kwargs)
    if accelerator.num_processes > 1:
        result = broadcast_object_list([result])[0]
    return result


def refuse_together(accelerator: Accelerator, problem: str | None) -> None:
    """All ranks call this, each with the problem it found (or None): if any rank found one, every
    rank raises `UsageError` with the first rank's problem (one gather). For checks that only some
    ranks can make, such as one that needs weights only the main process has loaded."""
    problems = gather_object([problem]) if accelerator.num_processes > 1 else [problem]
    found = [p for p in problems if p]
    if found:
        raise UsageError(found[0])


def fail_together(accelerator: Accelerator, problem: str | None) -> None:
    """All ranks call this, each with the fault it met (a one-line description) or None: if any
    rank met one, every rank raises `RunFailed` with the first (one gather). It stands where a
    barrier would, so the ranks that did not fail never wait in a collective the failed one skips."""
    problems = gather_object([problem]) if accelerator.num_processes > 1 else [problem]
    found = [p for p in problems if p]
    if found:
        raise RunFailed(found[0])
