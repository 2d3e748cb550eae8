#!/usr/bin/env python
"""Benchmark: what seeding each micro-batch's dropout masks costs (`ddp_utils.training.step_plan.SeededMicroBatches`).

Side by side, per micro-batch, one process and one thread as each process of a 2-process launch:

- iterating a step's micro-batches as a plain list (what the scripts did before);
- as `SeededMicroBatches` (the CPU's and the device's default generators seeded from (seed, step,
  place in the global step));
- seeding with `torch.manual_seed` instead (every backend's generators);
- for scale, forward + backward of the classification demo's model (all-MiniLM-L6-v2 in the
  demo's package: 6 layers, dropout 0.1) on one micro-batch of 16 rows of 128 tokens.

    python bench/bench_seeding.py [--repeats 20000]
"""

import argparse
import time

import torch

from ddp_utils.training.step_plan import SeededMicroBatches, micro_batch_seed, random_generators


def per_call_us(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20000, help="steps of 4 micro-batches timed per way")
    args = p.parse_args()
    torch.set_num_threads(1)
    micro_batches, generators = [object()] * 4, random_generators(torch.device("cpu"))

    def seeded_by_torch():
        for k, _ in enumerate(micro_batches):
            torch.manual_seed(micro_batch_seed(42, 1000, k))

    ways = {
        "plain list": lambda: list(micro_batches),
        "SeededMicroBatches": lambda: list(SeededMicroBatches(micro_batches, 42, 1000, 0, 2, generators)),
        "torch.manual_seed per micro-batch": seeded_by_torch,
    }
    results = {name: per_call_us(fn, args.repeats) / len(micro_batches) for name, fn in ways.items()}

    from transformers import AutoModelForSequenceClassification

    from ddp_utils.data.demo import demo_model_path

    model = AutoModelForSequenceClassification.from_pretrained(demo_model_path(), num_labels=3).train()
    batch = {"input_ids": torch.randint(1000, 20000, (16, 128)), "labels": torch.randint(0, 3, (16,))}

    def step():
        model(**batch).loss.backward()

    results["forward + backward of one micro-batch"] = per_call_us(step, 10)
    print("| per micro-batch | microseconds |\n|---|---|")
    for name, us in results.items():
        print(f"| {name} | {us:,.2f} |")
    added = results["SeededMicroBatches"] - results["plain list"]
    print(
        f"\nseeding adds {added:.1f} us per micro-batch: "
        f"{added / results['forward + backward of one micro-batch']:.2e} of its forward and backward"
    )


if __name__ == "__main__":
    main()
