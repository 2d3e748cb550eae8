#!/usr/bin/env python
"""Benchmark: scripts/train_sft.py SFT with LoRA against TRL's SFTTrainer, side by side, on the same
model (SmolLM2-135M-Instruct, the demo's dequantized GGUF directory), the same chat records (the
demo's drug-review sentiment conversations, written as JSONL `messages`), LoRA r16 (alpha 16,
dropout 0.05, all linear layers), batch 4 per process, max length 256, 1 epoch, lr 1e-3, 2 processes,
no checkpoints and no evaluation.

    pip install -r bench/requirements-bench.txt      # TRL, for the benchmark only (`make bench` does it)
    python bench/bench_sft.py [--train_records 128] [--trl_defaults_cap_s 600] [--only ours trl]
    python bench/bench_sft.py --train_records 16 --trl_defaults_cap_s 30   # a smoke run

Contenders: ours; ours with --packing; TRL matched to ours (fp32, no gradient checkpointing); TRL
with its own defaults (bf16=True, gradient_checkpointing=True), stopped after --trl_defaults_cap_s
seconds of training, with the steps it finished. Reports samples/s (records trained per second of
the training loop), wall time (launch to exit), peak resident memory per process, padded / real
token positions of the training batches, and ratios against TRL matched.
"""

import argparse
import importlib.util
import json
import platform
from pathlib import Path

import psutil
from bench_train import HERE, REPO, accelerate_launch, bench_env, check_world_size, padding_ratio, run_one, torchrun

NAMES = {
    "ours": "scripts/train_sft.py (ours)",
    "ours_packed": "ours, --packing",
    "trl": "TRL SFTTrainer, matched (fp32, no GC)",
    "trl_defaults": "TRL SFTTrainer, its defaults (bf16, GC)",
}
LORA_ALPHA, LORA_DROPOUT = 16, 0.05  # with --lora_r and all linear layers: the demo's LoRA
EXIT_MARGIN_S = 900  # the capped TRL run is killed this long after its cap: loading, and the step that crosses the cap


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train_records", type=int, default=128, help="chat records trained on (the demo's first N)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch_size", type=int, default=4, help="per-process batch size")
    p.add_argument(
        "--max_length", type=int, default=256, help="tokens per sequence (ours: --block_size; TRL: max_length)"
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lora_r", type=int, default=16, help="LoRA rank (alpha 16, dropout 0.05, all linear layers)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--trl_defaults_cap_s",
        type=float,
        default=600,
        help="seconds of training after which TRL with its defaults is stopped",
    )
    p.add_argument("--only", nargs="*", default=None, choices=list(NAMES), help="run only these contenders")
    p.add_argument("--workdir", default=str(HERE / "runs_sft"), help="where runs write")
    return p.parse_args()


def write_chat_data(workdir: Path, train_records: int, eval_records: int = 16) -> dict[str, Path]:
    """The demo's chat records, built by scripts/train_sft.py's own `load_raw_datasets` (its
    offline demo), the first N of each split, as JSONL `messages` files both trainers read. A
    validation file keeps ours from holding out 5% of the training records; nothing evaluates it."""
    spec = importlib.util.spec_from_file_location("train_sft", REPO / "scripts" / "train_sft.py")
    train_sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_sft)
    demo = train_sft.load_raw_datasets(argparse.Namespace(train_file=None, dataset_name=None))
    files = {}
    for split, count in (("train", train_records), ("validation", eval_records)):
        records = demo[split].select(range(min(count, len(demo[split]))))
        files[split] = workdir / f"chat_{split}.jsonl"
        files[split].write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in records))
    return files


def demo_model_dir() -> str:
    """The plain safetensors directory of the demo LLM (dequantized once, then cached)."""
    from accelerate import PartialState

    from ddp_utils.data.demo import demo_llm_gguf
    from ddp_utils.language_models.gguf import dequantized_gguf

    PartialState()  # ddp_utils logs through Accelerate's logger, which needs a state (here: one process, no group)
    return dequantized_gguf(*demo_llm_gguf())


