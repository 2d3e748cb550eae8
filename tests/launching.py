"""How the tests launch a script on N CPU processes (gloo): `launch`, through `accelerate launch` itself or,
where nothing it does differently matters, through the warm launcher (tests/warm_launch.py), which forks the
processes from one that has imported the libraries once. What a launch gives back (LaunchResult) and the
checks on a failed one's output are here too. conftest.py imports them for the tests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CPU_CONFIG = REPO / "accelerate_configs" / "cpu_2proc.yaml"
AUDIT_HOOK_DIR = Path(__file__).resolve().parent / "audit"


@dataclass
class LaunchResult:
    returncode: int
    output: str
    seconds: float  # from start to exit of the whole launch
    exit_after_last_line: float  # seconds between the last line printed and the launch's exit
    lines: list = field(default_factory=list)
    warm: bool = False  # through tests/warm_launch.py: no launcher process, so no launcher's summary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env(extra: dict | None = None) -> dict:
    """The environment of a launched test run: offline, one thread per process, isolated caches."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    env.update(extra or {})
    return env


def launch(
    script,
    *args,
    num_processes=2,
    launcher_args=(),
    env=None,
    timeout=300,
    file_size_limit=None,
    real_launcher=False,
) -> LaunchResult:
    """Run `<script> <args>` on `num_processes` CPU processes and time its exit. Where `env` holds only the test
    hooks' variables and the compile tests' backend (RUNTIME_ENV), the processes are forked from the warm launcher
    (tests/warm_launch.py: the environment `accelerate launch` gives, without a fresh interpreter's imports);
    otherwise, or with `real_launcher`, through `accelerate launch` itself. `file_size_limit` (bytes): no process of
    the launch may write a larger file (ulimit -f)."""
    launcher_args = [*(launcher_args or ["--config_file", str(CPU_CONFIG), "--num_processes", str(num_processes)])]
    launcher_args += ["--main_process_port", str(free_port())]
    extra = warm_env(env)
    if not (real_launcher or file_size_limit or extra is None or os.environ.get("TESTS_REAL_LAUNCHER")):
        result = launch_warm(script, args, launcher_args, extra, timeout)
        if result is not None:
            return result
    command = [sys.executable, "-m", "accelerate.commands.launch", *launcher_args, str(script), *map(str, args)]
    start = time.monotonic()

    def limit_file_size():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=launch_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=limit_file_size if file_size_limit else None,
    )
    reader, lines = read_in_background(process.stdout)
    try:
        process.wait(timeout=timeout)
    except BaseException as stop:  # a hang, or this process interrupted
        kill_with_descendants(process.pid)
        process.wait()
        reader.join(5)
        if isinstance(stop, subprocess.TimeoutExpired):
            raise hung(timeout, lines) from None
        raise
    return finished(process.returncode, start, reader, lines)


# The sharded layouts a test runs on 2 CPU processes: (harness in tests/launched, launch config, distributed_type).
SHARDED = {
    "fsdp": ("fsdp_on_cpu.py", "fsdp.yaml", "FSDP"),
    "zero3": ("deepspeed_on_cpu.py", "deepspeed_zero3.yaml", "DEEPSPEED"),
}


def launch_sharded(sharded: str, script: str, *args) -> LaunchResult:
    """scripts/<script>.py on 2 CPU processes under Accelerate's FSDP2 path or DeepSpeed ZeRO-3 (`SHARDED`, through
    tests/launched's harnesses), checked to have finished under that layout."""
    harness, config, kind = SHARDED[sharded]
    launcher = ["--config_file", REPO / "accelerate_configs" / config, "--num_processes", 2, "--mixed_precision", "no"]
    run = launch(REPO / "tests" / "launched" / harness, script, *args, launcher_args=[str(a) for a in launcher])
    assert run.returncode == 0, run.output[-3000:]
    assert f"distributed_type {kind}" in run.output
    return run


def kill_with_descendants(pid: int) -> None:
    """Kill a launcher and every process under it: torchrun starts its workers in sessions of their own, so a killed
    launcher, or its process group, leaves them running."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        launcher = psutil.Process(pid)
        for process in [*launcher.children(recursive=True), launcher]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def read_in_background(stream) -> tuple[threading.Thread, list[tuple[float, str]]]:
    """Each line of a launch's output with the time it arrived, read by a daemon thread."""
    lines: list[tuple[float, str]] = []

    def read():
        with stream:
            for line in stream:
                lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader, lines


