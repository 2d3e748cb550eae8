"""From one machine to a cluster, as far as this CPU machine can prove it: a real two-node run on
loopback, the SLURM job script under fake srun/scontrol, check_env.py, and the refusal of
FSDP/DeepSpeed configs where Accelerate cannot run them."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import AUDIT_HOOK_DIR, CPU_CONFIG, REPO, assert_fails_cleanly, free_port, launch, launch_env, train_args
from ddp_utils.checkpoints.manifest import checkpoint_problem

TRAIN = REPO / "scripts" / "train.py"
CHECK_ENV = REPO / "scripts" / "check_env.py"


FAKE_SLURM = REPO / "tests" / "fake_slurm"
SBATCH = REPO / "slurm" / "train.sbatch"
STEPS = ["--max_train_steps", 6, "--per_device_train_batch_size", 4, "--checkpointing_steps", "no"]


@pytest.fixture(scope="module")
def one_node(tiny_model, tiny_data, tmp_path_factory):
    """The reference: one node, 2 processes, 6 optimizer steps."""
    output_dir = tmp_path_factory.mktemp("one-node") / "out"
    result = launch(TRAIN, *train_args(tiny_model, tiny_data, output_dir, *STEPS), num_processes=2)
    assert result.returncode == 0, result.output[-3000:]
    return load_file(str(output_dir / "model.safetensors"))


def assert_same_model(output_dir, reference, world_size=2):
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["world_size"] == world_size and metrics["optimizer_steps"] == 6
    other = load_file(str(output_dir / "model.safetensors"))
    assert sorted(reference) == sorted(other)
    for key in reference:
        np.testing.assert_allclose(other[key], reference[key], rtol=1e-5, atol=1e-6, err_msg=key)


def slurm_env(tmp_path, **extra) -> dict:
    """A fake 2-node job: srun and scontrol test doubles first on the PATH."""
    env = launch_env(
        {
            "PATH": os.pathsep.join([str(FAKE_SLURM / "bin"), os.path.dirname(sys.executable), os.environ["PATH"]]),
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "test",
            "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "node-[a-b]",
            "SLURM_GPUS_ON_NODE": "8",
            "FAKE_HOSTNAMES": "node-a node-b",
            "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
            "OUTPUT_DIR": str(tmp_path / "out"),
        }
    )
    env.update(extra)
    return env


def run_sbatch(env, *args):
    return subprocess.run(
        ["bash", str(SBATCH), *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def recorded(tmp_path):
    """What each node's recording launcher saw, one file per node."""
    return [json.loads(path.read_text()) for path in sorted(tmp_path.glob("slurm.log.node*"))]


@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_slurm_script_gives_each_node_its_own_rank_and_the_same_main_address(launcher, tmp_path):
    recording = os.pathsep.join([str(FAKE_SLURM / "recording"), str(FAKE_SLURM / "bin"), os.environ["PATH"]])
    result = run_sbatch(
        slurm_env(tmp_path, PATH=recording, LAUNCHER=launcher), "scripts/train_clm.py", "--max_train_steps", 5
    )
    assert result.returncode == 0, result.stderr + result.stdout
    calls = sorted(recorded(tmp_path), key=lambda call: call["node_id"])
    assert [call["node_id"] for call in calls] == ["0", "1"], "one launcher per node"
    out = str(tmp_path / "out")
    for node, call in enumerate(calls):
        # Exactly the command README.md documents, with this node's rank.
        if launcher == "accelerate":
            expected = [
                "launch",
                "--config_file",
                "accelerate_configs/multi_node_ddp.yaml",
                "--num_machines",
                "2",
                "--num_processes",
                "16",
                "--machine_rank",
                str(node),
                "--main_process_ip",
                "node-a",
                "--main_process_port",
                "24242",
            ]
        else:
            expected = [
                "--nnodes",
                "2",
                "--nproc_per_node",
                "8",
                "--node_rank",
                str(node),
                "--master_addr",
                "node-a",
                "--master_port",
                "24242",
            ]
        assert call["argv"] == expected + [
            "scripts/train_clm.py",
            "--output_dir",
            out,
            "--resume_from_checkpoint",
            "latest",
            "--max_train_steps",
            "5",
        ]
    assert not (tmp_path / "slurm.log").exists(), "no requeue"


