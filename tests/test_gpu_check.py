"""The GPU checklist (bench/gpu_check/), checked on a CPU so that a bug in it never costs GPU time:

- the dry run (`make gpu-check DRY_RUN=1`) runs every step with tiny sizes, writes the JSON and the
  Markdown table, records each run's command, time and status, and catches the one failure a CPU
  must give (--sync_batchnorm) as a failure with its error line; here its launches are forked from a warm
  process (--warm_launcher, as the suite's other launches: tests/warm_launch.py);
- a step that raises is recorded as failed and the next step still runs;
- step 3 compiles with dynamo's eager backend in the dry run, so its graph breaks and recompiles are counted;
- the payload of wheels travels in sets (step 1's in one part), received part by part, joined, checked and
  installed with pip offline call after call, as on the GPU machine, a float16-carried model float32 again;
- the call plan: each session fits its device minutes, each call carries at most 64 MiB and fits its time,
  every step not yet run on a GPU is planned, the README shows the plan;
- the MFU arithmetic and the error lines.
"""

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import REPO, launch_env, make_tiny_causal_lm

GPU_CHECK = REPO / "bench" / "gpu_check"
CHECKLIST = GPU_CHECK / "checklist.py"
# The checklist's and the payload's modules import each other by name, as they do when checklist.py or payload.py
# runs as a script (its folder first on sys.path).
sys.path.insert(0, str(GPU_CHECK))
import checklist  # noqa: E402
import checklist_figures  # noqa: E402
import checklist_helpers  # noqa: E402
import checklist_plan  # noqa: E402
import checklist_report  # noqa: E402
import checklist_steps  # noqa: E402
import checklist_util  # noqa: E402
import payload_install  # noqa: E402
import payload_pack  # noqa: E402
import payload_wheels  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    results = tmp_path_factory.mktemp("gpu_check")
    env = launch_env()
    env.pop("OUT", None)
    warm = [] if os.environ.get("TESTS_REAL_LAUNCHER") else ["--warm_launcher"]  # as the suite's other launches
    done = subprocess.run(
        [sys.executable, CHECKLIST, "--dry_run", *warm, "--results", results, "--copy_to", results / "out"],
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
    assert list(steps) == ["1", "2a", "2b", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15"]
    for step in ("1", "2a", "2b", "3", "4", "5", "7", "8", "9", "10", "11", "12", "13", "14", "15"):
        assert steps[step]["status"] == "ok", (step, steps[step])
    for record in steps.values():
        assert record["wall_s"] > 0
        for run in record["runs"].values():
            if run["status"] == "skipped":
                assert run["reason"], run  # never skipped silently
            elif "command" in run:
                assert run["wall_s"] > 0 and (results / run["log"]).exists(), run
    if not os.environ.get("TESTS_REAL_LAUNCHER"):  # forked from a warm process, but for a variable read at import
        assert steps["2a"]["runs"]["lora_packed"]["warm"] and steps["5"]["runs"]["zero2"]["warm"]  # simple, torchrun
        assert steps["3"]["runs"]["compiled"]["warm"] is False  # its TORCH_LOGS: torch reads it at import

    # The figures each step exists for, parsed from the real runs' outputs.
    assert steps["1"]["figures"]["ours_x_trainer"] > 0
    assert steps["1"]["runs"]["ours"]["figures"]["mixed_precision"] == "bf16"  # single_gpu.yaml, as on the GPU
    for step, case in (("2a", "lora_packed"), ("2b", "full_gc"), ("13", "qlora"), ("13", "lora")):
        figures = steps[step]["runs"][case]["figures"]
        assert figures["target_tokens_per_s"] > 0 and figures["model_tflop_per_s"] > 0, figures
        assert figures["mfu"] is None  # no GPU, no peak to divide by
    # QLoRA on bitsandbytes' CPU backend (the tiny Llama is 64 wide: its kernels quantize in blocks of 64), against
    # our plain LoRA run of the same work, made in the step (the dry run's step 2a runs lora_packed alone)
    qlora = steps["13"]
    assert "--load_in_4bit" in qlora["runs"]["qlora"]["command"]
    assert "--load_in_4bit" not in qlora["runs"]["lora"]["command"]
    assert "QLoRA: the base model's linear layers in 4-bit NF4" in (results / qlora["runs"]["qlora"]["log"]).read_text()
    assert qlora["figures"]["qlora_x_lora_target_tokens_per_s"] > 0, qlora["figures"]
    assert [row[0] for row in qlora["table"]["rows"]][-1] == "lora (reference)"
    if qlora["runs"]["qlora_trl"]["status"] == "skipped":  # CI has no trl
        assert qlora["runs"]["qlora_trl"]["reason"] == "trl is not installed"
    else:
        assert qlora["figures"]["qlora_ours_x_trl"] > 0
    # train.py with the LLM as a classifier: whole, LoRA and QLoRA (its head out of 4-bit) train, and each saved
    # classifier (the merged ones for the adapters) reloads with every weight found
    classifier = steps["14"]
    assert classifier["runs"]["full"]["figures"]["trainable"] == "all"
    for case in ("full", "lora", "qlora"):
        figures = classifier["runs"][case]["figures"]
        assert figures["samples_per_s"] > 0 and figures["mixed_precision"] == "bf16", (case, figures)
        assert figures["reloads"].startswith("yes:"), (case, figures)
    for case in ("lora", "qlora"):
        assert "--merge_lora" in classifier["runs"][case]["command"]
        assert " of " in classifier["runs"][case]["figures"]["trainable"]  # the LoRA line of its log was read
        assert classifier["runs"][case]["figures"]["saved_mib"] < classifier["runs"]["full"]["figures"]["saved_mib"]
    assert (
        "QLoRA: the base model's linear layers in 4-bit NF4"
        in (results / classifier["runs"]["qlora"]["log"]).read_text()
    )
    assert classifier["figures"]["qlora_x_lora_samples_per_s"] > 0 and "LM head" not in classifier["figures"]["model"]
    assert [row[0] for row in classifier["table"]["rows"]] == ["full", "lora", "qlora"]
    # --gradient_checkpointing in train.py: the classifier's LoRA with and without it trains the same model (on a CPU
    # bit for bit: the recomputed forward is the stored one's), and the log says the layers were checkpointed
    checkpointed = steps["15"]
    assert "--gradient_checkpointing" in checkpointed["runs"]["lora_gc"]["command"]
    assert "--gradient_checkpointing" not in checkpointed["runs"]["lora"]["command"]
    log = (results / checkpointed["runs"]["lora_gc"]["log"]).read_text()
    assert "gradient checkpointing: each layer's activations recomputed" in log
    assert "is_gradient_checkpointing" not in log  # peft's FutureWarning, silenced (lora.add_lora)
    same = checkpointed["figures"]
    assert same["logged_steps"] >= 1 and same["saved_weights_relative_difference"] < 1e-6, same
    for name in ("train_loss_max_relative_change", "grad_norm_max_relative_change", "eval_loss_relative_change"):
        assert same[name] < 1e-6, (name, same)
    assert checkpointed["figures"]["gc_x_plain_samples_per_s"] > 0 and "gc_saves_gpu_mib" not in checkpointed["figures"]
    assert [row[0] for row in checkpointed["table"]["rows"]] == ["lora", "lora_gc"]
    # Step 3 ran dynamo (eager backend: nothing compiled) and counted what it found: graph breaks and recompiles.
    compiled = steps["3"]["figures"]
    assert compiled["speed_up_steady"] > 0
    assert compiled["compiled_graphs"] > 0, compiled  # metrics.json's count: dynamo traced the model
    assert compiled["graph_breaks"] == 0, compiled["graph_break_places"]  # configure_compile: the head's mask too
    assert compiled["graph_breaks"] == sum(compiled["graph_break_places"].values())
    assert any("eager" in note for note in steps["3"]["notes"])
    assert ["graph_breaks", compiled["graph_breaks"]] in steps["3"]["table"]["rows"]
    fsdp = steps["4"]["figures"]
    assert fsdp["reload"]["ok"] and fsdp["train"]["target_tokens_per_s"] > 0
    assert any("fsdp.yaml through tests/launched/fsdp_on_cpu.py" in note for note in steps["4"]["notes"])
    assert "fsdp_on_cpu.py" in steps["4"]["runs"]["train"]["command"]  # the dry run runs FSDP2 itself
    if importlib.util.find_spec("deepspeed"):  # make installs it; without it step 5 runs cpu_2proc.yaml once
        for stage in ("zero2", "zero3"):  # DeepSpeed's saved models, both reloaded by one helper
            reload = steps["5"]["runs"][stage]["figures"]["reload"]
            assert reload["ok"], reload

    # fp16 with the loss scaler at 2**40: the first steps overflow, are skipped and counted, and both finish.
    for name in ("image", "lora"):
        figures = steps["7"]["runs"][name]["figures"]
        assert figures["skipped_steps"] >= 1 and figures["final_loss_scale"] < 2.0**40, (name, figures)
    assert "--mixed_precision fp16" in steps["7"]["runs"]["lora"]["command"]
    manifest = steps["8"]["runs"]["manifest"]["figures"]
    assert manifest["checkpoint_gib"] > 0.04 and manifest["seconds"]["save_ours"] > 0, manifest
    assert "manifest_adds_to_a_save" in steps["8"]["figures"]
    dpo = steps["9"]["runs"]["bench_dpo"]["figures"]["ours"]  # TRL's runs need trl, which CI does not install
    assert dpo["per_s"] > 0 and dpo["steps"] >= 1, dpo
    grpo = steps["10"]["runs"]["bench_grpo"]["figures"]["ours"]
    assert grpo["per_s"] > 0 and grpo["steps"] >= 1, grpo
    assert "--model" in steps["10"]["runs"]["bench_grpo"]["command"]  # the prepared (here: tiny) LLM, not the demo's
    # --compile_generation's run: its decoding traced by dynamo into one graph, unbroken (on a GPU: a CUDA graph)
    assert steps["10"]["figures"]["ours_compiled_compiled_graphs"] == 1, steps["10"]["figures"]
    assert steps["10"]["figures"]["ours_compiled_graph_breaks"] == 0
    # DPO with --torch_compile: traced by dynamo, unbroken, a few graphs (the call's variants), none left uncompiled
    dpo_compiled = steps["11"]["figures"]
    assert steps["11"]["runs"]["bench_dpo"]["figures"]["ours_compiled"]["per_s"] > 0
    assert dpo_compiled["ours_compiled_compiled_graphs"] > 0 and dpo_compiled["ours_compiled_graph_breaks"] == 0
    assert dpo_compiled["ours_compiled_frames_left_eager"] == 0, dpo_compiled
    assert any("eager" in note for note in steps["11"]["notes"])
    # GRPO profiled, ours and ours without cuDNN's attention (CI has no trl, and a CPU no cuDNN: the switch is idle)
    for name in ("ours", "ours_no_cudnn_attention"):
        profile = steps["12"]["figures"][f"bench_grpo_{name}"]
        assert profile["steps"] == 2 and profile["step_s"] > 0 and profile["host_in_operators_s"] > 0, profile
        assert profile["generate_s"] > 0 and "longest_call_s" in profile["host_top"][0], profile
        assert (results / "lanes/0/step12/bench_grpo" / name / "train_log.jsonl").exists()
    rows = steps["12"]["table"]["rows"]
    assert [row[0] for row in rows] == ["bench_grpo ours", "bench_grpo ours_no_cudnn_attention"]
    assert "longest call" in rows[0][-1] and steps["12"]["figures"]["bench_grpo_no_cudnn_attention_x_ours_step_time"]

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
    with tarfile.open(results / "out" / "gpu_check_logs.tar.gz") as tar:  # the side-by-side runs' own logs too
        names = tar.getnames()
    lane = next(name.split("/step10/")[0] for name in names if "/step10/" in name)  # the dry run's lane of step 10
    assert f"{lane}/step10/ours.log" in names and f"{lane}/step10/ours/train_log.jsonl" in names, names


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


@pytest.mark.fast
def test_the_runner_records_a_compiled_run_with_the_standard_library_alone():
    """On the GPU machine the checklist runs under a bare `python3`: neither ddp_utils (not on its path) nor the
    machine's torch is importable in the runner, only in the runs it starts. Steps 10 and 11 record the compiled
    contender's figures and compile counts there; an import of ddp_utils did so in the dry run only (CI's venv has
    the package installed) and would have failed both steps on the GPU. `python -S`: no site-packages at all."""
    code = """
import sys
sys.path.insert(0, "bench/gpu_check")
import checklist  # the whole runner: every module it imports
from checklist_bench_steps import BenchSteps
class Step:
    step_record = {"figures": {}}
figures = {"ours": {"per_s": 2.0, "steady_per_s": 2.5}, "trl": {"per_s": 1.0},
           "ours_compiled": {"per_s": 3.0, "steady_per_s": 5.0, "compiled_graphs": 1, "graph_breaks": 0}}
BenchSteps.record_compiled_against_trl(Step(), figures)
assert "torch" not in sys.modules and "ddp_utils" not in sys.modules, "the runner imported more than the stdlib"
print(sorted(Step.step_record["figures"].items()))
"""
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(
        [
            ("compiled_x_eager_steady", 2.0),
            ("ours_compiled_compiled_graphs", 1),
            ("ours_compiled_graph_breaks", 0),
            ("ours_compiled_steady_per_s", 5.0),
            ("ours_compiled_x_trl", 3.0),
            ("ours_steady_per_s", 2.5),
            ("ours_x_trl", 2.0),
        ]
    )


def test_a_step_that_raises_is_recorded_and_the_next_step_runs(tmp_path):
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


def test_a_step_whose_run_was_cut_at_the_budget_is_still_to_run(tmp_path):
    """Session 3's step 3: its eager run finished and its compiled run was cut at --budget_s; the step read "ok",
    with no figures, so the plan would have counted it as done. Session 4's: its compiled run was not started, for
    the time left, and the step read "ok" too."""
    args = argparse.Namespace(
        dry_run=True, results=str(tmp_path), budget_s=None, site=None, copy_to=None, fresh=True, steps="3"
    )
    runner = checklist.Checklist(args)
    cut = {"name": "compiled", "status": "skipped", "stopped": True, "reason": "stopped after 438 s"}
    runner.step_3 = lambda: runner.step_record["runs"].update(eager={"name": "eager", "status": "ok"}, compiled=cut)
    runner.run_step("3")
    step = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]["3"]
    assert step["status"] == "skipped" and step["reason"] == "compiled: stopped after 438 s"
    # Session 4's: the compiled run not started, for the budget's 58 s left against its 228; the step read "ok".
    runner.deadline = time.monotonic() + 1  # what --budget_s 1 sets

    def eager_only():
        runner.step_record["runs"]["eager"] = {"name": "eager", "status": "ok"}
        runner.launch("compiled", ["true"])

    runner.step_3 = eager_only
    runner.run_step("3")
    step = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]["3"]
    assert (
        step["status"] == "skipped"
        and step["reason"].startswith("compiled: ")
        and "left of --budget_s" in step["reason"]
    ), step