def hung(timeout: float, lines: list) -> AssertionError:
    return AssertionError(f"launch hung for {timeout}s:\n" + "".join(text for _, text in lines[-60:]))


def finished(returncode: int, start: float, reader: threading.Thread, lines: list, warm=False) -> LaunchResult:
    """The result of a launch that has exited, once its last output is read."""
    end = time.monotonic()
    reader.join(10)
    last_line_at = lines[-1][0] if lines else end
    return LaunchResult(returncode, "".join(t for _, t in lines), end - start, end - last_line_at, lines, warm)


# Variables that the audit hook (tests/audit) and the helpers in tests/launched read at run time, after the
# imports, and the compile tests' backend, which each warm worker sets again itself: a launch that adds only these,
# and the audit hook's PYTHONPATH, can run warm. Not SIGTERM_ON_WRITE: a preemption's exit code and signals are the
# launcher's.
RUNTIME_ENV = {
    "WRITE_AUDIT_TARGET",
    "WRITE_AUDIT_LOG",
    "CRASH_ON_WRITE",
    "SLOW_ON_WRITE",
    "STEP_LOG",
    "FINISH_LOG",
    "FP16_INIT_SCALE",
    "FP16_BACKOFF_FACTOR",
    "FP16_INIT_SCALE_POWER",
    "LOCAL_LOSS_LOG",
    "TORCH_COMPILE_OVERRIDE_BACKENDS",  # read by torch at import, but set in dynamo's config by each warm worker
}
AUDIT_PYTHONPATH = os.pathsep.join([str(AUDIT_HOOK_DIR), str(REPO)])
# Set by an import, to a fixed default, the first time a test in the pytest process imports the library (torch's;
# scikit-learn's and joblib's; DeepSpeed's). Handed on as they are now, as a fresh launch inherits them: no change.
SET_BY_IMPORTS = {
    "TORCHINDUCTOR_CACHE_DIR",
    "KMP_DUPLICATE_LIB_OK",
    "KMP_INIT_AT_FORK",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
}
_WARM: dict = {}  # this pytest process's warm launcher: its server, socket path and the environment it started with


def environment_now() -> dict:
    """What a launch would inherit now, but for PYTEST_CURRENT_TEST, which pytest changes at each step of each test."""
    return {k: v for k, v in launch_env().items() if k != "PYTEST_CURRENT_TEST"}


def changed_since(before: dict, now: dict) -> set[str]:
    """The variables whose value differs between two `environment_now()`s, but for SET_BY_IMPORTS (never a change)."""
    return {name for name in set(before) | set(now) if before.get(name) != now.get(name)} - SET_BY_IMPORTS


class WarmServer:
    """A warm launcher server (tests/warm_launch.py) started with `env`, listening on a socket in a folder of its own;
    the suite's (`warm_launcher`) and the GPU checklist's dry run's (bench/gpu_check/checklist_warm.py)."""

    def __init__(self, env: dict):
        self.folder = tempfile.mkdtemp(prefix="warm-launch-")
        self.path = os.path.join(self.folder, "socket")
        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "warm_launch.py"), self.path],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self.process.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError("the warm launcher (tests/warm_launch.py) did not start: its error is above")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def warm_launcher() -> dict:
    """The warm launcher of this pytest process, started at its first use, and started again where the suite's
    environment has changed since (a variable read at import time would be stale in its processes: a test's
    monkeypatch.setenv, then its undoing) or where it has died."""
    now = environment_now()
    if _WARM:
        if not changed_since(_WARM["env"], now) and _WARM["server"].alive():
            return _WARM
        stop_warm_launcher()
    else:
        import atexit

        atexit.register(stop_warm_launcher)
    server = WarmServer(launch_env())
    _WARM.update(server=server, path=server.path, env=now)
    return _WARM


def stop_warm_launcher() -> None:
    if _WARM:
        _WARM["server"].stop()
        _WARM.clear()


def warm_env(env: dict | None) -> dict | None:
    """What a launch with `env` adds to the warm launcher's environment, or None where a fresh interpreter
    is needed: a variable other than RUNTIME_ENV's might be read at import time, before the fork. SET_BY_IMPORTS
    are passed on as they are now, and the name of the test running now."""
    extra = dict(env or {})
    hooks = extra.pop("PYTHONPATH", None)
    if hooks not in (None, AUDIT_PYTHONPATH) or set(extra) - RUNTIME_ENV:
        return None
    now = SET_BY_IMPORTS | {"PYTEST_CURRENT_TEST"}  # the server's are those of the test that started it
    extra = {**{k: v for k, v in os.environ.items() if k in now}, **extra}
    return {**extra, "PYTHONPATH": hooks} if hooks else extra