def test_slurm_script_runs_check_env_without_training_arguments(tmp_path):
    recording = os.pathsep.join([str(FAKE_SLURM / "recording"), str(FAKE_SLURM / "bin"), os.environ["PATH"]])
    result = run_sbatch(slurm_env(tmp_path, PATH=recording), "scripts/check_env.py")
    assert result.returncode == 0, result.stderr + result.stdout
    assert [call["argv"][-1] for call in recorded(tmp_path)] == ["scripts/check_env.py"] * 2


def test_check_env_reports_every_rank_and_a_correct_all_reduce():
    result = launch(CHECK_ENV, "--sizes_mib", "1,4", "--iterations", 2, num_processes=2)
    assert result.returncode == 0, result.output[-3000:]
    assert "rank 0/2  local rank 0" in result.output and "rank 1/2  local rank 1" in result.output
    assert "backend gloo" in result.output
    assert "all-reduce correctness over 2 processes: OK" in result.output
    assert "| 4 |" in result.output and "bus GB/s" in result.output
    assert result.output.count("check_env: all checks passed") == 1


def test_slurm_script_requeues_a_preempted_run(tmp_path):
    recording = os.pathsep.join([str(FAKE_SLURM / "recording"), str(FAKE_SLURM / "bin"), os.environ["PATH"]])
    result = run_sbatch(slurm_env(tmp_path, PATH=recording, FAKE_PREEMPT="1"))
    assert result.returncode == 0, result.stderr + result.stdout
    assert "requeue 4242" in (tmp_path / "slurm.log").read_text().splitlines()
    assert "preempted: requeueing job 4242" in result.stdout


@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_slurm_script_does_not_requeue_a_failure_after_a_preemption(launcher, tmp_path):
    """The requeued attempt fails for another reason (a bad node, an OOM): the marker the earlier,
    preempted attempt left must not requeue it again, and the job must fail with the launch's code."""
    recording = os.pathsep.join([str(FAKE_SLURM / "recording"), str(FAKE_SLURM / "bin"), os.environ["PATH"]])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "preempted.json").write_text('{"signal": "SIGTERM", "checkpoint": "checkpoint-3"}')
    result = run_sbatch(slurm_env(tmp_path, PATH=recording, FAKE_EXIT="1", LAUNCHER=launcher))
    assert result.returncode == 1, result.stderr + result.stdout
    assert not (tmp_path / "slurm.log").exists(), "no requeue"
    assert "requeueing" not in result.stdout
    assert len(recorded(tmp_path)) == 2, "the attempt itself ran on both nodes"


