#!/usr/bin/env python
"""Benchmark: scripts/train_clm.py against a hand-written DDP loop, side by side, on the same model
(the demo decoder from models/demo-decoder, random init, seed 42), data (the 600 demo reviews'
text in blocks of 128 tokens), batch size, learning rate and epochs, with 2 processes on this
machine; then the padding waste of SFT data with dynamic padding and with packing.

    python bench/bench_clm.py [--epochs 1] [--batch_size 8] [--block_size 128]

Reports target tokens/s (training loop only, evaluation excluded, all processes together),
wall time (launch to exit), peak resident memory per process and eval perplexity; ratios are
against the hand-written loop. The SFT runs report padded tokens / real tokens of their batches.
"""

import argparse
import platform
import sys
from pathlib import Path

import psutil
from bench_train import HERE, REPO, bench_env, run_one


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=1, help="training epochs for every contender")
    p.add_argument("--batch_size", type=int, default=8, help="per-process batch size")
    p.add_argument("--block_size", type=int, default=128, help="tokens per block")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (the demo decoder trains from scratch)")
    p.add_argument("--only", nargs="*", default=None, help="run only these: ours ddp sft_padded sft_packed")
    p.add_argument("--workdir", default=str(HERE / "runs_clm"), help="where runs write")
    return p.parse_args()


def bench_inputs(workdir: Path) -> tuple[Path, dict]:
    """The decoder every contender starts from (models/demo-decoder's config, the demo tokenizer,
    random init after seed 42, as the hand-written loop builds it), saved for train_clm.py; and
    the SFT records: "Write a <rating> drug review:" -> the review."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ddp_utils.data.demo import bench_decoder_config_path, demo_model_path, load_demo_reviews

    decoder = workdir / "decoder"
    torch.manual_seed(42)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(bench_decoder_config_path())).save_pretrained(decoder)
    AutoTokenizer.from_pretrained(demo_model_path()).save_pretrained(decoder)
    files = {}
    for split, records in load_demo_reviews().items():
        files[split] = workdir / f"sft_{split}.jsonl"
        files[split].write_text(
            "".join(
                json.dumps({"prompt": f"Write a {r['label']} drug review:", "completion": r["text"]}) + "\n"
                for r in records
            )
        )
    return decoder, files


def contenders(args, workdir: Path):
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "accelerate_configs" / "cpu_2proc.yaml"),
        "--main_process_port",
    ]

    decoder, sft = bench_inputs(workdir)
    sft_data = ["--train_file", sft["train"], "--validation_file", sft["validation"], "--eval_max_new_tokens", 0]

    def ours(name, port, *extra):
        return (
            workdir / name / "metrics.json",
            [
                *launch,
                port,
                str(REPO / "scripts" / "train_clm.py"),
                "--model_name_or_path",
                decoder,
                "--num_train_epochs",
                args.epochs,
                "--per_device_train_batch_size",
                args.batch_size,
                "--learning_rate",
                args.lr,
                "--block_size",
                args.block_size,
                "--output_dir",
                workdir / name,
                "--overwrite_output_dir",
                "--checkpointing_steps",
                "no",
                "--sample_prompt",
                "",
                *extra,
            ],
        )

    return {
        "ours": ours("ours", "29621"),
        "ddp": (
            workdir / "ddp.json",
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_port",
                "29622",
                str(HERE / "baselines" / "ddp_clm_loop.py"),
                workdir / "ddp.json",
                args.epochs,
                args.batch_size,
                args.lr,
                args.block_size,
            ],
        ),
        # SFT on the demo ("Write a <rating> drug review:" -> the review): the same records padded per batch, or packed.
        "sft_padded": ours("sft_padded", "29623", *sft_data, "--max_eval_samples", 50),
        "sft_packed": ours("sft_packed", "29624", *sft_data, "--packing", "--max_eval_samples", 50),
    }


def main():
    args = parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    names = {
        "ours": "scripts/train_clm.py (ours)",
        "ddp": "hand-written DDP loop",
        "sft_padded": "ours, SFT, dynamic padding",
        "sft_packed": "ours, SFT, --packing",
    }
    results = {}
    for key, (result_file, command) in contenders(args, workdir).items():
        if args.only and key not in args.only:
            continue
        print(f"running {names[key]} ...", flush=True)
        result = run_one(command, result_file, workdir / f"{key}.log", bench_env())
        data = result["data"]
        result["tokens_per_s"] = (
            data.get("train_target_tokens_per_second") or data["train_tokens"] / data["train_time_s"]
        )
        result["perplexity"] = data["eval_perplexity"]
        result["padding_waste"] = data.get("train_padding_waste")
        results[key] = result
        print(
            f"  {result['tokens_per_s']:.0f} tokens/s, wall {result['wall_s']:.1f} s, "
            f"perplexity {result['perplexity']:.1f}",
            flush=True,
        )

    base = results.get("ddp")
    print(
        f"\n{args.epochs} epoch(s), batch {args.batch_size}/process x 2 processes, block {args.block_size}, "
        f"lr {args.lr}; "
        f"{psutil.cpu_count()} CPUs, {platform.processor() or platform.machine()}, torch CPU, gloo\n"
    )
    print(
        "| run | target tokens/s | × DDP loop | wall time (s) | peak RSS / process (MiB) | eval perplexity "
        "| padded / real tokens | exit |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for key, r in results.items():
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base and key in ("ours", "ddp") else "-"
        waste = f"{r['padding_waste']:.3f}" if r["padding_waste"] is not None else "0 (blocks)"
        print(
            f"| {names[key]} | {r['tokens_per_s']:.0f} | {ratio} | {r['wall_s']:.1f} | {r['peak_rss_mib']:.0f} | "
            f"{r['perplexity']:.1f} | {waste} | {r['exit']} |"
        )


if __name__ == "__main__":
    main()
