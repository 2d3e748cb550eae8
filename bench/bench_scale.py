#!/usr/bin/env python
"""Benchmark: data at scale. scripts/train.py against transformers.Trainer with group_by_length, on
200,000 and 1,000,000 review rows (a CSV made from the demo's reviews, repeated with the words of
each review shuffled), 2 processes, a few optimizer steps, each launch with an empty `datasets`
cache; then ours again on the warm cache. With --sft, scripts/train_sft.py against TRL's
SFTTrainer with its dataset_num_proc instead, on the SFT demo's chat records made the same way
(the demo LLM, LoRA r16, blocks of 256), each preparing its data on the node's 2 cores.

For each launch: the seconds from the launch to the end of the first optimizer step (a global
optimizer-step hook, loaded in every process by bench/scale_hook/sitecustomize.py), the wall time
of the whole launch, and the peak resident memory of the largest process (`ru_maxrss` of the
launch's children, through /usr/bin/time).

    python bench/bench_scale.py [--rows 200000 1000000] [--steps 3]
    python bench/bench_scale.py --sft --rows 200000 [--steps 2]   # needs bench/requirements-bench.txt (TRL)

Not a test: the Trainer's launch on a million rows alone takes many minutes on 2 cores.
"""

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOOK = REPO / "bench" / "scale_hook"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[200_000, 1_000_000], help="training rows per size")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per launch")
    p.add_argument("--workdir", default=str(REPO / "bench" / "runs" / "scale"))
    p.add_argument("--only", nargs="*", default=None, help="contenders: ours, trainer_grouped, ours_warm")
    p.add_argument("--sft", action="store_true", help="train_sft.py against TRL's SFTTrainer, on chat records")
    return p.parse_args()


def write_chat_jsonl(path: Path, rows: int) -> Path:
    """`rows` chat records: the SFT demo's 600 (its own DATA section), each repeated with the words of
    its review shuffled (the same lengths and answers, new texts)."""
    import importlib.util

    if path.exists():
        return path
    spec = importlib.util.spec_from_file_location("train_sft", REPO / "scripts" / "train_sft.py")
    train_sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_sft)
    demo = train_sft.load_raw_datasets(argparse.Namespace(train_file=None, dataset_name=None))["train"]
    records, rng = list(demo["messages"]), random.Random(0)
    with open(path, "w") as handle:
        for i in range(rows):
            turns = [dict(turn) for turn in records[i % len(records)]]
            review, question = turns[1]["content"].rsplit("\n\n", 1)
            words = review.split()
            rng.shuffle(words)
            turns[1]["content"] = " ".join(words) + "\n\n" + question
            handle.write(json.dumps({"messages": turns}) + "\n")
    return path


def sft_contenders(args, workdir: Path, rows: int, launch_config) -> dict:
    """Ours and TRL's SFTTrainer on `rows` chat records, the same model (the demo LLM, dequantized),
    LoRA r16, blocks of 256, batch 4 per process, `args.steps` steps (TRL: stopped after its first)."""
    sys.path.insert(0, str(REPO / "bench"))
    from bench_sft import demo_model_dir

    model, train = demo_model_dir(), write_chat_jsonl(workdir / f"chat_{rows}.jsonl", rows)
    validation = write_chat_jsonl(workdir / "chat_validation.jsonl", 64)
    ours = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", launch_config, "scripts/train_sft.py"]
    ours += ["--model_name_or_path", model, "--train_file", train, "--validation_file", validation, "--block_size", 256]
    ours += ["--lora_r", 16, "--per_device_train_batch_size", 4, "--max_train_steps", args.steps, "--skip_zero_shot"]
    ours += ["--eval_max_new_tokens", 0, "--no-eval_perplexity", "--checkpointing_steps", "no", "--report_to", "none"]
    ours += ["--overwrite_output_dir", "--output_dir", workdir / f"sft_ours_{rows}"]
    trl = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", 2, "bench/baselines/trl_sft_run.py"]
    trl += ["--model", model, "--train_file", train, "--max_length", 256, "--batch_size", 4, "--epochs", 1]
    trl += ["--lr", 2e-4, "--lora_r", 16, "--prompt_completion", "--time_cap_s", 0, "--dataset_num_proc", 2]
    trl += ["--out", workdir / f"sft_trl_{rows}.json", "--output_dir", workdir / f"sft_trl_{rows}"]
    return {"sft_ours": (ours, "sft_ours", True), "sft_trl": (trl, "sft_trl", True)}


def write_csv(path: Path, rows: int) -> Path:
    """`rows` reviews: the demo's 600 training reviews, each repeated with its words shuffled (the
    same lengths and labels, new texts, so no two rows tokenize alike)."""
    from ddp_utils.data.demo import load_demo_reviews

    if path.exists():
        return path
    reviews = load_demo_reviews()["train"]
    texts, labels = list(reviews["text"]), list(reviews["label"])
    rng = random.Random(0)
    with open(path, "w") as handle:
        handle.write("text,label\n")
        for i in range(rows):
            words = texts[i % len(texts)].replace('"', "").split()
            rng.shuffle(words)
            handle.write(f'"{" ".join(words)}",{labels[i % len(labels)]}\n')
    return path


