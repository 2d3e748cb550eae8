"""The dry run's warm launches (`--warm_launcher`, what the test suite asks for): each `accelerate launch` of a step
forked from one process per lane that has imported torch, transformers and the rest once (tests/warm_launch.py, the
suite's own warm launcher), instead of a launcher and fresh interpreters that import them again: about 8 CPU seconds
a run on the 2-core CI machine. The command, its launcher arguments and its environment are the cold run's:
Accelerate's own parser reads them there, and Accelerate's code computes each process's environment. A run whose
environment adds a variable read at import time (step 3's TORCH_LOGS), or that `accelerate launch` would not start
with torchrun or its simple launcher for one process, runs cold; a server found gone is started again (the runner's
`warm_launcher`), and where one does not start the runs go cold, as the step says. A GPU run never comes here.
Standard library only, as the runner."""

from __future__ import annotations

import sys

from checklist_steps import REPO

TESTS = REPO / "tests"
LAUNCH = ["-m", "accelerate.commands.launch"]


class WarmLauncher:
    """One warm launcher, started with the environment every run of this lane gets (`env`): a variable read at import
    time (HF_HOME, PYTHONPATH) is the server's own, so each launch hands on only what it adds."""

    def __init__(self, env: dict):
        sys.path.insert(0, str(TESTS))
        import launching  # the suite's side: its server, the request and its answer, what a forked worker sets again

        self.launching = launching
        self.server = launching.WarmServer(env)
        self.path = self.server.path

    def alive(self) -> bool:
        return self.server.alive()

    def run(self, command: list, extra_env: dict, out_fd: int, timeout: float) -> int | None | str:
        """Run `command` (python -m accelerate.commands.launch LAUNCHER_ARGS SCRIPT ARGS) with its processes writing
        to `out_fd`: its exit code (-9 where it was killed, or its server died under it), None where it ran past
        `timeout` (its processes killed), or "cold" where it must run cold: not a launch, a variable read at import
        time, neither torchrun nor the simple launcher for one process, or a server gone before the launch began."""
        command = [str(part) for part in command]
        script = next((i for i, part in enumerate(command) if i > 2 and part.endswith(".py")), None)
        if command[1:3] != LAUNCH or script is None or set(extra_env) - self.launching.RUNTIME_ENV or not self.alive():
            return "cold"
        launcher_args, args = command[3:script], command[script + 1 :]
        try:
            connection = self.launching.request_launch(
                self.path, command[script], args, launcher_args, extra_env, None, out_fd
            )
        except OSError:  # the server is gone: nothing was started
            return "cold"
        try:
            returncode = self.launching.wait_for_warm_launch(connection, timeout)
        except TimeoutError:
            return None
        except OSError:  # reset: the server died before it read the request, so nothing was started (a launch that
            return "cold"  # dies later answers with an empty message, which is its exit code -9)
        return "cold" if returncode is None else returncode

    def stop(self) -> None:
        self.server.stop()
