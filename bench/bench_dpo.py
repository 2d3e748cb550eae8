#!/usr/bin/env python
"""Benchmark: scripts/train_dpo.py against TRL's DPOTrainer, side by side, on the same model
(SmolLM2-135M-Instruct, the demo's dequantized GGUF directory), the same pairs (the DPO demo's: a
drug review's sentiment question, the right word chosen, a wrong one rejected, as TRL's
conversational prompt/chosen/rejected JSONL), LoRA r16 (alpha 16, no dropout, all linear layers),
DPO's sigmoid loss with beta 0.1, batch 4 pairs per process, max length 256, 1 epoch, lr 5e-4,
2 processes, no checkpoints and no evaluation.

    pip install -r bench/requirements-bench.txt      # TRL, for the benchmark only (`make bench` does it)
    python bench/bench_dpo.py [--train_pairs 128] [--only ours trl ...]
    python bench/bench_dpo.py --train_pairs 16   # a smoke run

Contenders, each reference as its trainer offers it without a second model: the model with its
adapters off at every step (ours; TRL with a PEFT model), and the reference's log-probs computed once
before training (ours' --precompute_reference; TRL's precompute_ref_log_probs). A fifth, ours with
--torch_compile (adapters off), runs only when --only names it: it is for a GPU, where a step of this model is
bound by kernel launches, and on a CPU inductor compiles C++ for minutes. Reports pairs/s (pairs trained per second
of the training loop; the compiled run's with its compilation), wall time (launch to exit), peak resident
memory per process (on a GPU, `--gpu`: peak GPU memory too) and the ratios against TRL's same reference;
for ours also the steady pairs/s (the median of the later half of its logged windows, after a compilation).
"""

import argparse
import json
import platform
import sys
from pathlib import Path

import psutil
from baselines.common import demo_raw_datasets
from bench_sft import demo_model_dir
from bench_train import HERE, REPO, accelerate_launch, bench_env
from side_by_side import (
    add_side_by_side_args,
    ours_log_figures,
    peak_gpu_mib,
    print_side_by_side,
    run_contenders,
    train_log,
)

