#!/usr/bin/env python
"""Benchmark: scripts/train_grpo.py against TRL's GRPOTrainer, side by side, on the same model
(SmolLM2-135M-Instruct, the demo's dequantized GGUF directory), the same prompts (the GRPO demo's: a drug
review's sentiment question, its label the answer, as chat-turn JSONL), the same rewards (the script's
REWARDS: the right word 1.0, a short answer 0.5), G 8 samples per prompt of at most 8 tokens at
temperature 1, DAPO's token-level loss, epsilon 0.2, beta 0, LoRA r16 (alpha 16, no dropout, all linear
layers), 2 prompts per process per step, 1 epoch, lr 2e-4, 2 processes, no checkpoints and no evaluation.

    pip install -r bench/requirements-bench.txt      # TRL, for the benchmark only (`make bench` does it)
    python bench/bench_grpo.py [--train_prompts 32] [--only ours trl]   # about 8 minutes here
    python bench/bench_grpo.py --train_prompts 8   # a smoke run

A third contender, ours with --compile_generation (decoding in CUDA graphs), is for a GPU: on a CPU dynamo only
traces it (leave it out with --only ours trl). With --profile a fourth, ours with cuDNN's attention kernels off
(torch then takes its other ones; the switch is step_profile/sitecustomize.py's, nothing changed in the script):
the GPU check's session 4 found ours' training pass spending 0.49 s a step in cuDNN attention's host code.

Reports prompts/s (prompts trained per second of the training loop: generation, scoring and the update),
wall time (launch to exit), peak resident memory per process (on a GPU: peak GPU memory too), and the
ratios against TRL; for ours also the share of the step spent generating and the steady prompts/s (the median of
the later half of its logged windows, after a compilation). No vLLM on either side: all generate with the policy.
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
    "ours": "scripts/train_grpo.py (ours)",
    "trl": "TRL GRPOTrainer",
    "ours_compiled": "ours, --compile_generation",
    "ours_no_cudnn_attention": "ours, cuDNN attention off",
}
BASELINE = {"ours": "trl", "ours_compiled": "trl", "trl": "trl", "ours_no_cudnn_attention": "trl"}
LORA_ALPHA = 16


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train_prompts", type=int, default=32, help="prompts trained on (the demo's first N, shuffled)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch_size", type=int, default=2, help="prompts per process per step")
    p.add_argument("--num_generations", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--max_completion_length", type=int, default=8, help="new tokens per sample, at most")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lora_r", type=int, default=16, help="LoRA rank (alpha 16, no dropout, all linear layers)")
    add_side_by_side_args(p, NAMES, HERE / "runs_grpo")
    args = p.parse_args()
    if "ours_no_cudnn_attention" in (args.only or []) and not args.profile:
        p.error("ours_no_cudnn_attention runs with --profile only: step_profile/sitecustomize.py turns cuDNN off")
    return args


def write_prompts(workdir: Path, train_prompts: int, eval_prompts: int = 8) -> dict[str, Path]:
    """The demo's prompts, built by scripts/train_grpo.py's own `load_raw_datasets` (its offline demo),
    the first N of the training split shuffled (the demo's are in label order), as JSONL both trainers read."""
    demo = demo_raw_datasets("train_grpo")
    files = {}
    for split, count in (("train", train_prompts), ("validation", eval_prompts)):
        files[split] = workdir / f"prompts_{split}.jsonl"
        records = demo[split].shuffle(seed=0)
        with open(files[split], "w") as handle:
            for record in records.select(range(min(count, len(records)))):
                handle.write(json.dumps({"prompt": record["prompt"], "answer": record["answer"]}) + "\n")
    return files


def contenders(args, workdir: Path, model: str, data: dict[str, Path]):
    """name -> (results file, command)."""
    launch = [*accelerate_launch("29651"), "--num_processes", args.processes]
    launch[launch.index("--config_file") + 1] = REPO / "accelerate_configs" / args.config

    def ours(key: str, port: str, *extra):
        command = [
            *launch,
            *(["--mixed_precision", "bf16"] if args.bf16 else []),
            REPO / "scripts" / "train_grpo.py",
            "--model_name_or_path", model, "--train_file", data["train"], "--validation_file", data["validation"],
            "--lora_r", args.lora_r, "--lora_alpha", LORA_ALPHA, "--lora_dropout", 0.0,
            "--num_generations", args.num_generations, "--max_completion_length", args.max_completion_length,
            "--per_device_train_batch_size", args.batch_size, "--num_train_epochs", args.epochs,
            "--learning_rate", args.lr, "--seed", args.seed, "--checkpointing_steps", "no", "--skip_zero_shot",
            "--eval_max_new_tokens", 0, "--output_dir", workdir / key, "--overwrite_output_dir", "--report_to", "none",
            *extra,
        ]  # fmt: skip
        command[command.index("--main_process_port") + 1] = port
        return workdir / key / "metrics.json", command

    trl = [
        *[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", args.processes],
        *["--master_port", "29652"],
        HERE / "baselines" / "trl_grpo_run.py",
        "--out", workdir / "trl.json", "--epochs", args.epochs, "--batch_size", args.batch_size,
        "--lr", args.lr, "--max_length", args.max_completion_length, "--num_generations", args.num_generations,
        "--seed", args.seed, "--lora_r", args.lora_r, "--lora_alpha", LORA_ALPHA, "--model", model,
        "--train_file", data["train"], "--output_dir", workdir / "trl_out", *(["--bf16"] if args.bf16 else []),
    ]  # fmt: skip
    runs = {"ours": ours("ours", "29651"), "trl": (workdir / "trl.json", trl)}
    if args.profile:  # its switch is read by step_profile/sitecustomize.py, on the path only with --profile
        result, command = ours("ours_no_cudnn_attention", "29654")
        runs["ours_no_cudnn_attention"] = (result, ["env", "STEP_PROFILE_NO_CUDNN_ATTENTION=1", *command])
    # the compiled run last: where its compilation overruns a budget, the others have finished
    return {**runs, "ours_compiled": ours("ours_compiled", "29653", "--compile_generation")}


def figures(key: str, data: dict, workdir: Path) -> dict:
    """prompts/s over the whole training loop (with --compile_generation its compilation too) and peak GPU memory
    from one run's results (ours: metrics.json; TRL: its JSON); for ours also the share of the step spent generating
    (the mean of its log's records) and the steady prompts/s (the median of the later half of its logged windows:
    after the compilation)."""
    if key == "trl":
        per_s = data["train_prompts"] / data["train_time_s"]
        return {"per_s": per_s, "gpu_mib": peak_gpu_mib(data), "steps": data["optimizer_steps"]}
    log = train_log(workdir / key)
    shares = [record["train/generation_share"] for record in log if "train/generation_share" in record]
    return {
        "per_s": data["train_prompts_per_second"],
        "gpu_mib": peak_gpu_mib(data),
        "steps": data["optimizer_steps"],
        "generation_share": sum(shares) / len(shares) if shares else None,
        **ours_log_figures(log, data),  # steady prompts/s; with --compile_generation what it compiled
    }


def main():
    args = parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = write_prompts(workdir, args.train_prompts)
    prompts = sum(1 for _ in open(data["train"]))
    commands = contenders(args, workdir, args.model or demo_model_dir(), data)
    results = run_contenders(args, commands, NAMES, lambda key, data: figures(key, data, workdir), workdir, bench_env())
    print(
        f"\n{prompts} prompts, {args.epochs} epoch(s), batch {args.batch_size} prompts/process x {args.processes} "
        f"process(es), G {args.num_generations}, at most {args.max_completion_length} new tokens, "
        f"LoRA r{args.lora_r}, lr {args.lr}, {'bf16' if args.bf16 else 'fp32'}; "
        f"{psutil.cpu_count()} CPUs, {platform.processor() or platform.machine()}\n"
    )
    print_side_by_side(results, NAMES, BASELINE, "prompts")
    for key in ("ours", "ours_no_cudnn_attention", "ours_compiled"):
        run = results.get(key, {})
        if run.get("generation_share") is not None:
            steady = f"{run['steady_per_s']:.3f}" if run.get("steady_per_s") else "-"
            print(f"\n{NAMES[key]}: {run['generation_share']:.0%} of the step spent generating; steady {steady}/s")


if __name__ == "__main__":
    main()
