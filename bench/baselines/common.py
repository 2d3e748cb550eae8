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