def timed_launch(command: list, env: dict, log: Path) -> dict:
    """Run `command` under /usr/bin/time; returns wall seconds, the seconds to the first optimizer
    step (from the hook's file) and the peak RSS of the largest process (MiB)."""
    first_step = log.with_suffix(".first_step")
    first_step.unlink(missing_ok=True)
    env = {**env, "FIRST_STEP_FILE": str(first_step)}
    started = time.time()
    with open(log, "w") as handle:
        process = subprocess.run(
            ["/usr/bin/time", "-f", "MAXRSS_KB %M", *map(str, command)],
            env=env,
            cwd=REPO,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    wall = time.time() - started
    text = log.read_text()
    rss_kb = int(text.rsplit("MAXRSS_KB ", 1)[1].split()[0]) if "MAXRSS_KB " in text else 0
    first = float(first_step.read_text()) - started if first_step.exists() else None
    return {"exit": process.returncode, "wall_s": wall, "first_step_s": first, "peak_rss_mib": rss_kb / 1024}


def main():
    args = parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import CPU_CONFIG, launch_env

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    validation = workdir / "validation.csv"
    if not validation.exists():
        from ddp_utils.data.demo import load_demo_reviews

        load_demo_reviews()["validation"].to_csv(str(validation), index=False)
    results = {}
    for rows in args.rows:
        if args.sft:
            run_contenders(args, workdir, rows, sft_contenders(args, workdir, rows, CPU_CONFIG), launch_env, results)
            continue
        train = write_csv(workdir / f"train_{rows}.csv", rows)
        ours = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            CPU_CONFIG,
            "scripts/train.py",
            "--train_file",
            train,
            "--validation_file",
            validation,
            "--max_train_steps",
            args.steps,
            "--max_eval_samples",
            64,
            "--checkpointing_steps",
            "no",
            "--report_to",
            "none",
            "--overwrite_output_dir",
        ]
        trainer = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            2,
            "bench/baselines/trainer_run.py",
            "--train_file",
            train,
            "--validation_file",
            validation,
            "--max_steps",
            args.steps,
            "--sampling",
            "group_by_length",
            "--epochs",
            1,
            "--batch_size",
            8,
            "--lr",
            1e-4,
            "--max_length",
            128,
            "--max_eval_samples",
            64,
        ]
        # Each contender has its own cache: the Trainer's cold launch must not empty the one ours_warm reads.
        contenders = {
            "ours": (ours + ["--output_dir", workdir / f"ours_{rows}"], "ours", True),
            "trainer_grouped": (
                trainer + ["--out", workdir / f"trainer_{rows}.json", "--output_dir", workdir / f"trainer_{rows}"],
                "trainer",
                True,
            ),
            "ours_warm": (ours + ["--output_dir", workdir / f"ours_warm_{rows}"], "ours", False),
        }
        run_contenders(args, workdir, rows, contenders, launch_env, results)
    # A run of some contenders or sizes replaces their entries and keeps the others (each says when it ran);
    # the ratio below is then against the Trainer's latest launch of that size.
    saved = workdir / "results.json"
    results = {**(json.loads(saved.read_text()) if saved.exists() else {}), **results}
    saved.write_text(json.dumps(results, indent=1))
    print("\n| rows | run | to the first step (s) | wall (s) | × the peer's wall | peak RSS, largest process (MiB) |")
    print("|---:|---|---:|---:|---:|---:|")
    for key, r in results.items():
        name, rows = key.split()
        peer = "sft_trl" if name.startswith("sft") else "trainer_grouped"
        reference = results.get(f"{peer} {rows}", {}).get("wall_s")
        ratio = f"{r['wall_s'] / reference:.2f}" if reference else ""
        first = f"{r['first_step_s']:.1f}" if r["first_step_s"] is not None else "(none)"
        print(f"| {int(rows):,} | {name} | {first} | {r['wall_s']:.1f} | {ratio} | {r['peak_rss_mib']:.0f} |")


def run_contenders(args, workdir: Path, rows: int, contenders: dict, launch_env, results: dict) -> None:
    """Launch each contender (command, cache owner, cold) on `rows` rows, timed; a cold one with an
    empty `datasets` cache of its own. Adds each result to `results`."""
    for name, (command, owner, cold) in contenders.items():
        if args.only and name not in args.only:
            continue
        cache = workdir / f"cache_{owner}_{rows}"
        if cold:
            shutil.rmtree(cache, ignore_errors=True)
        elif not cache.exists():
            raise SystemExit(f"{name} needs the cache of a cold launch of ours first: add ours to --only")
        env = launch_env({"HF_DATASETS_CACHE": str(cache), "PYTHONPATH": f"{HOOK}:{REPO}"})
        env.pop("OMP_NUM_THREADS")  # as a user's launch: torchrun and accelerate set one thread per process
        result = timed_launch(command, env, workdir / f"{name}_{rows}.log")
        results[f"{name} {rows}"] = {**result, "steps": args.steps, "at": time.strftime("%Y-%m-%d %H:%M")}
        print(f"{name:16s} {rows:>9,} rows: {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
