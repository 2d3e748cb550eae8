"""Loaded at start-up by every launched process whose PYTHONPATH holds this folder (tests only).
It watches file writes through Python's audit hooks and, as the environment asks:

- WRITE_AUDIT_TARGET + WRITE_AUDIT_LOG: log every write, rename, removal or mkdir under the
  target to WRITE_AUDIT_LOG.rank<RANK>, so a test can show which ranks wrote there;
- CRASH_ON_WRITE=<text>: SIGKILL this process when it opens for writing a path containing <text>
  (a crash in the middle of a checkpoint save);
- SIGTERM_ON_WRITE=<text>: on rank 0, when a path containing <text> is first opened for writing,
  send SIGTERM (a preemption at a known point) to SIGTERM_TARGET: "launcher" (our parent, which
  forwards it to every rank), "workers" (every rank directly, the launcher untouched) or "step"
  (every process the fake srun of tests/fake_slurm started, launchers and ranks of every node, as
  SLURM signals a job step);
- SLOW_ON_WRITE=<text>:<seconds>[,<text>:<seconds>...]: on rank 0, sleep that long the first time
  it writes, creates, renames or removes a path containing <text> (a checkpoint, or a file, that
  takes that long to write).
"""

import os
import signal
import sys

_target = os.environ.get("WRITE_AUDIT_TARGET")
_crash_on = os.environ.get("CRASH_ON_WRITE")
_sigterm_on = os.environ.get("SIGTERM_ON_WRITE") if os.environ.get("RANK") == "0" else None
_slow_on = dict(item.rsplit(":", 1) for item in os.environ.get("SLOW_ON_WRITE", "").split(",") if item)
_slow_on = _slow_on if os.environ.get("RANK") == "0" else {}

if _target or _crash_on or _sigterm_on or _slow_on:
    _target = os.path.realpath(_target) if _target else None
    _log_path = f"{os.environ.get('WRITE_AUDIT_LOG')}.rank{os.environ.get('RANK', 'none')}"
    _events = {
        "os.rename",
        "os.replace",
        "os.remove",
        "os.rmdir",
        "os.mkdir",
        "shutil.rmtree",
        "shutil.move",
        "os.truncate",
    }
    _signalled = []

    def _path(value):
        try:
            return os.path.realpath(os.fsdecode(value))
        except (TypeError, ValueError):
            return None

    def _audit(event, args):
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & (
                os.O_WRONLY | os.O_RDWR | os.O_CREAT
            )
            paths = [_path(path)] if writes and path is not None else []
        elif event in _events:
            paths = [_path(a) for a in args if isinstance(a, (str, bytes, os.PathLike))]
        else:
            return
        for path in filter(None, paths):
            if _crash_on and event == "open" and _crash_on in path:
                os.kill(os.getpid(), signal.SIGKILL)
            if _sigterm_on and event == "open" and _sigterm_on in path and not _signalled:
                _signalled.append(path)
                target = os.environ.get("SIGTERM_TARGET", "launcher")
                if target == "launcher":
                    os.kill(os.getppid(), signal.SIGTERM)
                else:
                    import psutil

                    if target == "step":  # the launchers and ranks of every node, this one included
                        step = psutil.Process(int(os.environ["FAKE_SRUN_PID"])).children(recursive=True)
                    else:
                        step = psutil.Process(os.getppid()).children()
                    for process in step:
                        try:
                            os.kill(process.pid, signal.SIGTERM)
                        except ProcessLookupError:  # a process of the step that has just ended
                            pass
            for text in [text for text in _slow_on if text in path]:
                import time

                time.sleep(float(_slow_on.pop(text)))
            if _target and (path == _target or path.startswith(_target + os.sep)):
                with open(_log_path, "a") as log:  # the log is outside the target, so this does not recurse
                    log.write(f"{event} {path}\n")

    sys.addaudithook(_audit)
