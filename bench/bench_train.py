#!/usr/bin/env python
"""Benchmark: scripts/train.py against a hand-written DDP loop and transformers.Trainer, side by side,
on the same model (packaged all-MiniLM-L6-v2), data (600 drug reviews), batch size, sequence length,
learning rate and epochs, each with 2 processes on this machine.

    python bench/bench_train.py [--epochs 3] [--batch_size 8] [--max_length 128] [--lr 1e-4]

Reports train samples/s (training loop only, evaluation excluded, all processes together),
end-to-end wall time (launch to exit), peak resident memory per process, final eval accuracy,
and whether the launch exited by itself; ratios are against the hand-written loop.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
HANG_GRACE_S = 60  # a launch still alive this long after writing its results is hung at exit


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3, help="training epochs for every contender")
    p.add_argument("--batch_size", type=int, default=8, help="per-process batch size")
    p.add_argument("--max_length", type=int, default=128, help="truncation length")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    p.add_argument("--only", nargs="*", default=None, help="run only these contenders: ours ddp trainer")
    p.add_argument("--workdir", default=str(HERE / "runs"), help="where runs write")
    return p.parse_args()


def contenders(args, workdir: Path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    common = [args.epochs, args.batch_size, args.lr, args.max_length]
    return {
        "ours": (
            workdir / "ours" / "metrics.json",
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "cpu_2proc.yaml"),
             "--main_process_port", "29611", str(REPO / "scripts" / "train.py"),
             "--num_train_epochs", args.epochs, "--per_device_train_batch_size", args.batch_size, "--learning_rate", args.lr,
             "--max_length", args.max_length, "--output_dir", workdir / "ours", "--overwrite_output_dir",
             "--checkpointing_steps", "no"],  # the baselines save no checkpoints either; their cost: bench_checkpoint.py
        ),
        "ddp": (
            workdir / "ddp.json",
            [*torchrun, "29612", str(HERE / "baselines" / "ddp_loop.py"), workdir / "ddp.json", *common],
        ),
        "trainer": (
            workdir / "trainer.json",
            [*torchrun, "29613", str(HERE / "baselines" / "trainer_run.py"), workdir / "trainer.json", *common, workdir / "trainer_out"],
        ),
    }


def run_one(command, result_file: Path, log_file: Path, env) -> dict:
    """Run one launch; sample every worker's RSS; stop it if it hangs after writing its results."""
    result_file.unlink(missing_ok=True)
    start = time.perf_counter()
    log = open(log_file, "w")
    process = subprocess.Popen([str(c) for c in command], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    peak_rss: dict[int, int] = {}
    launcher = psutil.Process(process.pid)
    hung = False
    while process.poll() is None:
        try:
            for child in launcher.children(recursive=True):
                try:
                    if any(arg.endswith(".py") for arg in child.cmdline()):  # a worker, not a launcher
                        peak_rss[child.pid] = max(peak_rss.get(child.pid, 0), child.memory_info().rss)
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        results_at = result_file.stat().st_mtime if result_file.exists() else None
        if results_at is not None and time.time() - results_at > HANG_GRACE_S:
            hung = True
            for child in launcher.children(recursive=True):
                child.kill()
            process.kill()
            break
        time.sleep(0.25)
    process.wait()
    wall = time.perf_counter() - start
    log.close()
    if not result_file.exists():
        raise SystemExit(f"{command[0]} ... failed (exit {process.returncode}); see {log_file}")
    return {
        "data": json.loads(result_file.read_text()),
        "wall_s": wall - (HANG_GRACE_S if hung else 0.0),
        "peak_rss_mib": max(peak_rss.values()) / 2**20 if peak_rss else float("nan"),
        "workers_seen": len(peak_rss),
        "exit": f"hung at exit (killed after {HANG_GRACE_S}s)" if hung else ("clean" if process.returncode == 0 else f"exit {process.returncode}"),
    }


def bench_env() -> dict:
    """One thread per process, offline, the repo and the baselines importable."""
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join([str(REPO), str(HERE / "baselines")]))


def main():
    args = parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    env = bench_env()
    names = {"ours": "scripts/train.py (ours)", "ddp": "hand-written DDP loop", "trainer": "transformers.Trainer"}
    results = {}
    for key, (result_file, command) in contenders(args, workdir).items():
        if args.only and key not in args.only:
            continue
        print(f"running {names[key]} ...", flush=True)
        results[key] = run_one(command, result_file, workdir / f"{key}.log", env)
        data = results[key]["data"]
        results[key]["samples_per_s"] = data.get("train_samples_per_second") or data["train_samples"] / data["train_time_s"]
        results[key]["accuracy"] = data["eval_accuracy"]
        print(f"  {results[key]}", flush=True)

    base = results.get("ddp")
    print(f"\n{args.epochs} epochs, batch {args.batch_size}/process x 2 processes, max_length {args.max_length}, lr {args.lr}; "
          f"{psutil.cpu_count()} CPUs, {platform.processor() or platform.machine()}, torch CPU, gloo\n")
    print("| contender | train samples/s | × DDP loop | wall time (s) | × DDP loop | peak RSS / process (MiB) | eval accuracy | exit |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for key, r in results.items():
        speed = f"{r['samples_per_s'] / base['samples_per_s']:.3f}" if base else "-"
        wall = f"{r['wall_s'] / base['wall_s']:.3f}" if base else "-"
        print(f"| {names[key]} | {r['samples_per_s']:.2f} | {speed} | {r['wall_s']:.1f} | {wall} | {r['peak_rss_mib']:.0f} | {r['accuracy']:.4f} | {r['exit']} |")


if __name__ == "__main__":
    main()
