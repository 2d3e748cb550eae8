"""Every launch config under accelerate_configs/ (subfolders included): Accelerate's own loader
reads it, its launch-argument validation accepts it, every key is commented, and the file starts
with the command that launches it."""

import re

import pytest

from conftest import REPO

CONFIG_DIR = REPO / "accelerate_configs"
CONFIGS = sorted(CONFIG_DIR.rglob("*.yaml")) + sorted(CONFIG_DIR.rglob("*.yml"))


@pytest.mark.fast
def test_configs_are_found_in_subfolders_too():
    assert len(CONFIGS) >= 9, CONFIGS
    assert {p.stem for p in CONFIGS} >= {
        "cpu_2proc",
        "single_gpu",
        "multi_gpu_bf16",
        "multi_node_ddp",
        "fsdp",
        "deepspeed_zero2",
        "deepspeed_zero3",
        "deepspeed_zero2_offload",
        "deepspeed_zero3_offload",
    }


@pytest.mark.fast
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_config_loads_and_passes_accelerates_launch_validation(path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    config = load_config_from_file(str(path))
    assert config.num_processes >= 1 and config.num_machines >= 1
    args = launch_command_parser().parse_args(["--config_file", str(path), "scripts/train.py"])
    args, defaults, mp_from_config_flag = _validate_launch_command(args)
    assert args.num_processes == config.num_processes and args.num_machines == config.num_machines
    if config.distributed_type.value == "FSDP":
        assert args.use_fsdp and str(args.fsdp_version) == "2"
    if config.distributed_type.value == "DEEPSPEED":
        assert args.use_deepspeed and int(args.zero_stage) in (2, 3)


@pytest.mark.fast
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_config_is_documented(path):
    lines = path.read_text().splitlines()
    header = [line for line in lines if line.startswith("#")]
    assert any(
        f"accelerate launch --config_file accelerate_configs/{path.relative_to(CONFIG_DIR)}" in line
        for line in header[:8]
    ), "the file must start with the command that launches it"
    undocumented = [line for line in lines if re.match(r"^\s*\w[\w-]*:\s*\S", line) and "#" not in line]
    assert not undocumented, f"keys without a comment: {undocumented}"


@pytest.mark.fast
def test_make_trains_on_cpu_processes_with_cpu_2proc_wherever_gpus_are_visible():
    """`make train` is documented as 2 CPU processes, and cpu_2proc.yaml says use_cpu, which torchrun launches ignore:
    on a one-GPU workstation its second process asked for a GPU that does not exist. make says ACCELERATE_USE_CPU for
    it, and for no other config."""
    import subprocess

    def dry(*extra, target="train"):
        return subprocess.run(["make", "-n", target, *extra], cwd=REPO, capture_output=True, text=True).stdout

    assert "ACCELERATE_USE_CPU=true" in dry() and "cpu_2proc.yaml" in dry()
    assert "ACCELERATE_USE_CPU" not in dry("CONFIG=accelerate_configs/single_gpu.yaml")
    # and the LLM demos' precision, chosen from the CPU's flags, is for CPU processes only: a GPU config keeps its bf16
    assert "--mixed_precision" not in dry("CONFIG=accelerate_configs/single_gpu.yaml", target="train-sft")
