"""The GPU checklist (bench/gpu_check/), checked on a CPU so that a bug in it never costs GPU time:

- the dry run (`make gpu-check DRY_RUN=1`) runs every step with tiny sizes, writes the JSON and the
  Markdown table, records each run's command, time and status, and catches the one failure a CPU
  must give (--sync_batchnorm) as a failure with its error line;
- a step that raises is recorded as failed and the next step still runs;
- the payload of wheels is cut into parts, received part by part, joined, checked and installed with
  pip offline, as on the GPU machine;
- the MFU arithmetic and the error lines.
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import zipfile

import pytest

from conftest import REPO, launch_env

CHECKLIST = REPO / "bench" / "gpu_check" / "checklist.py"
PAYLOAD = REPO / "bench" / "gpu_check" / "payload.py"


def load(path):
    spec = importlib.util.spec_from_file_location(f"gpu_check_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    results = tmp_path_factory.mktemp("gpu_check")
    env = launch_env()
    env.pop("OUT", None)
    done = subprocess.run(
        [sys.executable, CHECKLIST, "--dry_run", "--results", results, "--copy_to", results / "out"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return done, results


def test_the_dry_run_runs_every_step_and_records_it(dry_run):
    done, results = dry_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    data = json.loads((results / "gpu_check.json").read_text())
    assert data["dry_run"] is True
    environment = data["environment"]
    assert environment["torch"] and environment["python"] and environment["gpu"] is None  # no CUDA here
    assert isinstance(environment["differs_from_requirements"], list)
    steps = data["steps"]
    assert list(steps) == ["1", "2a", "2b", "3", "4", "5", "6", "7", "8", "9"]
    for step in ("1", "2a", "2b", "3", "4", "5", "7", "8", "9"):
        assert steps[step]["status"] == "ok", (step, steps[step])
    for record in steps.values():
        assert record["wall_s"] > 0
        for run in record["runs"].values():
            if run["status"] == "skipped":
                assert run["reason"], run  # never skipped silently
            elif "command" in run:
                assert run["wall_s"] > 0 and (results / run["log"]).exists(), run

    # The figures each step exists for, parsed from the real runs' outputs.
    assert steps["1"]["figures"]["ours_x_trainer"] > 0
    assert steps["1"]["runs"]["ours"]["figures"]["mixed_precision"] == "bf16"  # single_gpu.yaml, as on the GPU
    for step, case in (("2a", "lora_packed"), ("2b", "full_gc")):
        figures = steps[step]["runs"][case]["figures"]
        assert figures["target_tokens_per_s"] > 0 and figures["model_tflop_per_s"] > 0, figures
        assert figures["mfu"] is None  # no GPU, no peak to divide by
    assert steps["3"]["figures"]["speed_up_steady"] > 0
    fsdp = steps["4"]["figures"]
    assert fsdp["reload"]["ok"] and fsdp["train"]["target_tokens_per_s"] > 0
    assert any("fsdp.yaml through tests/launched/fsdp_on_cpu.py" in note for note in steps["4"]["notes"])
    assert "fsdp_on_cpu.py" in steps["4"]["runs"]["train"]["command"]  # the dry run runs FSDP2 itself

    # fp16 with the loss scaler at 2**40: the first steps overflow, are skipped and counted, and both finish.
    for name in ("image", "lora"):
        figures = steps["7"]["runs"][name]["figures"]
        assert figures["skipped_steps"] >= 1 and figures["final_loss_scale"] < 2.0**40, (name, figures)
    assert "--mixed_precision fp16" in steps["7"]["runs"]["lora"]["command"]
    manifest = steps["8"]["runs"]["manifest"]["figures"]
    assert manifest["checkpoint_gib"] > 0.04 and manifest["seconds"]["save_ours"] > 0, manifest
    assert "manifest_adds_to_a_save" in steps["8"]["figures"]
    dpo = steps["9"]["runs"]["bench_dpo"]["figures"]["ours"]  # TRL's runs need trl, which CI does not install
    assert dpo["pairs_per_s"] > 0 and dpo["steps"] >= 1, dpo

    # The failure a CPU must give is caught, recorded with its error line, and expected.
    assert steps["6"]["status"] == "failed" and steps["6"]["expected_in_dry_run"]
    assert "--sync_batchnorm needs GPUs" in steps["6"]["runs"]["sync_batchnorm"]["error"]
    assert steps["6"]["runs"]["plain"]["status"] == "skipped"  # step 7 runs the same command, in fp16

    table = (results / "gpu_check.md").read_text()
    assert "| step | what | status | wall (s) | headline |" in table
    for step in steps:
        assert f"## Step {step}:" in table
    assert "--sync_batchnorm needs GPUs" in table
    assert sorted(p.name for p in (results / "out").iterdir()) == [
        "gpu_check.json",
        "gpu_check.md",
        "gpu_check_logs.tar.gz",
    ]


def test_make_gpu_check_runs_the_checklist_with_the_machines_own_python():
    """On the GPU machine there is no .venv: PYTHON=python3 runs the checklist with it, installing nothing."""
    plan = subprocess.run(
        ["make", "-n", "gpu-check", "PYTHON=python3", "STEPS=1,2a", "BUDGET_S=540"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert plan.returncode == 0, plan.stderr
    commands = plan.stdout.replace("\\\n", " ")
    assert "pip install" not in commands
    assert "python3 bench/gpu_check/checklist.py --steps 1,2a" in commands and "--budget_s 540" in commands
    dry = subprocess.run(["make", "-n", "gpu-check", "DRY_RUN=1"], cwd=REPO, capture_output=True, text=True)
    assert "checklist.py --steps all" in dry.stdout and "--dry_run" in dry.stdout


def test_a_step_that_raises_is_recorded_and_the_next_step_runs(tmp_path):
    checklist = load(CHECKLIST)
    args = argparse.Namespace(
        dry_run=True, results=str(tmp_path), budget_s=None, site=None, copy_to=None, fresh=True, steps="1,6"
    )
    runner = checklist.Checklist(args)
    runner.step_1 = lambda: 1 / 0
    runner.step_6 = lambda: runner.table(["a"], [["b"]])
    runner.run_step("1")
    runner.run_step("6")
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["steps"]["1"]["status"] == "failed"
    assert data["steps"]["1"]["error"] == "ZeroDivisionError: division by zero"
    assert "ZeroDivisionError" in data["steps"]["1"]["traceback"]
    assert data["steps"]["6"]["status"] == "ok"
    assert "| 1 | train.py demo in bf16" in (tmp_path / "gpu_check.md").read_text()


def test_the_error_line_is_the_line_that_says_why():
    checklist = load(CHECKLIST)
    ours = "loading\n[rank 0] error: --max_length 900 is above this model's limit\nTraceback\nChildFailedError: x\n"
    assert checklist.error_line(ours, 2) == "[rank 0] error: --max_length 900 is above this model's limit"
    python = "Traceback (most recent call last):\n  File x\nValueError: bad value\n"
    assert checklist.error_line(python, 1) == "ValueError: bad value"
    assert checklist.error_line("something\nlast words\n", 3) == "exit 3: last words"


def test_model_flops_count_what_each_kind_of_training_computes():
    checklist = load(CHECKLIST)
    facts = {"linear_params": 100, "head_params": 10, "layers": 2, "attention_width": 4, "mean_tokens_attended": 5}
    facts["lora_params"] = 1
    # 1,000 tokens, 50 of them targets; attention: 2 layers x width 4 x 5 tokens attended x 4 FLOPs (scores, sum)
    attention = 4 * 2 * 4 * 5 * 1000
    forward = 2 * 100 * 1000 + 2 * 10 * 50 + attention
    assert checklist.model_flops(facts, 1000, 50, lora=False) == 3 * forward
    # LoRA: no gradients of the frozen weights: their matmuls and the head twice, attention thrice, the adapters 6x.
    assert checklist.model_flops(facts, 1000, 50, lora=True) == 2 * (forward - attention) + 3 * attention + 6 * 1000


def fake_wheel(directory, name, version, payload_bytes=3000):
    """A minimal valid pure-Python wheel with `payload_bytes` of incompressible data in it."""
    import os

    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        wheel.writestr(f"{name}/data.bin", os.urandom(payload_bytes))
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def test_the_payload_travels_in_parts_and_installs_offline(tmp_path, monkeypatch):
    payload = load(PAYLOAD)
    monkeypatch.setattr(payload, "PAYLOAD", tmp_path / "here")
    monkeypatch.setattr(payload, "STASH", tmp_path / "stash")
    monkeypatch.setattr(payload, "PART_BYTES", 4096)
    monkeypatch.setattr(
        payload, "WHEELS", [payload.Wheel("gpucheck_alpha==1.0", "test"), payload.Wheel("gpucheck_beta==2.0", "test")]
    )
    wheels = tmp_path / "here" / "wheels"
    wheels.mkdir(parents=True)
    fake_wheel(wheels, "gpucheck_alpha", "1.0")
    fake_wheel(wheels, "gpucheck_beta", "2.0")
    assert payload.pack(None) == 0
    manifest = json.loads((tmp_path / "here" / "manifest.json").read_text())
    parts = [p["name"] for p in manifest["parts"]]
    assert len(parts) >= 2 and all(p["bytes"] <= 4096 for p in manifest["parts"])

    # The GPU machine: each call carries one part, which is checked and stashed.
    carried = tmp_path / "carried"
    carried.mkdir()
    for part in parts:
        (carried / part).write_bytes((tmp_path / "here" / part).read_bytes())
    for part in parts:
        (tmp_path / "here" / part).unlink()
    (tmp_path / "here" / parts[0]).write_bytes(b"corrupted")
    assert payload.receive(None) == 1  # a corrupt part is refused, and said so
    for part in parts:
        (tmp_path / "here" / part).write_bytes((carried / part).read_bytes())
        assert payload.receive(None) == 0
        (tmp_path / "here" / part).unlink()  # the next call does not carry it: the stash keeps it
    site = tmp_path / "site"
    assert payload.install(argparse.Namespace(site=str(site))) == 0
    installed = json.loads((site / payload.INSTALLED_MARKER).read_text())
    assert installed["installed"] == {"gpucheck_alpha": "1.0", "gpucheck_beta": "2.0"}
    check = subprocess.run(
        [sys.executable, "-c", "import gpucheck_alpha, gpucheck_beta; print(gpucheck_beta.VERSION)"],
        env={**launch_env(), "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert check.stdout.strip() == "2.0", check.stderr
