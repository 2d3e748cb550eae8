"""From one machine to a cluster, as far as this CPU machine can prove it: a real two-node run on
loopback, the SLURM job script under fake srun/scontrol, check_env.py, and the refusal of
FSDP/DeepSpeed configs where Accelerate cannot run them."""

import json
import os
import subprocess
import sys
import time

import numpy as np
from conftest import CPU_CONFIG, REPO, assert_fails_cleanly, free_port, launch, launch_env, train_args
from safetensors.numpy import load_file

TRAIN = REPO / "scripts" / "train.py"
CHECK_ENV = REPO / "scripts" / "check_env.py"


def test_two_nodes_on_loopback_train_the_same_model_as_one_node(tiny_model, tiny_data, tmp_path):
    """Two `accelerate launch` commands, --num_machines 2 and --machine_rank 0 / 1, one process each,
    rendezvous on 127.0.0.1: the same parameters as one node with 2 processes."""
    args = ["--max_train_steps", 6, "--per_device_train_batch_size", 4, "--checkpointing_steps", "no"]
    one_node = launch(TRAIN, *train_args(tiny_model, tiny_data, tmp_path / "one_node", *args), num_processes=2)
    assert one_node.returncode == 0, one_node.output[-3000:]

    port, output_dir = free_port(), tmp_path / "two_nodes"
    nodes = []
    for machine_rank in (0, 1):
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG),
                   "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(machine_rank),
                   "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                   str(TRAIN), *map(str, train_args(tiny_model, tiny_data, output_dir, *args))]
        nodes.append(subprocess.Popen(command, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    assert "2 process(es), MULTI_CPU" in outputs[0], "node 0 must lead a 2-process world"

    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["optimizer_steps"] == 6
    reference, other = load_file(str(tmp_path / "one_node" / "model.safetensors")), load_file(str(output_dir / "model.safetensors"))
    assert sorted(reference) == sorted(other)
    for key in reference:
        np.testing.assert_allclose(other[key], reference[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_fsdp_and_deepspeed_configs_are_refused_on_a_machine_without_gpus(tiny_model, tiny_data, tmp_path):
    """Measured with Accelerate 1.15: FSDP with cpu=True silently trains plain DDP, and without it
    every process trains alone. The scripts say so instead."""
    output_dir = tmp_path / "out"
    result = launch(TRAIN, *train_args(tiny_model, tiny_data, output_dir, "--max_train_steps", 2),
                    launcher_args=["--config_file", str(REPO / "accelerate_configs" / "fsdp.yaml"), "--num_processes", "2",
                                   "--mixed_precision", "no"])
    assert_fails_cleanly(result, "asks for FSDP, which Accelerate runs on GPUs only", output_dir)
