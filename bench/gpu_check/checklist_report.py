"""The results: gpu_check.json and the Markdown table written after every run (and copied to $OUT with the logs),
and `checklist.py --report`'s merge of the JSON files several calls brought back."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

from checklist_steps import STEPS
from checklist_util import f, now, read_json, write_atomic


def write_results(results: Path, data: dict, copy_to: Path | None) -> None:
    """gpu_check.json and gpu_check.md in `results`; with `copy_to` ($OUT on the GPU machine) also there,
    with every log (logs/, lanes/*/logs/, and the side-by-side steps' runs: their logs and ours' train_log.jsonl,
    whose records hold what the step's table does not, such as GRPO's generation share step by step) in
    gpu_check_logs.tar.gz."""
    write_atomic(results / "gpu_check.json", json.dumps(data, indent=2, default=str) + "\n")
    write_atomic(results / "gpu_check.md", markdown(data))
    if not copy_to:
        return
    try:
        copy_to.mkdir(parents=True, exist_ok=True)
        shutil.copy(results / "gpu_check.json", copy_to / "gpu_check.json")
        shutil.copy(results / "gpu_check.md", copy_to / "gpu_check.md")
        with tarfile.open(copy_to / "gpu_check_logs.tar.gz", "w:gz") as tar:
            logs = []
            for where in (results, *results.glob("lanes/*")):  # the dry run's lanes hold their steps' folders
                logs += [*where.glob("logs/*.log"), *where.glob("step*/*.log"), *where.glob("step*/*/train_log.jsonl")]
            for log in sorted(logs):
                tar.add(log, arcname=str(log.relative_to(results)))
    except OSError as exc:
        print(f"could not copy the results to {copy_to}: {exc}", flush=True)


def markdown(data: dict) -> str:
    env = data.get("environment", {})
    gpu = env.get("gpu") or {}
    lines = [
        "# GPU check" + (" (dry run: CPU, tiny sizes; the figures mean nothing)" if data.get("dry_run") else ""),
        "",
    ]
    lines += [
        f"- updated {data.get('updated')}; calls: "
        + "; ".join(f"{c['started']} steps {c['steps']}" for c in data.get("calls", [])),
        f"- GPU: {gpu['name']}; driver {gpu.get('driver')}; {gpu.get('memory')}"
        if gpu
        else "- GPU: none (no CUDA device)",
        f"- python {env.get('python')}; torch {env.get('torch')} (CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')})",
    ]
    if env.get("error"):
        lines.append(f"- environment not read: {env['error']}")
    differs = env.get("differs_from_requirements") or []
    if differs:
        lines += [
            "",
            "Versions that differ from requirements*.txt:",
            "",
            "| package | required | found here |",
            "|---|---|---|",
        ]
        lines += [f"| {d['name']} | {d['required']} | {d['found']} |" for d in differs]
    unmet = (env.get("payload") or {}).get("unmet_requirements") or []
    if unmet:
        lines += ["", "Requirements of the carried packages not met here: " + "; ".join(unmet)]
    lines += ["", "| step | what | status | wall (s) | headline |", "|---|---|---|---:|---|"]
    for step in STEPS:
        record = data.get("steps", {}).get(step)
        if record is None:
            lines.append(f"| {step} | {STEPS[step]} | not run | | |")
            continue
        status = record.get("status", "?")
        if status == "failed":
            status += f": {record.get('error', '')}" + (
                " (expected in the dry run)" if record.get("expected_in_dry_run") else ""
            )
        elif status == "skipped":
            status += f": {record.get('reason', '')}"
        lines.append(
            f"| {step} | {record['title']} | {cell(status)} | {f(record.get('wall_s'), 1)} | {cell(headline(record))} |"
        )
    for step in STEPS:
        record = data.get("steps", {}).get(step)
        if record is None:
            continue
        lines += ["", f"## Step {step}: {record['title']}", ""]
        table = record.get("table")
        if table and table["rows"]:
            lines += ["| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
            lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table["rows"]]
            lines.append("")
        lines += ["| run | status | wall (s) | command |", "|---|---|---:|---|"]
        for run in record.get("runs", {}).values():
            status = run.get("status", "?") + (
                f": {run.get('error') or run.get('reason')}" if run.get("status") != "ok" else ""
            )
            lines.append(
                f"| {run['name']} | {cell(status)} | {f(run.get('wall_s'), 1)} | `{cell(run.get('command', ''))}` |"
            )
        for note in record.get("notes", []):
            lines += ["", f"- {note}"]
    return "\n".join(lines) + "\n"


def headline(record: dict) -> str:
    figures = record.get("figures", {})
    parts = []
    for key, value in figures.items():
        if isinstance(value, float) and ("_x_" in key or key.startswith("speed_up") or key == "compile_s"):
            parts.append(f"{key} {value:.3f}")
        elif key == "graph_breaks":
            parts.append(f"{key} {value}")
    return ", ".join(parts)


def cell(value) -> str:
    return str(value if value is not None else "").replace("|", "\\|").replace("\n", " ")


def report(args) -> int:
    """Merge the JSON files several calls brought back (later steps win) and write the Markdown."""
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    merged: dict = {}
    for name in args.report:
        data = read_json(Path(name))
        steps = {**merged.get("steps", {}), **data.get("steps", {})}
        calls = merged.get("calls", []) + data.get("calls", [])  # a warm machine's JSON holds its earlier calls too
        calls = list({(c.get("started"), str(c.get("argv"))): c for c in calls}.values())
        merged = {**merged, **data, "steps": steps, "calls": calls}
    merged["updated"] = now()
    write_atomic(results / "gpu_check.json", json.dumps(merged, indent=2, default=str) + "\n")
    write_atomic(results / "gpu_check.md", markdown(merged))
    print(results / "gpu_check.md")
    return 0
