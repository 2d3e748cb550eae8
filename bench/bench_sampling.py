#!/usr/bin/env python
"""Benchmark: GRPO's generation, three ways, on one process: what each prompt computed once saves, and what
sampling from a generator per (seed, step, prompt, sample) costs. The model and prompts are the GRPO demo's
(SmolLM2-135M-Instruct, the reviews' question), 2 prompts a batch, G samples each, at temperature 1.

    python bench/bench_sampling.py [--batches 6] [--lengths 8 64] [--num_generations 8]

- `transformers generate`: `generate(do_sample=True, num_return_sequences=G)`, the prompt repeated G times
  and prefilled G times, sampled from one generator (what TRL does without vLLM);
- `ours, one draw per process`: ddp_utils' `sample_completions` (each prompt prefilled once, its cache copied
  to its samples) with the sampling swapped for one multinomial draw from torch's generator;
- `ours` (`scripts/train_grpo.py`): the same with `SeededSampling`: each sample from its own generator, the
  Gumbel noise drawn on the CPU.

Reports seconds per batch (the mean of --batches after one warm-up) and the ratios.
"""

import argparse
import platform
import time

import psutil
import torch
from accelerate import Accelerator
from baselines.common import demo_raw_datasets
from bench_sft import demo_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddp_utils.language_models import grpo
from ddp_utils.language_models.generation import stop_token_ids

TrainGrpoSampling = grpo.SeededSampling


class OneDrawPerProcess:
    """A logits processor that samples from torch's default generator (one per process), as `do_sample` does,
    and hands greedy decoding a score that picks the sample."""

    def __init__(self, seeds, temperature, top_p):
        self.temperature = temperature

    def __call__(self, input_ids, scores):
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        chosen = torch.multinomial(probs, 1)
        return torch.full_like(scores, -float("inf")).scatter(-1, chosen, 0.0)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=6, help="timed batches per way and length, after one warm-up")
    p.add_argument("--lengths", type=int, nargs="+", default=[8, 64], help="max new tokens")
    p.add_argument("--num_generations", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--batch_size", type=int, default=2, help="prompts per batch (the demo's per-device batch)")
    p.add_argument("--model", default=None, help="a local model directory (default: the demo LLM, dequantized)")
    return p.parse_args()


def main():
    args = parse_args()

    accelerator = Accelerator(cpu=True)
    model_dir = args.model or demo_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    raw = demo_raw_datasets("train_grpo")
    prompts = grpo.tokenize_prompts(raw, tokenizer, 512, True)["train"].shuffle(seed=0)
    collate = grpo.PromptCollator(tokenizer.pad_token_id)
    batches = [
        collate([prompts[i] for i in range(k * args.batch_size, (k + 1) * args.batch_size)])
        for k in range(args.batches + 1)
    ]
    stops = stop_token_ids(tokenizer, model.generation_config)

    def transformers_generate(batch, length, step):
        with torch.no_grad():
            model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                num_return_sequences=args.num_generations,
                max_new_tokens=length,
                eos_token_id=stops,
                pad_token_id=tokenizer.pad_token_id,
            )

    def ours(sampling):
        def run(batch, length, step):
            grpo.SeededSampling = sampling
            settings = argparse.Namespace(
                num_generations=args.num_generations, max_completion_length=length, seed=42, temperature=1.0, top_p=1.0
            )
            try:
                grpo.sample_completions(accelerator, model, batch, tokenizer, settings, step)
            finally:
                grpo.SeededSampling = TrainGrpoSampling

        return run

    ways = {
        "transformers generate (prompt G times)": transformers_generate,
        "ours, one draw per process": ours(OneDrawPerProcess),
        "ours (seeded per sample)": ours(TrainGrpoSampling),
    }
    print(
        f"{args.batch_size} prompts a batch, G {args.num_generations}, temperature 1, fp32, 1 process, "
        f"{torch.get_num_threads()} thread(s); {psutil.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    )
    print("\n| way | max new tokens | s / batch | prompts/s | × transformers |")
    print("|---|---:|---:|---:|---:|")
    for length in args.lengths:
        base = None
        for name, way in ways.items():
            torch.manual_seed(0)
            way(batches[0], length, 0)  # warm-up
            start = time.perf_counter()
            for step, batch in enumerate(batches[1:], 1):
                way(batch, length, step)
            seconds = (time.perf_counter() - start) / args.batches
            base = base or seconds
            print(
                f"| {name} | {length} | {seconds:.3f} | {args.batch_size / seconds:.2f} | {base / seconds:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
