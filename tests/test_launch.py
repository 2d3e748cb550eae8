"""The launch guard, how examples are sharded across ranks (real multi-process launches), and the suite's warm
launcher against `accelerate launch`."""

import json
import os
from collections import Counter

import pytest

from conftest import REPO, launch

LAUNCHED = REPO / "tests" / "launched"


def test_guard_refuses_cpu_flag_that_starts_one_process():
    # `accelerate launch --cpu --num_processes 2` goes through mpirun and starts ONE process.
    result = launch(
        REPO / "scripts" / "train.py",
        "--output_dir",
        "/nonexistent/never-written",
        launcher_args=["--cpu", "--num_processes", "2"],
        timeout=120,
    )
    assert result.returncode != 0
    assert "asked for 2 processes but started only this one" in result.output
    assert "accelerate_configs/cpu_2proc.yaml" in result.output, "the message must name the fix"
    assert result.seconds < 60


def test_guard_refuses_a_world_per_process_on_every_rank():
    # Accelerator() without cpu=True on a machine without GPUs: each process a world of its own.
    result = launch(LAUNCHED / "plain_accelerator.py", num_processes=2, timeout=120)
    assert result.returncode != 0
    assert "the guard let a mis-launched run through" not in result.output
    for rank in (0, 1):
        assert f"[rank {rank}] error: the launcher started 2 processes but this one sees a world of 1" in result.output
    assert result.seconds < 60


def test_more_processes_than_gpus_are_refused_on_every_rank(tmp_path, monkeypatch):
    """2 processes on a workstation with one GPU: Accelerate put both on it (local rank modulo the GPUs), and NCCL
    stopped the run at its first collective ("Duplicate GPU detected"), after loading, in a traceback. Torch is told
    here that this machine has one GPU; the guard refuses before any is used, and not a process shown one GPU of its
    own (CUDA_VISIBLE_DEVICES naming one device, as launchers that give each process its GPU set it)."""
    result = launch(LAUNCHED / "one_gpu_machine.py", "train", "--output_dir", tmp_path / "run", num_processes=2,
                    timeout=120)  # fmt: skip
    assert result.returncode != 0 and result.seconds < 60
    refused = "error: this launch starts 2 processes on this machine, which has 1 GPU(s)"
    for rank in (0, 1):
        assert f"[rank {rank}] {refused}" in result.output
    assert "give one process per GPU (1 here; --num_processes counts every machine's" in result.output
    assert not (tmp_path / "run").exists()
    from ddp_utils.lifecycle.launch_guard import refuse_more_processes_than_gpus

    with monkeypatch.context() as patched:
        patched.setattr("torch.cuda.is_available", lambda: True)
        patched.setattr("torch.cuda.device_count", lambda: 1)
        patched.setenv("LOCAL_WORLD_SIZE", "2")
        patched.setenv("CUDA_VISIBLE_DEVICES", "1")  # each process its own GPU: left alone
        refuse_more_processes_than_gpus()
        patched.setenv("CUDA_VISIBLE_DEVICES", "")
        patched.setenv("ACCELERATE_USE_CPU", "on")  # Accelerate's spellings: CPU processes
        refuse_more_processes_than_gpus()


def run_sample_count(tmp_path, num_processes, batch_size, num_examples=37, epochs=3, resume=()):
    out = tmp_path / f"samples-{num_processes}.json"
    result = launch(
        LAUNCHED / "count_samples.py", out, num_examples, batch_size, epochs, *resume, num_processes=num_processes
    )
    assert result.returncode == 0, result.output[-3000:]
    return json.loads(out.read_text())


def global_steps(epoch):
    """The examples of each global step of one epoch: rank r's i-th batch belongs to step i."""
    return [sorted(i for rank in epoch for i, w in zip(*rank[step]) if w == 1.0) for step in range(len(epoch[0]))]


@pytest.mark.fast
def test_every_example_used_exactly_once_per_epoch_and_reshuffled(tmp_path):
    two = run_sample_count(tmp_path, num_processes=2, batch_size=4)
    assert two["world_size"] == 2
    orders = []
    for epoch in two["epochs"]:
        assert len(epoch) == 2 and len(epoch[0]) == len(epoch[1]), "ranks must take the same number of steps"
        real = Counter(i for rank in epoch for ids, ws in rank for i, w in zip(ids, ws) if w == 1.0)
        assert real == Counter(range(37)), "each example exactly once per epoch, across ranks"
        fillers = [w for rank in epoch for _, ws in rank for w in ws if w == 0.0]
        assert not fillers, "37 = 4 steps of 2 x 4 + 5: the 3 fillers of the last step are never computed"
        last = [sum(w == 1.0 for w in rank[-1][1]) for rank in epoch]
        assert sorted(last) == [2, 3], "the last step's 5 real examples are shared out evenly over the ranks"
        orders.append([i for step in global_steps(epoch) for i in step])
    assert orders[0] != orders[1] != orders[2], "the shuffle must change between epochs"

    # One process with the same global batch sees the same examples at every step.
    one = run_sample_count(tmp_path, num_processes=1, batch_size=8)
    assert one["world_size"] == 1
    for epoch_two, epoch_one in zip(two["epochs"], one["epochs"]):
        assert global_steps(epoch_two) == global_steps(epoch_one)


@pytest.mark.fast
def test_resumed_epoch_continues_with_exactly_the_remaining_samples(tmp_path):
    # Accumulation 2, resumed after 3 optimizer steps of epoch 1: the skip is 6 micro-batches per rank.
    record = run_sample_count(tmp_path, num_processes=2, batch_size=2, num_examples=37, epochs=2, resume=(2, 1, 3))
    uninterrupted, resumed = record["epochs"][1], record["resumed"]
    for rank in (0, 1):
        assert resumed[rank] == uninterrupted[rank][3 * 2 :], (
            f"rank {rank}: the (rank, sample id) sequence after the resume point differs"
        )
    seen = Counter(
        i for rank in (0, 1) for ids, ws in uninterrupted[rank][:6] + resumed[rank] for i, w in zip(ids, ws) if w == 1.0
    )
    assert seen == Counter(range(37)), "before + after the resume point: every example exactly once"