def test_steps_9_and_10_alone_have_the_llm_prepared_for_them(tmp_path):
    """Call 5 runs --steps 9,10 alone: the environment helper must prepare the LLM they pass as --model."""
    args = argparse.Namespace(
        dry_run=True, results=str(tmp_path), budget_s=None, site=None, copy_to=None, fresh=True, steps="9,10"
    )
    runner = checklist.Checklist(args)
    asked = []
    runner.helper = lambda name, *helper_args, **_: asked.append(helper_args) or {"environment": {}, "llm": {}}
    for steps, llm in ((["9", "10"], True), (["10"], True), (["1", "6", "8"], False), (["2a"], True)):
        runner.environment(steps)
        assert ("--llm" in asked[-1]) == llm, steps


def test_the_error_line_is_the_line_that_says_why():
    ours = "loading\n[rank 0] error: --max_length 900 is above this model's limit\nTraceback\nChildFailedError: x\n"
    assert checklist_util.error_line(ours, 2) == "[rank 0] error: --max_length 900 is above this model's limit"
    python = "Traceback (most recent call last):\n  File x\nValueError: bad value\n"
    assert checklist_util.error_line(python, 1) == "ValueError: bad value"
    # one process (single_gpu.yaml): the simple launcher's own traceback follows the script's
    simple = python + "Traceback (most recent call last):\nsubprocess.CalledProcessError: Command '[...]' returned 1.\n"
    assert checklist_util.error_line(simple, 1) == "ValueError: bad value"
    assert checklist_util.error_line("something\nlast words\n", 3) == "exit 3: last words"