def request_launch(path: str, script, args: list, launcher_args: list, env: dict, startup, out_fd: int):
    """Ask the warm launcher at `path` for one launch whose processes write to `out_fd`, with `env` added to the
    server's environment and `startup` (a sitecustomize.py, or None) run first in each process, as a fresh
    interpreter would. Returns the connection: it answers {"pid": the launch's process group} at once and
    {"returncode": ...} at the end, or {"real": why} where only `accelerate launch` will do."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(path)
    message = {"script": str(script), "args": [str(a) for a in args], "launcher_args": launcher_args, "cwd": str(REPO)}
    message.update(env=env, startup=str(startup) if startup else None)
    socket.send_fds(connection, [json.dumps(message).encode()], [out_fd])
    return connection


def wait_for_warm_launch(connection, timeout: float) -> int | None:
    """The end of a launch asked for with `request_launch`: its exit code (-9 where it was killed), or None where the
    server says only `accelerate launch` will do. Past `timeout` it raises TimeoutError, and on any exception here the
    launch's processes are killed first, so none outlives its caller (a launch that had not started by then finds
    the connection closed before it forks any)."""
    deadline = time.monotonic() + timeout
    group = None
    try:
        connection.settimeout(max(deadline - time.monotonic(), 0.01))
        answer = json.loads(connection.recv(4096) or b"{}")
        if "real" in answer:
            return None
        if "pid" not in answer:  # it failed before it started (its error is in its output), or it was killed
            return answer.get("returncode", -signal.SIGKILL)
        group = answer["pid"]
        connection.settimeout(max(deadline - time.monotonic(), 0.01))
        answer = json.loads(connection.recv(4096) or b"{}")  # empty: its launch process was killed
    except BaseException:
        if group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        raise
    finally:
        connection.close()
    return answer.get("returncode", -signal.SIGKILL)


def launch_warm(script, args, launcher_args: list, env: dict, timeout: float) -> LaunchResult | None:
    """`launch` through the warm launcher: its processes write to a pipe read here; a hang, or this process
    interrupted, kills them. None where `accelerate launch` would use neither torchrun nor its simple launcher for
    one process on one machine (`warm_launch.launcher_of`) or cannot parse the launcher's arguments: `launch` then
    runs it for real."""
    start = time.monotonic()
    read_end, write_end = os.pipe()
    startup = AUDIT_HOOK_DIR / "sitecustomize.py" if env.get("PYTHONPATH") else None
    try:
        connection = request_launch(warm_launcher()["path"], script, list(args), launcher_args, env, startup, write_end)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)  # the launch holds its own copies: the reader sees the end when the last one is closed
    reader, lines = read_in_background(open(read_end, encoding="utf-8", errors="replace"))
    try:
        returncode = wait_for_warm_launch(connection, timeout)
    except TimeoutError:
        raise hung(timeout, lines) from None
    return None if returncode is None else finished(returncode, start, reader, lines, warm=True)


def assert_fails_cleanly(result: LaunchResult, expected: str, output_dir: Path) -> None:
    """Bad input: a non-zero exit within 60 s, the error on every rank, no output directory."""
    assert result.returncode != 0
    assert result.seconds < 60
    for rank in (0, 1):
        assert f"[rank {rank}] error:" in result.output, (
            f"rank {rank} did not report the error:\n{result.output[-3000:]}"
        )
    assert expected in result.output, result.output[-3000:]
    assert not output_dir.exists(), "bad input must not leave an output directory behind"
    assert_error_is_last(result, expected)


def assert_error_is_last(result: LaunchResult, expected: str) -> None:
    """The launcher's summary ends with the error line as its root cause (read from the failed
    process's error file), so the line holding `expected` is the last one but the closing rule."""
    assert not result.warm, "the last line is the launcher's: launch this run with real_launcher=True"
    lines = result.output.rstrip().splitlines()
    last = max((i for i, text in enumerate(lines) if expected in text), default=-1)
    assert last >= 0 and len(lines) - 1 - last <= 1, "the error is not the last line:\n" + "\n".join(lines[last:])