def contenders(args, workdir: Path, model: str, data: dict[str, Path]):
    """name -> (results file, command, time limit in seconds or None)."""

    def ours(name, port, *extra):
        return (
            workdir / name / "metrics.json",
            [
                *accelerate_launch(port),
                str(REPO / "scripts" / "train_sft.py"),
                "--model_name_or_path",
                model,
                "--train_file",
                data["train"],
                "--validation_file",
                data["validation"],
                "--lora_r",
                args.lora_r,
                "--lora_alpha",
                LORA_ALPHA,
                "--lora_dropout",
                LORA_DROPOUT,
                "--lora_target_modules",
                "all-linear",
                "--per_device_train_batch_size",
                args.batch_size,
                "--block_size",
                args.max_length,
                "--num_train_epochs",
                args.epochs,
                "--learning_rate",
                args.lr,
                "--seed",
                args.seed,
                "--checkpointing_steps",
                "no",
                "--eval_max_new_tokens",
                0,
                "--no-eval_perplexity",
                "--skip_zero_shot",
                "--output_dir",
                workdir / name,
                "--overwrite_output_dir",
                *extra,
            ],
            None,
        )

    def trl(name, port, *extra, limit=None):
        return (
            workdir / f"{name}.json",
            [
                *torchrun(port),
                str(HERE / "baselines" / "trl_sft_run.py"),
                "--out",
                workdir / f"{name}.json",
                "--epochs",
                args.epochs,
                "--batch_size",
                args.batch_size,
                "--lr",
                args.lr,
                "--max_length",
                args.max_length,
                "--seed",
                args.seed,
                "--lora_r",
                args.lora_r,
                "--lora_alpha",
                LORA_ALPHA,
                "--lora_dropout",
                LORA_DROPOUT,
                "--model",
                model,
                "--train_file",
                data["train"],
                "--output_dir",
                workdir / f"{name}_out",
                *extra,
            ],
            limit,
        )

    return {
        "ours": ours("ours", "29631"),
        "ours_packed": ours("ours_packed", "29632", "--packing"),
        "trl": trl("trl", "29633"),
        "trl_defaults": trl(
            "trl_defaults",
            "29634",
            "--trl_defaults",
            "--time_cap_s",
            args.trl_defaults_cap_s,
            limit=args.trl_defaults_cap_s + EXIT_MARGIN_S,
        ),
    }


def figures(key: str, data: dict, records: int, epochs: int) -> dict:
    """samples/s, padded/real and steps from one run's results (ours: metrics.json; TRL: its JSON)."""
    if key.startswith("ours"):
        trained = (records - data.get("train_records_dropped", 0)) * epochs  # records, whether packed into rows or not
        return {
            "samples_per_s": trained / data["train_runtime_s"],
            "padding": 1 + data["train_padding_waste"],
            "steps": f"{data['optimizer_steps']}",
            "capped": False,
        }
    steps = f"{data['optimizer_steps']} of {data['planned_steps']}" + (" (capped)" if data["capped"] else "")
    return {
        "samples_per_s": data["train_samples"] / data["train_time_s"],
        "padding": padding_ratio(data["padded_tokens"], data["real_tokens"]),
        "steps": steps,
        "capped": data["capped"],
    }


def main():
    args = parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = write_chat_data(workdir, args.train_records)
    records = sum(1 for _ in open(data["train"]))
    model = demo_model_dir()
    results = {}
    for key, (result_file, command, limit) in contenders(args, workdir, model, data).items():
        if args.only and key not in args.only:
            continue
        print(f"running {NAMES[key]} ...", flush=True)
        result = run_one(command, result_file, workdir / f"{key}.log", bench_env(), timeout_s=limit)
        check_world_size(NAMES[key], result["data"], result, workdir / f"{key}.log")
        result.update(figures(key, result["data"], records, args.epochs))
        results[key] = result
        print(
            f"  {result['samples_per_s']:.3f} samples/s, wall {result['wall_s']:.1f} s, "
            f"peak RSS {result['peak_rss_mib']:.0f} MiB, "
            f"padded/real {result['padding']:.3f}, steps {result['steps']}, {result['exit']}",
            flush=True,
        )

    base = results.get("trl")
    print(
        f"\n{records} chat records, {args.epochs} epoch(s), batch {args.batch_size}/process x 2 processes, "
        f"max length {args.max_length}, "
        f"LoRA r{args.lora_r}, lr {args.lr}; {psutil.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}, torch CPU, gloo\n"
    )
    print(
        "| run | samples/s | × TRL matched | wall time (s) | × TRL matched | peak RSS / process (MiB) "
        "| padded / real tokens | "
        "optimizer steps | exit |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for key, r in results.items():
        speed = f"{r['samples_per_s'] / base['samples_per_s']:.3f}" if base else "-"
        wall = (
            f"{r['wall_s'] / base['wall_s']:.3f}" if base and not r["capped"] else "-"
        )  # a capped run's wall time is the cap's
        print(
            f"| {NAMES[key]} | {r['samples_per_s']:.3f} | {speed} | {r['wall_s']:.1f} | {wall} "
            f"| {r['peak_rss_mib']:.0f} | "
            f"{r['padding']:.3f} | {r['steps']} | {r['exit']} |"
        )


if __name__ == "__main__":
    main()