def test_slurm_script_runs_a_real_two_node_training_on_loopback(one_node, tiny_model, tiny_data, tmp_path):
    """The job script itself, with real `accelerate launch`es: 2 fake nodes x 1 CPU process, on 127.0.0.1."""
    port = next(p for p in iter(free_port, None) if 20000 <= p < 40000)
    env = slurm_env(
        tmp_path,
        CONFIG="accelerate_configs/cpu_2proc.yaml",
        SLURM_GPUS_ON_NODE="1",
        FAKE_HOSTNAMES="127.0.0.1 localhost",
        SLURM_JOB_ID=str(port - 20000),
    )  # the port is 20000 + id % 20000
    args = train_args(tiny_model, tiny_data, "unused", *STEPS)
    i = args.index("--output_dir")
    del args[i : i + 2]  # the job script chooses the output dir
    result = run_sbatch(env, "scripts/train.py", *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_model(tmp_path / "out", one_node)


def batch_args(call) -> list:
    argv = call["argv"]
    return [
        argv[argv.index("--per_device_train_batch_size") + 1],
        argv[argv.index("--gradient_accumulation_steps") + 1],
    ]


def test_slurm_script_splits_a_global_batch_over_the_nodes_of_each_attempt(tmp_path):
    """GLOBAL_BATCH_SIZE=64 with at most 2 per device: 2 nodes x 8 GPUs take 2 x 2 accumulation
    steps per process, 1 node 2 x 4: the same 64 examples per optimizer step, so the job resumes
    its checkpoint wherever it is requeued."""
    recording = os.pathsep.join([str(FAKE_SLURM / "recording"), str(FAKE_SLURM / "bin"), os.environ["PATH"]])
    for nodes, expected in (("2", ["2", "2"]), ("1", ["2", "4"])):
        for old in tmp_path.glob("slurm.log.node*"):
            old.unlink()
        env = slurm_env(tmp_path, PATH=recording, SLURM_NNODES=nodes, GLOBAL_BATCH_SIZE="64", PER_DEVICE_BATCH_SIZE="2")
        result = run_sbatch(env, "scripts/train.py", "--max_train_steps", 5)
        assert result.returncode == 0, result.stderr + result.stdout
        assert [batch_args(call) for call in recorded(tmp_path)] == [expected] * int(nodes)
    refusals = {
        "GLOBAL_BATCH_SIZE=24 does not split over 16 processes": (["scripts/train.py"], {"GLOBAL_BATCH_SIZE": "24"}),
        "GLOBAL_BATCH_SIZE sets --per_device_train_batch_size for each attempt's node count": (
            ["scripts/train.py", "--per_device_train_batch_size", 4],
            {"GLOBAL_BATCH_SIZE": "64"},
        ),
    }
    for message, (args, extra) in refusals.items():
        result = run_sbatch(slurm_env(tmp_path, PATH=recording, **extra), *args)
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_slurm_job_requeued_on_fewer_nodes_resumes_elastically(one_node, tiny_model, tiny_data, tmp_path):
    """The job script with real `accelerate launch`es: preempted (SIGTERM to rank 0 as it first
    writes train_log.jsonl, at step 2) on 2 fake nodes x 1 process x 4, requeued on 1 node, where
    GLOBAL_BATCH_SIZE=8 becomes 1 process x 4 x 2 accumulation steps. It resumes from the
    preemption's checkpoint and ends with the parameters of the uninterrupted 2-process run."""
    port = next(p for p in iter(free_port, None) if 20000 <= p < 40000)
    args = train_args(
        tiny_model, tiny_data, "unused", "--max_train_steps", 6, "--checkpointing_steps", "no", "--logging_steps", 2
    )
    i = args.index("--output_dir")
    del args[i : i + 2]  # the job script chooses the output dir
    job = {
        "CONFIG": "accelerate_configs/cpu_2proc.yaml",
        "SLURM_GPUS_ON_NODE": "1",
        "SLURM_JOB_ID": str(port - 20000),
        "GLOBAL_BATCH_SIZE": "8",
        "PER_DEVICE_BATCH_SIZE": "4",
    }
    preempted = run_sbatch(
        slurm_env(
            tmp_path,
            **job,
            FAKE_HOSTNAMES="127.0.0.1 localhost",
            SIGTERM_ON_WRITE="train_log.jsonl",
            SIGTERM_TARGET="workers",
            PYTHONPATH=os.pathsep.join([str(AUDIT_HOOK_DIR), str(REPO)]),
        ),
        "scripts/train.py",
        *args,
    )
    assert preempted.returncode == 0, preempted.stdout[-3000:] + preempted.stderr[-3000:]
    assert (tmp_path / "slurm.log").read_text().splitlines() == [f"requeue {port - 20000}"]
    assert "global batch 8 = 2 process(es) x 4 per device x 1 accumulation steps" in preempted.stdout

    requeued = run_sbatch(
        slurm_env(tmp_path, **job, SLURM_NNODES="1", FAKE_HOSTNAMES="127.0.0.1"), "scripts/train.py", *args
    )
    output = requeued.stdout + requeued.stderr
    assert requeued.returncode == 0, output[-4000:]
    assert "global batch 8 = 1 process(es) x 4 per device x 2 accumulation steps" in output
    assert "resumed elastically from 2 processes x 4 x 1 onto 1 process x 4 x 2" in output
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["optimizer_steps"]) == (1, 6)
    resumed = load_file(str(tmp_path / "out" / "model.safetensors"))
    for key in one_node:
        if key.endswith("attention.self.key.bias"):  # its exact gradient is zero: Adam steps on rounding noise
            assert np.abs(resumed[key]).max() < 1e-3, key
            continue
        np.testing.assert_allclose(resumed[key], one_node[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_slurm_preemption_save_may_take_longer_than_the_launchers_30_seconds(tiny_model, tiny_data, tmp_path):
    """SLURM signals every process of the job step, the launchers too (`--signal` without `B:`, and
    a preemption). A launcher that gets SIGTERM closes its workers and SIGKILLs them after torch
    elastic's shutdown timeout, 30 s by default: a checkpoint that took longer to write (here rank
    0 takes 35 s over it) was killed mid-save, with no preempted.json and no requeue. The job
    script gives the launchers the time SLURM gives. And under `srun --kill-on-bad-exit` the first
    launcher to exit (node 1's, once its rank has saved) ends node 0's: rank 1 left while rank 0 was
    writing preempted.json (5 s here), so the marker was lost; now no rank leaves before it is written."""
    port = next(p for p in iter(free_port, None) if 20000 <= p < 40000)
    args = train_args(
        tiny_model, tiny_data, "unused", "--max_train_steps", 6, "--checkpointing_steps", "no", "--logging_steps", 2
    )
    i = args.index("--output_dir")
    del args[i : i + 2]  # the job script chooses the output dir
    env = slurm_env(
        tmp_path,
        CONFIG="accelerate_configs/cpu_2proc.yaml",
        SLURM_GPUS_ON_NODE="1",
        SLURM_JOB_ID=str(port - 20000),
        FAKE_HOSTNAMES="127.0.0.1 localhost",
        SIGTERM_ON_WRITE="train_log.jsonl",  # at step 2, to both launchers and both ranks
        SIGTERM_TARGET="step",
        # The preemption's checkpoint takes 35 s on rank 0, then preempted.json 5 s.
        SLOW_ON_WRITE=".tmp-checkpoint-:35,preempted.json:5",
        PYTHONPATH=os.pathsep.join([str(AUDIT_HOOK_DIR), str(REPO)]),
    )
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    result = run_sbatch(env, "scripts/train.py", *args)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Unable to shutdown process" not in output, "a launcher SIGKILLed a rank that was saving"
    marker = json.loads((tmp_path / "out" / "preempted.json").read_text())
    assert checkpoint_problem(marker["checkpoint"]) is None and os.path.basename(marker["checkpoint"]) in os.listdir(
        tmp_path / "out"
    ), marker
    assert (tmp_path / "slurm.log").read_text().splitlines() == [f"requeue {port - 20000}"]


def test_fsdp_and_deepspeed_configs_are_refused_on_a_machine_without_gpus(tiny_model, tiny_data, tmp_path):
    """Measured with Accelerate 1.15: FSDP with cpu=True silently trains plain DDP, and without it
    every process trains alone. The scripts say so instead."""
    output_dir = tmp_path / "out"
    result = launch(
        TRAIN,
        *train_args(tiny_model, tiny_data, output_dir, "--max_train_steps", 2),
        launcher_args=[
            "--config_file",
            str(REPO / "accelerate_configs" / "fsdp.yaml"),
            "--num_processes",
            "2",
            "--mixed_precision",
            "no",
        ],
        real_launcher=True,
    )
    assert_fails_cleanly(
        result, "asks for FSDP, and Accelerate started MULTI_CPU instead (it runs FSDP on GPUs only", output_dir
    )


def test_fsdp2_full_state_dict_save_reloads_the_gathered_parameters_on_cpu(tiny_model, tmp_path):
    """FSDP on CPU, as far as it goes: Accelerate will not run FSDP without GPUs, so the helper
    shards with torch's fully_shard over gloo, gathers as accelerator.get_state_dict does under
    FSDP2, and writes with ddp_utils.results.output.write_pretrained. The file holds the full parameters; the
    plain state_dict would have held half of each sharded one."""
    import torch
    from transformers import AutoModelForSequenceClassification

    result = launch(REPO / "tests" / "launched" / "fsdp_save.py", tiny_model, tmp_path / "saved", num_processes=2)
    assert result.returncode == 0, result.output[-3000:]
    reference = json.loads((tmp_path / "fsdp_reference.json").read_text())
    shards = reference["rank0_shards"]
    rows = len(reference["full"]["bert.embeddings.word_embeddings.weight"])
    assert shards["bert.embeddings.word_embeddings.weight"][0] == -(-rows // 2) < rows, (
        "model.state_dict() under FSDP holds each rank's shard: half the rows"
    )
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "saved")
    for name, param in reloaded.named_parameters():
        torch.testing.assert_close(param.detach(), torch.tensor(reference["full"][name]), msg=name)
    initial = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=3)
    assert not torch.equal(
        initial.bert.encoder.layer[0].attention.self.query.weight,
        reloaded.bert.encoder.layer[0].attention.self.query.weight,
    ), "training changed the weights"


