"""The dry run's warm launches (`--warm_launcher`, what the test suite asks for): each `accelerate launch` of a step
forked from one process per lane that has imported torch, transformers and the rest once (tests/warm_launch.py, the
suite's own warm launcher), instead of a launcher and fresh interpreters that import them again: about 8 CPU seconds
a run on the 2-core CI machine. The command, its launcher arguments and its environment are the cold run's: Accelerate's
own parser reads them there, and Accelerate's code computes each process's environment. A run whose environment adds
a variable read at import time (step 3's TORCH_LOGS), or that `accelerate launch` would not start with torchrun or
its simple launcher, runs cold. A GPU run never comes here. Standard library only, as the runner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

from checklist_steps import REPO

TESTS = REPO / "tests"
LAUNCH = ["-m", "accelerate.commands.launch"]


class WarmLauncher:
    """One warm launcher, started with the environment every run of this lane gets (`env`): a variable read at import
    time (HF_HOME, PYTHONPATH) is the server's own, so each launch hands on only what it adds."""

    def __init__(self, env: dict):
        sys.path.insert(0, str(TESTS))
        import launching  # the suite's client side: its request and the variables a forked worker sets again

        self.launching = launching
        self.folder = tempfile.mkdtemp(prefix="gpu-check-warm-")
        self.path = os.path.join(self.folder, "socket")
        self.server = subprocess.Popen(
            [sys.executable, str(TESTS / "warm_launch.py"), self.path], env=env, stdout=subprocess.PIPE, text=True
        )
        if self.server.stdout.readline().strip() != "ready":
            raise RuntimeError("the warm launcher (tests/warm_launch.py) did not start: its error is above")

    def run(self, command: list, extra_env: dict, out_fd: int, timeout: float) -> int | None | str:
        """Run `command` (python -m accelerate.commands.launch LAUNCHER_ARGS SCRIPT ARGS) with its processes writing
        to `out_fd`: its exit code, None where it ran past `timeout` (its processes killed), or "cold" where it must
        run cold (not a launch, a variable read at import time, neither torchrun nor the simple launcher)."""
        command = [str(part) for part in command]
        if command[1:3] != LAUNCH or set(extra_env) - self.launching.RUNTIME_ENV:
            return "cold"
        script = next(i for i, part in enumerate(command) if i > 2 and part.endswith(".py"))
        connection = self.launching.request_launch(
            self.path, command[script], command[script + 1 :], command[3:script], extra_env, None, out_fd
        )
        connection.settimeout(timeout)
        group = None
        try:
            answer = json.loads(connection.recv(4096))
            if "real" in answer:
                return "cold"
            group = answer["pid"]
            final = connection.recv(4096)
        except TimeoutError:
            if group is not None:
                os.killpg(group, signal.SIGKILL)  # the launch and its processes
            return None
        finally:
            connection.close()
        return json.loads(final)["returncode"] if final else -signal.SIGKILL  # empty: its launch was killed

    def stop(self) -> None:
        self.server.kill()
        self.server.wait()
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))
        os.rmdir(self.folder)
