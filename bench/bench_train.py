#!/usr/bin/env python
"""Benchmark: scripts/train.py against a hand-written DDP loop and transformers.Trainer (its defaults,
and with group_by_length), side by side, on the same model (packaged all-MiniLM-L6-v2), data (600 drug
reviews), batch size, sequence length, learning rate and epochs, each with 2 processes on this machine.

    python bench/bench_train.py [--epochs 3] [--seeds 42 43 44] [--only ours trainer trainer_grouped]
    python bench/bench_train.py --epochs 1 --ours_checkpoints   # one epoch end to end, ours with its default checkpoint
    python bench/bench_train.py --epochs 1 --max_train_samples 64 --max_eval_samples 32   # a smoke run

Reports train samples/s (training loop only, evaluation excluded, all processes together),
end-to-end wall time (launch to exit), peak resident memory per process, padded / real token
positions of the training batches, eval accuracy (mean and spread over the seeds), and whether the
launch exited by itself; ratios are against the hand-written loop and against the Trainer.
With several seeds, every seed runs all contenders in turn (interleaved, so a slow spell of the
machine hits all of them), and the figures are means over the seeds.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
HANG_GRACE_S = 60  # a launch still alive this long after writing its results is hung at exit
NAMES = {
    "ours": "scripts/train.py (ours)",
    "ours_ungrouped": "scripts/train.py --no-group_by_length",
    "ddp": "hand-written DDP loop",
    "trainer": "transformers.Trainer",
    "trainer_grouped": "transformers.Trainer, group_by_length",
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3, help="training epochs for every contender")
    p.add_argument("--batch_size", type=int, default=8, help="per-process batch size")
    p.add_argument("--max_length", type=int, default=128, help="truncation length")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    p.add_argument("--seeds", type=int, nargs="+", default=[42], help="run every contender once per seed")
    p.add_argument("--max_train_samples", type=int, default=None, help="train on the first N reviews only (smoke runs)")
    p.add_argument("--max_eval_samples", type=int, default=None, help="evaluate on the first N test reviews only")
    p.add_argument(
        "--ours_checkpoints",
        action="store_true",
        help="ours saves its default checkpoint every epoch, as a user's run does (issue 14's wall-time target); "
        "otherwise --checkpointing_steps no, like the baselines",
    )
    p.add_argument("--only", nargs="*", default=None, choices=list(NAMES), help="run only these contenders")
    p.add_argument("--workdir", default=str(HERE / "runs"), help="where runs write")
    return p.parse_args()


def accelerate_launch(port) -> list:
    """Our scripts' launch: 2 processes through the repo's CPU config (torchrun underneath)."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "accelerate_configs" / "cpu_2proc.yaml"),
        "--main_process_port",
        port,
    ]


