#!/usr/bin/env python
"""Benchmark: what a checkpoint's manifest costs at scale, on a checkpoint of several GB.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml bench/bench_manifest.py --size_gb 4 [--cold]

A model of plain linear layers sized so that it and its AdamW moments take --size_gb on disk
(12 bytes per parameter), in --dir. Times, each the median of --repeats:

- a save with the manifest (`save_checkpoint`: every rank hashes the files it wrote while they are
  flushed to disk), against the same save with the checksums left out (the files still flushed),
  and against a plain `accelerator.save_state` (no staging, no flush);
- a resume: `find_resume_checkpoint` (sizes, then each rank checksums its share) followed by
  `load_checkpoint`, against `load_checkpoint` alone; and the old check, every byte hashed on one
  process. With --cold (root only) the page cache is dropped before each, as after a restart.
"""

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

import ddp_utils
from ddp_utils.checkpoints import checkpoint_save, manifest
from ddp_utils.checkpoints.checkpoint_load import find_resume_checkpoint, load_checkpoint
from ddp_utils.checkpoints.checkpoint_save import save_checkpoint
from ddp_utils.lifecycle.start import make_accelerator


def drop_page_cache(accelerator, cold: bool) -> None:
    """All ranks call this: with `cold`, the main process flushes and drops the page cache."""
    if cold and accelerator.is_main_process:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
    accelerator.wait_for_everyone()