NAMES = {
    "ours": "scripts/train_dpo.py (ours), adapters off",
    "trl": "TRL DPOTrainer, adapters off",
    "ours_precomputed": "ours, --precompute_reference",
    "trl_precomputed": "TRL DPOTrainer, precompute_ref_log_probs",
    "ours_compiled": "ours, adapters off, --torch_compile",
}
BASELINE = {
    **{"ours": "trl", "trl": "trl", "ours_precomputed": "trl_precomputed", "trl_precomputed": "trl_precomputed"},
    "ours_compiled": "trl",
}
LORA_ALPHA, BETA = 16, 0.1


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train_pairs", type=int, default=128, help="preference pairs trained on (the demo's first N)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch_size", type=int, default=4, help="pairs per process per step")
    p.add_argument("--max_length", type=int, default=256, help="prompt + one answer (ours: --block_size)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--lora_r", type=int, default=16, help="LoRA rank (alpha 16, no dropout, all linear layers)")
    add_side_by_side_args(p, NAMES, HERE / "runs_dpo")
    return p.parse_args()


def write_pairs(workdir: Path, train_pairs: int, eval_pairs: int = 16) -> dict[str, Path]:
    """The demo's pairs, built by scripts/train_dpo.py's own `load_raw_datasets` (its offline demo),
    the first N of each split, as JSONL both trainers read."""
    demo = demo_raw_datasets("train_dpo")
    files = {}
    for split, count in (("train", train_pairs), ("validation", eval_pairs)):
        files[split] = workdir / f"pairs_{split}.jsonl"
        with open(files[split], "w") as handle:
            for record in demo[split].select(range(min(count, len(demo[split])))):
                answers = {side: [{"role": "assistant", "content": record[side]}] for side in ("chosen", "rejected")}
                handle.write(json.dumps({"prompt": record["prompt"], **answers}) + "\n")
    return files


def contenders(args, workdir: Path, model: str, data: dict[str, Path]):
    """name -> (results file, command)."""

    def ours(name, port, *extra):
        launch = [*accelerate_launch(port), "--num_processes", args.processes]
        launch[launch.index("--config_file") + 1] = REPO / "accelerate_configs" / args.config
        return (
            workdir / name / "metrics.json",
            [
                *launch,
                *(["--mixed_precision", "bf16"] if args.bf16 else []),
                REPO / "scripts" / "train_dpo.py",
                "--model_name_or_path", model, "--train_file", data["train"], "--validation_file", data["validation"],
                "--lora_r", args.lora_r, "--lora_alpha", LORA_ALPHA, "--lora_dropout", 0.0, "--beta", BETA,
                "--per_device_train_batch_size", args.batch_size, "--block_size", args.max_length,
                "--num_train_epochs", args.epochs, "--learning_rate", args.lr, "--seed", args.seed,
                "--checkpointing_steps", "no", "--skip_zero_shot", "--max_eval_samples", 8,
                "--output_dir", workdir / name, "--overwrite_output_dir", "--report_to", "none", *extra,
            ],
        )  # fmt: skip

    def trl(name, port, *extra):
        return (
            workdir / f"{name}.json",
            [
                *[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", args.processes],
                *["--master_port", port],
                HERE / "baselines" / "trl_dpo_run.py",
                "--out", workdir / f"{name}.json", "--epochs", args.epochs, "--batch_size", args.batch_size,
                "--lr", args.lr, "--max_length", args.max_length, "--seed", args.seed, "--beta", BETA,
                "--lora_r", args.lora_r, "--lora_alpha", LORA_ALPHA, "--model", model,
                "--train_file", data["train"], "--output_dir", workdir / f"{name}_out",
                *(["--bf16"] if args.bf16 else []), *extra,
            ],
        )  # fmt: skip

    return {
        "ours": ours("ours", "29641"),
        "trl": trl("trl", "29642"),
        "ours_precomputed": ours("ours_precomputed", "29643", "--precompute_reference"),
        "trl_precomputed": trl("trl_precomputed", "29644", "--precompute_ref_log_probs"),
        # last: where its compilation overruns a budget, the others have finished
        "ours_compiled": ours("ours_compiled", "29645", "--torch_compile"),
    }


def figures(key: str, data: dict, workdir: Path) -> dict:
    """pairs/s and peak GPU memory from one run's results (ours: metrics.json; TRL: its JSON); for ours also the
    steady pairs/s and, with --torch_compile, what it compiled."""
    if not key.startswith("ours"):
        per_s = data["train_pairs"] / data["train_time_s"]
        return {"per_s": per_s, "gpu_mib": peak_gpu_mib(data), "steps": data["optimizer_steps"]}
    return {
        "per_s": data["train_pairs_per_second"],
        "gpu_mib": peak_gpu_mib(data),
        "steps": data["optimizer_steps"],
        **ours_log_figures(train_log(workdir / key), data),
    }


def main():
    args = parse_args()
    if args.only is None:  # the compiled run only when named
        args.only = [key for key in NAMES if key != "ours_compiled"]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = write_pairs(workdir, args.train_pairs)
    pairs = sum(1 for _ in open(data["train"]))
    commands = contenders(args, workdir, args.model or demo_model_dir(), data)
    results = run_contenders(args, commands, NAMES, lambda key, data: figures(key, data, workdir), workdir, bench_env())
    print(
        f"\n{pairs} pairs, {args.epochs} epoch(s), batch {args.batch_size} pairs/process x {args.processes} "
        f"process(es), max length {args.max_length}, LoRA r{args.lora_r}, beta {BETA}, lr {args.lr}, "
        f"{'bf16' if args.bf16 else 'fp32'}; "
        f"{psutil.cpu_count()} CPUs, {platform.processor() or platform.machine()}\n"
    )
    print_side_by_side(results, NAMES, BASELINE, "pairs")


if __name__ == "__main__":
    main()