def two_node_launch(script_args, port, caches, nodes=2, processes_per_node=2, extra_env=None):
    """`nodes` accelerate launches on loopback, each with its own `datasets` cache (no shared file
    system); returns their outputs."""
    launched = []
    for machine_rank in range(nodes):
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(CPU_CONFIG),
            "--num_machines",
            str(nodes),
            "--num_processes",
            str(nodes * processes_per_node),
            "--machine_rank",
            str(machine_rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            *map(str, script_args),
        ]
        env = launch_env({"HF_DATASETS_CACHE": str(caches[machine_rank]), **(extra_env or {})})
        launched.append(
            subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = [node.communicate(timeout=300)[0] for node in launched]
    for node, output in zip(launched, outputs):
        assert node.returncode == 0, output[-3000:]
    return outputs


def test_two_nodes_train_the_same_model_as_one_and_each_prepares_the_data_once(
    one_node, tiny_model, tiny_data, tmp_path
):
    """Two loopback "nodes" (`accelerate launch --num_machines 2`, rendezvous on 127.0.0.1) of 2
    processes each, each node with its own datasets cache (no shared file system): the same
    parameters as one node with 2 processes and the same global batch; the tokenizing runs on one
    rank per node (ranks 0 and 2), not on every rank; and a second launch with another output
    directory runs it on no rank at all."""
    counter = REPO / "tests" / "launched" / "count_preparations.py"
    caches = [tmp_path / "cache-node0", tmp_path / "cache-node1"]
    # 4 processes x 2 examples: the reference's 8 examples per optimizer step (2 processes x 4).
    half_batch = ["--max_train_steps", 6, "--per_device_train_batch_size", 2, "--checkpointing_steps", "no"]
    for attempt in ("first", "second"):
        log = tmp_path / f"prepared-{attempt}"
        args = [counter, *train_args(tiny_model, tiny_data, tmp_path / attempt, *half_batch)]
        outputs = two_node_launch(args, free_port(), caches, extra_env={"PREPARED_LOG": str(log)})
        prepared = {rank: (tmp_path / f"{log.name}.rank{rank}").exists() for rank in range(4)}
        if attempt == "first":
            assert "4 process(es), MULTI_CPU" in outputs[0], "node 0 must lead a 4-process world"
            assert_same_model(tmp_path / attempt, one_node, world_size=4)
            assert prepared == {0: True, 1: False, 2: True, 3: False}, prepared
            assert all(list(cache.rglob("cache-*.arrow")) for cache in caches), "each node filled its own cache"
        else:
            assert prepared == {0: False, 1: False, 2: False, 3: False}, prepared