def test_model_flops_count_what_each_kind_of_training_computes():
    facts = {"linear_params": 100, "head_params": 10, "layers": 2, "attention_width": 4, "mean_tokens_attended": 5}
    facts["lora_params"] = 1
    # 1,000 tokens, 50 of them targets; attention: 2 layers x width 4 x 5 tokens attended x 4 FLOPs (scores, sum)
    attention = 4 * 2 * 4 * 5 * 1000
    forward = 2 * 100 * 1000 + 2 * 10 * 50 + attention
    assert checklist_figures.model_flops(facts, 1000, 50, lora=False) == 3 * forward
    # LoRA: no gradients of the frozen weights: their matmuls and the head twice, attention thrice, the adapters 6x.
    assert (
        checklist_figures.model_flops(facts, 1000, 50, lora=True)
        == 2 * (forward - attention) + 3 * attention + 6 * 1000
    )


def test_graph_breaks_are_counted_by_place_from_dynamos_log():
    prefix = "V1125 11:12:32.899000 1 torch/_dynamo/symbolic_convert.py:5124] [0/0] [__graph_breaks] "
    first = [
        "Graph break in user code at /x/transformers/modeling_utils.py:5113",
        "Graph Break Reason: Encountered graph break when attempting to trace CALL_FUNCTION_EX: f(*args):",
        "",
        "Dynamic shape operator",
        "  Developer debug context: aten.nonzero.default",
    ]
    again = [
        "Graph break (user stack suppressed due to duplicate graph break) in user code at /x/modeling_utils.py:5113",
        "Graph Break Reason: Failed to handle graph break gracefully. Graph break encountered:",
        "  Developer debug context: aten.nonzero.default",
    ]
    other = ["Graph break in user code at /x/peft/peft_model.py:2119", "Graph Break Reason: Unsupported thing"]
    log = "\n".join(prefix + line for line in first + again + ["train: 10%"] + other) + "\nRecompiling function\n"
    assert checklist_figures.graph_breaks(log) == {
        "graph_breaks": 3,
        "graph_break_places": {
            "modeling_utils.py:5113: aten.nonzero.default": 2,
            "peft_model.py:2119: Unsupported thing": 1,
        },
    }
    assert checklist_figures.graph_breaks("no dynamo here") == {"graph_breaks": 0, "graph_break_places": {}}


