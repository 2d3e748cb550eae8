"""The work every benchmarked trainer does alike: the demo model and data, tokenized the same way
as scripts/train.py (max_length truncation, dynamic padding, labels in sorted order)."""

import os

import torch
import torch.distributed as dist
from transformers import AutoTokenizer, DataCollatorWithPadding

from ddp_utils.demo import demo_model_path, load_demo_reviews

LABELS = ["negative", "neutral", "positive"]


def demo_data(max_length):
    """(tokenized DatasetDict with train/validation, tokenizer, collator)."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    raw = load_demo_reviews()

    def tokenize(batch):
        encoded = tokenizer(batch["text"], truncation=True, max_length=max_length)
        encoded["labels"] = [LABELS.index(label) for label in batch["label"]]
        return encoded

    tokenized = raw.map(tokenize, batched=True, remove_columns=["text", "label"])
    return tokenized, tokenizer, DataCollatorWithPadding(tokenizer)


def demo_text_blocks(block_size):
    """The demo reviews' text as scripts/train_clm.py's text mode makes it: EOS after each review,
    concatenated, cut into blocks of `block_size` tokens. Returns (blocks DatasetDict, tokenizer)."""
    from ddp_utils.lm import group_text_blocks

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    eos = tokenizer.sep_token_id  # this tokenizer has no EOS; train_clm.py uses its separator, as here
    raw = load_demo_reviews()
    encoded = raw.map(lambda b: {"input_ids": [x + [eos] for x in tokenizer(b["text"], add_special_tokens=False)["input_ids"]]},
                      batched=True, remove_columns=["text", "label"])
    blocks = encoded.map(group_text_blocks, batched=True, batch_size=10_000, fn_kwargs={"block_size": block_size})
    return blocks, tokenizer


def init_distributed():
    """The tutorials' set-up under torchrun: one process group (NCCL on GPUs, gloo on CPU), this
    process's device, seed 42. Returns (rank, device)."""
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(42)
    return dist.get_rank(), device


def tutorial_ddp_training(model, train_dataset, batch_size, collate_fn, lr, epochs, device):
    """What the DDP tutorials write around a model: DistributedDataParallel, a DistributedSampler,
    PyTorch's default AdamW (no decay on biases and norms) and linear warm-up over 10% of the steps.
    Returns (ddp_model, sampler, loader, optimizer, scheduler)."""
    import math

    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import get_linear_schedule_with_warmup

    from ddp_utils.optim import weight_decay_groups

    model = DistributedDataParallel(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    sampler = DistributedSampler(train_dataset, shuffle=True, seed=42)
    loader = DataLoader(train_dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.01), lr=lr)
    total_steps = epochs * len(loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(0.1 * total_steps), total_steps)
    return model, sampler, loader, optimizer, scheduler


def tutorial_train_epoch(model, sampler, loader, optimizer, scheduler, device, epoch) -> float:
    """One epoch of the tutorials' loop: the model's own (per-batch mean) loss, clipping at 1.0.
    Returns its seconds."""
    import time

    sampler.set_epoch(epoch)
    model.train()
    start = time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return time.perf_counter() - start