def timed(accelerator, work, before=None) -> float:
    """All ranks call this: the seconds of `work()` on all ranks, from a barrier to a barrier."""
    if before:
        before()
    accelerator.wait_for_everyone()
    start = time.perf_counter()
    work()
    accelerator.wait_for_everyone()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size_gb", type=float, default=4.0, help="checkpoint size: weights and AdamW moments")
    parser.add_argument("--repeats", type=int, default=6, help="median of this many of each (6: every order once)")
    parser.add_argument("--dir", default=None, help="the disk to test: a temporary directory there (default: /tmp)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each resume (root only)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file (the GPU checklist)")
    args = parser.parse_args()
    accelerator = make_accelerator(seed=0)
    width = 4096
    layers = max(1, round(args.size_gb * 1e9 / 12 / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    for parameter in model.parameters():  # AdamW's moments exist after a step, so the checkpoint has its real size
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad()

    base = args.dir or (tempfile.gettempdir() if accelerator.is_main_process else None)
    workdir = ddp_utils.core.ranks.from_main_process(accelerator, tempfile.mkdtemp, prefix="bench-manifest-", dir=base)
    state = {"step": 1, "epoch": 0, "step_in_epoch": 1}
    checkpoint = os.path.join(workdir, "checkpoint-1")

    plain_dir = os.path.join(workdir, "plain")

    def save_ours():
        save_checkpoint(accelerator, workdir, state)

    def clear():  # every save writes into an empty directory, as a run's new checkpoint does
        if accelerator.is_main_process:
            for path in (checkpoint, plain_dir):
                shutil.rmtree(path, ignore_errors=True)
            subprocess.run(["sync"], check=True)

    def without_checksums():  # the same save, the files still flushed, no checksum read
        real, manifest._checksum = manifest._checksum, lambda path: ""
        try:
            save_ours()
        finally:
            manifest._checksum = real

    # The phase the checksums are part of: this rank's files hashed while flushed (or only flushed), timed.
    phases, hash_and_flush = [], manifest.hash_and_flush

    def timed_hash_and_flush(directory, relatives):
        start = time.perf_counter()
        try:
            return hash_and_flush(directory, relatives)
        finally:
            phases.append(time.perf_counter() - start)

    checkpoint_save.hash_and_flush = timed_hash_and_flush

    def cold():
        drop_page_cache(accelerator, args.cold)

    def resume_checked():
        load_checkpoint(accelerator, find_resume_checkpoint(accelerator, workdir, "latest"), {})

    def resume_unchecked():
        load_checkpoint(accelerator, checkpoint, {})

    def check_on_one_process():
        if accelerator.is_main_process:
            manifest.checkpoint_problem(checkpoint)

    # Where a save's time goes: the writes of accelerator.save_state, timed in every save.
    writes, save_state = [], accelerator.save_state

    def timed_save_state(directory):
        start = time.perf_counter()
        try:
            return save_state(directory)
        finally:
            writes.append(time.perf_counter() - start)

    accelerator.save_state = timed_save_state

    # One of each per round, the rounds going through every order in turn, so the disk's state after one kind
    # of save (its write-back, the space freed by the last deletion) falls on every kind alike.
    kinds = {"ours": save_ours, "no_checksums": without_checksums, "plain": lambda: accelerator.save_state(plain_dir)}
    saves = {kind: [] for kind in (*kinds, "one_process_warm")}
    phase = {"ours": [], "no_checksums": []}
    write = {kind: [] for kind in kinds}
    orders = list(itertools.permutations(kinds))
    for round_ in range(args.repeats):
        for kind in orders[round_ % len(orders)]:
            saves[kind].append(timed(accelerator, kinds[kind], before=clear))
            write[kind].append(writes.pop())
            if kind in phase:
                phase[kind].append(phases.pop())
    save_ours()
    for _ in range(args.repeats):  # what the old manifest added: every byte hashed on one process, right after
        saves["one_process_warm"].append(timed(accelerator, check_on_one_process))
    clear()
    save_ours()  # a checkpoint with its checksums, to resume from
    resume_kinds = {
        "checked": resume_checked,
        "unchecked": resume_unchecked,
        "check_alone": lambda: find_resume_checkpoint(accelerator, workdir, "latest"),
        "one_process": check_on_one_process,
    }
    resumes = {kind: [] for kind in resume_kinds}
    for round_ in range(args.repeats):
        for kind in list(resume_kinds)[round_ % 4 :] + list(resume_kinds)[: round_ % 4]:
            resumes[kind].append(timed(accelerator, resume_kinds[kind], before=cold))
    spread = {k: (min(v), max(v)) for k, v in saves.items()}
    saves, resumes, phase, write = (
        {k: statistics.median(v) for k, v in d.items()} for d in (saves, resumes, phase, write)
    )

    if accelerator.is_main_process:
        size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(checkpoint) for f in files)
        cache = "page cache dropped before each" if args.cold else "warm page cache"
        print(
            f"\n{layers} linear layers of {width}x{width} + AdamW, a checkpoint of {size / 2**30:.2f} GiB, "
            f"{accelerator.num_processes} processes, {workdir}, median of {args.repeats}\n"
        )
        print("| what | seconds (median) | min to max | GiB/s |\n|---|---:|---:|---:|")
        rows = (
            ("save with the manifest (ours: each rank hashes its files while they are flushed)", "ours"),
            ("the same save without checksums (the files still flushed)", "no_checksums"),
            ("plain accelerator.save_state (no staging, no flush)", "plain"),
            ("every byte hashed on one process after the save (what the old manifest added)", "one_process_warm"),
        )
        for label, key in rows:
            low, high = spread[key]
            print(f"| {label} | {saves[key]:.2f} | {low:.2f} to {high:.2f} | {size / 2**30 / saves[key]:.2f} |")
        for label, key in (
            ("in the save with the manifest: accelerator.save_state's writes", "ours"),
            ("in the save without checksums: accelerator.save_state's writes", "no_checksums"),
            ("in the plain save: accelerator.save_state's writes", "plain"),
        ):
            print(f"| {label} | {write[key]:.2f} | | |")
        for label, key in (
            ("in the save with the manifest: rank 0 hashing while flushing its files", "ours"),
            ("in the save without checksums: rank 0 flushing its files", "no_checksums"),
        ):
            print(f"| {label} | {phase[key]:.2f} | | |")
        for label, key in (
            (f"resume: check (sizes, then checksums on every rank) + load, {cache}", "checked"),
            (f"resume: load alone, {cache}", "unchecked"),
            (f"resume: the check alone (sizes, then checksums on every rank), {cache}", "check_alone"),
            (f"every byte checksummed on one process (the old check), {cache}", "one_process"),
        ):
            print(f"| {label} | {resumes[key]:.2f} | | {size / 2**30 / resumes[key]:.2f} |")
        added = (phase["ours"] - phase["no_checksums"]) / saves["no_checksums"]
        print(
            f"\nthe checksums add {added:+.1%} to a save: the one phase that differs, hashing while flushing against "
            f"flushing alone. The whole saves' medians differ by {saves['ours'] / saves['no_checksums'] - 1:+.1%}, "
            f"made by accelerator.save_state's writes ({write['ours']:.2f} s and {write['no_checksums']:.2f} s), "
            "which no checksum touches: the disk's own variation between rounds. Hashing every byte on one process "
            f"after the save, as before, added {saves['one_process_warm'] / saves['no_checksums']:.1%}. The check "
            f"alone takes {resumes['check_alone'] / resumes['unchecked']:.0%} of a load's time; check and load "
            f"together take {resumes['checked'] / resumes['unchecked'] - 1:.1%} longer than the load alone"
        )
        if args.json:
            figures = {
                "checkpoint_gib": size / 2**30,
                "processes": accelerator.num_processes,
                "cold": args.cold,
                "seconds": {
                    **{f"save_{key}": value for key, value in saves.items()},
                    **{f"save_phase_{key}": value for key, value in phase.items()},
                    **{f"save_writes_{key}": value for key, value in write.items()},
                    **{f"resume_{key}": value for key, value in resumes.items()},
                },
                "manifest_adds_to_a_save": added,
                "check_adds_to_a_resume": resumes["check_alone"] / resumes["unchecked"],
            }
            with open(args.json, "w") as handle:
                json.dump(figures, handle, indent=2)
        shutil.rmtree(workdir)  # a temporary directory, in --dir when given
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
