"""The suite's warm launcher: the launched runs' processes forked from one that has imported torch,
transformers, datasets, peft, accelerate and ddp_utils once, instead of N fresh interpreters that import
them again (about 8 CPU seconds a process here, two thirds of a tiny run's cost).

What stays real: N processes, gloo, the script run as `__main__` from its first line, the environment `accelerate
launch` gives it, computed by Accelerate's own launcher code (`prepare_multi_gpu_env`, or `prepare_deepspeed_cmd_env`
for a DeepSpeed config on one machine, which torchrun launches too) plus the variables torchrun sets for each worker,
or for one process without torchrun (a single-GPU config, --cpu) the simple launcher's
(`prepare_simple_launcher_cmd_env`), and the end of a process: its non-daemon threads joined and its atexit functions
run, as at an interpreter's exit. Each worker reseeds what a fresh interpreter seeds at import (numpy's global
generator, datasets' random fingerprints). What it skips: the launcher process and torchrun's agent (their exit
codes, signals, error files and summary, and the command line a process sees as its parent's), a fresh interpreter's
imports, and the module teardown at its exit.
It assumes that no variable the launch adds (RANK, WORLD_SIZE, ACCELERATE_*, the test hooks' own) is read at import
time by the libraries imported here: true of the versions pinned, by a grep of their sources, but for
TORCH_COMPILE_OVERRIDE_BACKENDS (the compile tests' backend), which each worker sets in dynamo's config itself, and
OMP_NUM_THREADS, which each worker gives torch itself. `launching.launch` uses it where `accelerate launch` would
start torchrun or its simple launcher on this machine (`launcher_of`), unless a test sets a variable that may be read
at import time or a file size limit; tests of the launcher, of signals and exit codes and each script's demo pass
`real_launcher=True` and go through `accelerate launch`.

    python tests/warm_launch.py SOCKET     # serve: import once, then fork one launch per connection
"""

from __future__ import annotations

import contextlib
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
    import atexit
    import runpy
    import threading
    import traceback

    import datasets.fingerprint
    import numpy

    _die_with_parent(signal.SIGKILL)
    numpy.random.seed()  # a fresh interpreter seeds these from the OS at import; forked, all would share the server's
    datasets.fingerprint.fingerprint_rng.seed()
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.environ.clear()
    os.environ.update(env)
    # torch read TORCH_COMPILE_OVERRIDE_BACKENDS into dynamo's config at its import, before the fork: set the config
    # from this launch's environment, as a fresh import would (dynamo reads the config at each compilation).
    import torch._dynamo.config

    torch._dynamo.config.debug_backend_override = env.get("TORCH_COMPILE_OVERRIDE_BACKENDS", "")
    threads = int(env["OMP_NUM_THREADS"]) if env.get("OMP_NUM_THREADS", "").isdigit() else 0
    if threads > 0 and threads != torch.get_num_threads():  # OpenMP read it when torch loaded: the launch's own
        torch.set_num_threads(threads)
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
    # An interpreter's exit: wait for the non-daemon threads, then run the atexit functions (a hang there is a hang
    # of the real run too). The module teardown after them is skipped.
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launcher_of(parsed, defaults) -> str | None:
    """The launcher `accelerate launch` runs for these arguments, in its launch_command's order, where it starts the
    processes on this one machine: "torchrun" (its multi_gpu_launcher, and its deepspeed_launcher on one machine:
    DeepSpeed's own launcher only for several nodes) or "simple" (`python script`, one process, also under --cpu);
    None for the others (TPU, SageMaker, Megatron-LM, mpirun, several machines, --module, --no_python), and for the
    simple launcher asked for more processes than the one it starts: our launch guard refuses that by reading its
    parent's command line, which `accelerate launch` is, and a forked process's is not."""
    from accelerate.utils import ComputeEnvironment

    simple = "simple" if (parsed.num_processes or 1) == 1 else None
    sagemaker = defaults is not None and defaults.compute_environment == ComputeEnvironment.AMAZON_SAGEMAKER
    if parsed.num_machines > 1 or parsed.mpirun_hostfile is not None or parsed.module or parsed.no_python:
        return None  # several machines, mpirun, or a script that is not a Python file (run_worker runs a file)
    if not parsed.cpu and (parsed.use_deepspeed or parsed.use_fsdp):
        return "torchrun"
    if not parsed.cpu and parsed.use_megatron_lm:
        return None  # torchrun too, with Megatron-LM's own environment: never used here
    if not parsed.cpu and parsed.multi_gpu:
        return "torchrun"
    if (not parsed.cpu and parsed.tpu) or sagemaker:
        return None
    return simple


