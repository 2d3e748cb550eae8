"""The work every benchmarked trainer does alike: the demo model and data, tokenized the same way
as scripts/train.py (max_length truncation, dynamic padding, labels in sorted order); the
baselines' shared command line; and the padding count every contender is measured with."""

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoTokenizer, DataCollatorWithPadding

from ddp_utils.data.demo import demo_model_path, load_demo_reviews

LABELS = ["negative", "neutral", "positive"]


def load_script(name: str):
    """scripts/<name>.py as a module (its DATA section, its REWARDS), without running its main."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def demo_raw_datasets(name: str):
    """The offline demo data exactly as scripts/<name>.py reads it: its own DATA section's `load_raw_datasets`."""
    return load_script(name).load_raw_datasets(argparse.Namespace(train_file=None, dataset_name=None))


def demo_reviews():
    """The demo's reviews exactly as scripts/train.py reads them (each review's last words)."""
    return demo_raw_datasets("train")


def demo_data(max_length, max_train_samples=None, max_eval_samples=None, files=None):
    """(tokenized DatasetDict with train/validation, tokenizer, collator): the demo's reviews, or
    with `files` ({"train": csv, "validation": csv}) those files, tokenized in one process, as the
    Transformers examples do by default. The limits keep the first N examples, as
    scripts/train.py's --max_train_samples/--max_eval_samples do."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    if files:
        from datasets import load_dataset

        raw = load_dataset("csv", data_files=files)
    else:
        raw = demo_reviews()
    for split, limit in (("train", max_train_samples), ("validation", max_eval_samples)):
        if limit:
            raw[split] = raw[split].select(range(min(limit, len(raw[split]))))

    def tokenize(batch):
        encoded = tokenizer(batch["text"], truncation=True, max_length=max_length)
        encoded["labels"] = [LABELS.index(label) for label in batch["label"]]
        return encoded

    tokenized = raw.map(tokenize, batched=True, remove_columns=["text", "label"])
    return tokenized, tokenizer, DataCollatorWithPadding(tokenizer)


def demo_text_blocks(block_size):
    """The demo reviews' text as scripts/train_clm.py makes it: EOS after each review,
    concatenated, cut into blocks of `block_size` tokens. Returns (blocks DatasetDict, tokenizer)."""
    import datasets

    from ddp_utils.language_models.token_blocks import text_blocks

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    eos = tokenizer.sep_token_id  # this tokenizer has no EOS; train_clm.py uses its separator, as here
    raw = load_demo_reviews()
    encoded = raw.map(
        lambda b: {"input_ids": [x + [eos] for x in tokenizer(b["text"], add_special_tokens=False)["input_ids"]]},
        batched=True,
        remove_columns=["text", "label"],
    )
    blocks = datasets.DatasetDict({split: text_blocks(rows, block_size) for split, rows in encoded.items()})
    return blocks, tokenizer


def init_distributed(seed=42):
    """The tutorials' set-up under torchrun: one process group (NCCL on GPUs, gloo on CPU), this
    process's device, the seed. Returns (rank, device)."""
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    return dist.get_rank(), device


def baseline_arg_parser(doc: str) -> argparse.ArgumentParser:
    """The options bench_train.py and bench_sft.py give every baseline; each adds its own."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--out", required=True, help="the results JSON, written by rank 0")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--batch_size", type=int, required=True, help="per process")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--max_length", type=int, required=True)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max_train_samples", type=int, default=None, help="the first N training examples (smoke runs)")
    p.add_argument("--max_eval_samples", type=int, default=None, help="the first N evaluation examples")
    return p


def trl_matched_settings(args) -> dict:
    """What every TRL baseline sets as ours does: epochs, lr with 10% warm-up, weight decay 0.01, clipping at
    1.0, the seed; no evaluation, no checkpoints, no tracking; on the CPU without a GPU; no loader workers."""
    return dict(
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        warmup_steps=0.1,  # a float: a ratio of the steps, as ours' --warmup_ratio 0.1
        weight_decay=0.01,
        max_grad_norm=1.0,
        seed=args.seed,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        logging_steps=10,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )


def reduce_over_ranks(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    """`values` reduced over all ranks (as they are without a process group). All ranks call this."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":  # NCCL reduces GPU tensors only
            tensor = tensor.cuda()
        dist.all_reduce(tensor, op=op)
    return tensor.tolist()


class PaddingCounter:
    """A collator wrapper that counts the padded and the real token positions of the batches it
    makes (attention_mask zeros and ones; a batch without an attention_mask, padding-free, counts
    as all real), and for language-model batches (2-D labels) the target tokens: the positions
    whose next token is learned (labels[:, 1:] != -100). Every contender's padding is measured
    this way, over all its training batches."""

    def __init__(self, collate_fn):
        self.collate_fn, self.padded, self.real, self.targets = collate_fn, 0, 0, 0

    def __call__(self, rows):
        batch = self.collate_fn(rows)
        mask = batch.get("attention_mask")
        real = int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        self.real += real
        self.padded += batch["input_ids"].numel() - real
        labels = batch.get("labels")
        if labels is not None and labels.dim() == 2:
            self.targets += int((labels[:, 1:] != -100).sum())
        return batch

    def totals(self) -> dict:
        """{"padded_tokens", "real_tokens", "target_tokens"} of all ranks together. All ranks call this
        when a process group exists (an all-reduce)."""
        padded, real, targets = reduce_over_ranks([self.padded, self.real, self.targets])
        return {"padded_tokens": int(padded), "real_tokens": int(real), "target_tokens": int(targets)}


def peak_gpu_memory() -> dict:
    """This process's peak GPU memory (tensors allocated, and reserved by the caching allocator), in
    MiB, as ours reports it in metrics.json; nothing without a GPU."""
    if not torch.cuda.is_available():
        return {}
    return {
        "peak_gpu_memory_mb": torch.cuda.max_memory_allocated() / 2**20,
        "peak_gpu_reserved_mb": torch.cuda.max_memory_reserved() / 2**20,
    }


def count_train_padding(trainer) -> PaddingCounter:
    """Count the padding of a transformers Trainer's (or TRL SFTTrainer's) training batches only:
    its evaluation batches go through the same `data_collator`, so the counter is put in place just
    while the training DataLoader is built (it keeps the collator it was built with)."""
    counter = PaddingCounter(trainer.data_collator)
    build = trainer.get_train_dataloader

    def get_train_dataloader():
        plain, trainer.data_collator = trainer.data_collator, counter
        try:
            return build()
        finally:
            trainer.data_collator = plain

    trainer.get_train_dataloader = get_train_dataloader
    return counter


def tutorial_ddp_training(model, train_dataset, batch_size, collate_fn, lr, epochs, device, seed=42):
    """What the DDP tutorials write around a model: DistributedDataParallel, a DistributedSampler,
    PyTorch's default AdamW (no decay on biases and norms) and linear warm-up over 10% of the steps.
    Returns (ddp_model, sampler, loader, optimizer, scheduler)."""
    import math

    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import get_linear_schedule_with_warmup

    from ddp_utils.training.optimizer import weight_decay_groups

    model = DistributedDataParallel(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    sampler = DistributedSampler(train_dataset, shuffle=True, seed=seed)
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
