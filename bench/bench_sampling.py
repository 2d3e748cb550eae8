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

    python bench/bench_sampling.py --count_ops     # the operators each way runs: what a GPU launches

With --count_ops it times nothing: it counts the operators (torch's aten ops, views left out) each way runs
for one batch, and those of one training pass (forward and backward of the completions' log-probs, LoRA r16)
on those samples: one row per prompt, as the script lays them out, against one per completion (TRL's). On a
GPU a small model's step is bound by those launches, not by its FLOPs; the weights are drawn at random, so
every sample runs to its maximum length, as in the first GPU run's step 10.

    python bench/bench_sampling.py --count_ops --bf16   # as the GPU runs were: the model prepared in bf16

With --bf16 the model is prepared by a bf16 Accelerator, whose autocast wraps its forward, as in the script and
in TRL's trainer on the GPU; peft's `generate` calls its base model and so samples without it.
"""

import argparse
import platform
import time

import psutil
import torch
from accelerate import Accelerator
from baselines.common import demo_raw_datasets
from bench_sft import demo_model_dir
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ddp_utils.data.dataloaders import pad_multiple
from ddp_utils.language_models import grpo, grpo_data
from ddp_utils.language_models.generation import stop_token_ids
from ddp_utils.language_models.group_scoring import completion_logps
from ddp_utils.language_models.pair_scoring import ONE_ROW, TWO_ROWS

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


class OperatorCount(TorchDispatchMode):
    """Counts the operators torch dispatches (each a kernel launch or more on a GPU; views are none), and
    apart those run while `in_sampling` is set (the sampling processor's: on a GPU partly CPU work)."""

    def __init__(self):
        super().__init__()
        self.ops, self.sampling_ops, self.in_sampling = 0, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops += 1
            self.sampling_ops += self.in_sampling
        return func(*args, **(kwargs or {}))


def counted(processor_class, counter: OperatorCount):
    """`processor_class` whose calls count their operators apart in `counter`."""

    class Counted(processor_class):
        def __call__(self, input_ids, scores):
            counter.in_sampling = True
            try:
                return super().__call__(input_ids, scores)
            finally:
                counter.in_sampling = False

    return Counted


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=6, help="timed batches per way and length, after one warm-up")
    p.add_argument("--lengths", type=int, nargs="+", default=[8, 64], help="max new tokens")
    p.add_argument("--num_generations", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--batch_size", type=int, default=2, help="prompts per batch (the demo's per-device batch)")
    p.add_argument("--model", default=None, help="a local model directory (default: the demo LLM, dequantized)")
    p.add_argument("--count_ops", action="store_true", help="count each way's operators instead of timing it")
    p.add_argument("--bf16", action="store_true", help="the model prepared by a bf16 Accelerator, as the GPU runs were")
    return p.parse_args()


def main():
    args = parse_args()

    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if args.bf16 else "no")
    model_dir = args.model or demo_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if args.count_ops:  # weights drawn at random: no sample stops early
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32).eval()
        from peft import LoraConfig, get_peft_model  # the training pass's LoRA, as on the GPU

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if args.bf16:  # prepare wraps the forward in bf16 autocast; peft's generate calls its base model, which skips it
        model = accelerator.prepare(model)
    raw = demo_raw_datasets("train_grpo")
    prompts = grpo_data.tokenize_prompts(raw, tokenizer, 512, True)["train"].shuffle(seed=0)
    collate = grpo_data.PromptCollator(tokenizer.pad_token_id)
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

    if args.count_ops:
        return count_operators(args, accelerator, model, tokenizer, batches[0], transformers_generate, ours)
    ways = {
        "transformers generate (prompt G times)": transformers_generate,
        "ours, one draw per process": ours(OneDrawPerProcess),
        "ours (seeded per sample)": ours(TrainGrpoSampling),
    }
    precision = "bf16 autocast" if args.bf16 else "fp32"
    print(
        f"{args.batch_size} prompts a batch, G {args.num_generations}, temperature 1, {precision}, 1 process, "
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


def count_operators(args, accelerator, model, tokenizer, batch, transformers_generate, ours) -> None:
    """One batch of each way, and one training pass on each layout's rows, with their operators counted."""
    counter = OperatorCount()
    ways = {
        "transformers generate (prompt G times)": transformers_generate,
        "ours, one draw per process": ours(counted(OneDrawPerProcess, counter)),
        "ours (seeded per sample)": ours(counted(TrainGrpoSampling, counter)),
    }
    precision = "the model prepared in bf16 (autocast)" if args.bf16 else "fp32"
    print(
        f"{args.batch_size} prompts a batch, G {args.num_generations}, LoRA r16, weights drawn at random, {precision}"
    )
    print("\n| work | max new tokens | operators | in the sampling processor | per new token |")
    print("|---|---:|---:|---:|---:|")
    for length in args.lengths:
        for name, way in ways.items():
            counter.ops = counter.sampling_ops = 0
            with counter:
                way(batch, length, 0)
            print(
                f"| {name} | {length} | {counter.ops:,} | {counter.sampling_ops:,} | {counter.ops / length:,.0f} |",
                flush=True,
            )
    # The training pass of a GRPO step on these samples: the script's layout (a row per prompt: the prompt, then its
    # G completions under a 4D mask) against a row per completion (TRL's), through the script's own log-probs.
    settings = argparse.Namespace(
        num_generations=args.num_generations, max_completion_length=max(args.lengths), seed=42, temperature=1.0,
        top_p=1.0, loss_type="token",
    )  # fmt: skip
    model.train()
    for label, layout in (("one row per prompt (ours)", ONE_ROW), ("one row per completion (TRL)", TWO_ROWS)):
        rollout = grpo.sample_completions(accelerator, model, batch, tokenizer, settings, 0)
        advantages, multiple = torch.randn(len(rollout["index"])), pad_multiple(accelerator)  # as the script pads
        grpo.finish_rollouts([rollout], advantages, settings, layout, tokenizer.pad_token_id, multiple)
        rows = len(rollout["rows"]["input_ids"]) if layout == ONE_ROW else len(rollout["index"])
        counter.ops = 0
        with counter:
            logps = completion_logps(model, rollout, layout)
            (logps * rollout["completion_mask"]).sum().backward()
        print(f"| training pass: {label}, {rows} rows | - | {counter.ops:,} | - | - |", flush=True)


if __name__ == "__main__":
    main()