def run_launch(message: dict, out_fd: int, connection: socket.socket) -> int | None:
    """One launch, in its own process group: the env `accelerate launch` would give, N workers (one for the simple
    launcher), and torchrun's rule that one failed worker ends the others. Returns the launch's exit code, or None
    (after saying so) where the launcher's arguments do not parse or `launcher_of` finds no launcher forked here: the
    caller launches for real."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    try:
        parsed = launch_command_parser().parse_args([*message["launcher_args"], message["script"], *message["args"]])
        parsed, defaults, precision_from_config = _validate_launch_command(parsed)
    except (Exception, SystemExit) as error:  # `accelerate launch` itself will say what is wrong with its arguments
        connection.send(json.dumps({"real": f"the launcher's arguments: {error!r}"}).encode())
        return None
    launcher = launcher_of(parsed, defaults)
    if launcher is None:
        connection.send(json.dumps({"real": "neither torchrun nor the simple launcher on one machine"}).encode())
        return None
    os.setsid()
    _die_with_parent(signal.SIGKILL)  # with the server, which dies with the pytest process
    os.dup2(out_fd, 1)  # what this process says goes with its workers' output, as a launcher's
    os.dup2(out_fd, 2)
    connection.send(json.dumps({"pid": os.getpid()}).encode())
    if parsed.use_deepspeed:  # as launch_command: the config's DeepSpeed fields, which the processes read back
        fields = list(defaults.deepspeed_config) if defaults else []
        if precision_from_config:
            fields.append("mixed_precision")
        parsed.deepspeed_fields_from_accelerate_config = ",".join(fields)
        os.chdir(message["cwd"])  # the DeepSpeed launcher puts its working directory on PYTHONPATH
    os.environ.update(message["env"])  # the launcher's own environment, which Accelerate's code starts from
    if launcher == "simple":  # one process, as `python script args`, with the environment the launcher gives it
        envs = [prepare_simple_launcher_cmd_env(parsed)[1]]
    else:
        env = prepare_deepspeed_cmd_env(parsed)[1] if parsed.use_deepspeed else prepare_multi_gpu_env(parsed)
        world_size, port = parsed.num_processes, parsed.main_process_port
        envs = [worker_env(env, rank, world_size, port) for rank in range(world_size)]
    workers = {}
    for rank, rank_env in enumerate(envs):
        pid = os.fork()
        if pid == 0:
            connection.close()
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

    _die_with_parent()  # first: a caller killed during the imports leaves no server behind
    started_with = dict(os.environ)  # before the imports add theirs: each launch's own env comes on top (warm_env)
    for name in WARM_MODULES:
        importlib.import_module(name)
    import accelerate.commands.launch  # noqa: F401  (the launcher's own argument parser and checks)
    import accelerate.utils.launch  # noqa: F401

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
            os.environ.clear()
            os.environ.update(started_with)
            try:
                code = run_launch(json.loads(data), fds[0], connection)
            except BaseException as error:  # the launch could not start: say so, as a launcher would
                os.write(fds[0], f"warm launch failed: {error!r}\n".encode())
                code = FAILED
            if code is not None:
                with contextlib.suppress(OSError):  # its caller gone (timed out, interrupted): nobody to tell
                    connection.send(json.dumps({"returncode": code}).encode())
            os._exit(code or 0)
        connection.close()
        os.close(fds[0])


def _die_with_parent(how: int = signal.SIGTERM) -> None:
    """End this process with its parent (Linux: PR_SET_PDEATHSIG): the server with the pytest process, a launch
    with the server, a worker with its launch, so that no process of a killed test run is left behind."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, how)
    except OSError:
        return
    if os.getppid() != parent:  # it died before the prctl
        os.kill(os.getpid(), how)


if __name__ == "__main__":
    serve(sys.argv[1])
