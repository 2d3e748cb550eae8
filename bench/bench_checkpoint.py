#!/usr/bin/env python
"""Benchmark: what checkpoints cost on the default model (all-MiniLM-L6-v2 + AdamW state), 2 processes.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml bench/bench_checkpoint.py [--repeats 3]

Times one checkpoint save (ours: staging directory, fsync, rename; against a plain
`accelerator.save_state` into a directory) and one load, measures its size, times a
training step of the default run (batch 8 per process, max_length 128), and reports the
cost of checkpointing every N steps as a fraction of training time.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from accelerate.utils import broadcast_object_list
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import ddp_utils
from ddp_utils.checkpoints.checkpoint_load import load_checkpoint
from ddp_utils.checkpoints.checkpoint_save import save_checkpoint
from ddp_utils.data.demo import demo_model_path, load_demo_reviews
from ddp_utils.lifecycle.start import make_accelerator


def timed(accelerator, work, repeats):
    seconds = []
    for _ in range(repeats):
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        work()
        accelerator.wait_for_everyone()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="median of this many saves, loads and step timings")
    args = parser.parse_args()
    accelerator = make_accelerator(seed=0)
    model = AutoModelForSequenceClassification.from_pretrained(demo_model_path(), num_labels=3)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    optimizer = ddp_utils.make_adamw(model, 1e-4, 0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    texts = list(load_demo_reviews()["train"]["text"][:8])
    batch = {
        k: v.to(accelerator.device)
        for k, v in tokenizer(texts, truncation=True, max_length=128, padding=True, return_tensors="pt").items()
    }
    labels = torch.zeros(len(texts), dtype=torch.long, device=accelerator.device)

    def train_step():
        loss = F.cross_entropy(model(**batch).logits, labels)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    train_step()  # fills the AdamW state, so the checkpoint has its real size
    step_s = timed(accelerator, train_step, args.repeats * 3)

    workdir = broadcast_object_list([tempfile.mkdtemp(prefix="bench-ckpt-") if accelerator.is_main_process else None])[
        0
    ]
    state = {"step": 1, "epoch": 0, "step_in_epoch": 1}
    ours_save_s = timed(accelerator, lambda: save_checkpoint(accelerator, workdir, state, total_limit=1), args.repeats)
    plain_dir = os.path.join(workdir, "plain")
    plain_save_s = timed(accelerator, lambda: accelerator.save_state(plain_dir), args.repeats)
    checkpoint = os.path.join(workdir, "checkpoint-1")
    load_s = timed(accelerator, lambda: load_checkpoint(accelerator, checkpoint, {}), args.repeats)

    if accelerator.is_main_process:
        size_mib = (
            sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(checkpoint) for f in files) / 2**20
        )
        print(
            f"\nall-MiniLM-L6-v2 + AdamW, {accelerator.num_processes} processes, {accelerator.device}, "
            f"median of {args.repeats}\n"
        )
        print("| what | value |\n|---|---:|")
        print(f"| checkpoint size | {size_mib:.0f} MiB |")
        print(f"| save, ours (staging + fsync + rename) | {ours_save_s:.2f} s |")
        print(
            f"| save, plain accelerator.save_state | {plain_save_s:.2f} s "
            f"({ours_save_s / plain_save_s:.2f}× ours/plain) |"
        )
        print(f"| load (load_checkpoint) | {load_s:.2f} s |")
        print(f"| one training step (batch 8 per process) | {step_s:.2f} s |")
        print("\n| checkpoint every | cost, fraction of training time |\n|---|---:|")
        for label, steps in (("epoch of the demo (38 steps, the default)", 38), ("100 steps", 100), ("500 steps", 500)):
            print(f"| {label} | {ours_save_s / (steps * step_s):.1%} |")
        shutil.rmtree(workdir)
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