def test_a_problem_one_rank_finds_is_refused_on_every_rank():
    result = launch(LAUNCHED / "refuse_on_one_rank.py", num_processes=2, timeout=120)
    assert result.returncode != 0 and result.seconds < 30
    for rank in (0, 1):
        assert f"[rank {rank}] error: rank 1 found a problem" in result.output, result.output[-3000:]
    assert "a rank went on past the refusal" not in result.output


def test_a_rank_that_finds_the_same_bad_input_later_still_reports_it():
    """LoRA target modules the model lacks are found by each rank as it builds the model, and the
    ranks build it at different times (the others load their data after the main process)."""
    result = launch(LAUNCHED / "late_usage_error.py", num_processes=2, timeout=120)
    assert result.returncode != 0 and result.seconds < 30
    for rank in (0, 1):
        assert f"[rank {rank}] error: the same bad input" in result.output, result.output[-3000:]


@pytest.mark.skipif(bool(os.environ.get("TESTS_REAL_LAUNCHER")), reason="TESTS_REAL_LAUNCHER: no warm launcher")
@pytest.mark.parametrize(
    "config, processes", [("cpu_2proc.yaml", 2), ("deepspeed_zero3_offload.yaml", 2), ("single_gpu.yaml", 1)]
)
def test_the_warm_launcher_gives_each_process_what_accelerate_launch_gives(config, processes, tmp_path):
    """Most tests launch through tests/warm_launch.py (forked processes, the imports done once), DeepSpeed's
    too, and one process without torchrun (a single-GPU config: Accelerate's simple launcher). Each of its processes
    must see what `accelerate launch` gives one: the same arguments, working directory, first import path,
    environment (DeepSpeed's plugin settings among them) and torch threads, but for the rendezvous port and what only
    torchrun's agent has (its error files, the store it hosts)."""
    if config.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="make installs DeepSpeed (requirements-deepspeed.txt)")
    launcher_args = ["--config_file", str(REPO / "accelerate_configs" / config), "--num_processes", str(processes)]
    if processes == 1:  # the simple launcher sets OMP_NUM_THREADS from it: torch, loaded before the fork, must follow
        launcher_args += ["--num_cpu_threads_per_process", "2"]
    compile_tests = {"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:eager"}  # read by torch at import: set again when forked

    def seen(name, **options):
        result = launch(LAUNCHED / "show_environment.py", tmp_path / name, "one", "two words",
                        launcher_args=launcher_args, env=compile_tests, **options)  # fmt: skip
        assert result.returncode == 0 and result.warm == (name == "warm"), result.output[-3000:]
        return {rank: json.loads((tmp_path / f"{name}.rank{rank}.json").read_text()) for rank in range(processes)}

    real, warm = seen("real", real_launcher=True), seen("warm")
    agent_only = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"}
    for rank in range(processes):
        for key in ("argv", "cwd", "path0", "dynamo_backend_override", "threads"):
            assert real[rank][key] == warm[rank][key], (key, real[rank][key], warm[rank][key])
        ours, theirs = warm[rank]["env"], real[rank]["env"]
        differ = {name: (theirs.get(name), ours.get(name)) for name in set(ours) | set(theirs)}
        differ = {name: values for name, values in differ.items() if values[0] != values[1]}
        assert set(differ) <= agent_only, differ
        assert ours.get("RANK") == (str(rank) if processes > 1 else None)  # the simple launcher starts no world
        assert warm[rank]["dynamo_backend_override"] == ">=0:eager"
        assert warm[rank]["threads"] == (2 if processes == 1 else 1)
    if config.startswith("deepspeed"):
        assert ours["ACCELERATE_USE_DEEPSPEED"] == "true"
        assert ours["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"] == "cpu"
    else:
        assert ours["ACCELERATE_MIXED_PRECISION"] == ("bf16" if config == "single_gpu.yaml" else "no")


@pytest.mark.fast
def test_a_warm_launchs_answers_are_read_whatever_comes_and_a_timeout_kills_it():
    """The client's side of a warm launch (`launching.wait_for_warm_launch`, used by the suite and the GPU checklist's
    dry run), against each answer the server can give: an exit code, a launch killed (no answer), `accelerate launch`
    asked for, a launch that never answers, and one that started and then hangs, which is killed with its group."""
    import signal
    import socket
    import subprocess

    from launching import wait_for_warm_launch

    def answered(*messages, close=True, timeout=5.0):
        ours, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for message in messages:
            server.send(json.dumps(message).encode())
        if close:
            server.close()
        try:
            return wait_for_warm_launch(ours, timeout)
        finally:
            server.close()

    assert answered({"pid": 1}, {"returncode": 3}, close=False) == 3
    assert answered({"returncode": 1}) == 1  # it failed before it started: its error is in its output
    assert answered({"pid": 1}) == -signal.SIGKILL  # its launch process was killed: the connection closes unanswered
    assert answered() == -signal.SIGKILL
    assert answered({"real": "not torchrun"}) is None
    with pytest.raises(TimeoutError):
        answered(close=False, timeout=0.2)
    hanging = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a launch's group: its own session
    with pytest.raises(TimeoutError):
        answered({"pid": hanging.pid}, close=False, timeout=0.5)
    assert hanging.wait(timeout=10) == -signal.SIGKILL