def torchrun(port) -> list:
    """The baselines' launch, as their tutorials do it."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]


def limits(args) -> list:
    return [
        *(["--max_train_samples", args.max_train_samples] if args.max_train_samples else []),
        *(["--max_eval_samples", args.max_eval_samples] if args.max_eval_samples else []),
    ]


def contenders(args, workdir: Path, seed: int):
    common = [
        "--epochs",
        args.epochs,
        "--batch_size",
        args.batch_size,
        "--lr",
        args.lr,
        "--max_length",
        args.max_length,
        "--seed",
        seed,
        *limits(args),
    ]

    def trainer(key, port, sampling):
        return (
            workdir / f"{key}.json",
            [
                *torchrun(port),
                str(HERE / "baselines" / "trainer_run.py"),
                "--out",
                workdir / f"{key}.json",
                *common,
                "--output_dir",
                workdir / f"{key}_out",
                "--sampling",
                sampling,
            ],
        )

    def ours(key, port, *extra):
        return (
            workdir / key / "metrics.json",
            [
                *accelerate_launch(port),
                str(REPO / "scripts" / "train.py"),
                "--num_train_epochs",
                args.epochs,
                "--per_device_train_batch_size",
                args.batch_size,
                "--learning_rate",
                args.lr,
                "--max_length",
                args.max_length,
                "--seed",
                seed,
                *limits(args),
                "--output_dir",
                workdir / key,
                "--overwrite_output_dir",
                # The baselines save no checkpoints (the Trainer's default saves every 500 steps: none in these
                # runs); their cost: bench_checkpoint.py
                *([] if args.ours_checkpoints else ["--checkpointing_steps", "no"]),
                *extra,
            ],
        )

    return {
        "ours": ours("ours", "29611"),
        "ours_ungrouped": ours(
            "ours_ungrouped", "29615", "--no-group_by_length"
        ),  # what grouping changes, in speed and accuracy
        "ddp": (
            workdir / "ddp.json",
            [*torchrun("29612"), str(HERE / "baselines" / "ddp_loop.py"), "--out", workdir / "ddp.json", *common],
        ),
        "trainer": trainer("trainer", "29613", "random"),
        "trainer_grouped": trainer("trainer_grouped", "29614", "group_by_length"),
    }


def run_one(command, result_file: Path, log_file: Path, env, timeout_s: float | None = None) -> dict:
    """Run one launch; sample every worker's RSS; stop it if it hangs after writing its results, or
    (with `timeout_s`) if it is still running after that many seconds."""
    result_file.unlink(missing_ok=True)
    start = time.perf_counter()
    log = open(log_file, "w")
    process = subprocess.Popen([str(c) for c in command], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    peak_rss: dict[int, int] = {}
    launcher = psutil.Process(process.pid)
    hung = timed_out = False
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
        hung = results_at is not None and time.time() - results_at > HANG_GRACE_S
        timed_out = timeout_s is not None and time.perf_counter() - start > timeout_s
        if hung or timed_out:
            for child in launcher.children(recursive=True):
                child.kill()
            process.kill()
            break
        time.sleep(0.25)
    process.wait()
    wall = time.perf_counter() - start
    log.close()
    if not result_file.exists():
        reason = f"killed after {timeout_s:.0f} s" if timed_out else f"exit {process.returncode}"
        raise SystemExit(f"{command[0]} ... failed ({reason}); see {log_file}")
    return {
        "data": json.loads(result_file.read_text()),
        "wall_s": wall - (HANG_GRACE_S if hung else 0.0),
        "peak_rss_mib": max(peak_rss.values()) / 2**20 if peak_rss else float("nan"),
        "workers_seen": len(peak_rss),
        "exit": f"hung at exit (killed after {HANG_GRACE_S}s)"
        if hung
        else ("clean" if process.returncode == 0 else f"exit {process.returncode}"),
    }


def bench_env() -> dict:
    """One thread per process, offline, the repo and the baselines importable, and what PYTHONPATH already holds
    (on the GPU machine, the GPU checklist's installed wheels)."""
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(REPO), str(HERE / "baselines"), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )


def check_world_size(name: str, data: dict, result: dict, log_file: Path) -> None:
    """Refuse a run that trained on other than 2 processes (one `accelerate launch --cpu` starts)."""
    if data.get("world_size") != 2:
        raise SystemExit(f"{name} trained on {data.get('world_size')} process(es), not 2; see {log_file}")
    if result["workers_seen"] != 2:
        print(f"  note: {result['workers_seen']} worker processes seen by the RSS sampler", flush=True)


def padding_ratio(padded: float, real: float) -> float:
    """Token positions computed / real tokens (1.0: no padding)."""
    return (padded + real) / max(real, 1)


def ours_padding(args, seed: int, grouped: bool = True) -> dict:
    """Our training batches, rebuilt here as scripts/train.py builds them: the same tokenization,
    `ddp_utils.make_train_dataloader` (StepAlignedSampler, length-grouped as train.py's default
    --group_by_length, fillers dropped) for 2 processes and this seed, every epoch, counted with
    the baselines' PaddingCounter. train.py writes no padding figure of its own. Its unprepared
    dataloader holds every rank's batches (rank r takes batch j when j % 2 == r), each padded alone."""
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(HERE / "baselines"))
    from common import PaddingCounter, demo_data

    from ddp_utils import make_train_dataloader

    tokenized, _, collate = demo_data(args.max_length, args.max_train_samples, args.max_eval_samples)
    # What make_train_dataloader reads from the Accelerator of a 2-process run (ddp_utils.make_accelerator's data seed).
    accelerator = SimpleNamespace(
        num_processes=2,
        gradient_accumulation_steps=1,
        dataloader_config=SimpleNamespace(data_seed=seed),
        device=torch.device("cpu"),
    )
    counter = PaddingCounter(collate)
    options = SimpleNamespace(per_device_train_batch_size=args.batch_size, num_workers=0, group_by_length=grouped)
    loader = make_train_dataloader(tokenized["train"], options, accelerator, counter)
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        for _ in loader:
            pass
    return {"padded_tokens": counter.padded, "real_tokens": counter.real}


