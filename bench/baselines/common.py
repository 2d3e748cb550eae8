"""The work every benchmarked trainer does alike: the demo model and data, tokenized the same way
as scripts/train.py (max_length truncation, dynamic padding, labels in sorted order)."""

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
