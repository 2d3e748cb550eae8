#!/usr/bin/env python
"""Benchmark: does memory stay flat over a long run? scripts/train.py on 2 CPU processes for
thousands of optimizer steps, with batches of changing shapes (texts of 3 to 60 words, no length
grouping, several epochs, evaluation, logging and checkpoints along the way), while this process
samples every rank's *current* resident memory (not the peak) from outside.

    python bench/bench_memory.py [--steps 3000]

It prints the memory of each rank at the start of training, in the middle and at the end, and
the slope fitted over the second half of training (the last twentieth left out: the final save
imports matplotlib and writes the model), in MiB per 1,000 steps; the samples go to
bench/runs/memory/samples.jsonl. Not a test: it takes minutes.
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from conftest import CPU_CONFIG, FILLER, WORDS, launch_env, make_tiny_model  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps")
    p.add_argument("--interval_s", type=float, default=1.0, help="seconds between memory samples")
    p.add_argument("--workdir", default=str(REPO / "bench" / "runs" / "memory"))
    return p.parse_args()


def write_texts(path: Path, rows: int, seed: int) -> Path:
    """Labelled texts of 3 to 60 words: every batch has another shape."""
    rng = random.Random(seed)
    labels = list(WORDS)
    with open(path, "w") as handle:
        handle.write("text,label\n")
        for i in range(rows):
            label = labels[i % len(labels)]
            words = rng.choices(FILLER, k=rng.randint(2, 59)) + [rng.choice(WORDS[label])]
            handle.write(f"{' '.join(words)},{label}\n")
    return path


def main():
    args = parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    model = make_tiny_model(scratch / "model")
    train, validation = write_texts(scratch / "train.csv", 800, 1), write_texts(scratch / "validation.csv", 100, 2)
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CPU_CONFIG),
        str(REPO / "scripts" / "train.py"),
        "--model_name_or_path",
        model,
        "--train_file",
        train,
        "--validation_file",
        validation,
        "--max_length",
        64,
        "--per_device_train_batch_size",
        4,
        "--no-group_by_length",
        "--max_train_steps",
        args.steps,
        "--learning_rate",
        1e-3,
        "--logging_steps",
        50,
        "--checkpointing_steps",
        500,
        "--output_dir",
        scratch / "run",
        "--report_to",
        "tensorboard",
    ]
    # The launch's output goes to a file: a pipe read only at the end fills up, and the ranks block writing to it.
    output_log = open(workdir / "launch.log", "w")
    launcher = subprocess.Popen(
        [str(c) for c in command], env=launch_env(), cwd=REPO, stdout=output_log, stderr=subprocess.STDOUT
    )
    samples, started = [], time.monotonic()
    with open(workdir / "samples.jsonl", "w") as out:
        while launcher.poll() is None:
            ranks = [
                p for p in psutil.Process(launcher.pid).children(recursive=True) if "train.py" in " ".join(p.cmdline())
            ]
            try:
                sample = {
                    "t": time.monotonic() - started,
                    **{f"rss_mib_{i}": p.memory_info().rss / 2**20 for i, p in enumerate(ranks)},
                }
            except psutil.NoSuchProcess:
                continue
            if len(sample) > 1:
                samples.append(sample)
                out.write(json.dumps(sample) + "\n")
            time.sleep(args.interval_s)
    output_log.close()
    if launcher.returncode:
        raise SystemExit((workdir / "launch.log").read_text()[-3000:])
    log = [json.loads(line) for line in open(scratch / "run" / "train_log.jsonl")]
    steps = [r for r in log if "train/loss" in r]
    ranks = sorted(k for k in samples[0] if k.startswith("rss_mib_"))
    t = np.array([s["t"] for s in samples])
    print(f"\n{args.steps} optimizer steps, {len(steps)} log records, {len(samples)} samples over {t[-1]:.0f} s\n")
    print(
        "| rank | after start-up (MiB) | middle (MiB) | before the final save (MiB) | at the end (MiB) | "
        "slope over the second half (MiB per 1,000 steps) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for key in ranks:
        rss = np.array([s.get(key, np.nan) for s in samples])
        settled = len(rss) // 10  # the first tenth: imports, data, the first steps
        half, last = len(rss) // 2, len(rss) - max(1, len(rss) // 20)  # the last twentieth: the final save
        slope_per_s = np.polyfit(t[half:last], rss[half:last], 1)[0]
        per_step_s = t[-1] / args.steps  # the run's mean pace, start-up included: the slope errs high
        print(
            f"| {key.removeprefix('rss_mib_')} | {rss[settled]:.0f} | {rss[half]:.0f} | {rss[last - 1]:.0f} | "
            f"{rss[-1]:.0f} | {slope_per_s * per_step_s * 1000:+.2f} |"
        )


if __name__ == "__main__":
    main()
