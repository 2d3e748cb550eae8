"""The suite's warm launcher: the launched runs' processes forked from one that has imported torch,
transformers, datasets, peft, accelerate and ddp_utils once, instead of N fresh interpreters that import
them again (about 8 CPU seconds a process here, two thirds of a tiny run's cost).

What stays real: N processes, gloo, the script run as `__main__` from its first line, and the environment
`accelerate launch` gives it, computed by Accelerate's own launcher code (`prepare_multi_gpu_env`) plus the
variables torchrun sets for each worker. What it skips: the launcher process and torchrun's agent (their exit
codes, signals, error files and summary) and a fresh interpreter's imports. `launching.launch` uses it only for
the default CPU config with the suite's plain environment, where nothing read at import time differs; tests of
the launcher, of signals and of each script's demo pass `real_launcher=True` and go through `accelerate launch`.

    python tests/warm_launch.py SOCKET     # serve: import once, then fork one launch per connection
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

# Imported before the first fork, so that no launch pays for them (what the scripts import at the top).
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "transformers",
    "datasets",
    "peft",
    "accelerate",
    "ddp_utils",
)
FAILED = 1  # a failed launch's exit code, as torchrun's


def request(path: str, script, args: list, launcher_args: list, env: dict, startup, cwd, out_fd: int):
    """Ask the server at `path` for one launch whose processes write to `out_fd`, with `env` added to the
    server's environment and `startup` (a sitecustomize.py, or None) run first in each process, as a fresh
    interpreter would. Returns the connection: it answers {"pid": the launch's process group} at once and
    {"returncode": ...} at the end, or {"real": why} where only `accelerate launch` will do."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(path)
    message = {"script": str(script), "args": [str(a) for a in args], "launcher_args": launcher_args, "cwd": str(cwd)}
    message.update(env=env, startup=str(startup) if startup else None)
    socket.send_fds(connection, [json.dumps(message).encode()], [out_fd])
    return connection


def worker_env(base: dict, rank: int, world_size: int, port: int) -> dict:
    """What torchrun adds to each worker's environment (one node, static rendezvous)."""
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_WORLD_SIZE="1",
        ROLE_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID="none",
        TORCHELASTIC_USE_AGENT_STORE="False",  # no agent: rank 0 hosts the rendezvous store
        TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
        TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_worker(script: str, args: list, cwd: str, env: dict, startup, out_fd: int) -> None:
    """A forked worker: run `script` as `__main__`, as `python script args` would. Never returns."""
    import runpy
    import traceback

    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)  # as for `python script`: the script's folder first
    code = 0
    try:
        if startup:  # what a fresh interpreter imports at start-up from its PYTHONPATH
            runpy.run_path(startup, run_name="sitecustomize")
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def run_launch(message: dict, out_fd: int, connection: socket.socket) -> int | None:
    """One launch, in its own process group: the env `accelerate launch` would give, N workers, and
    torchrun's rule that one failed worker ends the others. Returns the launch's exit code, or None (after
    saying so) where `accelerate launch` would not start torchrun on this machine: the caller launches for real."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    parsed = launch_command_parser().parse_args([*message["launcher_args"], message["script"], *message["args"]])
    parsed, _, _ = _validate_launch_command(parsed)
    # Only where `accelerate launch` would start torchrun on this one machine (its multi_gpu_launcher).
    torchrun = (parsed.multi_gpu or parsed.use_fsdp) and not (parsed.cpu or parsed.use_deepspeed or parsed.tpu)
    if not torchrun or parsed.num_machines > 1:
        connection.send(json.dumps({"real": "not torchrun on one machine"}).encode())
        return None
    os.setsid()
    os.dup2(out_fd, 1), os.dup2(out_fd, 2)  # what this process says goes with its workers' output, as a launcher's
    connection.send(json.dumps({"pid": os.getpid()}).encode())
    env = {**prepare_multi_gpu_env(parsed), **message["env"]}
    world_size, port = parsed.num_processes, parsed.main_process_port
    workers = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            connection.close()
            rank_env = worker_env(env, rank, world_size, port)
            run_worker(message["script"], message["args"], message["cwd"], rank_env, message["startup"], out_fd)
        workers[pid] = rank
    os.close(out_fd)
    code = 0
    while workers:
        pid, status = os.wait()
        workers.pop(pid, None)
        if os.waitstatus_to_exitcode(status) != 0 and code == 0:
            code = FAILED
            for other in workers:  # torchrun's agent ends the rest of the group
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while workers and time.monotonic() < deadline:
                done, _ = os.waitpid(-1, os.WNOHANG)
                if done:
                    workers.pop(done, None)
                else:
                    time.sleep(0.05)
            for other in workers:
                os.kill(other, signal.SIGKILL)
    return code


def serve(path: str) -> None:
    import importlib

    started_with = dict(os.environ)  # without what the imports add (TORCHINDUCTOR_CACHE_DIR): a worker adds its own
    for name in WARM_MODULES:
        importlib.import_module(name)
    import accelerate.commands.launch  # noqa: F401  (the launcher's own argument parser and checks)
    import accelerate.utils.launch  # noqa: F401

    _die_with_parent()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # each launch's own process is reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(8)
    print("ready", flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nobody reads that pipe again: a full one would block a launch
    while True:
        connection, _ = listener.accept()
        data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 1)
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # this process waits for its workers
            os.environ.clear(), os.environ.update(started_with)
            try:
                code = run_launch(json.loads(data), fds[0], connection)
            except BaseException as error:  # the launch could not start: say so, as a launcher would
                os.write(fds[0], f"warm launch failed: {error!r}\n".encode())
                code = FAILED
            if code is not None:
                connection.send(json.dumps({"returncode": code}).encode())
            os._exit(code or 0)
        connection.close()
        os.close(fds[0])


def _die_with_parent() -> None:
    """End the server with the pytest process that started it (Linux: PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


if __name__ == "__main__":
    serve(sys.argv[1])
