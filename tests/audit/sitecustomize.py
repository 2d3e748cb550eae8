"""Loaded at start-up by every launched process whose PYTHONPATH holds this folder (tests only).

When WRITE_AUDIT_TARGET is set, every file write, rename, removal or directory creation under
that path is appended to WRITE_AUDIT_LOG.rank<RANK>, so a test can show which ranks wrote there.
"""

import os
import sys

_target = os.environ.get("WRITE_AUDIT_TARGET")
if _target:
    _target = os.path.realpath(_target)
    _log_path = f"{os.environ['WRITE_AUDIT_LOG']}.rank{os.environ.get('RANK', 'none')}"
    _events = {"os.rename", "os.replace", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "shutil.move", "os.truncate"}

    def _under_target(path):
        try:
            real = os.path.realpath(os.fsdecode(path))
            return real == _target or real.startswith(_target + os.sep)
        except (TypeError, ValueError):
            return False

    def _audit(event, args):
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if not (writes and path is not None and _under_target(path)):
                return
        elif event in _events:
            if not any(isinstance(a, (str, bytes, os.PathLike)) and _under_target(a) for a in args):
                return
        else:
            return
        with open(_log_path, "a") as log:  # the log is outside the target, so this does not recurse
            log.write(f"{event} {args[0]!r}\n")

    sys.addaudithook(_audit)
