#!/usr/bin/env python
"""The GPU checklist (issue 24): every step timed, every failure caught and recorded, so one broken
step does not cost the others; every figure in one JSON file and a Markdown table.

    make gpu-check                                  # all steps, here with the project's .venv
    make gpu-check PYTHON=python3 STEPS=1,2a        # on the GPU machine: its python3, some steps per call
    make gpu-check DRY_RUN=1                        # on a CPU: every step with tiny sizes (what CI runs)
    python bench/gpu_check/checklist.py --steps 4,5,6 --budget_s 540
    python bench/gpu_check/checklist.py --plan      # the device calls (CALLS) with their estimated seconds

Steps (bench/gpu_check/README.md says what each measures and how):

  1   scripts/train.py demo in bf16 (single_gpu.yaml) against transformers.Trainer in bf16
  2a  scripts/train_sft.py on the default LLM, LoRA: plain, gradient checkpointing, packing; each against
      TRL's SFTTrainer with its best settings for the case
  2b  the same, full fine-tuning: plain, gradient checkpointing
  3   --torch_compile on the LLM: compile time, speed-up, recompiles and graph breaks
  4   accelerate_configs/fsdp.yaml on one GPU: speed, GPU memory, and the saved model reloads (its
      correctness, resume included, is tested on CPU processes: tests/test_fsdp.py)
  5   DeepSpeed ZeRO-2 and ZeRO-3 with one process (skipped, with why, where deepspeed cannot be imported)
  6   scripts/train_image.py --sync_batchnorm on one GPU
  7   fp16: the image demo and the LoRA SFT with the loss scaler's first scale at 2**40, so that the first
      steps overflow and are skipped: both must finish, with the skipped steps counted
  8   bench/bench_manifest.py: a checkpoint of several GB saved and resumed, with and without the manifest
  9   bench/bench_dpo.py: train_dpo.py against TRL's DPOTrainer, both references
  10  bench/bench_grpo.py: train_grpo.py against TRL's GRPOTrainer, no vLLM on either side
  11  bench/bench_dpo.py: train_dpo.py with --torch_compile against TRL's DPOTrainer
  12  bench/bench_grpo.py --profile: where a GRPO step's time goes, ours (also without cuDNN attention) and TRL's
  13  QLoRA: step 2a's plain LoRA case with --load_in_4bit against TRL's SFTTrainer on the same 4-bit base, and
      against our plain LoRA run (the memory the 4-bit base saves, the speed it costs)
  14  scripts/train.py with the LLM as a classifier: full fine-tuning, LoRA and QLoRA (--lora_r, --load_in_4bit) on
      step 1's work: samples/s, peak GPU memory, accuracy; the merged classifiers reload
  15  scripts/train.py --gradient_checkpointing: the LLM classifier's LoRA with and without it, batch 32: the GPU
      memory it saves, the speed it costs, and the same training

Results accumulate in --results (default outputs/gpu_check): gpu_check.json (a step run again replaces
its record), gpu_check.md and logs/. With --copy_to (default: $OUT, set on the GPU machine) they are
copied there after every run, so a call stopped at its time limit still brings back what it did.

The runner itself imports only the standard library: each run is a subprocess, and so is every piece
of work that needs torch (this file with --helper), so a broken import breaks one step, not the run.

This file is the command: its options, the steps asked for, the dry run's two lanes, and `Checklist`, the runner
(checklist_runner.py) with the steps' groups (checklist_*_steps.py); bench/gpu_check/README.md lists the modules.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from checklist_bench_steps import BenchSteps
from checklist_classifier_steps import ClassifierSteps
from checklist_config_steps import ConfigSteps
from checklist_helpers import HELPERS
from checklist_llm_steps import LLMSteps
from checklist_plan import plan, plan_markdown, sets_missing
from checklist_report import report, write_results
from checklist_steps import DEFAULT_SITE, REPO, SITE_MARKER, STEPS
from checklist_util import error_line, f, now, read_json, write_atomic


class Checklist(ClassifierSteps, LLMSteps, ConfigSteps, BenchSteps):
    """The runner (launch, run_step, save: checklist_runner.py) with every step, `step_<id>`, from its group."""


def parse_steps(text: str) -> list[str]:
    steps = []
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        if item == "all":
            steps += list(STEPS)
        elif item == "2":
            steps += ["2a", "2b"]
        elif item in STEPS:
            steps.append(item)
        else:
            raise SystemExit(f"--steps: unknown step {item!r}; the steps are {', '.join(STEPS)} (2 = 2a,2b), or all")
    return list(dict.fromkeys(steps))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default="all", help="comma-separated: 1,2a,2b,3,...,15 (2 = 2a,2b), or all")
    p.add_argument("--dry_run", action="store_true", help="a CPU, tiny sizes: checks the checklist, not the GPU")
    p.add_argument("--results", default=None, help="where the JSON, Markdown and logs go (default outputs/gpu_check)")
    p.add_argument("--budget_s", type=float, default=None, help="start no run that would end after this many seconds")
    p.add_argument("--copy_to", default=os.environ.get("OUT"), help="copy the results here after every run ($OUT)")
    p.add_argument(
        "--site", default=None, help="the wheels payload.py installed (default /tmp/gpu_check_site if there)"
    )
    p.add_argument(
        "--jobs", type=int, default=None, help="dry run only: steps side by side in 2 processes (its default)"
    )
    p.add_argument(
        "--require_site", action="store_true", help="stop at once unless payload.py install has run on this machine"
    )
    p.add_argument(
        "--warm_launcher",
        action="store_true",
        help="dry run only: fork each launch from one warmed process (the tests')",
    )
    p.add_argument("--fresh", action="store_true", help="start a new JSON instead of adding to the one in --results")
    p.add_argument("--report", nargs="*", default=None, help="merge these gpu_check.json files into --results, render")
    p.add_argument("--plan", action="store_true", help="print the device calls (CALLS) with their estimated times")
    p.add_argument("--helper", default=None, help=argparse.SUPPRESS)
    p.add_argument("--helper_out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--llm_shape",
        default=None,
        help="the LLM steps on the demo LLM's shape (config, tokenizer: payload.py's llm_shape) with random weights",
    )
    p.add_argument("--llm", nargs=3, default=None, help=argparse.SUPPRESS)
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.helper:
        write_atomic(Path(args.helper_out), json.dumps(HELPERS[args.helper](args), indent=2, default=str) + "\n")
        return 0
    if args.plan:
        print(plan_markdown(plan()), end="")
        return 0
    args.results = args.results or str(REPO / "outputs" / ("gpu_check_dry_run" if args.dry_run else "gpu_check"))
    if args.report is not None:
        return report(args)
    steps = parse_steps(args.steps)
    if args.jobs is None:
        args.jobs = 2 if args.dry_run else 1
    if args.jobs > 1 and not args.dry_run:
        raise SystemExit(
            "--jobs: only the dry run runs steps side by side; on a GPU they would share it and time nothing"
        )
    if args.warm_launcher and not args.dry_run:
        raise SystemExit("--warm_launcher: only the dry run forks its launches; a GPU run's are the users' own")
    if args.jobs > 1:
        return run_lanes(args, steps)
    marker = Path(args.site or DEFAULT_SITE) / SITE_MARKER
    if args.require_site and not marker.exists():
        raise SystemExit(
            f"the carried wheels are not installed here ({args.site or DEFAULT_SITE} has no {SITE_MARKER}): the "
            "machine was started afresh, so send the payload again and install it (bench/gpu_check/README.md)"
        )
    not_ready = {}
    if args.require_site:  # a step whose set is not installed here would only fail on an import
        installed = set(read_json(marker).get("sets", []))
        for step in steps:
            missing = sets_missing(step, bool(args.llm_shape), installed)
            if missing:
                not_ready[step] = (
                    f"not run: it needs the payload's set {missing}, and this machine has "
                    f"{', '.join(sorted(installed)) or 'none'} (started afresh? bench/gpu_check/README.md)"
                )
                print(f"step {step}: {not_ready[step]}", flush=True)
        steps = [step for step in steps if step not in not_ready]
    checklist = Checklist(args)
    print(
        f"GPU check{' (dry run)' if args.dry_run else ''}: steps {', '.join(steps) or 'none'}; "
        f"results in {checklist.results}" + (f"; wheels from {checklist.site}" if checklist.site else ""),
        flush=True,
    )
    call = checklist.data["calls"][-1]
    call["not_run"] = not_ready
    start = time.monotonic()
    checklist.environment(steps)
    call["environment_s"] = round(time.monotonic() - start, 2)
    try:
        for step in steps:
            checklist.run_step(step)
    finally:
        if checklist.warm is not None:
            checklist.warm.stop()
    call["wall_s"] = round(time.monotonic() - start, 2)
    checklist.save()
    records = [checklist.data["steps"][s] for s in steps]
    unexpected = [r["id"] for r in records if r["status"] == "failed" and not r.get("expected_in_dry_run")]
    unexpected += list(not_ready)
    print(
        f"done: {checklist.md_path}" + (f"; failed or not run: {', '.join(unexpected)}" if unexpected else ""),
        flush=True,
    )
    return 1 if unexpected else 0


# The dry run's two lanes: steps 3 and 13 read step 2a's run, so they share its lane; about equal halves on a CPU
# (measured 2026-12-07 in tests/test_gpu_check.py alone on an idle machine, seconds in the two lanes at once: 1 19,
# 2a 8, 3 9, 5 27, 8 7, 9 11, 12 22, 13 18, 15 19 against 2b 9, 4 13, 6 7, 7 19, 10 20, 11 17, 14 32: the lanes 139 s
# and 117 s, the dry run 146 s; with step 9 in the second lane the dry run took 122 s).
LANES = [("1", "2a", "3", "5", "8", "12", "13", "15"), ("2b", "4", "6", "7", "9", "10", "11", "14")]


def run_lanes(args, steps: list[str]) -> int:
    """The dry run on a 2-core machine: its steps in two processes of this file at once (each with its own
    results in lanes/N), then merged into one JSON and one table. CI's time, not the figures', is what counts."""
    results = Path(args.results).resolve()
    shutil.rmtree(results / "lanes", ignore_errors=True)
    started, processes = now(), []
    for index, lane in enumerate(LANES):
        mine = [step for step in steps if step in lane]
        if not mine:
            continue
        command = [sys.executable, str(Path(__file__).resolve()), "--dry_run", "--jobs", "1", "--fresh"]
        command += ["--steps", ",".join(mine), "--results", str(results / "lanes" / str(index))]
        if args.site:
            command += ["--site", args.site]
        if args.warm_launcher:
            command.append("--warm_launcher")
        env = {key: value for key, value in os.environ.items() if key != "OUT"}
        output = results / "lanes" / f"output-{index}.log"  # two lanes printing at once would interleave
        output.parent.mkdir(parents=True, exist_ok=True)
        print(f"lane {index}: steps {','.join(mine)} (its output: {output})", flush=True)
        with open(output, "w") as handle:
            processes.append(
                (index, subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT))
            )
    merged: dict = {"dry_run": True, "schema": 1, "steps": {}, "lanes": {}}
    merged["calls"] = [{"started": started, "steps": args.steps, "argv": sys.argv[1:], "lanes": len(processes)}]
    for index, process in processes:
        rc = process.wait()
        lane_json = results / "lanes" / str(index) / "gpu_check.json"
        merged["lanes"][str(index)] = {"steps": [s for s in steps if s in LANES[index]], "exit": rc}
        data = read_json(lane_json) if lane_json.exists() else {"steps": {}}
        for step in (s for s in steps if s in LANES[index] and s not in data["steps"]):
            output = (results / "lanes" / f"output-{index}.log").read_text(errors="replace")
            error = f"its lane ended (exit {rc}) before this step: {error_line(output, rc)}"
            merged["steps"][step] = {"id": step, "title": STEPS[step], "status": "failed", "runs": {}, "error": error}
        merged.setdefault("environment", data.get("environment"))
        for step, record in data["steps"].items():
            for run in record.get("runs", {}).values():
                if run.get("log"):
                    run["log"] = f"lanes/{index}/{run['log']}"
            merged["steps"][step] = record
    merged["steps"] = {step: merged["steps"][step] for step in STEPS if step in merged["steps"]}
    merged["updated"] = now()
    write_results(results, merged, Path(args.copy_to) if args.copy_to else None)
    for record in merged["steps"].values():
        why = record.get("error") or record.get("reason") or ""
        print(f"step {record['id']}: {record['status']} in {f(record.get('wall_s'), 1)} s {why}".rstrip(), flush=True)
    unexpected = [
        r["id"] for r in merged["steps"].values() if r["status"] == "failed" and not r.get("expected_in_dry_run")
    ]
    print(
        f"done: {results / 'gpu_check.md'}" + (f"; failed: {', '.join(unexpected)}" if unexpected else ""), flush=True
    )
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