def spread(values: list[float], digits: int) -> str:
    """mean, and with several values ± the sample standard deviation and (min-max)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    return (
        f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"
    )


def summarise(runs: list[dict]) -> dict:
    """One contender's runs (one per seed) as the table's figures."""
    exits = sorted({r["exit"] for r in runs})
    return {
        "samples_per_s": statistics.fmean(r["samples_per_s"] for r in runs),
        "wall_s": statistics.fmean(r["wall_s"] for r in runs),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        "padding": statistics.fmean(padding_ratio(r["padded_tokens"], r["real_tokens"]) for r in runs),
        "accuracy": [r["accuracy"] for r in runs],
        "exit": ", ".join(exits),
    }


def ratio(value: float, base: dict | None, key: str) -> str:
    return f"{value / base[key]:.3f}" if base else "-"


def main():
    args = parse_args()
    env = bench_env()
    runs: dict[str, list[dict]] = {}
    for seed in args.seeds:
        workdir = Path(args.workdir) / f"seed{seed}"
        workdir.mkdir(parents=True, exist_ok=True)
        for key, (result_file, command) in contenders(args, workdir, seed).items():
            if args.only and key not in args.only:
                continue
            print(f"running {NAMES[key]}, seed {seed} ...", flush=True)
            result = run_one(command, result_file, workdir / f"{key}.log", env)
            data = result["data"]
            check_world_size(NAMES[key], data, result, workdir / f"{key}.log")
            result["samples_per_s"] = (
                data.get("train_samples_per_second") or data["train_samples"] / data["train_time_s"]
            )
            result["accuracy"] = data["eval_accuracy"]
            counts = ours_padding(args, seed, grouped=key == "ours") if key.startswith("ours") else data
            result["padded_tokens"], result["real_tokens"] = counts["padded_tokens"], counts["real_tokens"]
            runs.setdefault(key, []).append(result)
            print(
                f"  {result['samples_per_s']:.2f} samples/s, wall {result['wall_s']:.1f} s, "
                f"peak RSS {result['peak_rss_mib']:.0f} MiB, "
                f"padded/real {padding_ratio(result['padded_tokens'], result['real_tokens']):.3f}, "
                f"accuracy {result['accuracy']:.4f}, {result['exit']}",
                flush=True,
            )

    table = {key: summarise(value) for key, value in runs.items()}
    loop, trainer = table.get("ddp"), table.get("trainer")
    subset = (
        f"{args.max_train_samples} train / {args.max_eval_samples} eval reviews, "
        if args.max_train_samples or args.max_eval_samples
        else ""
    )
    print(
        f"\n{args.epochs} epochs, {subset}batch {args.batch_size}/process x 2 processes, "
        f"max_length {args.max_length}, lr {args.lr}, "
        f"seeds {' '.join(map(str, args.seeds))}{', ours with its checkpoints' if args.ours_checkpoints else ''}; "
        f"{psutil.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
        f"torch CPU, gloo\n"
    )
    print(
        "| contender | train samples/s | × DDP loop | × Trainer | wall time (s) | × DDP loop | × Trainer | "
        "peak RSS / process (MiB) | padded / real tokens | eval accuracy | exit |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for key, r in table.items():
        print(
            f"| {NAMES[key]} | {r['samples_per_s']:.2f} | {ratio(r['samples_per_s'], loop, 'samples_per_s')} | "
            f"{ratio(r['samples_per_s'], trainer, 'samples_per_s')} | {r['wall_s']:.1f} | "
            f"{ratio(r['wall_s'], loop, 'wall_s')} | "
            f"{ratio(r['wall_s'], trainer, 'wall_s')} | {r['peak_rss_mib']:.0f} | {r['padding']:.3f} | "
            f"{spread(r['accuracy'], 4)} | {r['exit']} |"
        )
    if len(args.seeds) > 1:
        print("\nMeans over the seeds; accuracy: mean ± sample standard deviation (min–max). Per seed:")
        for key, value in runs.items():
            print(
                f"- {NAMES[key]}: "
                + ", ".join(
                    f"seed {seed} {r['samples_per_s']:.2f} samples/s, {r['wall_s']:.1f} s, accuracy {r['accuracy']:.4f}"
                    for seed, r in zip(args.seeds, value)
                )
            )


if __name__ == "__main__":
    main()