def fake_wheel(directory, name, version, payload_bytes=3000, weights=None):
    """A minimal valid pure-Python wheel with `payload_bytes` of incompressible data in it, and with
    `weights` (a dict of numpy arrays) as <name>/model.safetensors."""
    import base64
    import hashlib
    import os

    from safetensors.numpy import save

    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n".encode(), f"{name}/data.bin": os.urandom(payload_bytes)}
    if weights is not None:
        files[f"{name}/model.safetensors"] = save(weights, metadata={"format": "pt"})
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [
        f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
        for n, d in files.items()
    ]
    with zipfile.ZipFile(path, "w") as wheel:
        for file, data in files.items():
            wheel.writestr(file, data)
        wheel.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path


def test_the_payload_travels_in_sets_and_installs_offline_call_after_call(tmp_path, monkeypatch):
    """Each set in equal parts, one per call with the manifest (PART_BYTES is tiny here): step 1's set
    installs alone, a later call the LLM's (the wheels every step needs already there), a set missing a
    part is refused with the part to carry, and a float16-carried model is float32 again."""
    import base64
    import hashlib

    import numpy as np
    from safetensors.numpy import load_file

    here = tmp_path / "here"
    # pack looks the payload's data up in payload_pack (which imported it), receive and install in payload_install
    monkeypatch.setattr(payload_pack, "PAYLOAD", here)
    monkeypatch.setattr(payload_install, "PAYLOAD", here)
    monkeypatch.setattr(payload_install, "STASH", tmp_path / "stash")
    monkeypatch.setattr(payload_pack, "PART_BYTES", 8192)
    monkeypatch.setattr(payload_pack, "SETS", {"step1": ("test", 9), "llm": ("test", 9)})
    monkeypatch.setattr(
        payload_pack,
        "WHEELS",
        [
            payload_wheels.Wheel("gpucheck_base==1.0", "every step", 0.1, ("step1", "llm")),
            payload_wheels.Wheel("gpucheck_model==1.0", "step 1's model", 0.1, ("step1",), half=True),
            payload_wheels.Wheel("gpucheck_llm==2.0", "the LLM", 0.1, ("llm",)),
        ],
    )
    wheels = here / "wheels"
    wheels.mkdir(parents=True)
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((16, 8)).astype(np.float32), "ids": np.arange(4, dtype=np.int64)}
    fake_wheel(wheels, "gpucheck_base", "1.0")
    fake_wheel(wheels, "gpucheck_model", "1.0", weights=weights)
    fake_wheel(wheels, "gpucheck_llm", "2.0", payload_bytes=20000)
    assert payload_pack.pack(None) == 0
    manifest = json.loads((here / "manifest.json").read_text())
    step1, llm = manifest["sets"]["step1"]["parts"], manifest["sets"]["llm"]["parts"]
    assert len(step1) >= 2 and len(llm) > len(step1), (step1, llm)  # PART_BYTES is tiny here
    for name, info in manifest["sets"].items():
        sizes = [p["bytes"] for p in manifest["parts"] if p["set"] == name]
        assert max(sizes) <= 8192 and max(sizes) - min(sizes) < len(sizes), (name, sizes)  # equal parts
        assert sum(sizes) == info["bytes"]
    model = next(w for w in manifest["wheels"] if w["name"] == "gpucheck_model")
    assert model["half"]["tensors"] == 1 and 0 < model["half"]["max_rel_error"] < 2**-11
    with zipfile.ZipFile(here / "half" / model["file"]) as copy:  # the copy's RECORD has the new file's hash
        data = copy.read("gpucheck_model/model.safetensors")
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record = copy.read("gpucheck_model-1.0.dist-info/RECORD").decode().splitlines()
        assert f"gpucheck_model/model.safetensors,sha256={digest},{len(data)}" in record

    # A set needing more parts than the call plan has is refused.
    monkeypatch.setattr(payload_pack, "SETS", {"step1": ("test", 1), "llm": ("test", 9)})
    assert payload_pack.pack(None) == 1
    monkeypatch.setattr(payload_pack, "SETS", {"step1": ("test", 9), "llm": ("test", 9)})
    assert payload_pack.pack(None) == 0

    parts = {
        p["name"]: (here / p["name"]).read_bytes() for p in json.loads((here / "manifest.json").read_text())["parts"]
    }
    for name in parts:
        (here / name).unlink()

    def call(*names, corrupt=False):
        """One device call: the manifest and these parts carried, and nothing else of the payload."""
        for old in here.glob("*-[0-9]*"):
            old.unlink()
        for name in names:
            (here / name).write_bytes(b"corrupted" if corrupt else parts[name])
        return payload_install.receive(None)

    site = tmp_path / "site"
    assert call(step1[0], corrupt=True) == 1  # a corrupt part is refused, and said so
    assert all(call(name) == 0 for name in step1)  # one part per call: the stash keeps the earlier ones
    # step1 only: llm has no part here
    assert payload_install.install(argparse.Namespace(site=str(site), sets=None)) == 0
    installed = json.loads((site / payload_wheels.INSTALLED_MARKER).read_text())
    assert installed["sets"] == ["step1"] and installed["installed"] == {
        "gpucheck_base": "1.0",
        "gpucheck_model": "1.0",
    }
    restored = load_file(site / "gpucheck_model" / "model.safetensors")
    assert restored["w"].dtype == np.float32 and np.array_equal(restored["w"], weights["w"].astype(np.float16))
    assert np.array_equal(restored["ids"], weights["ids"])
    assert payload_install.install(argparse.Namespace(site=str(site), sets=None)) == 0  # nothing new: nothing done

    assert all(call(name) == 0 for name in llm[:-1])
    assert payload_install.install(argparse.Namespace(site=str(site), sets=None)) == 1  # its last part missing: refused
    assert call(llm[-1]) == 0
    assert payload_install.install(argparse.Namespace(site=str(site), sets=None)) == 0
    installed = json.loads((site / payload_wheels.INSTALLED_MARKER).read_text())
    assert installed["sets"] == ["step1", "llm"]
    assert installed["installed"] == {"gpucheck_base": "1.0", "gpucheck_model": "1.0", "gpucheck_llm": "2.0"}
    assert [h["sets"] for h in installed["history"]] == [["step1"], ["llm"]]
    check = subprocess.run(
        [sys.executable, "-c", "import gpucheck_base, gpucheck_llm; print(gpucheck_llm.VERSION)"],
        env={**launch_env(), "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert check.stdout.strip() == "2.0", check.stderr

    # A machine started afresh: its stash is empty, so the LLM's last part alone cannot be installed.
    monkeypatch.setattr(payload_install, "STASH", tmp_path / "fresh_stash")
    assert call(llm[-1]) == 0
    assert payload_install.install(argparse.Namespace(site=str(tmp_path / "fresh_site"), sets=None)) == 1


@pytest.mark.fast
def test_step_15_compares_the_two_runs_whole_and_a_nan_never_passes(tmp_path):
    """same_training reads both runs' logs, metrics and saved adapters with the standard library (the runner has no
    torch): the largest relative change over the logged steps, the adapters' distance as torch computes it, and NaN
    where a value is not finite, which the step's `<=` check fails."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    weights = {"a.lora_A.weight": torch.randn(4, 8), "score.weight": torch.randn(3, 8), "b": torch.ones(2).half()}
    moved = {**weights, "a.lora_A.weight": weights["a.lora_A.weight"] * 1.01}
    for name, losses, saved in (("plain", [1.0, 0.5], weights), ("gc", [1.0, 0.51], moved)):
        (tmp_path / name).mkdir()
        lines = [{"step": 10 * (i + 1), "train/loss": loss, "train/grad_norm": 2.0} for i, loss in enumerate(losses)]
        lines.append({"step": 20, "eval/loss": 0.7})  # an evaluation's record: not a training step
        (tmp_path / name / "train_log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        (tmp_path / name / "metrics.json").write_text(json.dumps({"eval_loss": 0.7}))
        save_file(saved, str(tmp_path / name / "adapter_model.safetensors"))
    same = checklist_figures.same_training(tmp_path / "plain", tmp_path / "gc")
    assert same["logged_steps"] == 2 and same["grad_norm_max_relative_change"] == 0.0
    assert math.isclose(same["train_loss_max_relative_change"], 0.02) and same["eval_loss_relative_change"] == 0.0
    float32 = ("a.lora_A.weight", "score.weight")  # the half-precision tensor is not compared
    expected = math.sqrt(sum(float((moved[k] - weights[k]).pow(2).sum()) for k in float32))
    expected /= math.sqrt(sum(float(weights[k].pow(2).sum()) for k in float32))
    assert math.isclose(same["saved_weights_relative_difference"], expected, rel_tol=1e-5)
    (tmp_path / "gc" / "metrics.json").write_text(json.dumps({"eval_loss": float("nan")}))
    assert math.isnan(checklist_figures.same_training(tmp_path / "plain", tmp_path / "gc")["eval_loss_relative_change"])


def test_the_call_plan_fits_each_session_and_runs_every_step_not_yet_run_on_a_gpu():
    """README's device calls (checklist_plan.CALLS), session by session: each session fits its 15 device minutes;
    each call carries at most 64 MiB (its parts, the LLM's shape, the manifest and the working tree); each step
    runs after its set is installed in that session (a session starts a bare machine), and each call's
    estimated seconds fit its --budget_s; every step that has not yet run on a GPU is planned; README shows it."""
    calls, rows = checklist_plan.CALLS, checklist_plan.plan()
    # Sessions 1 to 4: GPU_S holds their runs (step 12's ran in session 4, and it runs again with a third contender)
    ran_on_a_gpu = {"1", "2a", "3", "4", "7", "9", "10"}
    assert ran_on_a_gpu <= {step for step, _ in checklist_plan.GPU_S}
    assert set(checklist_steps.STEPS) - ran_on_a_gpu <= {s for call in calls for s in call["steps"]}

    tree = payload_pack.tree_bytes()  # what every call sends besides its parts and the manifest (1.4 MiB)
    sizes = {}
    for name, (_, count) in payload_wheels.SETS.items():
        size = sum(w.mib for w in payload_wheels.WHEELS if name in w.sets) * 2**20 * 1.01  # tar headers
        assert math.ceil(size / payload_wheels.PART_BYTES) == count, name  # the parts the plan carries
        sizes.update({f"{name}-{i}": size / count for i in range(1, count + 1)})
    sizes["llm_shape"] = 3.5 * 2**20  # the LLM's config and tokenizer (payload.py pack measures it)
    session, carried, installed, session_s = None, [], set(), {}
    for call, row in zip(calls, rows):
        if call["session"] != session:  # a bare machine
            session, carried, installed = call["session"], [], set()
        carried += call["carry"]
        assert sum(sizes[name] for name in call["carry"]) + tree + 64 * 2**10 <= payload_wheels.CALL_BYTES, call
        if call["install"]:  # a set installs once all its parts have come
            for name, (_, count) in payload_wheels.SETS.items():
                if all(f"{name}-{i}" in carried for i in range(1, count + 1)):
                    installed.add(name)
        for step in call["steps"]:
            assert checklist_plan.sets_missing(step, call["shape"], installed) is None, (step, installed)
            assert not checklist_plan.needs_llm(step) or not call["shape"] or "llm_shape" in carried, step
        assert row["checklist_s"] <= row["budget_s"] and row["timeout_s"] <= 600, row
        assert len(row["command"]) <= 2000
        session_s[session] = session_s.get(session, 0) + row["device_s"]
    assert all(seconds <= checklist_plan.SESSION_S for seconds in session_s.values()), session_s
    readme = (REPO / "bench" / "gpu_check" / "README.md").read_text()
    assert checklist_plan.plan_markdown(rows) in readme, "README's call plan differs from checklist.py --plan"


def test_require_site_runs_only_the_steps_whose_set_is_installed(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / ".gpu_check_installed.json").write_text(json.dumps({"sets": ["step1"]}))
    env = launch_env()
    env.pop("OUT", None)
    done = subprocess.run(
        [sys.executable, CHECKLIST, "--steps", "2a", "--require_site", "--site", site, "--results", tmp_path / "r"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "step 2a: not run: it needs the payload's set llm, and this machine has step1" in done.stdout
    data = json.loads((tmp_path / "r" / "gpu_check.json").read_text())
    assert data["steps"] == {} and "2a" in data["calls"][-1]["not_run"]


def test_an_llm_step_runs_on_the_llm_shape_set_only_with_llm_shape(tmp_path):
    """A session too short to carry the LLM's weights installs `llm_shape` (every wheel but the demo models):
    the LLM steps run on it only with --llm_shape (weights drawn at random); the steps without the LLM on any set
    with the base wheels; step 13 only where the qlora set (bitsandbytes) is installed too."""
    assert checklist_plan.step_sets("2a", llm_shape=False) == ("llm",)
    assert "llm_shape" in checklist_plan.step_sets("9", llm_shape=True)
    assert "llm_shape" in checklist_plan.step_sets("6", llm_shape=False)  # the image demo needs no LLM
    assert checklist_plan.step_sets("1", llm_shape=True) == ("step1",)  # the MiniLM travels in step 1's set alone
    # QLoRA needs bitsandbytes as well: the qlora set, installed beside an LLM's set (it fits no call with their parts)
    assert checklist_plan.sets_missing("13", llm_shape=False, installed={"llm"}) == "qlora"
    assert checklist_plan.sets_missing("13", llm_shape=True, installed={"qlora"}) == "llm or llm_shape"
    assert checklist_plan.sets_missing("13", llm_shape=True, installed={"llm_shape", "qlora"}) is None
    assert checklist_plan.sets_missing("2a", llm_shape=False, installed={"llm"}) is None
    assert checklist_plan.sets_missing("14", llm_shape=False, installed={"llm"}) == "qlora"  # train.py's QLoRA run too


def test_the_llm_shape_becomes_a_model_with_random_weights_that_loads(tmp_path):
    """--llm_shape: the config and tokenizer the payload carries become a model directory with weights drawn
    at random (seeded), which from_pretrained loads with every weight found, and the tokenizer with it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = make_tiny_causal_lm(tmp_path / "source", chat_template=True)
    shape = tmp_path / "shape"
    shape.mkdir()
    for path in source.iterdir():  # what payload.py's write_llm_shape keeps: no weights
        if not path.name.endswith(".safetensors"):
            shutil.copy2(path, shape / path.name)
    first = Path(checklist_helpers.random_weights_llm(shape, tmp_path / "random"))
    again = checklist_helpers.random_weights_llm(shape, tmp_path / "random_again")
    model, info = AutoModelForCausalLM.from_pretrained(first, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    original = AutoModelForCausalLM.from_pretrained(source)
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        assert getattr(model.config, key) == getattr(original.config, key), key
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in original.parameters())
    reloaded = AutoModelForCausalLM.from_pretrained(again)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name  # seeded: the same weights each time
    tokenizer = AutoTokenizer.from_pretrained(first)
    assert tokenizer.chat_template and tokenizer("hello")["input_ids"]


def test_ours_peak_gpu_memory_is_read_from_its_per_process_figures():
    """Steps 9 and 10's ours' peak GPU memory: our metrics.json has one figure per process, TRL's JSON one (the
    first GPU run's table showed ours' as missing); none on a CPU."""
    sys.path.insert(0, str(REPO / "bench"))
    from side_by_side import peak_gpu_mib

    assert peak_gpu_mib({"peak_gpu_memory_mb_per_rank": [812.0, 845.5]}) == 845.5
    assert peak_gpu_mib({"peak_gpu_memory_mb": 2973.0}) == 2973.0
    assert peak_gpu_mib({"peak_gpu_memory_mb_per_rank": [None, None]}) is None
    assert peak_gpu_mib({}) is None


@pytest.mark.fast
def test_the_operator_count_gives_each_steps_operators_also_when_the_process_ends_with_os_exit(tmp_path):
    """side_by_side.py --count_ops: op_count/sitecustomize.py counts in any process (our scripts end with os._exit,
    which skips atexit); each step's count is the same from step to step, and grows with the step's work."""
    sys.path.insert(0, str(REPO / "bench"))
    from side_by_side import ops_per_step

    program = (
        "import os, sys, torch\n"
        "model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(int(sys.argv[1]))])\n"
        "optimizer = torch.optim.AdamW(model.parameters())\n"
        "for _ in range(5):\n"
        "    model(torch.randn(2, 4)).sum().backward(); optimizer.step(); optimizer.zero_grad()\n"
        "os._exit(0)\n"
    )
    counts = {}
    for layers in (1, 3):
        folder = tmp_path / str(layers)
        env = {**launch_env(), "OPS_PER_STEP_DIR": str(folder), "PYTHONPATH": str(REPO / "bench" / "op_count")}
        subprocess.run([sys.executable, "-c", program, str(layers)], env=env, check=True, timeout=120)
        (ends,) = [json.loads(path.read_text())["step_ends"] for path in folder.glob("ops-*.json")]
        steps = [b - a for a, b in zip(ends, ends[1:])]
        assert len(ends) == 5 and len(set(steps)) == 1, ends
        counts[layers] = ops_per_step(folder)
        assert counts[layers] == steps[0]
    assert counts[3] > counts[1] > 0, counts


@pytest.mark.fast
def test_the_step_profile_times_steps_4_to_8_in_any_process_also_when_it_ends_with_os_exit(tmp_path):
    """side_by_side.py --profile: step_profile/sitecustomize.py profiles steps 4 to 8 of any process (our scripts end
    with os._exit, which skips atexit), and writes their seconds, the GPU's busy share (none on a CPU), the launches,
    the host's time inside and outside operators and inside `generate`, and the operators that took the most time,
    each with its longest and median call; a run too short to reach step 8 writes nothing."""
    sys.path.insert(0, str(REPO / "bench"))
    from side_by_side import slowest_profile, top_host_operator

    program = (
        "import os, sys, sitecustomize, torch, transformers\n"
        "assert sitecustomize._union_s([(0, 2), (1, 3), (5, 6)]) == 4e-6  # kernels that overlap count once\n"
        "model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])  # its addmm: a top operator\n"
        "optimizer = torch.optim.AdamW(model.parameters())\n"
        "config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,\n"
        "    num_attention_heads=2, num_key_value_heads=2)\n"
        "lm = transformers.LlamaForCausalLM(config).eval()\n"
        "for _ in range(int(sys.argv[1])):\n"
        "    lm.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, min_new_tokens=2, do_sample=False)\n"
        "    model(torch.randn(256, 512)).sum().backward(); optimizer.step(); optimizer.zero_grad()\n"
        "os._exit(0)\n"
    )
    for steps in (10, 7):
        folder = tmp_path / str(steps)
        env = {**launch_env(), "STEP_PROFILE_DIR": str(folder), "PYTHONPATH": str(REPO / "bench" / "step_profile")}
        subprocess.run([sys.executable, "-c", program, str(steps)], env=env, check=True, timeout=120)
    profile = slowest_profile(tmp_path / "10")
    assert profile["steps"] == 5 and profile["step_s"] > 0, profile
    assert (profile["gpu_busy_s"], profile["gpu_busy_share"], profile["launches"]) == (None, None, 0)
    assert (profile["syncs"], profile["sync_wait_s"]) == (0, 0)
    # The step's host time split: inside torch's operators, and outside them (Python); generate's region within it.
    assert 0 < profile["host_in_operators_s"] < profile["step_s"] and profile["host_outside_operators_s"] > 0, profile
    assert 0 < profile["generate_s"] < profile["step_s"], profile
    names = [row["name"] for row in profile["host_top"]]
    assert "aten::addmm" in names and profile["device_top"] == [], names
    addmm = next(row for row in profile["host_top"] if row["name"] == "aten::addmm")
    assert addmm["calls"] == 3  # 3 layers a step
    # Its 15 calls' own seconds: the longest and the median (a cost paid once per new shape shows as the longest).
    assert addmm["s"] * 5 >= addmm["longest_call_s"] >= addmm["median_call_s"] > 0, addmm
    assert "longest call" in top_host_operator(profile)
    assert next(row for row in profile["host_top"] if row["name"] == "transformers generate")["calls"] == 1
    assert slowest_profile(tmp_path / "7") is None


@pytest.mark.fast
def test_attention_shapes_logs_each_training_steps_attention_and_not_generations(tmp_path):
    """bench/attention_shapes: the shape of each attention call autograd records, by optimizer step (a call without
    gradients, as in generation, is not logged); lengths.py gives each step's shape."""
    sys.path.insert(0, str(REPO / "bench" / "attention_shapes"))
    from lengths import step_shapes

    program = (
        "import sitecustomize, torch, torch.nn.functional as F\n"
        "weight = torch.nn.Parameter(torch.ones(1))\n"
        "optimizer = torch.optim.SGD([weight], lr=0.1)\n"
        "for length in (5, 8, 5):\n"
        "    q = torch.randn(2, 3, length, 4) * weight\n"
        "    with torch.no_grad():\n"
        "        F.scaled_dot_product_attention(q, q, q)  # as generation: not logged\n"
        "    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()\n"
        "    optimizer.step()\n"
    )
    env = {
        **launch_env(),
        "ATTENTION_SHAPES_DIR": str(tmp_path),
        "PYTHONPATH": str(REPO / "bench" / "attention_shapes"),
    }
    subprocess.run([sys.executable, "-c", program], env=env, check=True, timeout=120)
    (path,) = tmp_path.glob("shapes-*.jsonl")
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert step_shapes(path) == [(2, 3, 5, 4), (2, 3, 8, 4), (2, 3, 5, 4)]


@pytest.mark.fast
def test_the_report_merges_the_calls_json_with_later_steps_winning_and_each_call_once(tmp_path):
    """`checklist.py --report`: a warm machine's JSON already holds its earlier calls, which the merge lists once
    (session 2's table listed its first call twice); a step a later call ran again takes that call's record."""
    session2 = json.loads((REPO / "bench/gpu_check/results/2026-11-26-h200-session2/gpu_check.json").read_text())
    first = {
        **session2,
        "calls": session2["calls"][:1],
        "steps": {"9": {"status": "skipped"}, "10": session2["steps"]["10"]},
    }
    (tmp_path / "1.json").write_text(json.dumps(first))
    (tmp_path / "2.json").write_text(json.dumps(session2))
    args = argparse.Namespace(
        report=[str(tmp_path / "1.json"), str(tmp_path / "2.json")], results=str(tmp_path / "out")
    )
    assert checklist_report.report(args) == 0
    merged = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [call["steps"] for call in merged["calls"]] == ["10,9", "9"]
    assert merged["steps"]["9"]["status"] == "ok" and merged["steps"]["10"] == session2["steps"]["10"]
    assert "ours_x_trl 1.315" in (tmp_path / "out" / "gpu_check.md").read_text()
