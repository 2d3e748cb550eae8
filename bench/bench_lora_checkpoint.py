#!/usr/bin/env python
"""Benchmark: a LoRA run's checkpoint, whole (every weight, as before) against the trained weights only (now),
on the demo LLM (SmolLM2-135M-Instruct, fp32 as the demo trains it) with LoRA r16 on every linear layer and its
AdamW state, 2 processes.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml bench/bench_lora_checkpoint.py [--repeats 3]
    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 --mixed_precision no \
        tests/launched/fsdp_on_cpu.py bench/bench_lora_checkpoint.py   # FSDP2 on CPU processes (the tests' harness)

Saves with `save_checkpoint` (staging, manifest, fsync, rename) and loads with `load_checkpoint`, first as
Accelerate does by itself, then with `checkpoint_trainable_weights_only`'s hooks, in one run: the size, the
median save and load times and their ratios.
"""

import argparse
import os
import shutil
import tempfile

import torch
from accelerate.utils import broadcast_object_list
from bench_checkpoint import timed  # bench/ is the script's directory
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import ddp_utils
from ddp_utils.checkpoints.checkpoint_load import load_checkpoint
from ddp_utils.checkpoints.checkpoint_save import save_checkpoint
from ddp_utils.checkpoints.frozen_weights import FROZEN_DIGEST, checkpoint_trainable_weights_only
from ddp_utils.data.demo import demo_llm_gguf
from ddp_utils.language_models.gguf import dequantized_gguf
from ddp_utils.lifecycle.start import make_accelerator


def size_mib(directory):
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(directory) for f in files) / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="median of this many saves and loads")
    args = parser.parse_args()
    accelerator = make_accelerator(seed=0)
    with accelerator.main_process_first():  # the main process dequantizes the demo GGUF once, the others reuse it
        path = dequantized_gguf(*demo_llm_gguf())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    optimizer = ddp_utils.make_adamw(model, 1e-4, 0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 1000, (2, 64), device=accelerator.device)
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()  # fills the AdamW state, so the checkpoint has its real size
    optimizer.zero_grad()

    workdir = broadcast_object_list([tempfile.mkdtemp(prefix="bench-lora-") if accelerator.is_main_process else None])
    rows = {}
    state = {"step": 1, "epoch": 0, "step_in_epoch": 1}
    for name in ("whole (before)", "trained weights only (now)"):
        identity = {}  # as the Checkpointer has it: the frozen weights' digest, saved and matched
        if name.startswith("trained"):
            identity[FROZEN_DIGEST] = checkpoint_trainable_weights_only(accelerator, accelerator.unwrap_model(model))
        directory = os.path.join(workdir[0], name.split()[0])
        checkpoint = os.path.join(directory, "checkpoint-1")

        def save(directory=directory, identity=identity):
            save_checkpoint(accelerator, directory, {**state, **identity}, total_limit=1)

        def load(checkpoint=checkpoint, identity=identity):
            load_checkpoint(accelerator, checkpoint, identity)

        save_s, load_s = timed(accelerator, save, args.repeats), timed(accelerator, load, args.repeats)
        rows[name] = (size_mib(checkpoint), save_s, load_s)

    if accelerator.is_main_process:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        print(
            f"\nSmolLM2-135M-Instruct (fp32) + LoRA r16 all-linear ({trainable:,} of {total:,} weights trained) + "
            f"AdamW, {accelerator.num_processes} processes, {accelerator.distributed_type.value}, "
            f"{accelerator.device}, median of {args.repeats}\n"
        )
        print("| checkpoint | size | save | load |\n|---|---:|---:|---:|")
        for name, (size, save_s, load_s) in rows.items():
            print(f"| {name} | {size:.0f} MiB | {save_s:.2f} s | {load_s:.2f} s |")
        (size_a, save_a, load_a), (size_b, save_b, load_b) = rows.values()
        print(f"| now / before | {size_b / size_a:.3f}× | {save_b / save_a:.2f}× | {load_b / load_a:.2f}× |")
        shutil.rmtree(workdir[0])
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
